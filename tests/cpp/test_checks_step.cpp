// The torch-free check families on synthetic views, continued (test_checks.cpp): magnitudes and
// step integrity, thresholds pinned at their edges. Messages are compared in full.
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

const double kInf = std::numeric_limits<double>::infinity();

// Totals are set directly: MagnitudeCheck reads only them (and the top gradient's name).
StepView magnitude_step(int64_t step, double grad_norm, int64_t opt = 0) {
  StepView v;
  v.step = step;
  v.opt = opt;
  v.params = {param(0, "w", grad_norm)};
  v.totals.grad_norm = grad_norm;
  v.totals.top_grad = 0;
  return v;
}

StepView ratio_step(int64_t step, double ratio) {
  StepView v = magnitude_step(step, 1.0);
  v.totals.any_update = true;
  v.totals.ratio_denom = 1.0;
  v.totals.update_ratio = ratio;
  return v;
}

TEST(MagnitudeCheck, GradExplosionFactorBoundary) {
  Options o;  // factor 50, warmup 5
  for (const double norm : {50.0, std::nextafter(50.0, kInf)}) {
    FakeSink sink;
    MagnitudeCheck c(sink, o);
    for (int64_t s = 0; s < 5; ++s) c.on_step(magnitude_step(s, 1.0));  // running average 1
    c.on_step(magnitude_step(5, norm));
    if (norm == 50.0) {
      EXPECT_TRUE(sink.calls.empty());
      continue;
    }
    ASSERT_EQ(sink.calls.size(), 1u);
    EXPECT_EQ(sink.calls[0].kind, Kind::grad_explosion);
    EXPECT_EQ(sink.calls[0].tensor, "");
    EXPECT_EQ(sink.calls[0].message,
              "the global gradient norm is 50, 50x its running average 1 (largest: w) — lower the "
              "learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), or look for an "
              "unnormalised loss or input at this step");
    EXPECT_EQ(sink.calls[0].value, norm);
    // An exploding step stays out of the average: the next one fires again.
    c.on_step(magnitude_step(6, norm));
    EXPECT_EQ(sink.count(Kind::grad_explosion), 2);
  }
}

TEST(MagnitudeCheck, GradExplosionWarmupBoundaryAndPerOptimizer) {
  Options o;
  o.grad_explosion_warmup = 5;
  FakeSink sink;
  MagnitudeCheck c(sink, o);
  for (int64_t s = 0; s < 4; ++s) c.on_step(magnitude_step(s, 1.0));
  c.on_step(magnitude_step(4, 1000.0));  // the 5th step: still warming up, enters the average
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(magnitude_step(5, 1000.0, /*opt=*/1));  // another optimizer: its own average
  c.on_step(magnitude_step(6, 1.0e6, /*opt=*/1));
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(magnitude_step(7, 1.0e5));  // average 0.9 + 100 = 100.9: 1e5 > 50 x 100.9
  EXPECT_EQ(sink.calls.size(), 1u);
  // A non-finite gradient skips the rule and the average.
  StepView nan = magnitude_step(8, 1.0e9);
  nan.totals.any_nonfinite_grad = true;
  c.on_step(nan);
  EXPECT_EQ(sink.calls.size(), 1u);
}

TEST(MagnitudeCheck, GradExplosionLimit) {
  Options o;
  o.grad_explosion_limit = 10.0;
  FakeSink sink;
  MagnitudeCheck c(sink, o);
  c.on_step(magnitude_step(0, 10.0));
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(magnitude_step(1, 11.0));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].message,
            "the global gradient norm is 11, above the limit 10 (largest: w) — lower the learning "
            "rate, clip gradients (torch.nn.utils.clip_grad_norm_), or look for an unnormalised "
            "loss or input at this step");
}

TEST(MagnitudeCheck, UpdateRatioBandEdges) {
  Options o;  // band [1e-8, 1], 3 steps
  for (const double edge : {o.update_ratio_low, o.update_ratio_high}) {
    FakeSink sink;
    MagnitudeCheck c(sink, o);
    for (int64_t s = 0; s < 5; ++s) c.on_step(ratio_step(s, edge));
    EXPECT_TRUE(sink.calls.empty());
  }
  FakeSink sink;
  MagnitudeCheck c(sink, o);
  const double low = std::nextafter(o.update_ratio_low, 0.0);
  c.on_step(ratio_step(0, low));
  c.on_step(ratio_step(1, low));
  c.on_step(ratio_step(2, 1e-3));  // back in the band: the count restarts
  c.on_step(ratio_step(3, low));
  c.on_step(ratio_step(4, low));
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(ratio_step(5, low));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::update_ratio);
  EXPECT_EQ(sink.calls[0].message,
            "the update ratio ||Δθ||/||θ|| (θ before the step) has been 1e-08 (outside [1e-08, "
            "1]) for 3 step(s) — the learning rate is far too low for these weights (typical "
            "ratios are 1e-4..1e-2)");
  EXPECT_EQ(sink.calls[0].value, low);
  EXPECT_EQ(sink.calls[0].step, 5);
}

TEST(MagnitudeCheck, UpdateRatioExtremeFiresOnOneStep) {
  Options o;
  FakeSink sink;
  MagnitudeCheck c(sink, o);
  c.on_step(ratio_step(0, 10.0));  // exactly 10x the upper bound: not extreme
  EXPECT_TRUE(sink.calls.empty());
  FakeSink sink2;
  MagnitudeCheck c2(sink2, o);
  c2.on_step(ratio_step(0, 12.5));
  ASSERT_EQ(sink2.calls.size(), 1u);
  EXPECT_EQ(sink2.calls[0].message,
            "the update ratio ||Δθ||/||θ|| (θ before the step) has been 12.5 (outside [1e-08, "
            "1]) for 1 step(s) — the learning rate is far too high for these weights (typical "
            "ratios are 1e-4..1e-2)");
}

// Note [Manual-mode steps]: a manual-mode step that wrote and changed no parameter applied no
// update (a micro-batch of an accumulation): neither judged nor counted, and it does not break a
// run of out-of-band steps; one whose values changed (a write through .data) is judged.
TEST(MagnitudeCheck, UpdateRatioSkipsManualStepsThatAppliedNoUpdate) {
  Options o;  // band [1e-8, 1], 3 steps
  const double low = std::nextafter(o.update_ratio_low, 0.0);
  FakeSink sink;
  MagnitudeCheck c(sink, o);
  auto no_update = [&](int64_t step) {
    StepView v = ratio_step(step, low);
    v.unwritten = true;
    v.totals.changed = 0;
    return v;
  };
  for (int64_t s = 0; s < 6; ++s) c.on_step(no_update(s));  // six micro-batches: silent
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(ratio_step(6, low));
  c.on_step(ratio_step(7, low));
  c.on_step(no_update(8));  // not counted, and the run goes on
  EXPECT_TRUE(sink.calls.empty());
  StepView data_write = ratio_step(9, low);  // unwritten, but its values changed: judged
  data_write.unwritten = true;
  data_write.totals.changed = 1;
  c.on_step(data_write);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].step, 9);
  EXPECT_NE(sink.calls[0].message.find("for 3 step(s)"), std::string::npos)
      << sink.calls[0].message;
}

TEST(MagnitudeCheck, UpdateRatioNeedsAnUpdateAGradientAndALearningRate) {
  Options o;
  FakeSink sink;
  MagnitudeCheck c(sink, o);
  StepView v = ratio_step(0, 100.0);
  v.lr_zero = true;
  c.on_step(v);
  v = ratio_step(1, 100.0);
  v.totals.any_update = false;
  c.on_step(v);
  v = ratio_step(2, 100.0);
  v.totals.grad_norm = 0.0;
  c.on_step(v);
  v = ratio_step(3, 100.0);
  v.totals.ratio_denom = 0.0;
  c.on_step(v);
  EXPECT_TRUE(sink.calls.empty());
}

// --- step integrity ---

TEST(StepIntegrityCheck, ClearedUnusedGradientsAtTheNextTrainingForward) {
  FakeSink sink;
  Options o;
  StepIntegrityCheck c(sink, o);
  ForwardView f;
  f.step = 2;
  f.skipped = {"fc.weight", "fc.bias"};
  f.grad_enabled = false;  // only a training forward with grad enabled reports them
  c.on_forward(f);
  EXPECT_TRUE(sink.calls.empty());
  f.grad_enabled = true;
  c.on_forward(f);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::skipped_step);
  EXPECT_EQ(sink.calls[0].tensor, "fc.weight");
  EXPECT_EQ(sink.calls[0].message,
            "gradients of 2 parameter(s) (e.g. fc.weight) were produced by backward() and then "
            "cleared by zero_grad() without any optimizer.step() using them — call "
            "optimizer.step() after backward()");
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_EQ(sink.calls[0].step, 2);
}

// Note [Discarded gradients]: gradients read before a clear; skipped_step's advice follows them.
TEST(StepIntegrityCheck, DiscardedNonFiniteGradientsNameTheGuard) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  NonfiniteCheck n(sink, o, origins);
  StepIntegrityCheck c(sink, o);
  TensorStats clean = testing::stats(1.0);
  TensorStats bad = testing::stats(1.0);
  bad.nan = 3;
  EXPECT_FALSE(n.on_discarded({{"fc.weight", clean}}, 0));
  EXPECT_TRUE(sink.calls.empty());
  const bool found = n.on_discarded({{"fc.weight", clean}, {"fc.bias", bad}}, 0);
  EXPECT_TRUE(found);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::nonfinite_grad);
  EXPECT_EQ(sink.calls[0].tensor, "fc.bias");
  EXPECT_EQ(sink.calls[0].value, 3.0);
  EXPECT_NE(sink.calls[0].message.find("being cleared without an optimizer step"),
            std::string::npos);
  EXPECT_TRUE(origins.armed(1));  // the next steps name the origin
  c.on_discarded(found);
  ForwardView f;
  f.step = 0;
  f.skipped = {"fc.weight"};
  c.on_forward(f);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[1].kind, Kind::skipped_step);
  EXPECT_NE(sink.calls[1].message.find("held NaN/Inf (see nonfinite_grad)"), std::string::npos);
  EXPECT_EQ(sink.calls[1].message.find("call optimizer.step() after backward()"),
            std::string::npos);
  // Finite gradients cleared unused later: the ordinary advice again.
  c.on_discarded(false);
  f.skipped = {"fc.bias"};
  c.on_forward(f);
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_NE(sink.calls[2].message.find("call optimizer.step() after backward()"),
            std::string::npos);
}

TEST(StepIntegrityCheck, MaxAccumulationBoundary) {
  FakeSink sink;
  Options o;
  o.max_accumulation = 64;
  StepIntegrityCheck c(sink, o);
  ForwardView f;
  f.backwards_since_step = 64;
  c.on_forward(f);
  EXPECT_TRUE(sink.calls.empty());
  f.backwards_since_step = 65;
  f.have_optimizer = false;
  c.on_forward(f);
  EXPECT_TRUE(sink.calls.empty());
  f.have_optimizer = true;
  c.on_forward(f);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].tensor, "");
  EXPECT_EQ(sink.calls[0].message,
            "65 backward passes ran without an optimizer step (more than max_accumulation=64) — "
            "optimizer.step() is never called, or the accumulation condition never holds");
  EXPECT_EQ(sink.calls[0].value, 65.0);
}

StepView cleared_step(GradAtStep a, GradAtStep b, int64_t b_zero) {
  StepView v;
  v.step = 4;
  v.params = {param(0, "a"), param(1, "b"), param(2, "unused"), param(3, "loose")};
  v.params[0].grad_at_step = a;
  v.params[1].grad_at_step = b;
  v.params[1].grad->zero = b_zero;        // of 4
  v.params[2].observed.got_grad = false;  // neither produced nor cleared: ignored
  v.params[3].opt = -1;                   // in no optimizer: ignored
  compute_totals(v);
  return v;
}

TEST(StepIntegrityCheck, GradientsClearedBeforeTheStep) {
  FakeSink sink;
  Options o;
  StepIntegrityCheck c(sink, o);
  c.on_step(cleared_step(GradAtStep::kNone, GradAtStep::kModified, 3));  // b clipped, not zeroed
  c.on_step(cleared_step(GradAtStep::kNone, GradAtStep::kAsBackwardLeft, 4));
  EXPECT_TRUE(sink.calls.empty());
  EXPECT_FALSE(c.take_probe_request());
  StepView manual = cleared_step(GradAtStep::kNone, GradAtStep::kNone, 0);
  manual.manual = true;
  c.on_step(manual);
  StepView partial = cleared_step(GradAtStep::kNone, GradAtStep::kNone, 0);
  partial.partial = true;  // attached inside the step: not judged
  c.on_step(partial);
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(cleared_step(GradAtStep::kNone, GradAtStep::kNone, 4));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].message,
            "the gradients of all 2 parameter(s) that got one since the previous step were None "
            "at optimizer.step() — something between backward() and step() clears them (a "
            "zero_grad() or p.grad = None there?), so the step uses no gradient; clear gradients "
            "before backward() (or after step())");
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_EQ(sink.calls[0].step, 4);
  EXPECT_FALSE(c.take_probe_request());
}

// Note [Zero gradients]: all zero and modified in place (clipped, unscaled, or zeroed) is judged
// by what backward() left, probed after the first such step.
TEST(StepIntegrityCheck, ZeroGradientsAsBackwardLeftThemAreNotCleared) {
  FakeSink sink;
  Options o;
  StepIntegrityCheck c(sink, o);
  // A fully masked batch, clipped: unknown at first, so silent and a probe is asked for.
  StepView masked = cleared_step(GradAtStep::kModified, GradAtStep::kModified, 4);
  masked.params[0].grad->zero = 4;
  c.on_step(masked);
  EXPECT_TRUE(sink.calls.empty());
  EXPECT_TRUE(c.take_probe_request());
  EXPECT_FALSE(c.take_probe_request());  // reading resets it
  // Some set to None, the rest zeroed in place without evidence: not judged either.
  c.on_step(cleared_step(GradAtStep::kNone, GradAtStep::kModified, 4));
  EXPECT_TRUE(sink.calls.empty());
  EXPECT_TRUE(c.take_probe_request());
  // Probed: backward() left them all zero — legitimately nothing to do; no probe needed.
  StepView zero = cleared_step(GradAtStep::kModified, GradAtStep::kModified, 4);
  zero.params[0].grad->zero = 4;
  zero.params[0].grad_left_nonzero = false;
  zero.params[1].grad_left_nonzero = false;
  c.on_step(zero);
  EXPECT_TRUE(sink.calls.empty());
  EXPECT_FALSE(c.take_probe_request());
  // Probed: one of them was nonzero as backward() left it, and zero at the step: cleared.
  StepView cleared = zero;
  cleared.params[1].grad_left_nonzero = true;
  c.on_step(cleared);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].message,
            "the gradients of all 2 parameter(s) that got one since the previous step were "
            "nonzero as backward() left them and zero at optimizer.step() — something between "
            "backward() and step() clears them (a zero_grad() or p.grad = None there?), so the "
            "step uses no gradient; clear gradients before backward() (or after step())");
}

// Note [Unchanged tensors]
StepView unchanged_step(double lr = 0.1) {
  StepView v;
  v.step = 7;
  v.opt = 0;
  v.params = {param(0, "moved"), param(1, "w")};
  for (ParamView& p : v.params) {
    p.eps = 1.1920928955078125e-07;  // float32
    p.lr = lr;
    p.grad->absmax = 0.5;
    p.param.absmax = 1.0;
  }
  v.params[0].update = UpdateStats{4, 0.05, 0.05};
  v.params[1].update = UpdateStats{0, 0.0, 0.0};
  compute_totals(v);
  return v;
}

TEST(StepIntegrityCheck, TensorTheStepLeftUnchanged) {
  Options o;
  {
    FakeSink sink;
    StepIntegrityCheck c(sink, o);
    c.on_step(unchanged_step());
    ASSERT_EQ(sink.calls.size(), 1u);
    EXPECT_EQ(sink.calls[0].kind, Kind::skipped_step);
    EXPECT_EQ(sink.calls[0].tensor, "w");
    EXPECT_EQ(sink.calls[0].message,
              "optimizer.step() changed other parameters but not one element of w, although its "
              "gradient is nonzero (max |g| 0.5) and its group's learning rate is 0.1 — the "
              "optimizer (or its kernel) ignores this tensor: check a custom step() for "
              "parameters it skips, and that the optimizer holds this very tensor (not a copy "
              "made before the model was moved or rebuilt)");
    EXPECT_EQ(sink.calls[0].value, 0.5);
    EXPECT_EQ(sink.calls[0].step, 7);
  }
  // Legitimate: each of these leaves w unchanged without a finding.
  std::vector<std::pair<std::string, StepView>> silent;
  silent.emplace_back("group lr 0", unchanged_step(0.0));
  silent.emplace_back("whole step lr 0", unchanged_step());
  silent.back().second.lr_zero = true;
  silent.emplace_back("zero gradient (weight decay only)", unchanged_step());
  silent.back().second.params[1].grad->absmax = 0.0;
  silent.emplace_back("no gradient", unchanged_step());
  silent.back().second.params[1].grad.reset();
  silent.emplace_back("non-finite gradient", unchanged_step());
  silent.back().second.params[1].grad->nan = 1;
  silent.emplace_back("frozen", unchanged_step());
  silent.back().second.params[1].trainable = false;
  silent.emplace_back("bfloat16 weights", unchanged_step());
  silent.back().second.params[1].eps = 0.0078125;
  silent.emplace_back("float16 weights", unchanged_step());
  silent.back().second.params[1].eps = 0.0009765625;
  silent.emplace_back("not floating point", unchanged_step());
  silent.back().second.params[1].eps = 0.0;
  silent.emplace_back("in no optimizer", unchanged_step());
  silent.back().second.params[1].opt = -1;
  silent.emplace_back("another optimizer's", unchanged_step());
  silent.back().second.params[1].opt = 1;
  silent.emplace_back("no update statistics this step", unchanged_step());
  silent.back().second.params[1].update.reset();
  silent.emplace_back("attached inside the step", unchanged_step());
  silent.back().second.partial = true;
  silent.emplace_back("manual", unchanged_step());
  silent.back().second.manual = true;
  silent.emplace_back("sparse update (some elements)", unchanged_step());
  silent.back().second.params[1].update = UpdateStats{1, 0.01, 0.01};
  // lr * max|g| = 1e-7 * 0.5 below 4 ulp of max|θ| = 1 (4.77e-7): fp32 rounds it away.
  silent.emplace_back("underflowing update", unchanged_step(1e-7));
  for (auto& [what, v] : silent) {
    compute_totals(v);
    FakeSink sink;
    StepIntegrityCheck c(sink, o);
    c.on_step(v);
    EXPECT_EQ(sink.count(Kind::skipped_step, "w"), 0) << what;
  }
  // A step that moved nothing at all is the whole-step rule only (a converged LBFGS, a lr that
  // underflows everywhere), never one finding per tensor.
  {
    StepView v = unchanged_step();
    v.params[0].update = UpdateStats{0, 0.0, 0.0};
    compute_totals(v);
    FakeSink sink;
    StepIntegrityCheck c(sink, o);
    c.on_step(v);
    ASSERT_EQ(sink.calls.size(), 1u);
    EXPECT_EQ(sink.calls[0].tensor, "");
  }
}

TEST(StepIntegrityCheck, TensorLeftUnchangedThresholdEdges) {
  Options o;
  const double eps = 1.1920928955078125e-07;
  // The predicted move min(largest move, lr * max|g|) against 4 eps max|θ| (= 4 eps here).
  auto fires = [&](double lr, double largest_move) {
    StepView v = unchanged_step(lr);
    v.params[1].grad->absmax = 1.0;
    v.params[0].update->max = largest_move;
    compute_totals(v);
    FakeSink sink;
    StepIntegrityCheck c(sink, o);
    c.on_step(v);
    return sink.count(Kind::skipped_step, "w") > 0;
  };
  EXPECT_FALSE(fires(4 * eps, 1.0));
  EXPECT_TRUE(fires(std::nextafter(4 * eps, kInf), 1.0));
  EXPECT_FALSE(fires(1.0, 4 * eps));  // the step's largest move bounds it (adaptive optimizers)
  EXPECT_TRUE(fires(1.0, std::nextafter(4 * eps, kInf)));
  // Unknown learning rate (C++ end_step, a device tensor): estimated from the tensors that
  // moved, the smallest update.max / max|g|: here 0.05 / 0.5 = 0.1.
  {
    StepView v = unchanged_step(kNaN);
    compute_totals(v);
    FakeSink sink;
    StepIntegrityCheck c(sink, o);
    c.on_step(v);
    ASSERT_EQ(sink.calls.size(), 1u);
    EXPECT_NE(sink.calls[0].message.find("its group's learning rate is not 0 —"),
              std::string::npos);
  }
  {
    StepView v = unchanged_step(kNaN);
    v.params[1].grad->absmax = 1e-6;  // 0.1 * 1e-6 = 1e-7 < 4 eps: would underflow
    compute_totals(v);
    FakeSink sink;
    StepIntegrityCheck c(sink, o);
    c.on_step(v);
    EXPECT_TRUE(sink.calls.empty());
  }
}

TEST(StepIntegrityCheck, StepThatChangedNothing) {
  Options o;
  auto step = [](int64_t changed) {
    StepView v;
    v.params = {param(0, "w")};
    v.params[0].update = UpdateStats{changed, 0.0, 0.0};
    compute_totals(v);
    return v;
  };
  FakeSink sink;
  StepIntegrityCheck c(sink, o);
  c.on_step(step(1));
  StepView lr0 = step(0);
  lr0.lr_zero = true;
  c.on_step(lr0);
  StepView manual = step(0);
  manual.manual = true;
  c.on_step(manual);
  StepView no_grad = step(0);
  no_grad.params[0].grad = stats(0.0);
  compute_totals(no_grad);
  c.on_step(no_grad);
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(step(0));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].message,
            "optimizer.step() ran but changed no parameter although the gradients are nonzero — "
            "the optimizer holds other tensors than the model's parameters (built before the "
            "model was replaced or moved?), or its learning rate underflows");
  EXPECT_EQ(sink.calls[0].value, 0.0);
}

// A step that moves nothing because every gradient is below what the weights can register (an
// LBFGS that has converged returns without an update) is not a skipped step; the same step with a
// gradient the weights do register, or a learning rate that rounds every update away, is.
TEST(StepIntegrityCheck, StepThatChangedNothingBelowWhatTheWeightsRegister) {
  Options o;
  auto step = [](double grad_max, double lr) {
    StepView v;
    v.params = {param(0, "w")};
    v.params[0].update = UpdateStats{0, 0.0, 0.0};
    v.params[0].grad->absmax = grad_max;
    v.params[0].param.absmax = 1.0;
    v.params[0].eps = 1.1920928955078125e-07;  // float32
    v.params[0].lr = lr;
    compute_totals(v);
    return v;
  };
  FakeSink sink;
  StepIntegrityCheck c(sink, o);
  c.on_step(step(1e-8, 1.0));  // 1e-8 < 4 ulp(1.0) = 4.8e-7: converged, nothing to register
  EXPECT_TRUE(sink.calls.empty());
  c.on_step(step(1e-3, 1.0));
  EXPECT_EQ(sink.calls.size(), 1u);
  c.on_step(step(0.5, 1e-30));  // the learning rate underflows
  EXPECT_EQ(sink.calls.size(), 2u);
}

TEST(StepIntegrityCheck, UpdateOutsideStepOnePerParameter) {
  FakeSink sink;
  sink.enabled[Kind::update_outside_step] = true;  // opt-in
  Options o;
  StepIntegrityCheck c(sink, o);
  c.on_step_begin({}, 3);
  c.on_step_begin({"w", "b"}, 3);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].tensor, "w");
  EXPECT_EQ(sink.calls[1].tensor, "b");
  EXPECT_EQ(sink.calls[0].message,
            "w changed between the previous optimizer step and this one without a step — a "
            "manual in-place update (.data, copy_, add_ under no_grad), a load_state_dict, or "
            "another optimizer writing it");
  EXPECT_FALSE(sink.calls[0].value);
  EXPECT_EQ(sink.calls[0].step, 3);
}

}  // namespace
}  // namespace trainsan::host
