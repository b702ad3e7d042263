// inplace_before_backward and bad_custom_grad: the integrity of what autograd computes from.
// The facts come from the caller's hooks (bindings/trainsan/autograd_checks.py): a saved tensor
// whose values changed while its version counter did not, and directional finite-difference
// figures of a custom Function's backward. The rules and their wording are here.
#include "checks/autograd.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

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

// Note [Shared-memory parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Hogwild training (pytorch/examples mnist_hogwild: model.share_memory(), one mp.Process per
// worker, each with its own optimizer) updates one set of parameters from several processes
// without locks, by design: another process's optimizer step lands between this process's forward
// and its backward, and the backward then computes from the new weights. That write moves no
// version counter here and changes the saved weight's contents: the very facts of a .data or
// NumPy write in this process, which cannot be told apart from it (neither moves the counter;
// both write the same storage). So a parameter (or a view of one) whose storage is in CPU shared
// memory (`shared_memory`: is_shared(), which model.share_memory() and passing a model to a
// multiprocessing child set) is not reported: other processes may write it on purpose. Its
// own-process .data / NumPy writes go unseen there; a model that is not shared (every
// single-process loop, DDP, FSDP) is checked as before, and so are saved tensors that are not
// parameters (a DataLoader worker's batch is in shared memory too, but no process writes it after
// delivering it). CUDA parameters shared through CUDA IPC are not recognised (is_shared() is true
// of every CUDA tensor): a CUDA Hogwild run can still report its lock-free updates.
void AutogradCheck::on_saved_tensor_changed(const SavedTensorChange& c, int64_t step) {
  if (c.shared_memory && !c.tensor.empty()) return;  // Note [Shared-memory parameters]
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
// off by a factor or a sign misses by O(|u·Jv|). u is the judged part of the cotangent: zero
// on the elements where a surrogate gradient is legitimate (Note [Surrogate gradients]). So:
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

// Note [Surrogate gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Some custom Functions are written so that their backward is not the derivative of their
// forward, on purpose: a straight-through estimator (forward round/sign/binarise, backward the
// identity), a clamp with a straight-through backward, a spiking nonlinearity (forward a step,
// backward a smooth surrogate), gradient reversal and gradient scaling layers (forward the
// identity, backward −λg or λg), Megatron's copy-to-region (forward the identity, backward an
// all-reduce). Their tell, at the sampled points, is in the forward: the backward disagrees only
//   * on output elements where the forward is flat along v: f(x+εv) == f(x−εv) exactly (a step
//     function between its jumps, a clamp's saturated side). A true derivative is 0 there (for a
//     random v, J_i·v = 0 means the row J_i is 0), so a gradient that the backward passes through
//     such an element is a surrogate, not a slip;
//   * on an output that is the perturbed input itself (f_o(x±εv) == x±εv): an identity forward;
//     nobody writes a Function for the identity but to shape its gradient.
// The measurement (surrogate_masks, custom_grad.cpp) splits the cotangent u into the judged part
// (zero on those elements) and the rest w, runs the backward for each, and reports w·(Jv) by the
// backward (`surrogate_analytic`) and by the differences (`surrogate_central`: 0 where flat, w·v
// through an identity). The Function passes a surrogate gradient on that input when they differ
// by more than 1e-6·‖w‖‖v‖ (1e-3 in lower precision) + 1e-4·|surrogate_central|; then none of its
// inputs is reported (the scale gradient of a learned-step quantiser — LSQ: round(x/s)·s, whose
// straight-through derivative in s is round(x/s) − x/s — is a surrogate too, though its outputs
// are not flat in s). Otherwise the judged part is judged as above (a ReLU whose backward masks
// correctly has flat zeros but passes no gradient there: its positive side is judged, so a 2x
// slip is found).
// What this cannot tell apart: a bug whose wrong gradient lies only where the forward is flat or
// an identity (a custom ReLU that forgets to mask its gradient is a straight-through ReLU; an
// identity forward with a 2x backward is a gradient scaler), and a slip in another input of a
// Function that is a surrogate on one. Such Functions are not reported; set trainsan_gradcheck =
// False on a class to skip it altogether.
bool AutogradCheck::surrogate(const CustomGradResult& r) {
  if (!(r.surrogate_unit > 0.0)) return false;
  if (!std::isfinite(r.surrogate_analytic) || !std::isfinite(r.surrogate_central)) return false;
  const double tol =
      (r.low_precision ? 1e-3 : 1e-6) * r.surrogate_unit + 1e-4 * std::abs(r.surrogate_central);
  return std::abs(r.surrogate_analytic - r.surrogate_central) > tol;
}

void AutogradCheck::on_custom_grads(const std::vector<CustomGradResult>& results, int64_t step) {
  std::set<std::string> surrogates;
  for (const CustomGradResult& r : results) {
    if (surrogate(r)) surrogates.insert(r.function);
  }
  for (const CustomGradResult& r : results) {
    if (surrogates.count(r.function) == 0) on_custom_grad(r, step);
  }
}

void AutogradCheck::on_custom_grad(const CustomGradResult& r, int64_t step) {
  if (surrogate(r) || judge(r) != Verdict::kMismatch) return;
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
  check.on_custom_grads(results, 0);
  return sink.out;
}

}  // namespace trainsan::host
