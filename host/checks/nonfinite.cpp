// nonfinite_loss, nonfinite_grad, nonfinite_param, nonfinite_activation and fp16_overflow: values
// that are (or will become, under fp16 autocast) NaN or ±Inf.
#include "checks/nonfinite.h"

#include <sstream>

namespace trainsan::host {

namespace {

std::string nonfinite_text(const TensorStats& s) {
  std::ostringstream os;
  os << s.nan << " NaN, " << s.posinf << " +Inf and " << s.neginf << " -Inf values of " << s.numel;
  return os.str();
}

}  // namespace

// A NaN loss whose step's class-index loss had only ignore_index targets is the mean over no
// element (0/0): its backward gives zero gradients, training goes on unharmed, and empty_loss (a
// warning, LossCheck) names it. It stays nonfinite_loss's when the step's gradients are not
// finite after all (something else made the NaN), or when it is +-Inf rather than NaN.
void NonfiniteCheck::on_loss(const TensorStats& loss, int64_t step, bool empty_targets) {
  if (loss.nonfinite() == 0) return;
  if (empty_targets && loss.nan == loss.nonfinite()) {
    pending_loss_ = std::make_pair(loss, step);
    return;
  }
  report_loss(loss, step);
}

void NonfiniteCheck::report_loss(const TensorStats& loss, int64_t step) {
  origins_.rearm(step);
  std::string origin = origins_.describe(step);
  if (origin.empty()) {
    origin =
        " (Module outputs are flagged on sampled steps and on the steps after a non-finite "
        "value: with policy 'warn' or 'record' the next steps name the module where it "
        "appears; provenance_every=1 flags every step.)";
  }
  sink_.add(Kind::nonfinite_loss, "",
            "the loss holds " + nonfinite_text(loss) +
                " — check the model outputs and the loss inputs (log of 0, division by 0, too "
                "large a learning rate in the previous step)." +
                origin,
            static_cast<double>(loss.nonfinite()), step);
}

void NonfiniteCheck::on_step(const StepView& v) {
  if (pending_loss_ && pending_loss_->second <= v.step) {
    const auto [loss, step] = *pending_loss_;
    pending_loss_.reset();
    bool finite = true;
    for (const ParamView& p : v.params) finite = finite && (!p.grad || p.grad->nonfinite() == 0);
    if (!finite || step < v.step) report_loss(loss, step);
  }
  bool first_grad = true;
  for (const ParamView& p : v.params) {
    if (p.grad && p.grad->nonfinite() > 0) {
      origins_.rearm(v.step);
      // The origin, once per step: on the first non-finite gradient's finding.
      const std::string origin = first_grad ? origins_.describe(v.step) : std::string();
      first_grad = false;
      sink_.add(Kind::nonfinite_grad, p.name,
                p.name + ".grad holds " + nonfinite_text(*p.grad) +
                    " — look for log/sqrt/division of zero or negative values, too large a "
                    "learning rate, or fp16 overflow in the forward" +
                    (origin.empty() ? std::string("; torch.autograd.set_detect_anomaly(True) "
                                                  "names the op")
                                    : "." + origin),
                static_cast<double>(p.grad->nonfinite()), v.step);
    }
    if (!p.param_measured) continue;  // Note [Every-step tier]: found at the next measured step
    if (p.param.nonfinite() > 0) {
      sink_.add(Kind::nonfinite_param, p.name,
                p.name + " holds " + nonfinite_text(p.param) +
                    " after the step — a non-finite gradient or learning rate reached the "
                    "weights; check the gradients at this step and the optimizer's state",
                static_cast<double>(p.param.nonfinite()), v.step);
    }
    if (v.fp16_in_use && p.param.fp16_overflow > 0) {
      sink_.add(Kind::fp16_overflow, p.name,
                p.name + " holds " + std::to_string(p.param.fp16_overflow) +
                    " values beyond ±65504, which become Inf when cast to fp16 under autocast — "
                    "use bfloat16, rescale, or keep this computation in float32",
                static_cast<double>(p.param.fp16_overflow), v.step);
    }
  }
}

bool NonfiniteCheck::on_discarded(const std::vector<std::pair<std::string, TensorStats>>& grads,
                                  int64_t step) {
  // Note [Discarded gradients] (sanitizer.cpp): gradients cleared without a step that used them.
  bool first = true;
  for (const auto& [name, g] : grads) {
    if (g.nonfinite() == 0) continue;
    if (first) origins_.rearm(step);
    const std::string origin = first ? origins_.describe(step) : std::string();
    first = false;
    sink_.add(Kind::nonfinite_grad, name,
              name + ".grad holds " + nonfinite_text(g) +
                  " and is being cleared without an optimizer step having used it — a loop that "
                  "skips the step when the gradients are not finite hides the NaN/Inf, and the "
                  "model stops training while it repeats; find where it is made (log/sqrt/"
                  "division of zero or negative values, an op whose backward divides by 0, too "
                  "large a learning rate, fp16 overflow)" +
                  (origin.empty() ? std::string("; torch.autograd.set_detect_anomaly(True) "
                                                "names the op")
                                  : "." + origin),
              static_cast<double>(g.nonfinite()), step);
  }
  return !first;
}

void NonfiniteCheck::on_module_output(const ModuleRef& module, const TensorStats& output,
                                      int64_t step) {
  if (output.nonfinite() == 0) return;
  const std::string type = module.type.empty() ? "" : " (" + module.type + ")";
  sink_.add(Kind::nonfinite_activation, module.name,
            "the output of " + module.name + type + " holds " + std::to_string(output.nan) +
                " NaN and " + std::to_string(output.posinf + output.neginf) +
                " ±Inf values — the first module whose output is non-finite is where to look",
            static_cast<double>(output.nonfinite()), step);
}

}  // namespace trainsan::host
