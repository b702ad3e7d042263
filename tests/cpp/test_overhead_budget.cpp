// The overhead budget's sampling period (Note [Overhead budget]) on synthetic timings.
#include <gtest/gtest.h>

#include "overhead_budget.h"

namespace trainsan::host {
namespace {

// Feeds `n` steps alternating as the budget asks: a snapshot step costs base + extra.
int64_t settle(OverheadBudget& b, double plain, double base, double extra, int steps = 200) {
  for (int s = 0; s < steps; ++s) {
    const bool snap = b.update_due(s) || b.update_due(s + 1);
    const double own = base + (snap ? extra : 0.0);
    b.observe(plain + own, own, snap);
  }
  return b.period();
}

TEST(OverheadBudget, NoBudgetMeansEveryStep) {
  OverheadBudget b(0.0, 10);
  EXPECT_EQ(settle(b, 10e-3, 5e-3, 5e-3), 1);
  for (int s = 0; s < 100; ++s) EXPECT_TRUE(b.update_due(s));
}

TEST(OverheadBudget, WarmupStepsAllHaveUpdates) {
  OverheadBudget b(0.05, 10);
  for (int s = 0; s < 10; ++s) EXPECT_TRUE(b.update_due(s)) << s;
  // Before any cost is known the first period applies.
  EXPECT_FALSE(b.update_due(11));
  EXPECT_TRUE(b.update_due(OverheadBudget::kFirstPeriod * 2));
}

TEST(OverheadBudget, CheapSnapshotsRunEveryStep) {
  // 1% base + 1% extra of a 100 ms step: within half of 5% (the measured share).
  OverheadBudget b(0.05, 0);
  EXPECT_EQ(settle(b, 0.1, 1e-3, 1e-3), 1);
}

TEST(OverheadBudget, PeriodKeepsTheAverageWithinBudget) {
  // plain 10 ms, budget 10%, of which the measured time may use half = 0.5 ms; base 0.3 ms,
  // snapshot extra 1 ms: 0.3 + 1 * 2 / p <= 0.5  ->  p >= 10.
  OverheadBudget b(0.10, 0);
  EXPECT_EQ(settle(b, 10e-3, 0.3e-3, 1e-3), 10);
}

TEST(OverheadBudget, TheMeasuredTimeGetsHalfTheBudget) {
  // The same costs under a 5% budget: 0.25 ms measured allowed, the base (0.3 ms) alone exceeds
  // it, so the update statistics are rarest. At 20%: 1 ms allowed, 0.3 + 1 * 2 / p <= 1 -> p = 3.
  OverheadBudget tight(0.05, 0);
  EXPECT_EQ(settle(tight, 10e-3, 0.3e-3, 1e-3), OverheadBudget::kMaxPeriod);
  OverheadBudget wide(0.20, 0);
  EXPECT_EQ(settle(wide, 10e-3, 0.3e-3, 1e-3), 3);
}

TEST(OverheadBudget, BaseOverBudgetGivesTheLongestPeriod) {
  // The essentials alone (1 ms of 10 ms) exceed 5%: they still run, updates are rarest.
  OverheadBudget b(0.05, 0);
  EXPECT_EQ(settle(b, 10e-3, 1e-3, 1e-3), OverheadBudget::kMaxPeriod);
}

TEST(OverheadBudget, StallsBetweenStepsDoNotWidenTheBudget) {
  // Every fifth interval holds a long pause (data loading, evaluation, another job's steps): the
  // step's cost is the median interval, so the period stays that of the steady steps.
  OverheadBudget b(0.10, 0);
  const double plain = 10e-3, base = 0.3e-3, extra = 1e-3;
  for (int s = 0; s < 300; ++s) {
    const bool snap = b.update_due(s) || b.update_due(s + 1);
    const double own = base + (snap ? extra : 0.0);
    b.observe(plain + own + (s % 5 == 0 ? 0.5 : 0.0), own, snap);
  }
  EXPECT_EQ(b.period(), 10);
}

}  // namespace
}  // namespace trainsan::host
