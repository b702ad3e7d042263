// grad_explosion and update_ratio: the global gradient norm and update ratio against running
// baselines, per optimizer (with several, each covers its own parameters).
#include "checks/magnitudes.h"

namespace trainsan::host {

MagnitudeCheck::PerOptimizer& MagnitudeCheck::of(int64_t opt) {
  for (auto& [key, state] : per_opt_) {
    if (key == opt) return state;
  }
  per_opt_.emplace_back(opt, PerOptimizer{});
  return per_opt_.back().second;
}

void MagnitudeCheck::on_step(const StepView& v) {
  const StepTotals& t = v.totals;
  PerOptimizer& s = of(v.opt);
  // grad_explosion: against an exponential moving average of past finite global norms.
  if (!t.any_nonfinite_grad && t.grad_norm > 0.0) {
    const double norm = t.grad_norm;
    const bool warm = s.grad_norm_steps >= opts_.grad_explosion_warmup && s.grad_norm_ema > 0.0;
    const bool jump = warm && norm > opts_.grad_explosion_factor * s.grad_norm_ema;
    const bool over = opts_.grad_explosion_limit > 0.0 && norm > opts_.grad_explosion_limit;
    if (jump || over) {
      // A positive finite norm implies a finite gradient, hence a top one.
      const std::string top = t.top_grad ? v.params[*t.top_grad].name : std::string();
      sink_.add(Kind::grad_explosion, "",
                "the global gradient norm is " + fmt(norm) +
                    (jump ? ", " + fmt(norm / s.grad_norm_ema) + "x its running average " +
                                fmt(s.grad_norm_ema)
                          : ", above the limit " + fmt(opts_.grad_explosion_limit)) +
                    " (largest: " + top +
                    ") — lower the learning rate, clip gradients "
                    "(torch.nn.utils.clip_grad_norm_), or look for an unnormalised loss or input "
                    "at this step",
                norm, v.step);
    } else {
      // An exploding step does not enter the average, so a run of them keeps firing.
      s.grad_norm_ema = s.grad_norm_steps == 0 ? norm : 0.9 * s.grad_norm_ema + 0.1 * norm;
      s.grad_norm_steps += 1;
    }
  }
  // A ratio that is only a lower bound (a change no sampled element saw) judges only the top of
  // the band. A manual-mode step that wrote and changed no parameter applied no update (a
  // micro-batch of an accumulation): not judged, nor counted (Note [Manual-mode steps]).
  if (v.unwritten && t.changed == 0) return;
  if (t.any_update && !v.lr_zero && t.ratio_denom > 0.0 && t.grad_norm > 0.0 &&
      !(t.update_lower_bound && t.update_ratio < opts_.update_ratio_low)) {
    const double ratio = t.update_ratio;
    const bool outside = ratio < opts_.update_ratio_low || ratio > opts_.update_ratio_high;
    s.update_ratio_out = outside ? s.update_ratio_out + 1 : 0;
    // One step beyond 10x the upper bound is enough: adaptive optimizers (Adam) with an absurd
    // learning rate inflate the weights in one step, after which the ratio falls back under 1.
    const bool extreme = ratio > 10.0 * opts_.update_ratio_high;
    if (outside && (s.update_ratio_out >= opts_.update_ratio_steps || extreme)) {
      sink_.add(Kind::update_ratio, "",
                "the update ratio ||Δθ||/||θ|| (θ before the step) has been " + fmt(ratio) +
                    " (outside [" + fmt(opts_.update_ratio_low) + ", " +
                    fmt(opts_.update_ratio_high) + "]) for " + std::to_string(s.update_ratio_out) +
                    " step(s) — the learning rate is far too " +
                    (ratio > opts_.update_ratio_high ? "high" : "low") +
                    " for these weights (typical ratios are 1e-4..1e-2)",
                ratio, v.step);
    }
  }
}

}  // namespace trainsan::host
