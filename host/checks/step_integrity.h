// StepIntegrityCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/step_integrity.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class StepIntegrityCheck {  // step_integrity.cpp: skipped_step (3 rules), update_outside_step
 public:
  StepIntegrityCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_forward(const ForwardView& v);  // cleared-unused gradients, max_accumulation
  void on_step(const StepView& v);        // cleared before the step, a step that changed nothing
  /// Gradients were cleared unused (Note [Discarded gradients]); `nonfinite`: they held NaN/Inf,
  /// so the loop skipped its step on purpose (a guard): skipped_step's advice says so.
  void on_discarded(bool nonfinite) { discarded_nonfinite_ = nonfinite; }
  /// update_outside_step: the parameters that changed since the previous step's end.
  void on_step_begin(const std::vector<std::string>& changed, int64_t step);
  /// Whether the last step's gradients were all zero and modified in place before the step, with
  /// nothing to tell whether backward() left them so (Note [Zero gradients]); the sanitizer then
  /// probes the next steps' gradients as backward() leaves them. Reading resets it.
  bool take_probe_request() { return std::exchange(probe_request_, false); }

 private:
  void unchanged_tensors(const StepView& v);
  void micro_cleared(const StepView& v);  // Note [Micro-batches cleared]
  static bool visible_move(const StepView& v);
  FindingSink& sink_;
  const Options& opts_;
  bool probe_request_ = false;
  bool discarded_nonfinite_ = false;  // the latest gradients read before a clear held NaN/Inf
};

}  // namespace trainsan::host
