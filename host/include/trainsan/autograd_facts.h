// Facts of the autograd-integrity checks (inplace_before_backward, bad_custom_grad), gathered by
// the caller (the Python package's saved-tensor hooks and autograd.Function wrapper, or a
// LibTorch program) and judged by the sanitizer (host/checks/autograd.cpp), and of a foreign
// backward (missing_grad, host/checks/gradient_flow.cpp). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainsan/facts_table.h"

namespace trainsan {

/// A tensor saved for backward whose values changed between its save (in the forward) and its
/// use (in the backward) while its version counter did not: a write autograd cannot see (fields:
/// saved_tensor_change.def).
struct SavedTensorChange {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/saved_tensor_change.def"
#undef TRAINSAN_FACT
};

/// One directional check of a custom autograd.Function's backward against finite differences,
/// on input `input_index`: with a random cotangent u and direction v (v on that input only),
/// `analytic` = u·(J v) as the Function's backward computes it (v·(Jᵀu)), `central` =
/// u·(f(x+εv) − f(x−εv))/2ε, `curvature` bounds the error of `central`, `scale` bounds |central|
/// (Note [Directional gradcheck], host/checks/autograd.cpp; fields: custom_grad_result.def).
struct CustomGradResult {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/custom_grad_result.def"
#undef TRAINSAN_FACT
};

/// A backward whose autograd graph reached none of the sanitizer's parameters but reached
/// requires-grad leaves outside them (fields: foreign_backward.def): Sanitizer::foreign_backward.
struct ForeignBackward {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/foreign_backward.def"
#undef TRAINSAN_FACT
};

template <>
struct FactTable<SavedTensorChange> {
  static constexpr const char* kName = "SavedTensorChange";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/saved_tensor_change.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<CustomGradResult> {
  static constexpr const char* kName = "CustomGradResult";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/custom_grad_result.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<ForeignBackward> {
  static constexpr const char* kName = "ForeignBackward";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/foreign_backward.def"
#undef TRAINSAN_FACT
  }
};

}  // namespace trainsan
