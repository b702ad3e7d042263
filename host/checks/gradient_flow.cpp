// missing_grad, stale_grad, param_not_in_optimizer and grad_vanishing: whether gradients reach
// the parameters, and only the current step's.
#include "checks/gradient_flow.h"

#include <algorithm>

namespace trainsan::host {

// Note [Foreign backwards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A loss module built around the model (`LossWrapper(model)`, a closure over it) keeps that model
// when the loop later swaps in another one — a trainer that rebuilds the model on resume but not
// its wrapper, `model = copy.deepcopy(model)` or `model = Net(); model.load_state_dict(...)` after
// the wrapper was built. The optimizer then steps the new model, whose parameters never get a
// gradient, while every backward trains (the gradients of) the old one: per-parameter
// missing_grad stays silent, as no parameter of ours got one ("while other parameters did"), and
// the loss is not ours (Note [Loss roots]: a root reaching none of our parameters is another
// model's). The caller reports such a backward — its graph walked to its end reached none of our
// parameters but reached requires-grad leaves — as a ForeignBackward (the Python package from the
// walk Note [Loss roots] already does, a LibTorch loop from watch_loss's root), and names what
// holds those leaves once a step looked wrong (foreign_suspected: the search costs, so it runs
// only then).
//
// The rule, at a step of optimizer K (not a partial step, not manual mode): a foreign backward
// ran since K's previous step, and of the elements of the trainable parameters K steps at most
// 1/16 got a gradient — for missing_grad_patience consecutive steps of K. Both halves are needed,
// and they keep the legitimate loops silent:
//  * several models, each with its optimizer (a GAN's generator and discriminator with one
//    sanitizer or two, a probe trained on detached features, actor and critic): the other model's
//    backward is foreign to us, but our own backward reached our parameters before our step;
//  * mixture of experts with top-k routing: few experts reached per step, but every backward is
//    ours (none is foreign), and even top-1 of 8 experts on one token reaches more than 1/16 of
//    the elements once the shared layers count (the router, attention, embeddings);
//  * frozen parts (requires_grad False: a frozen backbone, a distillation teacher) are not
//    counted, and have no leaf in any graph; a teacher in no optimizer is not stepped by ours;
//  * EMA copies and evaluation passes run no backward; LBFGS's closures and gradient accumulation
//    run several backwards per step, all ours;
//  * a step whose model ran its forwards since the previous step only under no_grad in train
//    mode is no_grad_leak's (Note [Mode rules]): a backbone left in `with torch.no_grad():` while
//    the head, attached apart, trains; that error's advice is the right one there;
//  * a gradient assigned by hand counts as reached (p.grad holds a nonzero element): Reptile,
//    first-order MAML and outer optimizers (DiLoCo) run their backwards on an inner copy and set
//    .grad of the stepped parameters themselves, so the hooks see nothing.
// "A small fraction" rather than "none" covers a wrapper around an old backbone feeding a new
// head: the head's few parameters get a gradient (per-parameter missing_grad also counts the
// others, but its advice — a .detach() — would be wrong; it is left out of a step this rule
// reports). The error names the holder and what to do.
bool GradientFlowCheck::foreign_step(const StepView& v) {
  if (v.manual || v.partial || !v.have_optimizer) return false;
  auto it = std::find_if(foreign_steps_.begin(), foreign_steps_.end(),
                         [&](const auto& e) { return e.first == v.opt; });
  if (it == foreign_steps_.end()) {
    foreign_steps_.emplace_back(v.opt, 0);
    it = foreign_steps_.end() - 1;
  }
  int64_t& steps = it->second;
  int64_t counted = 0, reached = 0, counted_el = 0, reached_el = 0;
  for (const ParamView& p : v.params) {
    if (!p.trainable || p.opt < 0 || (v.opt >= 0 && p.opt != v.opt)) continue;
    counted += 1;
    counted_el += p.param.numel;
    // A gradient assigned by hand (Reptile, first-order MAML, an outer optimizer over the
    // difference of an inner copy: their backwards are the copy's) counts as one.
    const bool assigned = p.grad && p.grad->numel > 0 && p.grad->zero < p.grad->numel;
    if (p.observed.got_grad || assigned) {
      reached += 1;
      reached_el += p.param.numel;
    }
  }
  // The model's forwards since the step all ran under no_grad in train mode: no_grad_leak's step
  // (Note [Mode rules]), whose advice is the right one.
  const bool no_grad_leak = v.no_grad_train_forwards > 0 && v.grad_forwards == 0;
  const bool holds = v.foreign_backwards > 0 && v.foreign.leaves > 0 && counted > 0 &&
                     reached_el * 16 <= counted_el && !no_grad_leak;
  steps = holds ? steps + 1 : 0;
  if (!holds || steps < opts_.missing_grad_patience) return false;
  const ForeignBackward& f = v.foreign;
  std::string held;
  if (!f.holder.empty()) {
    held = ", held by " + f.holder;
    if (!f.holder_type.empty() || f.holder_params > 0) {
      held += " (" + f.holder_type;
      if (f.holder_params > 0) {
        held += std::string(f.holder_type.empty() ? "" : ", ") + std::to_string(f.holder_params) +
                " parameter" + (f.holder_params == 1 ? "" : "s");
      }
      held += ")";
    }
  }
  const std::string whose =
      v.opt >= 0 ? "optimizer " + std::to_string(v.opt) + " steps" : std::string("in an optimizer");
  sink_.add(Kind::missing_grad, "",
            (reached == 0 ? "none" : "only " + std::to_string(reached)) + " of the " +
                std::to_string(counted) + " trainable parameters " + whose +
                " got a gradient, for " + std::to_string(steps) +
                (steps == 1 ? " step" : " steps") +
                ", while the backward since its previous step reached " + std::to_string(f.leaves) +
                " requires-grad tensor" + (f.leaves == 1 ? "" : "s") + " (" +
                std::to_string(f.elements) + " elements) outside this model" + held +
                " — the backward trains another model: a loss wrapper or closure still holds the "
                "model from before a resume or copy (it was built before `model = Net(); "
                "model.load_state_dict(...)` or `model = copy.deepcopy(model)`); rebuild it "
                "around the model the optimizer steps (e.g. criterion = LossWrapper(model))",
            static_cast<double>(steps), v.step);
  return true;
}

bool GradientFlowCheck::foreign_suspected() const {
  if (opts_.missing_grad_patience <= 1) return true;
  return std::any_of(foreign_steps_.begin(), foreign_steps_.end(),
                     [](const auto& e) { return e.second > 0; });
}

// Note [Optimizers holding none]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Optimizers are attached (not manual mode) and none of them holds a parameter the sanitizer
// watches: each was built on tensors the model no longer uses — the parameters from before
// fully_shard, a flat-parameter wrapper, distribute_module or load_state_dict(assign=True)
// replaced them (found at attach, or at the re-binding of Note [Attach order]). Every step then
// changes nothing the model uses while the loop looks healthy. The per-parameter rule below is
// for a model some optimizer trains (have_optimizer); here it would name every parameter, so
// one finding about the model ("") says it, at the first step of an attached optimizer (opt >= 0:
// a step the optimizer's hooks delimit, not end_step() of a loop that updates by hand) whose
// backward reached trainable parameters, under every policy (a recorded error under record, not
// only the note at attach).
void GradientFlowCheck::optimizers_hold_none(const StepView& v) {
  if (v.manual || v.have_optimizer || v.partial || v.opt < 0) return;
  std::vector<const ParamView*> trained;
  for (const ParamView& p : v.params) {
    if (p.trainable && p.observed.got_grad) trained.push_back(&p);
  }
  if (trained.empty()) return;
  sink_.add(Kind::param_not_in_optimizer, "",
            std::to_string(trained.size()) + " parameter(s) of the model (e.g. " +
                trained.front()->name +
                ") receive gradients, but the optimizer(s) attached hold none of the model's "
                "parameters, so no step changes anything the model uses — the optimizer was "
                "built on the tensors from before they were replaced (fully_shard, a "
                "flat-parameter wrapper, distribute_module, load_state_dict(assign=True)); "
                "build it after the wrap, from model.parameters() of the model you train",
            static_cast<double>(trained.size()), v.step);
}

void GradientFlowCheck::on_step(const StepView& v) {
  optimizers_hold_none(v);
  const bool foreign = foreign_step(v);
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
      if (without >= opts_.missing_grad_patience && !foreign) {
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
