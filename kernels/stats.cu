// CUDA backend of the fused statistics pass: one launch per call, however many tensors.
// stats_kernel runs one block per chunk (Note [Chunking]), grid-stride when there are more chunks
// than blocks:
//   1. the block reduces its chunk's elements into one StatsRecord in the chunk's own slot of
//      `partials`, then takes a ticket from its tensor's counter (Note [Last block]);
//   2. the block that takes a tensor's last ticket combines that tensor's partials in chunk order
//      and writes the packed row; empty tensors (no chunk) get their row from the grid as a whole.
// Both reductions use cub::BlockReduce's default (deterministic) algorithm over a fixed block
// size, and each thread walks a fixed set of elements (then partials) in a fixed order, so the
// result has the same bits on every run, whichever block finishes last (Note [Determinism]).
// cuda_stop_if_nonfinite is the device-side stop (Note [Device stop]): one one-block launch.
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
// rounding of the CPU backend. Which block combines a tensor's partials (the last to finish one
// of its chunks, Note [Last block]) varies from run to run, but not what it computes: thread i
// combines partials i, i + kBlockSize, ... of the tensor in chunk order, then the block reduction
// as in the chunk step, exactly as the separate finalize launch of earlier versions did, so the
// packed rows have the same bits as with two launches.
//
// Note [Last block]
// ~~~~~~~~~~~~~~~~~
// `tickets` holds one int32 counter per tensor, 0 at launch. A block that has written a chunk's
// partial makes it visible device-wide (__threadfence) and then takes a ticket (atomicAdd on the
// tensor's counter); the block that draws ticket (chunks of the tensor - 1) is the last one, sees
// every partial of the tensor (they were fenced before their tickets), reads them from L2
// (__ldcg: L1 is not coherent across blocks), writes the packed row and sets the counter back to
// 0. So after every launch all counters are 0 again and the next launch on the same stream (which
// runs after it) can use them: the host keeps one such buffer per (device, stream), zeroed once
// when it is allocated (host/stats_cuda.cpp). No block ever waits on another, so the pattern
// cannot deadlock whatever the number of resident blocks.

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
  if (t.sample_stride > 1) {
    // Note [Update sample]: the strata that reach into this chunk, one thread a stratum.
    T* sample = static_cast<T*>(t.snapshot);
    const int64_t stride = t.sample_stride;
    const int64_t first = start / stride;
    const int64_t last = (start + count - 1) / stride;
    for (int64_t j = first + threadIdx.x; j <= last; j += kBlockSize) {
      const int64_t i = sample_index(j, stride, t.numel);
      if (i < start || i >= start + count) continue;
      const T v = t.contiguous ? static_cast<const T*>(t.data)[i] : load_strided<T>(t, i);
      accumulate_update<T>(r, v, sample[j]);
      sample[j] = v;
    }
    return;
  }
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

// One record of `partials` written by another block: read through L2 (Note [Last block]).
__device__ __forceinline__ StatsRecord load_partial(const StatsRecord* p) {
  StatsRecord r;
  const long long* src = reinterpret_cast<const long long*>(p);
  long long* dst = reinterpret_cast<long long*>(&r);
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(StatsRecord) / 8); ++k) dst[k] = __ldcg(src + k);
  return r;
}

__device__ __forceinline__ void pack_row(const StatsRecord& r, const TensorDesc& t, int64_t row,
                                         int64_t* out_int, double* out_float, bool with_update) {
  // A kModeHash row is computed as a full row here and packed as a hash row (Note [Lean rows]).
  if (with_update) {
    pack_record_update(r, out_int + row * kIntFieldsUpdate, out_float + row * kFloatFieldsUpdate,
                       t.mode);
  } else {
    pack_record(r, out_int + row * kIntFields, out_float + row * kFloatFields, t.mode);
  }
}

__global__ void __launch_bounds__(kBlockSize)
    stats_kernel(const TensorDesc* __restrict__ tensors, int64_t num_tensors,
                 const int64_t* __restrict__ chunk_begin, int64_t num_chunks, StatsRecord* partials,
                 int32_t* tickets, int64_t* __restrict__ out_int, double* __restrict__ out_float,
                 bool with_update) {
  __shared__ typename BlockReduce::TempStorage temp;
  __shared__ int last;  // this block drew the last ticket of the tensor of its current chunk

  // Empty tensors own no chunk, so no block finishes them: the grid packs their rows (the
  // identity record, which is what combining no partial gives).
  for (int64_t t = blockIdx.x * static_cast<int64_t>(kBlockSize) + threadIdx.x; t < num_tensors;
       t += static_cast<int64_t>(gridDim.x) * kBlockSize) {
    if (chunk_begin[t] == chunk_begin[t + 1]) {
      StatsRecord r;
      init_record(r);
      pack_row(r, tensors[t], t, out_int, out_float, with_update);
    }
  }

  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    const int64_t ti = find_tensor(chunk_begin, num_tensors, chunk);
    const TensorDesc& t = tensors[ti];
    const int64_t first = chunk_begin[ti];
    const int64_t end = chunk_begin[ti + 1];
    const int64_t start = (chunk - first) * kChunkSize;
    const int64_t count = min(kChunkSize, t.numel - start);
    StatsRecord r;
    init_record(r);
    TRAINSAN_DISPATCH_DTYPE_DEVICE(t.dtype, T, chunk_stats<T>(t, start, count, r));
    const StatsRecord total = BlockReduce(temp).Reduce(r, CombineOp());
    if (threadIdx.x == 0) {
      partials[chunk] = total;
      __threadfence();  // the partial is visible device-wide before the ticket is taken
      const int ticket = atomicAdd(tickets + ti, 1);
      last = ticket == static_cast<int>(end - first - 1);
    }
    __syncthreads();  // `last` is set, and `temp` may be reused
    if (last) {
      __threadfence();  // pairs with the other blocks' fences before their tickets
      StatsRecord acc;
      init_record(acc);
      for (int64_t c = first + threadIdx.x; c < end; c += kBlockSize) {
        combine(acc, load_partial(partials + c));
      }
      const StatsRecord tensor_total = BlockReduce(temp).Reduce(acc, CombineOp());
      if (threadIdx.x == 0) {
        pack_row(tensor_total, t, ti, out_int, out_float, with_update);
        tickets[ti] = 0;  // ready for the next launch on this stream
      }
    }
    __syncthreads();  // temp and `last` are reused by the next chunk of this block
  }
}

// Note [Device stop]
// ~~~~~~~~~~~~~~~~~~
// The stop before the optimizer step for jobs that must not apply a non-finite update, without a
// host synchronisation (the idea of torch._assert_async): one block sums the nan, posinf and
// neginf columns of the packed rows already on the device and, when the sum is not 0, prints
// the counts and fails a device-side assertion, which traps. The kernel is enqueued before the
// optimizer's kernels on the same stream, so they never run: the CUDA context is unusable from
// then on and the next CUDA call on the host (typically the next step's) raises "device-side
// assert triggered". The process cannot go on training; it is meant to stop with the non-finite
// update never applied (what survives is the last checkpoint).
struct NonFinite {
  long long nan, posinf, neginf;
};

struct NonFiniteSum {
  __device__ __forceinline__ NonFinite operator()(const NonFinite& a, const NonFinite& b) const {
    return {a.nan + b.nan, a.posinf + b.posinf, a.neginf + b.neginf};
  }
};

__global__ void __launch_bounds__(kBlockSize)
    stop_if_nonfinite_kernel(const int64_t* __restrict__ ints, int64_t rows, int64_t row_stride) {
  using Reduce = cub::BlockReduce<NonFinite, kBlockSize>;
  __shared__ typename Reduce::TempStorage temp;
  NonFinite mine{0, 0, 0};
  for (int64_t r = threadIdx.x; r < rows; r += kBlockSize) {
    const int64_t* row = ints + r * row_stride;
    mine.nan += row[kColNan];
    mine.posinf += row[kColPosinf];
    mine.neginf += row[kColNeginf];
  }
  const NonFinite total = Reduce(temp).Reduce(mine, NonFiniteSum());
  if (threadIdx.x == 0 && total.nan + total.posinf + total.neginf != 0) {
    printf(
        "trainsan: device_stop: %lld non-finite gradient elements (%lld NaN, %lld +Inf, %lld "
        "-Inf); the optimizer step was not applied. The CUDA context is stopped on purpose "
        "(device_stop=True), so this process cannot continue: resume from the last checkpoint, "
        "and to find the cause rerun without device_stop (TrainSan then reports the non-finite "
        "gradients one step late instead of stopping).\n",
        total.nan + total.posinf + total.neginf, total.nan, total.posinf, total.neginf);
    __assert_fail("trainsan device_stop: non-finite gradients, optimizer step not applied",
                  __FILE__, __LINE__, __func__);
    __trap();  // not reached: the failed assertion traps
  }
}

}  // namespace

void cuda_tensor_stats(const TensorDesc* tensors, int64_t num_tensors, const int64_t* chunk_begin,
                       int64_t num_chunks, StatsRecord* partials, int32_t* tickets,
                       int64_t* out_int, double* out_float, bool with_update, CUstream_st* stream) {
  TRAINSAN_NVTX_RANGE("trainsan/tensor_stats");
  if (num_tensors == 0) return;
  // At least one block, for a list of empty tensors only.
  const int64_t blocks = num_chunks > 0 ? num_chunks : 1;
  const int grid = static_cast<int>(blocks < kMaxGrid ? blocks : kMaxGrid);
  stats_kernel<<<grid, kBlockSize, 0, stream>>>(tensors, num_tensors, chunk_begin, num_chunks,
                                                partials, tickets, out_int, out_float, with_update);
  TRAINSAN_CHECK_LAUNCH();
}

void cuda_stop_if_nonfinite(const int64_t* ints, int64_t rows, int64_t row_stride,
                            CUstream_st* stream) {
  TRAINSAN_NVTX_RANGE("trainsan/stop_if_nonfinite");
  if (rows == 0) return;
  stop_if_nonfinite_kernel<<<1, kBlockSize, 0, stream>>>(ints, rows, row_stride);
  TRAINSAN_CHECK_LAUNCH();
}

bool cuda_compiled() { return true; }

}  // namespace trainsan::kernels
