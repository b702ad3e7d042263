// bad_custom_grad for LibTorch: the directional finite-difference check of a custom autograd
// function's backward (Note [Directional gradcheck], host/checks/autograd.cpp), measured here and
// judged by the same rule as the Python package's checks.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "trainsan/autograd_facts.h"
#include "trainsan/finding.h"

namespace trainsan {

/// A custom autograd function applied to its tensor arguments, e.g.
///   [](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{MyFn::apply(x[0],
///   x[1])}; }
/// Other arguments are captured by the lambda. It must not keep state between calls.
using TensorFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// The directional check of `fn` at `inputs`, one result per differentiable input (a floating
/// tensor that requires grad), in input order, named `name` (CustomGradResult::function). `fn`
/// is evaluated on float64 copies of the floating inputs (the others as given): once with grad
/// and its backward (torch::autograd::grad) with a random cotangent u, then without grad at x and
/// at x ± εv per input, v random. Every evaluation starts from the same RNG state, seeded from
/// `name` (a stochastic function is evaluated with one random draw); the caller's RNG state (CPU,
/// and the CUDA devices of `inputs`) is put back afterwards, and `inputs` are not touched.
/// Returns no result when no input is differentiable, no output requires grad, `fn` throws on
/// the copies (it cannot run in float64), or two evaluations at x differ (not deterministic
/// under one seed).
std::vector<CustomGradResult> measure_custom_grad(const std::string& name, const TensorFunction& fn,
                                                  const std::vector<at::Tensor>& inputs);

/// measure_custom_grad, but an exception thrown by `fn` (or by an operation on its outputs)
/// propagates instead of meaning "no result": the Python package then tries other copies of the
/// inputs (Note [First-use gradcheck inputs], bindings/trainsan/autograd_checks.py).
std::vector<CustomGradResult> measure_custom_grad_or_throw(const std::string& name,
                                                           const TensorFunction& fn,
                                                           const std::vector<at::Tensor>& inputs);

/// bad_custom_grad outside a sanitizer: measure_custom_grad judged by the sanitizer's rule; one
/// finding per input whose backward disagrees (messages prefixed "bad_custom_grad: ", step 0).
std::vector<Finding> check_custom_grad(const std::string& name, const TensorFunction& fn,
                                       const std::vector<at::Tensor>& inputs);

/// The step of the central difference on input `x` (float64): ε = (1e-3 when the function's
/// outputs are in lower precision, else 1e-6) · (1 + max|x|).
double directional_eps(const at::Tensor& x, bool low_precision);

/// The output elements of one directional check (on the input perturbed to `x_plus` and
/// `x_minus`) whose backward is not judged (Note [Surrogate gradients], host/checks/autograd.cpp):
/// per output a bool tensor of its shape, true where f(x+εv) == f(x−εv) exactly (the forward is
/// flat along v there: a round, a sign, a clamp's saturated side, a ReLU's zeros) and on all of
/// an output that is the perturbed input itself (f_o(x±εv) == x±εv: an identity forward, whose
/// Function exists to shape the gradient: gradient reversal or scaling).
std::vector<at::Tensor> surrogate_masks(const at::Tensor& x_plus, const at::Tensor& x_minus,
                                        const std::vector<at::Tensor>& yp,
                                        const std::vector<at::Tensor>& ym);

/// The figures of one directional check from its evaluations (measure_custom_grad's per-input
/// step; the Python package's measurement calls it too): cotangents `u` and outputs `y0` (at x),
/// `yp` (x + εv), `ym` (x − εv) per output, direction `v`, and `grad` = Jᵀu on the input
/// (undefined: zero). `u` is the judged part of the cotangent (zero on the surrogate_masks()
/// elements); `u_surrogate` (empty: none) the rest, with `grad_surrogate` = Jᵀu_surrogate. Fills
/// every figure of CustomGradResult but `function` and `input_index`; `low_precision` is whether
/// some output of `y0` is not float64.
CustomGradResult directional_figures(const std::vector<at::Tensor>& u, const at::Tensor& v,
                                     const std::vector<at::Tensor>& y0,
                                     const std::vector<at::Tensor>& yp,
                                     const std::vector<at::Tensor>& ym, const at::Tensor& grad,
                                     double eps, const std::vector<at::Tensor>& u_surrogate = {},
                                     const at::Tensor& grad_surrogate = at::Tensor());

}  // namespace trainsan
