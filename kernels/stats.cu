// CUDA backend of the fused statistics pass: two launches per call, however many tensors.
//   1. chunk_stats_kernel: one block per chunk (Note [Chunking]) reduces its elements into one
//      StatsRecord in the chunk's own slot of `partials`.
//   2. finalize_kernel: one block per tensor combines that tensor's partials and writes the packed
//      row. Both reductions use cub::BlockReduce's default (deterministic) algorithm over a fixed
//      block size, and each thread walks a fixed set of elements in a fixed order, so the result
//      has the same bits on every run (Note [Determinism]).
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include "check.h"
#include "dispatch.h"
#include "nvtx.h"
#include "stats.cuh"

namespace trainsan::kernels {

// Note [Determinism]
// Counts, min, max, absmax and hash are exact (integer or order-independent) and so bitwise equal
// across runs, GPUs and the CPU backend. sum and sumsq are float64 sums whose rounding depends on
// the order of additions: fixed here by the block size, the thread-to-element mapping and the
// CUB block reduction, so they are bitwise equal run to run on one GPU and within float64
// rounding of the CPU backend.

namespace {

constexpr int kBlockSize = 256;
constexpr int kMaxGrid = 1 << 20;

struct CombineOp {
  __device__ __forceinline__ StatsRecord operator()(const StatsRecord& a,
                                                    const StatsRecord& b) const {
    StatsRecord r = a;
    combine(r, b);
    return r;
  }
};

using BlockReduce = cub::BlockReduce<StatsRecord, kBlockSize>;

__device__ __forceinline__ int64_t find_tensor(const int64_t* chunk_begin, int64_t num_tensors,
                                               int64_t chunk) {
  // Last tensor t with chunk_begin[t] <= chunk; empty tensors own no chunk and are skipped.
  int64_t lo = 0, hi = num_tensors;  // invariant: chunk_begin[lo] <= chunk < chunk_begin[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (chunk_begin[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ T load_strided(const TensorDesc& t, int64_t index) {
  int64_t offset = 0;
  int64_t rem = index;
#pragma unroll
  for (int d = kMaxDims - 1; d >= 0; --d) {
    if (d < t.ndim) {
      const int64_t size = t.sizes[d];
      offset += (rem % size) * t.strides[d];
      rem /= size;
    }
  }
  return static_cast<const T*>(t.data)[offset];
}

template <typename T>
__device__ void chunk_update(const TensorDesc& t, int64_t start, int64_t count, StatsRecord& r) {
  T* snap = static_cast<T*>(t.snapshot) + start;
  for (int64_t i = threadIdx.x; i < count; i += kBlockSize) {
    const T v =
        t.contiguous ? static_cast<const T*>(t.data)[start + i] : load_strided<T>(t, start + i);
    accumulate_update<T>(r, v, snap[i]);
    snap[i] = v;
  }
}

template <typename T, bool kHash, bool kLean>
__device__ __forceinline__ void add(StatsRecord& r, T v, int64_t index) {
  if constexpr (kLean) {
    accumulate_lean<T>(r, v);
  } else {
    accumulate<T, kHash>(r, v, index);
  }
}

template <typename T, bool kHash, bool kLean>
__device__ void chunk_stats_impl(const TensorDesc& t, int64_t start, int64_t count,
                                 StatsRecord& r) {
  const int tid = threadIdx.x;
  if (t.contiguous) {
    const T* p = static_cast<const T*>(t.data) + start;
    constexpr int kVec = 16 / sizeof(T);
    // 16-byte loads when the chunk starts on a 16-byte boundary (kChunkSize is a multiple of
    // kVec, so that is the tensor's base alignment); scalar loads for the rest.
    int64_t vec_elems = 0;
    if (reinterpret_cast<uintptr_t>(p) % 16 == 0) {
      vec_elems = (count / kVec) * kVec;
      const uint4* pv = reinterpret_cast<const uint4*>(p);
      for (int64_t v = tid; v < vec_elems / kVec; v += kBlockSize) {
        const uint4 raw = pv[v];
        T vals[kVec];
        memcpy(vals, &raw, sizeof(raw));
#pragma unroll
        for (int k = 0; k < kVec; ++k) add<T, kHash, kLean>(r, vals[k], start + v * kVec + k);
      }
    }
    for (int64_t i = vec_elems + tid; i < count; i += kBlockSize) {
      add<T, kHash, kLean>(r, p[i], start + i);
    }
  } else {
    for (int64_t i = tid; i < count; i += kBlockSize) {
      add<T, kHash, kLean>(r, load_strided<T>(t, start + i), start + i);
    }
  }
}

template <typename T>
__device__ void chunk_stats(const TensorDesc& t, int64_t start, int64_t count, StatsRecord& r) {
  if (t.snapshot != nullptr) chunk_update<T>(t, start, count, r);
  if (t.mode == kModeLean) {
    chunk_stats_impl<T, false, true>(t, start, count, r);
  } else if (t.mode == kModeNoHash) {
    chunk_stats_impl<T, false, false>(t, start, count, r);
  } else {
    chunk_stats_impl<T, true, false>(t, start, count, r);
  }
}

__global__ void __launch_bounds__(kBlockSize)
    chunk_stats_kernel(const TensorDesc* __restrict__ tensors, int64_t num_tensors,
                       const int64_t* __restrict__ chunk_begin, int64_t num_chunks,
                       StatsRecord* __restrict__ partials) {
  __shared__ typename BlockReduce::TempStorage temp;
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    const int64_t ti = find_tensor(chunk_begin, num_tensors, chunk);
    const TensorDesc& t = tensors[ti];
    const int64_t start = (chunk - chunk_begin[ti]) * kChunkSize;
    const int64_t count = min(kChunkSize, t.numel - start);
    StatsRecord r;
    init_record(r);
    TRAINSAN_DISPATCH_DTYPE_DEVICE(t.dtype, T, chunk_stats<T>(t, start, count, r));
    const StatsRecord total = BlockReduce(temp).Reduce(r, CombineOp());
    if (threadIdx.x == 0) partials[chunk] = total;
    __syncthreads();  // temp is reused by the next chunk of this block
  }
}

__global__ void __launch_bounds__(kBlockSize)
    finalize_kernel(const TensorDesc* __restrict__ tensors, int64_t num_tensors,
                    const int64_t* __restrict__ chunk_begin,
                    const StatsRecord* __restrict__ partials, int64_t* __restrict__ out_int,
                    double* __restrict__ out_float, bool with_update) {
  __shared__ typename BlockReduce::TempStorage temp;
  for (int64_t t = blockIdx.x; t < num_tensors; t += gridDim.x) {
    StatsRecord r;
    init_record(r);
    for (int64_t c = chunk_begin[t] + threadIdx.x; c < chunk_begin[t + 1]; c += kBlockSize) {
      combine(r, partials[c]);
    }
    const StatsRecord total = BlockReduce(temp).Reduce(r, CombineOp());
    if (threadIdx.x == 0) {
      const bool lean = tensors[t].mode == kModeLean;
      if (with_update) {
        pack_record_update(total, out_int + t * kIntFieldsUpdate,
                           out_float + t * kFloatFieldsUpdate, lean);
      } else {
        pack_record(total, out_int + t * kIntFields, out_float + t * kFloatFields, lean);
      }
    }
    __syncthreads();
  }
}

}  // namespace

void cuda_tensor_stats(const TensorDesc* tensors, int64_t num_tensors, const int64_t* chunk_begin,
                       int64_t num_chunks, StatsRecord* partials, int64_t* out_int,
                       double* out_float, bool with_update, CUstream_st* stream) {
  TRAINSAN_NVTX_RANGE("trainsan/tensor_stats");
  if (num_tensors == 0) return;
  if (num_chunks > 0) {
    const int grid = static_cast<int>(num_chunks < kMaxGrid ? num_chunks : kMaxGrid);
    chunk_stats_kernel<<<grid, kBlockSize, 0, stream>>>(tensors, num_tensors, chunk_begin,
                                                        num_chunks, partials);
    TRAINSAN_CHECK_LAUNCH();
  }
  const int grid = static_cast<int>(num_tensors < kMaxGrid ? num_tensors : kMaxGrid);
  finalize_kernel<<<grid, kBlockSize, 0, stream>>>(tensors, num_tensors, chunk_begin, partials, out_int,
                                                   out_float, with_update);
  TRAINSAN_CHECK_LAUNCH();
}

bool cuda_compiled() { return true; }

}  // namespace trainsan::kernels
