// inplace_before_backward and bad_custom_grad: the integrity of what autograd computes from.
// The facts come from the caller's hooks (bindings/trainsan/autograd_checks.py): a saved tensor
// whose values changed while its version counter did not, and directional finite-difference
// figures of a custom Function's backward. The rules and their wording are here.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "checks/check.h"

namespace trainsan::host {

namespace {

std::string shape_text(const std::vector<int64_t>& sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t k = 0; k < sizes.size(); ++k) os << (k ? ", " : "") << sizes[k];
  os << "]";
  return os.str();
}

}  // namespace

bool AutogradCheck::inplace_sampled(int64_t step) const {
  if (step < opts_.audit_first_steps) return true;
  return opts_.audit_every > 0 && step % opts_.audit_every == 0;
}

bool AutogradCheck::gradcheck_sampled(int64_t step) const {
  return opts_.gradcheck_every > 0 && step % opts_.gradcheck_every == 0;
}

void AutogradCheck::on_saved_tensor_changed(const SavedTensorChange& c, int64_t step) {
  const std::string node = c.node.empty() ? "an autograd node" : c.node;
  const std::string desc = shape_text(c.sizes) + (c.dtype.empty() ? "" : " " + c.dtype);
  const std::string what =
      c.tensor.empty() ? "a tensor " + desc : "parameter " + c.tensor + " (" + desc + ")";
  // Key: the parameter, else the node and shape (one finding per distinct saved tensor).
  const std::string key = c.tensor.empty() ? node + " " + desc : c.tensor;
  sink_.add(Kind::inplace_before_backward, key,
            what + ", saved for backward by " + node +
                ", was changed between the forward and its backward by a write autograd cannot "
                "see (its version counter did not move: a write through .data, a NumPy view, or "
                "set_/copy_ on such an alias) — the backward computes the gradient from the new "
                "values, not the ones the forward used; make the change after backward() (e.g. "
                "after optimizer.step()), or write the tensor itself in place (under "
                "torch.no_grad() if it is a leaf) so that autograd can check it",
            std::nullopt, step);
}

// Note [Directional gradcheck]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The caller evaluates the Function in float64 at x, x+εv and x−εv (v random, on one input) and
// its backward once with a random cotangent u. The central difference is off by at most
// `curvature` (the second difference, O(ε) where the forward is smooth; at a kink — relu at 0,
// abs, round, many exact zeros after a ReLU — it is the whole error, whatever u does) plus the
// rounding noise of the outputs (`noise`: Σ_o ‖u_o‖·‖f_o(x)‖·machine-ε/ε); a backward that is
// off by a factor or a sign misses by O(|u·Jv|). So:
//   * non-finite figures are inconclusive — silent;
//   * the backward disagrees when |analytic − central| > rtol·max(|analytic|, |central|) + atol,
//     with rtol 1e-4 (float64 outputs; 2e-2 when the Function computes in lower precision) and
//     atol = 2·curvature + 10·noise + 1e-7·scale (1e-3·scale in lower precision)
//     + 1e-12·‖u‖‖v‖.
AutogradCheck::Verdict AutogradCheck::judge(const CustomGradResult& r) {
  for (double x : {r.analytic, r.central, r.curvature, r.scale, r.unit}) {
    if (!std::isfinite(x)) return Verdict::kInconclusive;
  }
  const double noise = std::isfinite(r.noise) ? std::max(r.noise, 0.0) : 0.0;
  const double atol = 2.0 * std::abs(r.curvature) + 10.0 * noise +
                      (r.low_precision ? 1e-3 : 1e-7) * r.scale + 1e-12 * std::abs(r.unit);
  const double rtol = r.low_precision ? 2e-2 : 1e-4;
  const double diff = std::abs(r.analytic - r.central);
  return diff > rtol * std::max(std::abs(r.analytic), std::abs(r.central)) + atol
             ? Verdict::kMismatch
             : Verdict::kAgrees;
}

void AutogradCheck::on_custom_grad(const CustomGradResult& r, int64_t step) {
  if (judge(r) != Verdict::kMismatch) return;
  const std::string input = "input " + std::to_string(r.input_index);
  std::string hint;
  if (r.central != 0.0 && std::abs(r.analytic + r.central) <= 1e-2 * std::abs(r.central)) {
    hint = " (the opposite sign)";
  } else if (r.central != 0.0) {
    hint = " (" + fmt(r.analytic / r.central) + "x)";
  }
  sink_.add(Kind::bad_custom_grad, r.function + ":" + input,
            "custom autograd.Function " + r.function +
                ": its backward disagrees with finite "
                "differences on " +
                input + " — along a random direction, uᵀJv is " + fmt(r.analytic) +
                " by backward() but " + fmt(r.central) + " by central differences in float64" +
                hint +
                ", on this step's inputs; fix backward() (a missing factor, a wrong sign, a "
                "transposed or unreduced term, a gradient returned for the wrong input); if it is "
                "deliberately not the derivative (straight-through estimator, gradient reversal), "
                "set trainsan_gradcheck = False on the class",
            r.central != 0.0 ? std::optional<double>(r.analytic / r.central) : std::nullopt, step);
}

std::vector<Finding> judge_custom_grad(const std::vector<CustomGradResult>& results) {
  CollectingSink sink;
  const Options opts;
  AutogradCheck check(sink, opts);
  for (const CustomGradResult& r : results) check.on_custom_grad(r, 0);
  return sink.out;
}

}  // namespace trainsan::host
