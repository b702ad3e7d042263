// The loss family (host/checks/loss.cpp): loss_spike and trivial_loss on synthetic loss streams,
// thresholds pinned at their edges (Note [Loss stream]).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "checks/check.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;

// A scalar loss of value x; its hash is its bits (enough for the constant rule).
LossView loss(double x, int64_t step, bool in_step = false) {
  LossView v;
  v.step = step;
  v.in_step = in_step;
  v.stats.numel = 1;
  if (std::isnan(x)) {
    v.stats.nan = 1;
  } else if (std::isinf(x)) {
    (x > 0 ? v.stats.posinf : v.stats.neginf) = 1;
  } else {
    v.stats.sum = x;
    v.stats.zero = x == 0.0 ? 1 : 0;
    v.stats.min = v.stats.max = x;
    v.stats.absmax = std::abs(x);
  }
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  v.stats.hash = bits;
  return v;
}

Options no_trivial() {
  Options o;
  o.trivial_loss_steps = 0;
  return o;
}

// --- loss_spike ---

// A steady stream around 1.0 (a small alternating noise), then one loss `x`.
void steady_then(LossCheck& c, double x, int n = 20) {
  for (int k = 0; k < n; ++k) c.on_loss(loss(k % 2 ? 1.01 : 0.99, k));
  c.on_loss(loss(x, n));
}

TEST(LossSpike, FiresAboveTheRelativeFloorOfASteadyLoss) {
  // median 1.0, MAD 0.01 -> band = max(0.0148, 0.2) = 0.2; factor 10 -> excess > 2.0, x > 3.0.
  const Options o = no_trivial();
  FakeSink sink;
  LossCheck c(sink, o);
  steady_then(c, 3.01);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::loss_spike);
  EXPECT_EQ(sink.calls[0].step, 20);
  EXPECT_NEAR(*sink.calls[0].value, 3.01, 1e-12);
  EXPECT_EQ(sink.calls[0].message,
            "the loss jumped to 3.01, 3.01x its running median 1 over the last 20 losses (the "
            "largest of them: 1.01) — a corrupted or outlier batch, a learning-rate jump, or an "
            "optimizer instability; look at this step's batch and learning rate, and consider "
            "gradient clipping (torch.nn.utils.clip_grad_norm_)");
}

TEST(LossSpike, SilentJustBelowTheEdgeAndOnARestartThatDoublesTheLoss) {
  const Options o = no_trivial();
  for (const double x : {2.99, 2.0}) {
    FakeSink sink;
    LossCheck c(sink, o);
    steady_then(c, x);
    EXPECT_TRUE(sink.calls.empty()) << x;
  }
}

TEST(LossSpike, FactorOptionMovesTheEdge) {
  Options o = no_trivial();
  o.loss_spike_factor = 5.0;  // excess > 1.0
  FakeSink a, b;
  LossCheck ca(a, o), cb(b, o);
  steady_then(ca, 2.01);
  steady_then(cb, 1.99);
  EXPECT_EQ(a.calls.size(), 1u);
  EXPECT_TRUE(b.calls.empty());
}

TEST(LossSpike, NotBeforeTheWarmup) {
  Options o = no_trivial();
  o.loss_spike_warmup = 10;
  FakeSink early, ready;
  LossCheck ce(early, o), cr(ready, o);
  steady_then(ce, 100.0, 9);  // the 10th loss: 9 seen before it
  steady_then(cr, 100.0, 10);
  EXPECT_TRUE(early.calls.empty());
  EXPECT_EQ(ready.calls.size(), 1u);
}

TEST(LossSpike, HeavyTailedNoiseInTheWindowIsNotASpike) {
  // Small-batch noise: mostly 0.05, one hard batch of 0.7 every 10 losses. A new 0.75 is within
  // twice the window's largest excursion; 1.5 is not.
  const Options o = no_trivial();
  auto run = [&](double x) {
    FakeSink sink;
    LossCheck c(sink, o);
    for (int k = 0; k < 40; ++k) c.on_loss(loss(k % 10 == 3 ? 0.7 : 0.05 + 0.001 * (k % 3), k));
    c.on_loss(loss(x, 40));
    return sink.calls.size();
  };
  EXPECT_EQ(run(0.75), 0u);
  EXPECT_EQ(run(1.3), 0u);  // excess 1.25 < 2 x 0.65
  EXPECT_EQ(run(1.4), 1u);  // excess 1.35 > 1.3
}

TEST(LossSpike, WindowForgetsOldExcursions) {
  Options o = no_trivial();
  o.loss_spike_window = 8;
  FakeSink sink;
  LossCheck c(sink, o);
  c.on_loss(loss(50.0, 0));  // an early high loss, out of the window 8 losses later
  for (int k = 1; k <= 12; ++k) c.on_loss(loss(1.0, k));
  c.on_loss(loss(20.0, 13));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].step, 13);
}

TEST(LossSpike, DecreasingLossAndNonfiniteOrInStepLossesAreSilent) {
  const Options o = no_trivial();
  FakeSink sink;
  LossCheck c(sink, o);
  for (int k = 0; k < 30; ++k) c.on_loss(loss(10.0 / (1 + k), k));
  c.on_loss(loss(std::nan(""), 30));           // nonfinite_loss's
  c.on_loss(loss(1e9, 31, /*in_step=*/true));  // a closure's line-search trial
  EXPECT_TRUE(sink.calls.empty());
  c.on_loss(loss(1e9, 32));
  EXPECT_EQ(sink.calls.size(), 1u);
}

TEST(LossSpike, NegativeLossesUseTheNoiseBand) {
  // Around -5 (a log-likelihood): band = max(1.4826 x 0.1, 0.2 x 5) = 1; the factor is in bands.
  const Options o = no_trivial();
  auto run = [&](double x, FakeSink& sink) {
    LossCheck c(sink, o);
    for (int k = 0; k < 20; ++k) c.on_loss(loss(k % 2 ? -4.9 : -5.1, k));
    c.on_loss(loss(x, 20));
  };
  FakeSink below, sink;
  run(4.0, below);  // excess 9.0 < 10
  EXPECT_TRUE(below.calls.empty());
  run(5.5, sink);  // excess 10.5
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_NEAR(*sink.calls[0].value, 10.5, 1e-9);
  EXPECT_NE(sink.calls[0].message.find("noise bands above its running median -5"),
            std::string::npos)
      << sink.calls[0].message;
}

// --- trivial_loss ---

TEST(TrivialLoss, ExactlyZeroWithinTheFirstSteps) {
  const Options o;  // trivial_loss_steps 10
  FakeSink sink;
  LossCheck c(sink, o);
  c.on_loss(loss(0.0, 0));
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::trivial_loss);
  EXPECT_EQ(sink.calls[0].message,
            "the loss is exactly 0 within the first 10 steps — it cannot teach anything: a target "
            "equal to the prediction (loss(pred, pred), a swapped variable), a mask or "
            "ignore_index covering every term (reduction='sum' gives 0, 'mean' NaN), or labels "
            "leaked into the inputs; check what the loss compares");
}

TEST(TrivialLoss, ZeroAfterTheFirstStepsIsSilent) {
  const Options o;
  FakeSink sink;
  LossCheck c(sink, o);
  for (int k = 0; k < 10; ++k) c.on_loss(loss(1.0 / (1 + k), k));
  c.on_loss(loss(0.0, 10));  // step 10: outside the first 10 (0..9)
  EXPECT_TRUE(sink.calls.empty());
  c.on_loss(loss(0.0, 9));
  EXPECT_EQ(sink.calls.size(), 1u);
}

TEST(TrivialLoss, CollapseRatioEdge) {
  const Options o;  // ratio 1e-3
  FakeSink at, above;
  LossCheck ca(at, o), cb(above, o);
  ca.on_loss(loss(2.0, 0));
  ca.on_loss(loss(2.0e-3, 3));  // exactly 1e-3 x the first
  cb.on_loss(loss(2.0, 0));
  cb.on_loss(loss(2.1e-3, 3));
  ASSERT_EQ(at.calls.size(), 1u);
  EXPECT_EQ(at.calls[0].step, 3);
  EXPECT_NEAR(*at.calls[0].value, 1e-3, 1e-15);
  EXPECT_EQ(at.calls[0].message.rfind("the loss fell from 2 to 0.002 (0.001x) within the first 10 "
                                      "steps — a task this easy this early",
                                      0),
            0u)
      << at.calls[0].message;
  EXPECT_TRUE(above.calls.empty());
}

TEST(TrivialLoss, EasyTaskReachingASmallLossLateIsSilent) {
  const Options o;
  FakeSink sink;
  LossCheck c(sink, o);
  for (int k = 0; k < 40; ++k)
    c.on_loss(loss(2.0 * std::pow(0.5, k), k));  // <= 1e-3x from step 10 on
  EXPECT_TRUE(sink.calls.empty());
}

TEST(TrivialLoss, ConstantForTheFirstFiveSteps) {
  const Options o;
  FakeSink four, five;
  LossCheck c4(four, o), c5(five, o);
  for (int k = 0; k < 4; ++k) c4.on_loss(loss(0.6931, k));
  c4.on_loss(loss(0.6932, 4));
  for (int k = 0; k < 5; ++k) {
    c5.on_loss(loss(0.6931, k));
    c5.on_loss(loss(0.6931, k));  // two losses a step: still one step
  }
  EXPECT_TRUE(four.calls.empty());
  ASSERT_EQ(five.calls.size(), 1u);  // once, at step 4 (the repeat of step 4 is counted)
  EXPECT_EQ(five.calls[0].step, 4);
  EXPECT_EQ(five.count(Kind::trivial_loss), 1);
}

TEST(TrivialLoss, OffWithZeroStepsAndSwitchable) {
  Options o;
  o.trivial_loss_steps = 0;
  FakeSink sink;
  LossCheck c(sink, o);
  c.on_loss(loss(0.0, 0));
  EXPECT_TRUE(sink.calls.empty());
  const Options d;
  FakeSink off;
  off.enabled[Kind::trivial_loss] = false;
  LossCheck c2(off, d);
  c2.on_loss(loss(0.0, 0));
  EXPECT_TRUE(off.calls.empty());
}

}  // namespace
}  // namespace trainsan::host
