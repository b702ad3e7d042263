// skipped_step (gradients cleared unused, too many backwards without a step, gradients cleared
// before the step, a step that changed nothing, a tensor a step left unchanged) and
// update_outside_step.
#include "checks/step_integrity.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace trainsan::host {

void StepIntegrityCheck::on_forward(const ForwardView& v) {
  if (!v.grad_enabled || !v.training) return;
  // Gradients cleared without a step that used them are seen by the hooks of the next backward;
  // report them at the next training forward, since no optimizer step may ever come.
  if (!v.skipped.empty()) {
    const std::string& first = v.skipped.front();
    // Note [Discarded gradients]: the cleared gradients held NaN/Inf: a guard skipped the step.
    const std::string advice =
        discarded_nonfinite_
            ? " — the cleared gradients held NaN/Inf (see nonfinite_grad), so the loop skipped "
              "its steps on purpose: the step is not missing, the non-finite gradients are the "
              "bug; fix where they are made (skipping them stops the training while it repeats)"
            : " — call optimizer.step() after backward()";
    sink_.add(Kind::skipped_step, first,
              "gradients of " + std::to_string(v.skipped.size()) + " parameter(s) (e.g. " + first +
                  ") were produced by backward() and then cleared by zero_grad() without any "
                  "optimizer.step() using them" +
                  advice,
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

// Note [Zero gradients]
// ~~~~~~~~~~~~~~~~~~~~~
// A step whose gradients are all exactly zero changes nothing, legitimately: a batch whose every
// label is the ignore_index, a fully masked batch. Library trainers then still clip (or unscale)
// the gradients in place, so at the step they read as "modified after backward() and all zero" —
// exactly what zero_grad(set_to_none=False) between backward() and step() leaves. The values as
// backward() left them are gone by then, and reading them at every backward would cost a pass
// over all gradients. So: gradients set to None are unambiguous (cleared); zeroed-in-place ones
// with no evidence are not judged, and the step asks for a probe (take_probe_request): for the
// next few steps the gradient hooks record whether each gradient as backward() left it had a
// nonzero element (ParamView::grad_left_nonzero). A loop that clears its gradients before every
// step is then caught one step later; a one-off masked batch stays silent.

void StepIntegrityCheck::on_step(const StepView& v) {
  if (v.manual || v.partial) return;  // no optimizer step to judge / only its end was seen
  micro_cleared(v);
  // Cleared before the step: every gradient produced since the previous step of this optimizer
  // was gone at the step — set to None, or zeroed in place after backward() although backward()
  // left it nonzero. Clearing only some (selective freezing) is fine.
  int64_t produced = 0, cleared = 0, none = 0, zeroed_unknown = 0;
  bool left_nonzero = false;
  for (const ParamView& p : v.params) {
    if (!p.observed.got_grad || p.opt < 0) continue;
    produced += 1;
    const bool zeroed =
        p.grad_at_step == GradAtStep::kModified && p.grad && p.grad->zero == p.grad->numel;
    none += p.grad_at_step == GradAtStep::kNone ? 1 : 0;
    cleared += (p.grad_at_step == GradAtStep::kNone || zeroed) ? 1 : 0;
    if (zeroed && p.grad_left_nonzero) {
      left_nonzero = left_nonzero || *p.grad_left_nonzero;
    } else if (zeroed) {
      zeroed_unknown += 1;
    }
  }
  if (produced > 0 && cleared == produced) {
    if (none == produced || left_nonzero) {
      const std::string how = none == produced ? "were None at optimizer.step()"
                                               : "were nonzero as backward() left them and zero at "
                                                 "optimizer.step()";
      sink_.add(Kind::skipped_step, "",
                "the gradients of all " + std::to_string(produced) +
                    " parameter(s) that got one since the previous step " + how +
                    " — something between backward() and step() clears them (a zero_grad() or "
                    "p.grad = None there?), so the step uses no gradient; clear gradients before "
                    "backward() (or after step())",
                static_cast<double>(produced), v.step);
    } else if (zeroed_unknown > 0) {
      probe_request_ = true;  // Note [Zero gradients]: all zero, maybe as backward() left them
    }
  }
  const StepTotals& t = v.totals;
  if (t.any_update && !v.lr_zero && t.grad_norm > 0.0 && t.changed == 0 && visible_move(v)) {
    sink_.add(Kind::skipped_step, "",
              "optimizer.step() ran but changed no parameter although the gradients are nonzero "
              "— the optimizer holds other tensors than the model's parameters (built before the "
              "model was replaced or moved?), or its learning rate underflows",
              0.0, v.step);
  }
  if (t.any_update && !v.lr_zero && t.changed > 0) unchanged_tensors(v);
}

namespace {

// Whether parameter p belongs to the optimizer stepping in v (v.opt -1: all of them).
bool stepping(const StepView& v, const ParamView& p) {
  return p.opt >= 0 && (v.opt < 0 || p.opt == v.opt);
}

// 4 ulp of p's largest weight: eps * max|θ| bounds the ulp of every element.
double four_ulp(const ParamView& p) {
  return 4.0 * std::max(p.eps, 0.0) * (p.param.absmax ? *p.param.absmax : 0.0);
}

}  // namespace

// Whether the step should have moved some parameter visibly: one of the stepping optimizer's
// trainable parameters has a finite nonzero gradient and a learning rate that is unknown, or a
// gradient or predicted move (lr * max|g|) that exceeds 4 ulp of its largest weight (the
// gradient alone: a learning rate so small that it rounds every update away is the bug). A step
// that moves nothing because its gradients are below what the weights can register (an LBFGS
// that has converged, tolerance_grad 1e-7, returns without an update) is not a skipped step.
bool StepIntegrityCheck::visible_move(const StepView& v) {
  for (const ParamView& p : v.params) {
    if (!stepping(v, p) || !p.trainable || !p.grad || p.grad->nonfinite() > 0 || p.lr == 0.0) {
      continue;
    }
    // max|g| (its norm bounds it from above where the pass has no absmax)
    const double g = p.grad->absmax ? *p.grad->absmax : p.grad->l2;
    if (!(g > 0.0)) continue;
    if (std::isnan(p.lr)) return true;
    if (std::max(1.0, std::abs(p.lr)) * g > four_ulp(p)) return true;
  }
  return false;
}

// Note [Unchanged tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A step that moved some parameters but left one with a clearly nonzero gradient bit for bit
// unchanged: an optimizer or kernel that silently ignores some tensors (a custom step that skips
// a parameter, an off-by-one over a group, a fused kernel that drops a tensor). Only a parameter
// of the stepping optimizer, requiring grad, whose group's learning rate is not 0, whose gradient
// is finite with a nonzero element, in float32/float64 (fp16/bf16 weights legitimately round small
// updates away). And only where the update would clearly show: the move predicted for its largest
// gradient element, min(the largest element move of this step, s * max|g|) with s its group's
// learning rate (or, unknown, the smallest update.max/max|g| of the tensors that moved — the
// learning rate for SGD, less for adaptive optimizers), must exceed 4 ulp of its largest weight
// (eps * max|θ| bounds the ulp of every element). A step that moved nothing is the whole-step rule
// above (a converged LBFGS, a failed line search: not this rule).
// Note [Micro-batches cleared] (host/grad_tracker.cpp): zero_grad() inside the micro-batch loop.
void StepIntegrityCheck::micro_cleared(const StepView& v) {
  std::vector<const ParamView*> cleared;
  for (const ParamView& p : v.params) {
    if (p.opt == v.opt && p.observed.micro_cleared) cleared.push_back(&p);
  }
  if (cleared.empty()) return;
  const std::string& first = cleared.front()->name;
  sink_.add(Kind::skipped_step, first,
            "the gradients of " + std::to_string(cleared.size()) + " parameter(s) (e.g. " + first +
                ") were cleared by zero_grad() between the backward passes of one step, at this "
                "step and the one before: each step used only its last micro-batch's gradient "
                "and threw the earlier micro-batches away — with gradient accumulation, call "
                "zero_grad() once per optimizer step (after step()), not before every "
                "micro-batch",
            static_cast<double>(cleared.size()), v.step);
}

void StepIntegrityCheck::unchanged_tensors(const StepView& v) {
  double largest_move = 0.0;
  double lr_est = std::numeric_limits<double>::infinity();
  for (const ParamView& p : v.params) {
    // A tensor whose change no sampled element saw has no measured move (Note [Update statistics
    // without a snapshot] in update_stats.cpp).
    if (!p.update || p.update->changed == 0 || p.update->unseen) continue;
    largest_move = std::max(largest_move, p.update->max);
    if (p.grad && p.grad->nonfinite() == 0 && p.grad->absmax && *p.grad->absmax > 0.0) {
      lr_est = std::min(lr_est, p.update->max / *p.grad->absmax);
    }
  }
  if (!(largest_move > 0.0)) return;
  for (const ParamView& p : v.params) {
    if (!stepping(v, p) || !p.trainable || !p.update || p.update->changed != 0) {
      continue;
    }
    if (!p.grad || p.grad->nonfinite() > 0 || !p.grad->absmax || !(*p.grad->absmax > 0.0)) {
      continue;
    }
    if (p.eps <= 0.0 || p.eps > 1e-6) continue;  // not float32/float64
    if (p.lr == 0.0 || p.param.nonfinite() > 0) continue;
    const double s = std::isnan(p.lr) ? lr_est : p.lr;
    if (!std::isfinite(s)) continue;
    const double g = *p.grad->absmax;
    const double predicted = std::min(largest_move, s * g);
    if (!(predicted > four_ulp(p))) continue;
    sink_.add(Kind::skipped_step, p.name,
              "optimizer.step() changed other parameters but not one element of " + p.name +
                  ", although its gradient is nonzero (max |g| " + fmt(g) +
                  ") and its group's learning rate is " +
                  (std::isnan(p.lr) ? std::string("not 0") : fmt(p.lr)) +
                  " — the optimizer (or its kernel) ignores this tensor: check a custom step() "
                  "for parameters it skips, and that the optimizer holds this very tensor (not a "
                  "copy made before the model was moved or rebuilt)",
              g, v.step);
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
