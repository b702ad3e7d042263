// The torch-free check families on synthetic step views (host/checks/): the global figures, the
// non-finite, mode and input rules. Magnitudes and step integrity are in test_checks_step.cpp,
// gradient flow in test_checks_flow.cpp; thresholds are pinned at their edges. Messages are
// compared in full: they are part of the contract (docs/kinds.md).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "checks/checks.h"
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
  Origins origins(o);
  NonfiniteCheck c(sink, o, origins);
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
            "step). (Module outputs are flagged on sampled steps and on the steps after a "
            "non-finite value: with policy 'warn' or 'record' the next steps name the module "
            "where it appears; provenance_every=1 flags every step.)");
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_EQ(sink.calls[0].step, 3);
}

TEST(NonfiniteCheck, PerParameterInterleavingAndMessages) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  NonfiniteCheck c(sink, o, origins);
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
  Origins origins(o);
  NonfiniteCheck c(sink, o, origins);
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

ModeModule mode_module(const std::string& name, const std::string& type, std::vector<size_t> params,
                       bool mode_dependent) {
  ModeModule m;
  m.ref = {name, type};
  m.params = std::move(params);
  m.mode_dependent = mode_dependent;
  return m;
}

TEST(ModeCheck, NoGradForwardInTrainModeIsSilentWithoutModeDependentModules) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  c.set_modules({mode_module("fc", "Linear", {0, 1}, false)});
  ForwardView f;
  f.step = 1;
  c.on_forward(f);  // a training forward
  f.grad_enabled = false;
  c.on_forward(f);  // a prediction / rollout / metric in train mode: nothing mode-dependent
  f.training = false;
  f.train_mode_dependent = {0};  // (validation in eval mode: never judged)
  c.on_forward(f);
  EXPECT_TRUE(sink.calls.empty());
}

TEST(ModeCheck, NoGradForwardWarnsNamingTheConsequence) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  c.set_modules({mode_module("drop", "Dropout", {0, 1}, true),
                 mode_module("bn", "BatchNorm1d", {2, 3}, true),
                 mode_module("fc", "Linear", {0, 1}, false)});
  ForwardView f;
  f.step = 2;
  f.grad_enabled = false;
  f.train_mode_dependent = {1};
  c.on_forward(f);
  f.train_mode_dependent = {0, 1};
  f.step = 3;
  c.on_forward(f);
  f.grad_enabled = true;  // with grad: a training forward, not judged here
  c.on_forward(f);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].kind, Kind::no_grad_leak);
  EXPECT_EQ(sink.calls[0].severity, Severity::kWarning);
  EXPECT_EQ(sink.calls[0].tensor, "bn");
  EXPECT_EQ(sink.calls[0].value, 1.0);
  EXPECT_EQ(sink.calls[0].message,
            "the model's forward ran under torch.no_grad / inference_mode while the model is in "
            "train mode, so module 'bn' (BatchNorm1d) behaved as in training — BatchNorm running "
            "statistics are updated with this forward's data (evaluation data leaks into the "
            "statistics used at inference); for evaluation or prediction call model.eval() first "
            "(and model.train() after); if the no_grad forward is part of training on purpose "
            "(e.g. generating samples for another model), this warning can be ignored");
  EXPECT_EQ(sink.calls[1].tensor, "drop");
  EXPECT_EQ(sink.calls[1].severity, Severity::kWarning);
  EXPECT_EQ(sink.calls[1].value, 2.0);
  EXPECT_NE(sink.calls[1].message.find("module 'drop' (Dropout) and 1 other mode-dependent "
                                       "module(s) behaved as in training — BatchNorm running "),
            std::string::npos)
      << sink.calls[1].message;
  EXPECT_NE(sink.calls[1].message.find(", and dropout is active, so these outputs are randomly "
                                       "perturbed;"),
            std::string::npos)
      << sink.calls[1].message;
}

// Two trainable parameters of optimizer 0 and one of optimizer 1; none got a gradient.
StepView no_grad_step() {
  StepView v;
  v.step = 4;
  v.opt = 0;
  v.params = {param(0, "conv.weight"), param(1, "conv.bias"), param(2, "other.weight")};
  v.params[2].opt = 1;
  for (ParamView& p : v.params) {
    p.observed.got_grad = false;
    p.grad.reset();
  }
  v.no_grad_train_forwards = 2;
  v.grad_forwards = 0;
  return v;
}

TEST(ModeCheck, NoGradLeakIsAnErrorWhenTheStepTrainsNothing) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  c.on_step(no_grad_step());
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::no_grad_leak);
  EXPECT_EQ(sink.calls[0].severity, Severity::kError);
  EXPECT_EQ(sink.calls[0].tensor, "");
  EXPECT_EQ(sink.calls[0].step, 4);
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_EQ(sink.calls[0].message,
            "the model's forward ran with gradients disabled (torch.no_grad / inference_mode) in "
            "train mode (2 forward(s) since the previous step) and never with gradients enabled, "
            "so none of its 2 trainable parameter(s) in this optimizer (e.g. conv.weight) got a "
            "gradient for this step — remove the no_grad context around the training forward; if "
            "the model is meant to stay frozen, set requires_grad_(False) on it or leave it out "
            "of the optimizer");
}

TEST(ModeCheck, NoGradLeakNamesWhereTheForwardWasCalled) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  ForwardView f;
  f.step = 4;
  f.grad_enabled = false;
  f.site = "/work/train.py:12 in main";
  c.on_forward(f);
  c.on_graphless_backward(4, 1);  // backward() of a loss without a graph (torch raises next)
  c.on_step(no_grad_step());      // a step without gradients after the same forward
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].kind, Kind::no_grad_leak);
  EXPECT_EQ(sink.calls[0].severity, Severity::kError);
  EXPECT_EQ(sink.calls[0].step, 4);
  EXPECT_EQ(sink.calls[0].value, 1.0);
  EXPECT_EQ(sink.calls[0].message,
            "backward() was called on a loss without an autograd graph because the model's "
            "forward (called at /work/train.py:12 in main) ran with gradients disabled "
            "(torch.no_grad / inference_mode) in train mode (1 forward(s) since the previous "
            "step, none with gradients enabled): nothing of the model can train — remove the "
            "no_grad context around the training forward");
  EXPECT_EQ(sink.calls[1].message.rfind("the model's forward (called at /work/train.py:12 in "
                                        "main) ran with gradients disabled",
                                        0),
            0u)
      << sink.calls[1].message;
}

TEST(ModeCheck, NoGradLeakSilentCases) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  StepView v = no_grad_step();
  v.grad_forwards = 1;  // a grad-enabled forward too: the no_grad one was a prediction
  c.on_step(v);
  v = no_grad_step();
  v.no_grad_train_forwards = 0;  // no forward at all since the step (e.g. a scheduler test step)
  c.on_step(v);
  v = no_grad_step();
  v.params[1].observed.got_grad = true;  // a gradient arrived (an LBFGS closure inside the step)
  c.on_step(v);
  v = no_grad_step();
  v.params[0].trainable = v.params[1].trainable = false;  // frozen on purpose
  c.on_step(v);
  v = no_grad_step();
  v.params[0].opt = v.params[1].opt = -1;  // in no optimizer
  c.on_step(v);
  v = no_grad_step();
  v.opt = 1;
  v.params[2].observed.got_grad = true;  // the other optimizer's step trains its parameter
  c.on_step(v);
  v = no_grad_step();
  v.manual = true;  // no optimizer: steps are training forwards
  c.on_step(v);
  EXPECT_TRUE(sink.calls.empty());
}

// bn owns 0-1, drop sits in the model (0-3), frozen_bn owns 4-5 (requires_grad False),
// unopt owns 6 (trainable, in no optimizer), all: registered without parameters (LibTorch).
StepView eval_step_view(std::vector<size_t> eval_modules) {
  StepView v;
  v.step = 7;
  v.opt = 0;
  for (size_t i = 0; i < 7; ++i) {
    static const char* names[] = {"bn.weight",  "bn.bias",  "fc.weight",   "fc.bias",
                                  "fbn.weight", "fbn.bias", "unopt.weight"};
    v.params.push_back(param(i, names[i]));
  }
  v.params[4].trainable = v.params[5].trainable = false;
  v.params[4].observed.got_grad = v.params[5].observed.got_grad = false;
  v.params[6].opt = -1;
  v.eval_modules = std::move(eval_modules);
  return v;
}

std::vector<ModeModule> eval_modules_registry() {
  return {mode_module("bn", "BatchNorm1d", {0, 1}, true),
          mode_module("drop", "Dropout", {0, 1, 2, 3}, true),
          mode_module("fbn", "BatchNorm1d", {4, 5}, true),
          mode_module("unopt", "Linear", {6}, false), mode_module("all", "", {}, true)};
}

TEST(ModeCheck, EvalModeJudgedByWhatTrains) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  c.set_modules(eval_modules_registry());
  c.on_step(eval_step_view({}));
  c.on_step(eval_step_view({2, 3}));  // frozen BN, and a module whose parameter is in no optimizer
  StepView nothing = eval_step_view({0, 1});
  for (ParamView& p : nothing.params) p.observed.got_grad = false;  // nothing trains this step
  c.on_step(nothing);
  StepView manual = eval_step_view({0});
  manual.manual = true;
  c.on_step(manual);
  EXPECT_TRUE(sink.calls.empty());

  c.on_step(eval_step_view({0, 1, 2}));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::eval_mode);
  EXPECT_EQ(sink.calls[0].severity, Severity::kWarning);
  EXPECT_EQ(sink.calls[0].tensor, "bn");
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_EQ(sink.calls[0].step, 7);
  EXPECT_EQ(sink.calls[0].message,
            "module 'bn' (BatchNorm1d) and 1 other module(s) ran in eval mode during a training "
            "step while its parameters are being trained (e.g. bn.weight) — it behaves as at "
            "inference (Dropout off, BatchNorm on frozen running statistics); call model.train() "
            "after validation, or, if it is frozen on purpose, freeze its parameters too "
            "(requires_grad_(False))");

  c.on_step(eval_step_view({1}));  // a parameterless Dropout: the parameters around it train
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[1].tensor, "drop");
  EXPECT_NE(sink.calls[1].message.find("module 'drop' (Dropout) ran in eval mode during a "
                                       "training step while the parameters of its enclosing "
                                       "module are being trained (e.g. bn.weight)"),
            std::string::npos)
      << sink.calls[1].message;

  c.on_step(eval_step_view({4}));  // registered without parameters: every parameter counts
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_EQ(sink.calls[2].tensor, "all");
}

TEST(ModeCheck, WholeModelTrainedInEvalMode) {
  FakeSink sink;
  Options o;
  ModeCheck c(sink, o);
  c.set_modules(eval_modules_registry());
  StepView v = eval_step_view({0, 1, 2});
  v.model_eval = true;
  c.on_step(v);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].tensor, "<model>");
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_EQ(sink.calls[0].message,
            "the model ran in eval mode (model.training is False) during a training step while "
            "its parameters are being trained (e.g. bn.weight) — Dropout is off, BatchNorm "
            "normalises with (and stops updating) its running statistics, and any module that "
            "reads self.training behaves as at inference; call model.train() after validation (or "
            "after loading the model)");
  // A model in eval mode whose step trains nothing (frozen, evaluated with grad): silent.
  FakeSink quiet;
  ModeCheck c2(quiet, o);
  StepView frozen = eval_step_view({});
  frozen.model_eval = true;
  for (ParamView& p : frozen.params) p.observed.got_grad = false;
  c2.on_step(frozen);
  EXPECT_TRUE(quiet.calls.empty());
}

// --- inputs ---

TEST(InputsCheck, RepeatsWithoutTheStuckSignatureAreSilent) {
  FakeSink sink;
  Options o;
  {
    InputsCheck c(sink, o);  // full batch from step 0
    for (int64_t s = 0; s < 10; ++s) c.on_inputs(42, s);
  }
  {
    InputsCheck c(sink, o);  // a probe forward, then full batch; a GAN's D(fake.detach()), D(fake)
    for (int64_t s = 0; s < 6; ++s) c.on_inputs(s == 0 ? 7 : 42, s);
  }
  {
    InputsCheck c(sink, o);  // data echoing: each batch twice, never two changes in a row
    for (int64_t s = 0; s < 8; ++s) c.on_inputs(static_cast<uint64_t>(s / 2), s);
  }
  {
    InputsCheck c(sink, o);  // a loader restarted, but the inputs differ (shuffled)
    for (int64_t s = 0; s < 4; ++s) c.on_inputs(static_cast<uint64_t>(s), s, s);
  }
  {
    InputsCheck c(sink, o);  // back to a batch of two steps ago
    c.on_inputs(1, 0);
    c.on_inputs(2, 1);
    c.on_inputs(1, 2);
  }
  EXPECT_TRUE(sink.calls.empty());
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Note [Repeated batches]: loader pass 1; workers, worker_init_fn.
LoaderView pass_of(int64_t pass, int64_t workers = 2, bool init = false) {
  return LoaderView{pass, workers, init};
}

TEST(InputsCheck, SharedRngWorkersRepeatBatchesWithinAPass) {
  FakeSink sink;
  Options o;
  InputsCheck c(sink, o);
  // Two workers that draw the same samples: A A B B C C.
  const uint64_t seq[] = {10, 10, 11, 11, 12, 12};
  for (int64_t s = 0; s < 3; ++s) c.on_inputs(seq[s], s, 0, pass_of(1));
  EXPECT_TRUE(sink.calls.empty());        // one repeat (step 1), and no other batch before it
  c.on_inputs(seq[3], 3, 0, pass_of(1));  // the second repeat of the pass, with B != A
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::duplicate_batch);
  EXPECT_EQ(sink.calls[0].step, 3);
  EXPECT_EQ(sink.calls[0].value, 1.0);  // one step back
  EXPECT_TRUE(has(sink.calls[0].message,
                  "as at step 2, within the same pass over the data "
                  "loader (num_workers=2, no worker_init_fn), 2 times"))
      << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "worker_init_fn")) << sink.calls[0].message;
}

TEST(InputsCheck, PeriodicRepeatsWithinAPass) {
  FakeSink sink;
  Options o;
  InputsCheck c(sink, o);
  // A B C A B C: lag 3; reported at the second repeat (step 4), lag 3.
  for (int64_t s = 0; s < 4; ++s) c.on_inputs(static_cast<uint64_t>(s % 3), s, 0, pass_of(7, 3));
  EXPECT_TRUE(sink.calls.empty());
  c.on_inputs(1, 4, 0, pass_of(7, 3));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_TRUE(has(sink.calls[0].message, "num_workers=3")) << sink.calls[0].message;
  // A repeat 9 steps back is outside the window of 8.
  FakeSink far;
  InputsCheck d(far, o);
  for (int64_t s = 0; s < 9; ++s) d.on_inputs(static_cast<uint64_t>(s), s, 0, pass_of(1));
  d.on_inputs(0, 9, 0, pass_of(1));
  d.on_inputs(1, 10, 0, pass_of(1));
  EXPECT_TRUE(far.calls.empty());
}

TEST(InputsCheck, RepeatsAcrossPassesOrWithoutLoaderAreSilent) {
  FakeSink sink;
  Options o;
  {
    InputsCheck c(sink, o);  // an unshuffled loader of 2 batches: A B | A B | A B
    for (int64_t s = 0; s < 8; ++s) c.on_inputs(static_cast<uint64_t>(s % 2), s, 0, pass_of(s / 2));
  }
  {
    InputsCheck c(sink, o);  // full-batch loader: one batch per pass
    for (int64_t s = 0; s < 8; ++s) c.on_inputs(5, s, 0, pass_of(s + 1, 0));
  }
  {
    InputsCheck c(sink, o);  // constant data within a pass (every batch the same)
    for (int64_t s = 0; s < 8; ++s) c.on_inputs(5, s, 0, pass_of(1, 2));
  }
  {
    InputsCheck c(sink, o);  // A B A B without a known loader pass (LibTorch): not judged
    for (int64_t s = 0; s < 8; ++s) c.on_inputs(static_cast<uint64_t>(s % 2), s);
  }
  {
    InputsCheck c(sink, o);  // a single repeat in a pass (chance, a sampler with replacement)
    const uint64_t seq[] = {1, 2, 3, 1, 4, 5, 6, 7, 8, 9};
    for (int64_t s = 0; s < 10; ++s) c.on_inputs(seq[s], s, 0, pass_of(1));
  }
  EXPECT_TRUE(sink.calls.empty());
}

TEST(InputsCheck, StuckAfterAdvancing) {
  FakeSink sink;
  Options o;
  InputsCheck c(sink, o);
  c.on_inputs(1, 0);
  c.on_inputs(2, 1);
  c.on_inputs(3, 2);  // two changes in a row: the data was advancing
  EXPECT_TRUE(sink.calls.empty());
  c.on_inputs(3, 3);
  c.on_inputs(3, 4);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].kind, Kind::duplicate_batch);
  EXPECT_EQ(sink.calls[0].severity, Severity::kWarning);
  EXPECT_EQ(sink.calls[0].step, 3);
  EXPECT_FALSE(sink.calls[0].value);
  EXPECT_EQ(sink.calls[0].message,
            "the training forward received exactly the same inputs (bit for bit) as at the "
            "previous step, after earlier steps each got new inputs — the data stopped advancing "
            "(an exhausted iterator whose last batch is kept, a batch variable no longer "
            "reassigned, a cached batch); check where the loop fetches its batch");
  EXPECT_EQ(sink.count(Kind::duplicate_batch), 2);
}

TEST(InputsCheck, LoaderRestartedAfterItsFirstBatch) {
  FakeSink sink;
  Options o;
  InputsCheck c(sink, o);
  c.on_inputs(5, 0, 3);  // restarts before attach do not count
  c.on_inputs(5, 1, 3);  // the same inputs, no restart in between: full batch
  EXPECT_TRUE(sink.calls.empty());
  c.on_inputs(5, 2, 4);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].step, 2);
  EXPECT_EQ(sink.calls[0].message,
            "the training forward received exactly the same inputs (bit for bit) as at the "
            "previous step, and a DataLoader was iterated anew in between after its previous "
            "iterator had yielded only its first batch — `next(iter(loader))` inside the loop "
            "takes the same first batch every step: create the iterator once (`it = iter(loader)` "
            "before the loop, `next(it)` inside) or loop `for x, y in loader`");
}

}  // namespace
}  // namespace trainsan::host
