// NonfiniteCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/nonfinite.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class NonfiniteCheck {  // nonfinite.cpp: nonfinite_loss/grad/param/activation, fp16_overflow
 public:
  NonfiniteCheck(FindingSink& sink, const Options& opts, Origins& origins)
      : sink_(sink), opts_(opts), origins_(origins) {}
  /// `empty_targets`: the audit saw a class-index loss call of this step whose targets were all
  /// ignore_index (a mean over no element is 0/0): the NaN is empty_loss's unless the step's
  /// gradients are not finite (decided in on_step).
  void on_loss(const TensorStats& loss, int64_t step, bool empty_targets = false);
  void on_step(const StepView& v);
  /// Gradients a backward produced that are being cleared without an optimizer step having used
  /// them (Note [Discarded gradients]): (parameter name, gradient statistics). Returns whether
  /// one held NaN/Inf.
  bool on_discarded(const std::vector<std::pair<std::string, TensorStats>>& grads, int64_t step);
  void on_module_output(const ModuleRef& module, const TensorStats& output, int64_t step);

 private:
  void report_loss(const TensorStats& loss, int64_t step);
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
  Origins& origins_;
  // A NaN loss explained by an all-ignored target, waiting for its step's gradients.
  std::optional<std::pair<TensorStats, int64_t>> pending_loss_;
};

}  // namespace trainsan::host
