// The torch-free check families on synthetic views, continued (test_checks.cpp): gradient flow,
// thresholds pinned at their edges. Messages are compared in full.
#include <gtest/gtest.h>

#include <cmath>

#include "checks/checks.h"
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

// Note [Foreign backwards]: a step of optimizer `opt` whose parameters "w" (big) and "head"
// (small) got a gradient or not, after `foreign` backwards that reached none of them.
StepView foreign_step(int64_t step, bool w_grad, bool head_grad, int64_t foreign, int64_t opt = 0) {
  StepView v;
  v.step = step;
  v.opt = opt;
  v.params = {param(0, "w"), param(1, "head")};
  v.params[0].param = stats(1.0, 1000);
  v.params[1].param = stats(1.0, 10);
  v.params[0].observed.got_grad = w_grad;
  v.params[1].observed.got_grad = head_grad;
  if (!w_grad) v.params[0].grad.reset();
  if (!head_grad) v.params[1].grad.reset();
  for (ParamView& p : v.params) p.opt = opt;
  v.foreign_backwards = foreign;
  v.foreign.leaves = 6;
  v.foreign.elements = 1010;
  v.foreign.holder = "criterion.model";
  v.foreign.holder_type = "Net";
  v.foreign.holder_params = 6;
  compute_totals(v);
  return v;
}

TEST(GradientFlowCheck, ForeignBackwardFiresAtThePatienceNamingTheHolder) {
  FakeSink sink;
  Options o;
  o.missing_grad_patience = 3;
  GradientFlowCheck c(sink, o, 2);
  EXPECT_FALSE(c.foreign_suspected());
  c.on_step(foreign_step(0, false, false, 1));
  EXPECT_TRUE(c.foreign_suspected());  // the caller names the holder from now on
  c.on_step(foreign_step(1, false, false, 2));
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(foreign_step(2, false, false, 1));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::missing_grad);
  EXPECT_EQ(sink.calls[0].tensor, "");
  EXPECT_EQ(sink.calls[0].message,
            "none of the 2 trainable parameters optimizer 0 steps got a gradient, for 3 steps, "
            "while the backward since its previous step reached 6 requires-grad tensors (1010 "
            "elements) outside this model, held by criterion.model (Net, 6 parameters) — the "
            "backward trains another model: a loss wrapper or closure still holds the model from "
            "before a resume or copy (it was built before `model = Net(); "
            "model.load_state_dict(...)` or `model = copy.deepcopy(model)`); rebuild it around "
            "the model the optimizer steps (e.g. criterion = LossWrapper(model))");
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_EQ(sink.calls[0].step, 2);
}

// "A small fraction": an old backbone feeding a new head (1% of the elements) still fires, and
// the per-parameter missing_grad of "w" (whose advice would be wrong) is left out of that step;
// 1/16 of the elements is the edge.
TEST(GradientFlowCheck, ForeignBackwardSmallFractionAndItsEdge) {
  {
    FakeSink sink;
    Options o;
    o.missing_grad_patience = 1;
    GradientFlowCheck c(sink, o, 2);
    c.on_step(foreign_step(0, false, true, 1));
    ASSERT_EQ(sink.calls.size(), 1u);
    EXPECT_EQ(sink.calls[0].message.rfind("only 1 of the 2 trainable parameters", 0), 0u);
    EXPECT_EQ(sink.count(Kind::missing_grad, "w"), 0);
  }
  for (const int64_t head : {62, 63, 100}) {  // 1000 + 62 = 1062: 62 * 16 = 992 <= 1062
    FakeSink sink;
    Options o;
    o.missing_grad_patience = 1;
    GradientFlowCheck c(sink, o, 2);
    StepView v = foreign_step(0, false, true, 1);
    v.params[1].param = stats(1.0, head);
    c.on_step(v);
    EXPECT_EQ(sink.count(Kind::missing_grad, ""), head * 16 <= 1000 + head ? 1 : 0) << head;
  }
}

// The legitimate twins: our backward reached our parameters (several models, a GAN, a probe); no
// foreign backward (MoE routing, a frozen part: per-parameter missing_grad's business); frozen
// or optimizer-less parameters are not counted; another optimizer's step; a partial or manual
// step; a gradient resets the count.
TEST(GradientFlowCheck, ForeignBackwardTwinsStaySilent) {
  FakeSink sink;
  Options o;
  o.missing_grad_patience = 1;
  GradientFlowCheck c(sink, o, 2);
  c.on_step(foreign_step(0, true, true, 5));    // ours reached too (a GAN's G with D's backward)
  c.on_step(foreign_step(1, true, false, 3));   // most of ours reached
  c.on_step(foreign_step(2, false, false, 0));  // no foreign backward: not this rule
  StepView frozen = foreign_step(3, false, false, 1);
  for (ParamView& p : frozen.params) p.trainable = false;
  c.on_step(frozen);
  StepView orphans = foreign_step(4, false, false, 1);
  for (ParamView& p : orphans.params) p.opt = -1;
  c.on_step(orphans);
  StepView other = foreign_step(5, false, false, 1, /*opt=*/1);
  for (ParamView& p : other.params) p.opt = 0;  // ours are in optimizer 0; optimizer 1 stepped
  c.on_step(other);
  StepView partial = foreign_step(6, false, false, 1);
  partial.partial = true;
  c.on_step(partial);
  StepView manual = foreign_step(7, false, false, 1);
  manual.manual = true;
  c.on_step(manual);
  StepView assigned = foreign_step(13, false, false, 1);  // .grad set by hand (Reptile)
  assigned.params[0].grad = stats(0.5, 1000);
  c.on_step(assigned);
  StepView leak = foreign_step(14, false, false, 1);  // no_grad_leak's step
  leak.no_grad_train_forwards = 1;
  c.on_step(leak);
  StepView no_leaves = foreign_step(8, false, false, 1);
  no_leaves.foreign.leaves = 0;
  c.on_step(no_leaves);
  EXPECT_EQ(sink.count(Kind::missing_grad, ""), 0);
  // Consecutive steps: one with our gradient in between resets the count.
  o.missing_grad_patience = 2;
  c.on_step(foreign_step(9, false, false, 1));
  c.on_step(foreign_step(10, true, true, 1));
  c.on_step(foreign_step(11, false, false, 1));
  EXPECT_EQ(sink.count(Kind::missing_grad, ""), 0);
  c.on_step(foreign_step(12, false, false, 1));
  EXPECT_EQ(sink.count(Kind::missing_grad, ""), 1);
}

// zero_grad(set_to_none=False): the stepped parameters hold all-zero gradients, still none.
TEST(GradientFlowCheck, ForeignBackwardCountsZeroFilledGradientsAsNone) {
  FakeSink sink;
  Options o;
  o.missing_grad_patience = 1;
  GradientFlowCheck c(sink, o, 2);
  StepView v = foreign_step(0, false, false, 1);
  v.params[0].grad = stats(0.0, 1000);
  v.params[0].grad->zero = 1000;
  c.on_step(v);
  EXPECT_EQ(sink.count(Kind::missing_grad, ""), 1);
}

// Without a holder (a LibTorch loop: the walk counts the leaves, no names) the message says so.
TEST(GradientFlowCheck, ForeignBackwardWithoutAHolder) {
  FakeSink sink;
  Options o;
  o.missing_grad_patience = 1;
  GradientFlowCheck c(sink, o, 2);
  StepView v = foreign_step(0, false, false, 1);
  v.opt = -1;  // the C++ end_step() without a binding: every parameter in an optimizer
  v.foreign = ForeignBackward{};
  v.foreign.leaves = 1;
  v.foreign.elements = 4;
  c.on_step(v);
  ASSERT_EQ(sink.calls.size(), 1u);
  const std::string prefix =
      "none of the 2 trainable parameters in an optimizer got a gradient, for 1 step, while the "
      "backward since its previous step reached 1 requires-grad tensor (4 elements) outside this "
      "model —";
  EXPECT_EQ(sink.calls[0].message.rfind(prefix, 0), 0u) << sink.calls[0].message;
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

// Note [Optimizers holding none]: an attached optimizer's step (opt >= 0) with no parameter in
// any optimizer is one finding about the model, counting the parameters that got a gradient.
TEST(GradientFlowCheck, OptimizersHoldingNoneIsOneFindingAboutTheModel) {
  FakeSink sink;
  Options o;
  GradientFlowCheck c(sink, o, 3);
  StepView v = flow_step(2, true);
  v.params.push_back(param(2, "frozen"));
  v.params[2].trainable = false;  // frozen: not counted
  for (ParamView& p : v.params) p.opt = -1;
  v.have_optimizer = false;
  v.opt = 0;
  compute_totals(v);
  c.on_step(v);
  ASSERT_EQ(sink.kinds(), (std::vector<Kind>{Kind::param_not_in_optimizer}));
  EXPECT_EQ(sink.calls[0].tensor, "");
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_EQ(sink.calls[0].message.rfind(
                "2 parameter(s) of the model (e.g. a) receive gradients, but the optimizer(s) "
                "attached hold none of the model's parameters",
                0),
            0u)
      << sink.calls[0].message;
  // Not in manual mode, not at end_step() of a loop without a binding (opt -1), not at a
  // partial step, not where no trainable parameter got a gradient, not where some optimizer
  // holds a parameter (the per-parameter rule's).
  for (int variant = 0; variant < 5; ++variant) {
    FakeSink each;
    StepView w = v;
    if (variant == 0) w.manual = true;
    if (variant == 1) w.opt = -1;
    if (variant == 2) w.partial = true;
    if (variant == 3) {
      for (ParamView& p : w.params) p.observed.got_grad = false;
    }
    if (variant == 4) w.have_optimizer = true;
    GradientFlowCheck fresh(each, o, 3);
    fresh.on_step(w);
    EXPECT_EQ(each.count(Kind::param_not_in_optimizer, ""), 0) << "variant " << variant;
  }
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
