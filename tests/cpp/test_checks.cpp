// The torch-free check families on synthetic step views (host/checks/): the global figures, the
// non-finite, mode and input rules. Magnitudes and step integrity are in test_checks_step.cpp,
// gradient flow in test_checks_flow.cpp; thresholds are pinned at their edges. Messages are
// compared in full: they are part of the contract (../shared/DESIGN.md).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "checks/check.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;
using testing::kNaN;
using testing::param;
using testing::stats;

// --- compute_totals ---

TEST(StepTotals, MatchesHandComputedFigures) {
  StepView v;
  v.params = {param(0, "a", 3.0, 4.0), param(1, "b", 4.0, 3.0), param(2, "c")};
  v.params[0].update = UpdateStats{2, 1.0, 0.5};
  v.params[0].param_l2_before = 5.0;
  v.params[1].update = UpdateStats{0, 2.0, 1.0};
  v.params[1].param_l2_before = 12.0;
  v.params[2].grad->nan = 1;     // left out of the gradient norm
  v.params[2].param.posinf = 1;  // left out of the parameter norm
  v.params[2].observed.got_grad = false;
  compute_totals(v);
  const StepTotals& t = v.totals;
  EXPECT_DOUBLE_EQ(t.grad_norm, 5.0);
  EXPECT_DOUBLE_EQ(t.param_norm, 5.0);
  EXPECT_DOUBLE_EQ(t.update_norm, std::sqrt(5.0));
  EXPECT_DOUBLE_EQ(t.ratio_denom, 13.0);  // before the step: sqrt(5² + 12²)
  EXPECT_DOUBLE_EQ(t.update_ratio, std::sqrt(5.0) / 13.0);
  EXPECT_EQ(t.changed, 2);
  EXPECT_TRUE(t.any_update);
  EXPECT_TRUE(t.any_nonfinite_grad);
  EXPECT_EQ(t.with_grad, 2);
  EXPECT_EQ(t.top_grad, std::optional<size_t>(1));
}

TEST(StepTotals, UnknownNormBeforeFallsBackToTheNormAfter) {
  StepView v;
  v.params = {param(0, "a", 1.0, 3.0), param(1, "b", 1.0, 4.0), param(2, "c", 1.0, 100.0)};
  v.params[0].update = UpdateStats{1, 1.0, 1.0};
  v.params[0].param_l2_before = 30.0;
  v.params[1].update = UpdateStats{1, 1.0, 1.0};
  v.params[1].param_l2_before = kNaN;
  v.params[2].param_l2_before = kNaN;  // no update: its norm before does not matter
  compute_totals(v);
  EXPECT_DOUBLE_EQ(v.totals.ratio_denom, v.totals.param_norm);
  EXPECT_DOUBLE_EQ(v.totals.update_ratio, std::sqrt(2.0) / std::sqrt(10025.0));

  v.params[1].param_l2_before = 40.0;
  compute_totals(v);
  EXPECT_DOUBLE_EQ(v.totals.ratio_denom, 50.0);
}

TEST(StepTotals, FirstOfEqualGradientsIsTheTopAndNoGradientNone) {
  StepView v;
  v.params = {param(0, "a", 2.0), param(1, "b", 2.0)};
  compute_totals(v);
  EXPECT_EQ(v.totals.top_grad, std::optional<size_t>(0));
  for (ParamView& p : v.params) p.grad.reset();
  v.params[0].param = stats(0.0);
  v.params[1].param = stats(0.0);
  compute_totals(v);
  EXPECT_FALSE(v.totals.top_grad);
  EXPECT_FALSE(v.totals.any_update);
  EXPECT_EQ(v.totals.update_ratio, 0.0);  // no denominator
}

// --- nonfinite ---

TEST(NonfiniteCheck, LossMessageAndValue) {
  FakeSink sink;
  Options o;
  NonfiniteCheck c(sink, o);
  c.on_loss(stats(1.0, 1), 3);
  EXPECT_TRUE(sink.calls.empty());
  TensorStats s = stats(1.0, 8);
  s.nan = 1;
  s.posinf = 2;
  c.on_loss(s, 3);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::nonfinite_loss);
  EXPECT_EQ(sink.calls[0].tensor, "");
  EXPECT_EQ(sink.calls[0].message,
            "the loss holds 1 NaN, 2 +Inf and 0 -Inf values of 8 — check the model outputs and "
            "the loss inputs (log of 0, division by 0, too large a learning rate in the previous "
            "step)");
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_EQ(sink.calls[0].step, 3);
}

TEST(NonfiniteCheck, PerParameterInterleavingAndMessages) {
  FakeSink sink;
  Options o;
  NonfiniteCheck c(sink, o);
  StepView v;
  v.step = 7;
  v.fp16_in_use = true;
  v.params = {param(0, "w"), param(1, "b")};
  v.params[0].grad->neginf = 1;
  v.params[0].param.nan = 2;
  v.params[0].param.fp16_overflow = 3;
  v.params[1].grad->nan = 1;
  c.on_step(v);
  ASSERT_EQ(sink.kinds(), (std::vector<Kind>{Kind::nonfinite_grad, Kind::nonfinite_param,
                                             Kind::fp16_overflow, Kind::nonfinite_grad}));
  EXPECT_EQ(sink.calls[0].message,
            "w.grad holds 0 NaN, 0 +Inf and 1 -Inf values of 4 — look for log/sqrt/division of "
            "zero or negative values, too large a learning rate, or fp16 overflow in the forward; "
            "torch.autograd.set_detect_anomaly(True) names the op");
  EXPECT_EQ(sink.calls[1].message,
            "w holds 2 NaN, 0 +Inf and 0 -Inf values of 4 after the step — a non-finite gradient "
            "or learning rate reached the weights; check the gradients at this step and the "
            "optimizer's state");
  EXPECT_EQ(sink.calls[2].message,
            "w holds 3 values beyond ±65504, which become Inf when cast to fp16 under autocast — "
            "use bfloat16, rescale, or keep this computation in float32");
  EXPECT_EQ(sink.calls[2].value, 3.0);
  EXPECT_EQ(sink.calls[3].tensor, "b");
  EXPECT_EQ(sink.calls[3].step, 7);

  sink.calls.clear();
  v.fp16_in_use = false;  // values beyond fp16 only matter under fp16 autocast
  v.params[0].param.nan = 0;
  v.params[0].grad->neginf = 0;
  v.params[1].grad->nan = 0;
  c.on_step(v);
  EXPECT_TRUE(sink.calls.empty());
}

TEST(NonfiniteCheck, ModuleOutputWithAndWithoutType) {
  FakeSink sink;
  sink.enabled[Kind::nonfinite_activation] = true;  // opt-in
  Options o;
  NonfiniteCheck c(sink, o);
  TensorStats s = stats(1.0, 10);
  c.on_module_output({"fc1", "Linear"}, s, 2);
  EXPECT_TRUE(sink.calls.empty());
  s.nan = 2;
  s.posinf = 1;
  s.neginf = 1;
  c.on_module_output({"fc1", "Linear"}, s, 2);
  c.on_module_output({"head", ""}, s, 2);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].message,
            "the output of fc1 (Linear) holds 2 NaN and 2 ±Inf values — the first module whose "
            "output is non-finite is where to look");
  EXPECT_EQ(sink.calls[0].tensor, "fc1");
  EXPECT_EQ(sink.calls[0].value, 4.0);
  EXPECT_EQ(sink.calls[1].message,
            "the output of head holds 2 NaN and 2 ±Inf values — the first module whose output is "
            "non-finite is where to look");
}

// --- mode ---

TEST(ModeCheck, NoGradLeakInTrainModeOnly) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  ForwardView f;
  f.step = 1;
  c.on_forward(f);
  f.grad_enabled = false;
  f.training = false;  // validation
  c.on_forward(f);
  EXPECT_TRUE(sink.calls.empty());
  f.training = true;
  c.on_forward(f);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::no_grad_leak);
  EXPECT_EQ(sink.calls[0].message,
            "the model's forward ran with gradients disabled (torch.no_grad / inference_mode) "
            "while the model is in train mode — parameters get no gradient from this forward; if "
            "this is validation, call model.eval() first, otherwise remove the no_grad context "
            "around the training forward");
  EXPECT_EQ(sink.calls[0].step, 1);
}

TEST(ModeCheck, EvalModeWithAndWithoutType) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  StepView v;
  v.step = 6;
  c.on_step(v);
  v.eval_modules = {{"drop", "Dropout"}, {"bn", "BatchNorm1d"}};
  v.manual = true;  // no step to judge
  c.on_step(v);
  EXPECT_TRUE(sink.calls.empty());
  v.manual = false;
  c.on_step(v);
  v.eval_modules = {{"head", ""}};
  c.on_step(v);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].tensor, "drop");
  EXPECT_EQ(sink.calls[0].message,
            "module 'drop' (Dropout) and 1 other module(s) ran in eval mode during a training "
            "step — Dropout/BatchNorm behave as at inference and BatchNorm statistics stop "
            "updating; call model.train() after validation");
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_EQ(sink.calls[1].message,
            "module 'head' ran in eval mode during a training step — Dropout/BatchNorm behave as "
            "at inference and BatchNorm statistics stop updating; call model.train() after "
            "validation");
  EXPECT_EQ(sink.calls[1].value, 1.0);
}

// --- inputs ---

TEST(InputsCheck, DuplicateBatchAgainstThePreviousStepOnly) {
  FakeSink sink;
  Options o;
  InputsCheck c(sink, o);
  c.on_inputs(1, 0);
  c.on_inputs(2, 1);
  c.on_inputs(1, 2);  // same as two steps ago: fine
  EXPECT_TRUE(sink.calls.empty());
  c.on_inputs(1, 3);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::duplicate_batch);
  EXPECT_EQ(sink.calls[0].message,
            "the training forward received exactly the same inputs (bit for bit) as at the "
            "previous step — the data loader or the batch variable is not advancing (e.g. `x, y = "
            "next(iter(loader))` inside the loop, or a batch reused by mistake)");
  EXPECT_FALSE(sink.calls[0].value);
  EXPECT_EQ(sink.calls[0].step, 3);
}

}  // namespace
}  // namespace trainsan::host
