// The overhead budget (Note [Overhead budget] in overhead_budget.h).
#include "overhead_budget.h"

#include <algorithm>
#include <cmath>

namespace trainsan::host {

namespace {

void average(double& avg, bool& have, double x) {
  avg = have ? 0.8 * avg + 0.2 * x : x;
  have = true;
}

}  // namespace

void OverheadBudget::observe(double interval_s, double own_s, bool snapshot) {
  if (budget_ <= 0.0) return;
  if (interval_s > 0.0) {
    // The step's own cost without TrainSan: this interval less TrainSan's time in it.
    intervals_[n_intervals_ % kWindow] = interval_s - own_s;
    n_intervals_ += 1;
  }
  average(snapshot ? snap_ : base_, snapshot ? have_snap_ : have_base_, own_s);
  if (!have_base_ || !have_snap_ || n_intervals_ == 0) return;
  std::array<double, kWindow> recent = intervals_;
  const size_t n = std::min(n_intervals_, kWindow);
  std::nth_element(recent.begin(), recent.begin() + n / 2, recent.begin() + n);
  const double plain = std::max(recent[n / 2], 1e-9);
  const double allowed = kMeasuredShare * budget_ * plain;
  const double extra = std::max(snap_ - base_, 0.0);
  if (base_ + extra <= allowed) {
    period_ = 1;
  } else if (allowed <= base_) {
    period_ = kMaxPeriod;
  } else {
    const double p = std::ceil(2.0 * extra / (allowed - base_));
    period_ = std::clamp<int64_t>(static_cast<int64_t>(p), 2, kMaxPeriod);
  }
}

}  // namespace trainsan::host
