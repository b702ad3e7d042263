// GradientFlowCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/gradient_flow.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class GradientFlowCheck {  // gradient_flow.cpp: missing_grad, stale_grad, param_not_in_optimizer,
                           // grad_vanishing
 public:
  GradientFlowCheck(FindingSink& sink, const Options& opts, size_t num_params)
      : sink_(sink),
        opts_(opts),
        steps_without_grad_(num_params, 0),
        vanishing_steps_(num_params, 0) {}
  void on_step(const StepView& v);
  /// A step of some optimizer already looked like Note [Foreign backwards] (its parameters got
  /// no gradient while a foreign backward ran): the caller names what such a backward reached
  /// (ForeignBackward::holder), which costs a search, only from then on.
  bool foreign_suspected() const;

 private:
  /// Note [Foreign backwards]: whether it reported.
  bool foreign_step(const StepView& v);
  void optimizers_hold_none(const StepView& v);  // Note [Optimizers holding none]
  FindingSink& sink_;
  const Options& opts_;
  std::vector<std::pair<int64_t, int64_t>> foreign_steps_;  // (StepView::opt, consecutive steps)
  std::vector<int64_t> steps_without_grad_;
  std::vector<int64_t> vanishing_steps_;
  bool manual_prev_changed_ = false;  // manual mode: the previous pass saw a parameter change
};

}  // namespace trainsan::host
