// Public C++ API of TrainSan's fused statistics pass.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/tensor_stats.h"

namespace trainsan {

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

/// The every-step tier's pass (Note [Lean rows], Note [Every-step tier]): like
/// tensor_stats_packed, but only the counts, sum, l2 and absmax are computed (the sanitizer's
/// per-step read of the gradients); min and max are NaN and hash is 0. One device.
PackedStats gradient_stats_packed(const std::vector<at::Tensor>& tensors);

/// The fingerprints only (Note [Lean rows], kModeHash): numel and hash with the same bits as
/// tensor_stats_packed's; the other counts are 0 and the float columns NaN. On the CPU it reads
/// each element once for the hash alone (the sanitizer's fingerprint of every training batch);
/// on CUDA it costs a full pass. One device.
PackedStats fingerprint_stats_packed(const std::vector<at::Tensor>& tensors);

/// Convert packed results (any device; copied to the host if needed) to TensorStats.
std::vector<TensorStats> unpack_stats(const PackedStats& packed);
/// The column names of a packed result (without the update columns): the int64 columns, then
/// the float64 ones; packed_int_fields() of them are int64.
std::vector<std::string> packed_field_names();
size_t packed_int_fields();
/// The inverse of unpack_stats, on the CPU (NaN where min/max/absmax are empty).
PackedStats pack_stats(const std::vector<TensorStats>& stats);
/// Uninitialised results of the right shapes on the tensors' device (the meta/fake kernel).
PackedStats tensor_stats_packed_shapes(const std::vector<at::Tensor>& tensors);

/// Counts of the magnitudes |x| of a floating tensor `t` (float16/32/64, bfloat16), exact: int64
/// [3 + K] on t's device, K = bounds.size(): non-finite elements, zeros, then the finite nonzero
/// ones in the bins (0, b_0], (b_0, b_1], ..., (b_{K-2}, b_{K-1}] and the rest above b_{K-1}
/// (K+1 bins: the last is "> b_{K-1}"). `bounds` must ascend; they are compared in float32 for
/// float32/16 and bfloat16 tensors (pass float32 values) and in float64 for float64 ones. The
/// precision-headroom counts (bindings/trainsan/precision.py). CPU: one parallel pass; other
/// devices: torch ops (bucketize, bincount).
at::Tensor range_histogram(const at::Tensor& t, const std::vector<double>& bounds);

/// True when this build of TrainSan includes the CUDA kernels.
bool cuda_compiled();

}  // namespace trainsan
