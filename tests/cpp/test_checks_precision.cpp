// The precision family (host/checks/precision.cpp) on synthetic facts: the gradient scaler's
// skips and scales (amp_scale_collapse), overflow provenance (Origins: arming and wording, the
// fp16_overflow of its causes), low_precision_loss and update_underflow per tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "checks/checks.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;
using testing::param;

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

ScalerStep scaler(bool skipped, double scale) {
  ScalerStep s;
  s.opt = 0;
  s.skipped = skipped;
  s.scale = scale;
  return s;
}

TEST(PrecisionCheck, WarmUpSkipsAreTheScalerFindingItsScale) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  double scale = 65536.0;
  for (int i = 0; i < 10; ++i) {  // the first steps skip until the scale fits: no finding
    c.on_scaler(scaler(true, scale), 0);
    scale /= 2;
  }
  EXPECT_TRUE(sink.calls.empty());
  for (int i = 0; i < 20; ++i) c.on_scaler(scaler(false, scale), i);
  c.on_scaler(scaler(true, scale), 20);  // one skip after growth: legitimate
  for (int i = 21; i < 40; ++i) c.on_scaler(scaler(false, scale / 2), i);
  EXPECT_TRUE(sink.calls.empty());
}

TEST(PrecisionCheck, SkipsInARowAfterWarmUpCollapse) {
  FakeSink sink;
  Options o;  // amp_skip_run 5
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  c.on_scaler(scaler(false, 1024.0), 0);
  double scale = 1024.0;
  for (int i = 0; i < 4; ++i) {
    c.on_scaler(scaler(true, scale), 1);
    scale /= 2;
  }
  EXPECT_TRUE(sink.calls.empty());
  c.on_scaler(scaler(true, scale), 1);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::amp_scale_collapse);
  EXPECT_EQ(sink.calls[0].value, 5.0);
  const std::string& m = sink.calls[0].message;
  EXPECT_TRUE(has(m, "skipped the last 5 steps in a row (5 skipped in all)")) << m;
  EXPECT_TRUE(has(m, "1024 1024* 512* 256* 128* 64* (* skipped)")) << m;
  EXPECT_TRUE(has(m, "missing zero_grad")) << m;  // no provenance: the likely causes
}

TEST(PrecisionCheck, TooManySkipsInTheWindow) {
  FakeSink sink;
  Options o;
  o.amp_skip_window = 10;
  o.amp_skip_fraction = 0.3;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  // Every other step skips: never 5 in a row, but 3 of the last 10 (and more).
  for (int i = 0; i < 9; ++i) c.on_scaler(scaler(i % 2 == 1, 256.0), i);
  EXPECT_TRUE(sink.calls.empty());  // the window is not full yet
  c.on_scaler(scaler(false, 256.0), 9);
  c.on_scaler(scaler(true, 256.0), 10);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_TRUE(has(sink.calls[0].message, "it skipped 5 of the last 10 steps"))
      << sink.calls[0].message;
}

TEST(PrecisionCheck, ScaleBelowOneCollapsesEvenInWarmUp) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  c.on_scaler(scaler(true, 2.0), 0);
  c.on_scaler(scaler(true, 1.0), 0);
  EXPECT_TRUE(sink.calls.empty());
  c.on_scaler(scaler(true, 0.5), 0);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_TRUE(has(sink.calls[0].message, "its scale fell to 0.5")) << sink.calls[0].message;
  EXPECT_EQ(sink.calls[0].value, 0.5);
}

TEST(PrecisionCheck, UnknownScalesAreNotHistory) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  c.on_scaler(scaler(false, testing::kNaN), 0);
  for (int i = 0; i < 5; ++i) c.on_scaler(scaler(true, testing::kNaN), 1);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_FALSE(has(sink.calls[0].message, "its scale over")) << sink.calls[0].message;
}

ModuleOrigin origin(const std::string& module, bool backward = false) {
  ModuleOrigin o;
  o.module = module;
  o.type = "Linear";
  o.dtype = "float16";
  o.autocast = "float16";
  o.backward = backward;
  o.inf_only = true;
  o.position = 2;
  o.checked = 7;
  return o;
}

// Note [Backward NaN]: a NaN born in the backward at consecutive scaler skips.
Provenance backward_nan(int64_t step, bool inf_only = false, double prior = 0.0) {
  Provenance p;
  p.step = step;
  p.forward_checked = 5;
  p.backward_checked = 5;
  ModuleOrigin b = origin("fc1", true);
  b.inf_only = inf_only;
  b.prior_absmax = prior;
  b.prior_where = prior > 0.0 ? "the output of head (float16)" : "";
  p.backward = b;
  return p;
}

TEST(PrecisionCheck, BackwardNaNAtTheSecondSkip) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  origins.record(backward_nan(0));
  c.on_scaler(scaler(true, 65536.0), 0);  // the first skip: silent
  EXPECT_TRUE(sink.calls.empty());
  c.on_scaler(scaler(true, 32768.0), 0);  // a skipped step keeps its number
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::nonfinite_grad);
  EXPECT_EQ(sink.calls[0].tensor, "fc1");
  EXPECT_EQ(sink.calls[0].value, 2.0);
  EXPECT_TRUE(has(sink.calls[0].message, "skipped 2 steps in a row")) << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "the gradient of the output of fc1"))
      << sink.calls[0].message;
  c.on_scaler(scaler(true, 16384.0), 0);  // once per scaler
  EXPECT_EQ(sink.calls.size(), 1u);
}

TEST(PrecisionCheck, OverflowSkipsAreNotABackwardNaN) {
  FakeSink sink;
  Options o;
  {
    Origins origins(o);  // warm-up: the first non-finite gradient is ±Inf (an overflow)
    PrecisionCheck c(sink, o, origins);
    origins.record(backward_nan(0, /*inf_only=*/true));
    for (int i = 0; i < 3; ++i) c.on_scaler(scaler(true, 65536.0 / (1 << i)), 0);
  }
  {
    Origins origins(o);  // NaN after a value near the fp16 range: an overflow turned NaN
    PrecisionCheck c(sink, o, origins);
    origins.record(backward_nan(0, false, 16384.0));
    for (int i = 0; i < 3; ++i) c.on_scaler(scaler(true, 65536.0 / (1 << i)), 0);
  }
  {
    Origins origins(o);  // the forward is the origin (the loss itself is NaN)
    PrecisionCheck c(sink, o, origins);
    Provenance p = backward_nan(0);
    ModuleOrigin f = origin("fc0");
    f.inf_only = false;
    p.forward = f;
    origins.record(p);
    for (int i = 0; i < 3; ++i) c.on_scaler(scaler(true, 65536.0 / (1 << i)), 0);
  }
  {
    Origins origins(o);  // one skip only, then steps
    PrecisionCheck c(sink, o, origins);
    origins.record(backward_nan(3, false, 16383.0));
    c.on_scaler(scaler(true, 1024.0), 3);
    c.on_scaler(scaler(false, 512.0), 3);
    c.on_scaler(scaler(true, 512.0), 4);  // no provenance kept for step 4
    c.on_scaler(scaler(true, 256.0), 4);
  }
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
}

TEST(Origins, ArmedOnSampledStepsAndAfterANonFiniteValue) {
  Options o;
  o.provenance_every = 10;
  o.provenance_rearm = 2;
  Origins origins(o);
  EXPECT_TRUE(origins.armed(0));
  EXPECT_FALSE(origins.armed(1));
  EXPECT_TRUE(origins.armed(20));
  origins.rearm(13);
  EXPECT_TRUE(origins.armed(14));
  EXPECT_TRUE(origins.armed(15));
  EXPECT_FALSE(origins.armed(16));
  o.provenance_every = 0;  // only after a non-finite value
  Origins after(o);
  EXPECT_FALSE(after.armed(0));
  after.rearm(0);
  EXPECT_TRUE(after.armed(1));
}

TEST(Origins, DescribesTheForwardOriginFirst) {
  Options o;
  Origins origins(o);
  Provenance p;
  p.step = 4;
  p.forward_checked = 7;
  p.forward = origin("enc.mid");
  p.backward = origin("enc.out", true);
  origins.record(p);
  const std::string d = origins.describe(4);
  EXPECT_TRUE(has(d,
                  "It first appeared in the forward at the output of enc.mid (Linear, "
                  "float16 under float16 autocast; the 2nd of 7 tensors flagged in forward "
                  "order), ±Inf only: an fp16 overflow"))
      << d;
  EXPECT_FALSE(has(d, "enc.out")) << d;  // the backward's follows from the forward's
  EXPECT_EQ(origins.describe(5), "");
  Provenance clean;
  clean.step = 5;
  clean.forward_checked = 7;
  clean.backward = origin("enc.out", true);
  origins.record(clean);
  const std::string b = origins.describe(5);
  EXPECT_TRUE(has(b,
                  "The forward's 7 flagged tensors (module inputs and outputs) were all finite. "
                  "It first appeared in the backward at the gradient of the output of enc.out"))
      << b;
  ModuleOrigin in = origin("enc.mid");
  in.input = true;
  EXPECT_TRUE(has(origin_text(in), "the input of enc.mid")) << origin_text(in);
  EXPECT_TRUE(has(origin_text(in), "forward code of enc itself")) << origin_text(in);
  in.module = "";
  EXPECT_TRUE(has(origin_text(in), "the batch itself")) << origin_text(in);
}

TEST(NonfiniteCheck, LossQuotesTheOriginAndRearms) {
  FakeSink sink;
  Options o;
  o.provenance_every = 0;
  Origins origins(o);
  NonfiniteCheck n(sink, o, origins);
  PrecisionCheck c(sink, o, origins);
  Provenance p;
  p.step = 3;
  p.forward_checked = 5;
  p.forward = origin("mid");
  p.forward->beyond_fp16 = {{"mid.weight", 2}};
  c.on_provenance(p);
  ASSERT_EQ(sink.calls.size(), 1u);  // the cause first
  EXPECT_EQ(sink.calls[0].kind, Kind::fp16_overflow);
  EXPECT_EQ(sink.calls[0].tensor, "mid.weight");
  TensorStats loss = testing::stats(1.0, 1);
  loss.posinf = 1;
  n.on_loss(loss, 3);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[1].kind, Kind::nonfinite_loss);
  EXPECT_TRUE(has(sink.calls[1].message, "mid.weight (2)")) << sink.calls[1].message;
  EXPECT_TRUE(origins.armed(4));
}

TEST(PrecisionCheck, RangeOverflowsAreFp16Findings) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  Provenance p;
  p.step = 1;
  p.fp16_range.push_back({"enc.norm", "LayerNorm", "float32", 1.5e5});
  c.on_provenance(p);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].tensor, "enc.norm");
  EXPECT_TRUE(has(sink.calls[0].message, "reaches 1.5e+05")) << sink.calls[0].message;
}

TEST(PrecisionCheck, LowPrecisionLoss) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  LossView v;
  v.dtype = "float32";
  c.on_loss(v);
  EXPECT_TRUE(sink.calls.empty());
  v.dtype = "bfloat16";
  c.on_loss(v);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::low_precision_loss);
}

ParamView lossy(size_t i, const std::string& name, double eps, int64_t numel, int64_t zero_grads,
                int64_t changed) {
  ParamView p = param(i, name);
  p.eps = eps;
  p.lr = 1e-4;
  p.grad->numel = numel;
  p.grad->zero = zero_grads;
  p.param.numel = numel;
  p.param.absmax = 1.0;
  p.update = UpdateStats{changed, 1e-4, 1e-4};
  return p;
}

TEST(PrecisionCheck, UpdateUnderflowPerTensorAfterConsecutiveSteps) {
  FakeSink sink;
  Options o;  // fraction 0.5, 3 steps
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  const double bf16 = std::ldexp(1.0, -7);
  const double fp32 = std::ldexp(1.0, -23);
  StepView v;
  v.opt = 0;
  // ln: 32 elements, 2 with a zero gradient, 3 changed -> 27/30 lost. w: trains. f: fp32, 60%.
  v.params = {lossy(0, "ln.weight", bf16, 32, 2, 3), lossy(1, "w", bf16, 100, 0, 90),
              lossy(2, "f", fp32, 100, 0, 40)};
  for (int s = 0; s < 2; ++s) {
    v.step = s;
    c.on_step(v);
  }
  EXPECT_TRUE(sink.calls.empty());
  v.step = 2;
  c.on_step(v);
  ASSERT_EQ(sink.calls.size(), 1u);  // not w (10% lost), not f (float32 is not judged)
  EXPECT_EQ(sink.calls[0].tensor, "ln.weight");
  EXPECT_NEAR(*sink.calls[0].value, 27.0 / 30.0, 1e-12);
  EXPECT_TRUE(has(sink.calls[0].message, "left 27 of its 30 elements")) << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "(bfloat16)")) << sink.calls[0].message;
  // A step where it trains resets its run; a step with lr 0 is not judged.
  sink.calls.clear();
  v.params[0].update->changed = 30;
  v.step = 3;
  c.on_step(v);
  v.params[0].update->changed = 0;
  v.step = 4;
  c.on_step(v);
  v.lr_zero = true;
  c.on_step(v);
  EXPECT_TRUE(sink.calls.empty());
}

TEST(PrecisionCheck, NegligibleGradientsAreNotUnderflow) {
  FakeSink sink;
  Options o;
  Origins origins(o);
  PrecisionCheck c(sink, o, origins);
  const double bf16 = std::ldexp(1.0, -7);
  StepView v;
  v.opt = 0;
  // A conv bias before BatchNorm: its gradient cancels to ~0 and nothing of it moves.
  v.params = {lossy(0, "conv.bias", bf16, 16, 0, 0), lossy(1, "fc.weight", bf16, 64, 0, 60)};
  v.params[0].grad->l2 = 1e-9;
  for (int s = 0; s < 5; ++s) {
    v.step = s;
    c.on_step(v);
  }
  EXPECT_TRUE(sink.calls.empty());
}

}  // namespace
}  // namespace trainsan::host
