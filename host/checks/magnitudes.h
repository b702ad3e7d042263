// MagnitudeCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/magnitudes.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class MagnitudeCheck {  // magnitudes.cpp: grad_explosion, update_ratio
 public:
  MagnitudeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_step(const StepView& v);

 private:
  struct PerOptimizer {
    double grad_norm_ema = 0.0;
    int64_t grad_norm_steps = 0;
    int64_t update_ratio_out = 0;  // consecutive steps outside the band
  };
  FindingSink& sink_;
  const Options& opts_;
  std::vector<std::pair<int64_t, PerOptimizer>> per_opt_;  // keyed by StepView::opt
  PerOptimizer& of(int64_t opt);
};

}  // namespace trainsan::host
