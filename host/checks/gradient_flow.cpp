// missing_grad, stale_grad, param_not_in_optimizer and grad_vanishing: whether gradients reach
// the parameters, and only the current step's.
#include "checks/check.h"

namespace trainsan::host {

void GradientFlowCheck::on_step(const StepView& v) {
  const int64_t with_grad = v.totals.with_grad;
  const size_t n = v.params.size();
  for (const ParamView& p : v.params) {
    if (p.index >= steps_without_grad_.size()) {
      steps_without_grad_.resize(p.index + 1, 0);
      vanishing_steps_.resize(p.index + 1, 0);
    }
  }
  // The hook observations, per parameter.
  for (size_t k = 0; k < n; ++k) {
    const ParamView& p = v.params[k];
    const GradObservation& o = p.observed;
    // Note [Manual-mode stale gradients]: without an optimizer no step marks a gradient as
    // consumed; accumulating onto an uncleared gradient is stale only when the *previous* pass
    // saw the parameters change (an update used it). manual_prev_changed_ is set at the end of
    // on_step, so this reads the previous pass's value.
    if (o.stale || (v.manual && o.accumulated && manual_prev_changed_)) {
      sink_.add(Kind::stale_grad, p.name,
                p.name + " still holds the gradient of step " + std::to_string(v.step - 1) +
                    " — optimizer.zero_grad() was not called after optimizer.step() (for "
                    "gradient accumulation, zero after the step)",
                std::nullopt, v.step);
    }
    if (v.have_optimizer && p.opt < 0 && o.got_grad) {
      sink_.add(Kind::param_not_in_optimizer, p.name,
                p.name +
                    " receives gradients but is in no optimizer's param_groups, so it never "
                    "trains — build the optimizer from model.parameters() after the model is "
                    "complete (or add_param_group), or set requires_grad=False if it is meant to "
                    "be frozen",
                std::nullopt, v.step);
    }
    int64_t& without = steps_without_grad_[p.index];
    const bool counted = v.manual ? p.trainable : (p.opt >= 0 && p.trainable);
    // A partial step (attached inside it) may have missed gradients that arrived before attach.
    if (counted && !o.got_grad && with_grad > 0 && !v.partial) {
      without += 1;
      if (without >= opts_.missing_grad_patience) {
        sink_.add(Kind::missing_grad, p.name,
                  p.name + " got no gradient for " + std::to_string(without) +
                      " steps while other parameters did — its output does not reach the loss "
                      "(a .detach(), torch.no_grad(), .data, or an unused branch in forward())",
                  static_cast<double>(without), v.step);
      }
    } else if (o.got_grad) {
      without = 0;
    }
  }
  // grad_vanishing: counted on every step with a gradient (also at lr 0), reported only when
  // the learning rate is nonzero.
  for (const ParamView& p : v.params) {
    // A shard's gradient says nothing about the whole tensor's (the rows of an embedding this
    // rank holds may be unused for a while, or a rank's shard of an unevenly split one empty).
    if (!p.grad || p.grad->numel == 0 || p.sharded) continue;
    const TensorStats& g = *p.grad;
    int64_t& steps = vanishing_steps_[p.index];
    const bool vanished =
        g.nonfinite() == 0 && (g.l2 == 0.0 || g.l2 <= opts_.grad_vanishing_ratio * p.param.l2);
    steps = vanished ? steps + 1 : 0;
    if (vanished && steps >= opts_.grad_vanishing_steps && !v.lr_zero) {
      sink_.add(Kind::grad_vanishing, p.name,
                p.name + ".grad has been " +
                    (g.l2 == 0.0 ? "exactly zero" : "negligible (" + fmt(g.l2) + ")") + " for " +
                    std::to_string(steps) +
                    " steps — dead activations (ReLU), saturated sigmoid/tanh, a multiplication "
                    "by zero, or a loss that does not depend on this layer",
                g.l2, v.step);
    }
  }
  // Note [Manual-mode stale gradients]: read by the next pass, not this one.
  if (v.manual) manual_prev_changed_ = v.totals.changed > 0;
}

}  // namespace trainsan::host
