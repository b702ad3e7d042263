// ModeCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/mode.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class ModeCheck {  // mode.cpp: no_grad_leak, eval_mode (Note [Mode rules])
 public:
  ModeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// The registered modules, once at attach; views refer to them by position.
  void set_modules(std::vector<ModeModule> modules) { modules_ = std::move(modules); }
  void on_forward(const ForwardView& v);
  void on_step(const StepView& v);
  /// A backward was called on a loss without an autograd graph (torch's "does not require grad"
  /// error follows) while the `no_grad_forwards` training forwards since the step all ran under
  /// no_grad: no_grad_leak, naming that forward.
  void on_graphless_backward(int64_t step, int64_t no_grad_forwards);

 private:
  void no_grad_step(const StepView& v);
  std::string forward_named() const;
  std::string last_site_;  // of the latest no_grad forward in train mode
  void eval_step(const StepView& v);
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
  std::vector<ModeModule> modules_;
};

}  // namespace trainsan::host
