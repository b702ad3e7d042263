// no_grad_leak and eval_mode: the training forward ran in the wrong grad or module mode.
#include "checks/check.h"

namespace trainsan::host {

void ModeCheck::on_forward(const ForwardView& v) {
  if (v.grad_enabled || !v.training) return;
  sink_.add(Kind::no_grad_leak, "",
            "the model's forward ran with gradients disabled (torch.no_grad / inference_mode) "
            "while the model is in train mode — parameters get no gradient from this forward; if "
            "this is validation, call model.eval() first, otherwise remove the no_grad context "
            "around the training forward",
            std::nullopt, v.step);
}

void ModeCheck::on_step(const StepView& v) {
  if (v.eval_modules.empty() || v.manual) return;
  const ModuleRef& first = v.eval_modules.front();
  const std::string type = first.type.empty() ? "" : " (" + first.type + ")";
  const size_t n = v.eval_modules.size();
  const std::string others =
      n > 1 ? " and " + std::to_string(n - 1) + " other module(s)" : std::string();
  sink_.add(Kind::eval_mode, first.name,
            "module '" + first.name + "'" + type + others +
                " ran in eval mode during a training step — Dropout/BatchNorm behave as at "
                "inference and BatchNorm statistics stop updating; call model.train() after "
                "validation",
            static_cast<double>(n), v.step);
}

}  // namespace trainsan::host
