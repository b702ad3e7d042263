// The global figures of a step (StepTotals), computed once for the checks and the trace.
#include <cmath>

#include "checks/check.h"

namespace trainsan::host {

void compute_totals(StepView& view) {
  StepTotals& t = view.totals;
  t = StepTotals{};
  double grad_sq = 0.0, param_sq = 0.0, upd_sq = 0.0;
  double pre_sq = 0.0;  // ‖θ‖² before the step, over the parameters with an update
  bool pre_known = true;
  double top_grad_l2 = -1.0;
  for (size_t k = 0; k < view.params.size(); ++k) {
    const ParamView& p = view.params[k];
    t.with_grad += p.observed.got_grad ? 1 : 0;
    if (p.grad) {
      if (p.grad->nonfinite() > 0) {
        t.any_nonfinite_grad = true;
      } else {
        grad_sq += p.grad->l2 * p.grad->l2;
        if (p.grad->l2 > top_grad_l2) {  // strictly: the first of equal norms wins
          top_grad_l2 = p.grad->l2;
          t.top_grad = k;
        }
      }
    }
    if (p.param.nonfinite() == 0) param_sq += p.param.l2 * p.param.l2;
    if (p.update) {
      t.any_update = true;
      upd_sq += p.update->l2 * p.update->l2;
      t.changed += p.update->changed;
      t.update_lower_bound = t.update_lower_bound || p.update->unseen;
      if (std::isfinite(p.param_l2_before)) {
        pre_sq += p.param_l2_before * p.param_l2_before;
      } else {
        pre_known = false;
      }
    }
  }
  t.grad_norm = std::sqrt(grad_sq);
  t.param_norm = std::sqrt(param_sq);
  t.update_norm = std::sqrt(upd_sq);
  // The update ratio is against the parameters *before* the step (cs231n's update/weight
  // ratio): against ‖θ_after‖ it could never exceed ~1 once updates dominate the weights
  // (‖Δθ‖ <= ‖θ_after‖ + ‖θ_before‖), so update_ratio_high = 1 would be out of reach. Falls back
  // to the norm after the step where the norm before is unknown.
  const double pre_norm = std::sqrt(pre_sq);
  t.ratio_denom = pre_known && pre_norm > 0.0 ? pre_norm : t.param_norm;
  t.update_ratio = t.ratio_denom > 0.0 ? t.update_norm / t.ratio_denom : 0.0;
}

}  // namespace trainsan::host
