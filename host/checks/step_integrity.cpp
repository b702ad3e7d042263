// skipped_step (gradients cleared unused, too many backwards without a step, gradients cleared
// before the step, a step that changed nothing) and update_outside_step.
#include "checks/check.h"

namespace trainsan::host {

void StepIntegrityCheck::on_forward(const ForwardView& v) {
  if (!v.grad_enabled || !v.training) return;
  // Gradients cleared without a step that used them are seen by the hooks of the next backward;
  // report them at the next training forward, since no optimizer step may ever come.
  if (!v.skipped.empty()) {
    const std::string& first = v.skipped.front();
    sink_.add(Kind::skipped_step, first,
              "gradients of " + std::to_string(v.skipped.size()) + " parameter(s) (e.g. " + first +
                  ") were produced by backward() and then cleared by zero_grad() without any "
                  "optimizer.step() using them — call optimizer.step() after backward()",
              static_cast<double>(v.skipped.size()), v.step);
  }
  if (v.have_optimizer && v.backwards_since_step > opts_.max_accumulation) {
    sink_.add(Kind::skipped_step, "",
              std::to_string(v.backwards_since_step) +
                  " backward passes ran without an optimizer step (more than max_accumulation=" +
                  std::to_string(opts_.max_accumulation) +
                  ") — optimizer.step() is never called, or the accumulation condition never "
                  "holds",
              static_cast<double>(v.backwards_since_step), v.step);
  }
}

void StepIntegrityCheck::on_step(const StepView& v) {
  if (v.manual) return;  // no optimizer step to judge
  // Cleared before the step: every gradient produced since the previous step of this optimizer
  // was gone at the step — set to None, or zeroed in place after backward() (zero_grad() between
  // backward() and step()). Clearing only some (selective freezing) is fine.
  int64_t produced = 0, cleared = 0;
  for (const ParamView& p : v.params) {
    if (!p.observed.got_grad || p.opt < 0) continue;
    produced += 1;
    const bool zeroed =
        p.grad_at_step == GradAtStep::kModified && p.grad && p.grad->zero == p.grad->numel;
    cleared += (p.grad_at_step == GradAtStep::kNone || zeroed) ? 1 : 0;
  }
  if (produced > 0 && cleared == produced) {
    sink_.add(Kind::skipped_step, "",
              "optimizer.step() ran after the gradients of all " + std::to_string(produced) +
                  " parameter(s) that got one since the previous step had been cleared — "
                  "zero_grad() is called between backward() and step(); call it before "
                  "backward() (or after step())",
              static_cast<double>(produced), v.step);
  }
  const StepTotals& t = v.totals;
  if (t.any_update && !v.lr_zero && t.grad_norm > 0.0 && t.changed == 0) {
    sink_.add(Kind::skipped_step, "",
              "optimizer.step() ran but changed no parameter although the gradients are nonzero "
              "— the optimizer holds other tensors than the model's parameters (built before the "
              "model was replaced or moved?), or its learning rate underflows",
              0.0, v.step);
  }
}

void StepIntegrityCheck::on_step_begin(const std::vector<std::string>& changed, int64_t step) {
  for (const std::string& n : changed) {
    sink_.add(Kind::update_outside_step, n,
              n + " changed between the previous optimizer step and this one without a step — "
                  "a manual in-place update (.data, copy_, add_ under no_grad), a "
                  "load_state_dict, or another optimizer writing it",
              std::nullopt, step);
  }
}

}  // namespace trainsan::host
