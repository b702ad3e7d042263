// Public C++ API of TrainSan's fused statistics pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainsan {

/// Statistics of one tensor, computed in one fused pass (see ../shared/DESIGN.md).
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

/// Statistics of every tensor, one TensorStats each, in order. Tensors may mix dtypes
/// (float32/16, bfloat16, float64, int8/16/32/64, uint8, bool), sizes (empty to more than 2^31
/// elements), layouts (non-contiguous and expanded views) and devices (CPU and CUDA): one fused
/// pass per device. Blocks until the results are on the host.
/// Throws c10::TypeError / c10::ValueError naming the offending element for an undefined, sparse,
/// quantized, meta or otherwise unsupported tensor.
std::vector<TensorStats> tensor_stats(const std::vector<at::Tensor>& tensors);

/// Packed results of one pass: `ints` is int64 [N, 8] (numel nan posinf neginf zero subnormal
/// fp16_overflow hash-bits), `floats` is float64 [N, 5] (min max absmax sum l2, NaN where empty),
/// both on the tensors' device.
struct PackedStats {
  at::Tensor ints;
  at::Tensor floats;
};

/// The asynchronous form: one pass over tensors that all live on one device. On CUDA it enqueues
/// the pass on the current stream and returns at once, without synchronising; read the buffers
/// later (e.g. after an asynchronous copy to pinned memory) with unpack_stats().
PackedStats tensor_stats_packed(const std::vector<at::Tensor>& tensors);

/// Convert packed results (any device; copied to the host if needed) to TensorStats.
std::vector<TensorStats> unpack_stats(const PackedStats& packed);

/// True when this build of TrainSan includes the CUDA kernels.
bool cuda_compiled();

}  // namespace trainsan
