// The torch-free check families on synthetic views, continued (test_checks.cpp): gradient flow,
// thresholds pinned at their edges. Messages are compared in full.
#include <gtest/gtest.h>

#include <cmath>

#include "checks/check.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;
using testing::param;
using testing::stats;

// --- gradient flow ---

StepView flow_step(int64_t step, bool a_got_grad) {
  StepView v;
  v.step = step;
  v.params = {param(0, "a"), param(1, "b")};
  v.params[0].observed.got_grad = a_got_grad;
  if (!a_got_grad) v.params[0].grad.reset();
  compute_totals(v);
  return v;
}

TEST(GradientFlowCheck, MissingGradFiresAtExactlyThePatience) {
  FakeSink sink;
  Options o;
  o.missing_grad_patience = 3;
  GradientFlowCheck c(sink, o, 2);
  c.on_step(flow_step(0, false));
  c.on_step(flow_step(1, false));
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(flow_step(2, false));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::missing_grad);
  EXPECT_EQ(sink.calls[0].tensor, "a");
  EXPECT_EQ(sink.calls[0].message,
            "a got no gradient for 3 steps while other parameters did — its output does not "
            "reach the loss (a .detach(), torch.no_grad(), .data, or an unused branch in "
            "forward())");
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_EQ(sink.calls[0].step, 2);
  // A gradient resets the count; a step where no parameter got one leaves it.
  c.on_step(flow_step(3, true));
  c.on_step(flow_step(4, false));
  StepView none = flow_step(5, false);
  none.params[1].observed.got_grad = false;
  compute_totals(none);
  c.on_step(none);
  c.on_step(flow_step(6, false));
  EXPECT_EQ(sink.calls.size(), 1u);
  c.on_step(flow_step(7, false));
  EXPECT_EQ(sink.calls.size(), 2u);
}

// Attached inside a step (StepView::partial): a gradient that arrived before attach was not
// seen, so that step does not count towards missing_grad.
TEST(GradientFlowCheck, MissingGradSkipsAPartialStep) {
  FakeSink sink;
  Options o;
  o.missing_grad_patience = 1;
  GradientFlowCheck c(sink, o, 2);
  StepView partial = flow_step(0, false);
  partial.partial = true;
  c.on_step(partial);
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(flow_step(1, false));
  EXPECT_EQ(sink.count(Kind::missing_grad, "a"), 1);
}

TEST(GradientFlowCheck, MissingGradCountsOnlyTrainableParametersOfAnOptimizer) {
  for (const bool manual : {false, true}) {
    FakeSink sink;
    Options o;
    o.missing_grad_patience = 1;
    GradientFlowCheck c(sink, o, 3);
    StepView v = flow_step(0, true);
    v.manual = manual;
    v.params.push_back(param(2, "frozen"));
    v.params[1].observed.got_grad = false;
    v.params[1].opt = -1;  // counted in manual mode only
    v.params[2].observed.got_grad = false;
    v.params[2].trainable = false;
    compute_totals(v);
    c.on_step(v);
    EXPECT_EQ(sink.count(Kind::missing_grad, "b"), manual ? 1 : 0);
    EXPECT_EQ(sink.count(Kind::missing_grad, "frozen"), 0);
  }
}

TEST(GradientFlowCheck, StaleGradAndParamNotInOptimizer) {
  FakeSink sink;
  Options o;
  GradientFlowCheck c(sink, o, 2);
  StepView v = flow_step(4, true);
  v.params[0].observed.stale = true;
  v.params[1].opt = -1;
  c.on_step(v);
  ASSERT_EQ(sink.kinds(), (std::vector<Kind>{Kind::stale_grad, Kind::param_not_in_optimizer}));
  EXPECT_EQ(sink.calls[0].message,
            "a still holds the gradient of step 3 — optimizer.zero_grad() was not called after "
            "optimizer.step() (for gradient accumulation, zero after the step)");
  EXPECT_FALSE(sink.calls[0].value);
  EXPECT_EQ(sink.calls[1].message,
            "b receives gradients but is in no optimizer's param_groups, so it never trains — "
            "build the optimizer from model.parameters() after the model is complete (or "
            "add_param_group), or set requires_grad=False if it is meant to be frozen");
  sink.calls.clear();
  v.params[0].observed.stale = false;
  v.have_optimizer = false;  // nothing to be in
  c.on_step(v);
  EXPECT_TRUE(sink.calls.empty());
}

TEST(GradientFlowCheck, ManualStaleGradNeedsThePreviousStepsChange) {
  FakeSink sink;
  Options o;
  GradientFlowCheck c(sink, o, 2);
  auto manual = [](int64_t step, bool accumulated, int64_t changed) {
    StepView v = flow_step(step, true);
    v.manual = true;
    v.params[0].observed.accumulated = accumulated;
    v.params[0].update = UpdateStats{changed, 1.0, 1.0};
    compute_totals(v);
    return v;
  };
  c.on_step(manual(0, true, 5));  // this pass's change does not count for itself
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(manual(1, true, 0));  // the previous pass changed the parameters
  EXPECT_EQ(sink.count(Kind::stale_grad, "a"), 1);
  c.on_step(manual(2, true, 0));  // the previous one did not: accumulation on purpose
  EXPECT_EQ(sink.count(Kind::stale_grad, "a"), 1);
  StepView auto_mode = manual(3, true, 5);
  auto_mode.manual = false;  // with an optimizer, only the hooks' `stale` counts
  c.on_step(auto_mode);
  c.on_step(manual(4, true, 0));
  EXPECT_EQ(sink.count(Kind::stale_grad, "a"), 1);
}

StepView vanishing_step(int64_t step, double grad_l2, bool lr_zero = false) {
  StepView v;
  v.step = step;
  v.lr_zero = lr_zero;
  v.params = {param(0, "w", grad_l2, 4.0)};
  compute_totals(v);
  return v;
}

TEST(GradientFlowCheck, GradVanishingRatioBoundary) {
  Options o;
  o.grad_vanishing_ratio = 0.25;  // 0.25 x 4.0 = 1.0, exactly
  o.grad_vanishing_steps = 3;
  {
    FakeSink sink;
    GradientFlowCheck c(sink, o, 1);
    for (int64_t s = 0; s < 2; ++s) c.on_step(vanishing_step(s, 1.0));
    EXPECT_TRUE(sink.calls.empty());
    c.on_step(vanishing_step(2, 1.0));
    ASSERT_EQ(sink.calls.size(), 1u);
    EXPECT_EQ(sink.calls[0].kind, Kind::grad_vanishing);
    EXPECT_EQ(sink.calls[0].message,
              "w.grad has been negligible (1) for 3 steps — dead activations (ReLU), saturated "
              "sigmoid/tanh, a multiplication by zero, or a loss that does not depend on this "
              "layer");
    EXPECT_EQ(sink.calls[0].value, 1.0);
  }
  {
    FakeSink sink;
    GradientFlowCheck c(sink, o, 1);
    const double above = std::nextafter(1.0, 2.0);
    for (int64_t s = 0; s < 5; ++s) c.on_step(vanishing_step(s, above));
    EXPECT_TRUE(sink.calls.empty());
  }
}

// A shard of a parameter (FSDP2, tensor parallel) that is zero, or empty (an uneven split), says
// nothing about the whole tensor: grad_vanishing judges whole tensors only.
TEST(GradientFlowCheck, GradVanishingSkipsShards) {
  Options o;
  o.grad_vanishing_steps = 2;
  FakeSink sink;
  GradientFlowCheck c(sink, o, 1);
  for (int64_t s = 0; s < 4; ++s) {
    StepView v = vanishing_step(s, 0.0);
    v.params[0].sharded = true;
    c.on_step(v);
  }
  for (int64_t s = 4; s < 8; ++s) {
    StepView v = vanishing_step(s, 0.0);
    v.params[0].grad->numel = 0;
    c.on_step(v);
  }
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(vanishing_step(8, 0.0));
  c.on_step(vanishing_step(9, 0.0));
  EXPECT_EQ(sink.calls.size(), 1u);  // the same gradients, whole: reported
}

TEST(GradientFlowCheck, GradVanishingCountsUnderLrZeroAndResets) {
  FakeSink sink;
  Options o;
  o.grad_vanishing_steps = 3;
  GradientFlowCheck c(sink, o, 1);
  for (int64_t s = 0; s < 3; ++s) c.on_step(vanishing_step(s, 0.0, /*lr_zero=*/true));
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(vanishing_step(3, 0.0));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].message,
            "w.grad has been exactly zero for 4 steps — dead activations (ReLU), saturated "
            "sigmoid/tanh, a multiplication by zero, or a loss that does not depend on this "
            "layer");
  // A healthy or non-finite gradient resets the count; a step without a gradient keeps it.
  c.on_step(vanishing_step(4, 1.0));
  c.on_step(vanishing_step(5, 0.0));
  StepView nan = vanishing_step(6, 0.0);
  nan.params[0].grad->nan = 1;
  c.on_step(nan);
  c.on_step(vanishing_step(7, 0.0));
  StepView no_grad = vanishing_step(8, 0.0);
  no_grad.params[0].grad.reset();
  c.on_step(no_grad);
  c.on_step(vanishing_step(9, 0.0));
  EXPECT_EQ(sink.calls.size(), 1u);
  c.on_step(vanishing_step(10, 0.0));
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[1].step, 10);
}

TEST(GradientFlowCheck, HookRulesComeBeforeVanishing) {
  FakeSink sink;
  Options o;
  o.grad_vanishing_steps = 1;
  o.missing_grad_patience = 1;
  GradientFlowCheck c(sink, o, 2);
  StepView v = flow_step(0, false);
  v.params[1].grad = stats(0.0);
  c.on_step(v);
  EXPECT_EQ(sink.kinds(), (std::vector<Kind>{Kind::missing_grad, Kind::grad_vanishing}));
}

}  // namespace
}  // namespace trainsan::host
