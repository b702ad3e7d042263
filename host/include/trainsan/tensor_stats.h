// TensorStats: the statistics of one tensor. Torch-free, so that the checks (host/checks/) and
// their unit tests build without LibTorch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace trainsan {

/// Statistics of one tensor, computed in one fused pass (see docs/statistics.md).
///
/// Counts are exact. `min`, `max`, `absmax`, `sum` and `l2` cover the finite elements only, so one
/// NaN does not hide the rest; `min`, `max` and `absmax` are empty when no element is finite,
/// `sum` and `l2` are then 0. `sum` and the sum of squares behind `l2` are accumulated in float64.
/// `subnormal` counts nonzero elements below the smallest normal number of the tensor's own dtype;
/// `fp16_overflow` counts finite elements with |x| > 65504. `hash` is a 64-bit fingerprint of the
/// exact bits of every element and its logical row-major index (kernels/stats.cuh,
/// Note [Hash]): independent of memory layout, thread count and reduction order.
/// Integer and bool tensors have no NaN/Inf/subnormal; their values enter min/max/sum as float64.
struct TensorStats {
  int64_t numel = 0;
  int64_t nan = 0;
  int64_t posinf = 0;
  int64_t neginf = 0;
  int64_t zero = 0;
  int64_t subnormal = 0;
  int64_t fp16_overflow = 0;
  std::optional<double> min;
  std::optional<double> max;
  std::optional<double> absmax;
  double sum = 0.0;
  double l2 = 0.0;
  uint64_t hash = 0;

  /// Number of NaN and ±Inf elements.
  int64_t nonfinite() const { return nan + posinf + neginf; }
  std::string to_string() const;
};

}  // namespace trainsan
