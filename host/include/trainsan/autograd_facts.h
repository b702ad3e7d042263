// Facts of the autograd-integrity checks (inplace_before_backward, bad_custom_grad), gathered by
// the caller (the Python package's saved-tensor hooks and autograd.Function wrapper, or a
// LibTorch program) and judged by the sanitizer (host/checks/autograd.cpp). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainsan {

/// A tensor saved for backward whose values changed between its save (in the forward) and its
/// use (in the backward) while its version counter did not: a write autograd cannot see.
struct SavedTensorChange {
  std::string node;            ///< the autograd node that saved it, e.g. "AddmmBackward0"
  std::string tensor;          ///< the parameter it is (or views), when it is one; else ""
  std::vector<int64_t> sizes;  ///< of the saved tensor
  std::string dtype;           ///< e.g. "float32"
};

/// One directional check of a custom autograd.Function's backward against finite differences,
/// on input `input_index`: with a random cotangent u and direction v (v on that input only),
/// `analytic` = u·(J v) as the Function's backward computes it (v·(Jᵀu)), `central` =
/// u·(f(x+εv) − f(x−εv))/2ε, `curvature` = Σ_o ‖u_o‖·‖f_o(x+εv) − 2f_o(x) + f_o(x−εv)‖/2ε (a
/// bound on the error of `central`: O(ε) where f is smooth, the whole error at a kink),
/// `scale` = Σ_o ‖u_o‖·‖f_o(x+εv) − f_o(x−εv)‖/2ε (a bound on |central|), `unit` = ‖u‖·‖v‖
/// (Note [Directional gradcheck], host/checks/autograd.cpp).
struct CustomGradResult {
  std::string function;  ///< the Function's qualified class name
  int64_t input_index = 0;
  double analytic = 0.0;
  double central = 0.0;
  double curvature = 0.0;
  double scale = 0.0;
  double unit = 0.0;
  /// Rounding noise of the differences: Σ_o ‖u_o‖·‖f_o(x)‖·(machine ε of f_o's dtype)/ε.
  double noise = 0.0;
  /// Some output was not float64 (the Function computes in lower precision): looser tolerance.
  bool low_precision = false;
};

}  // namespace trainsan
