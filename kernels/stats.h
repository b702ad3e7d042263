// Plain descriptors and entry points of the fused statistics pass. No LibTorch, no CUDA headers:
// the host layer fills these from at::Tensor, the CPU backend and the CUDA kernels consume them.
#pragma once

#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace trainsan::kernels {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kUInt8 = 8,
  kBool = 9,
};

const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);
bool dtype_is_floating(DType dtype);

// Collapsed views of up to kMaxDims dimensions are read in place; the host layer makes anything
// with more (after merging dimensions that are contiguous with each other) contiguous first.
constexpr int kMaxDims = 6;

// Note [Chunking]
// Every tensor is cut into chunks of kChunkSize logical (row-major) elements; the last chunk of a
// tensor may be shorter and an empty tensor has none. Each chunk produces one StatsRecord
// (a partial) in its own slot, and the partials of a tensor are combined in chunk order. The chunk
// boundaries depend only on numel, so results do not depend on thread count or launch shape.
constexpr int64_t kChunkSize = int64_t{1} << 16;

struct TensorDesc {
  const void* data;  // address of logical element 0 (storage pointer + storage offset)
  int64_t numel;
  int64_t sizes[kMaxDims];    // after collapsing; unused trailing dims are 1
  int64_t strides[kMaxDims];  // in elements; 0 for expanded dims
  int32_t ndim;               // 1..kMaxDims (a 0-d tensor is described as [1])
  DType dtype;
  int32_t contiguous;  // 1 when element i lives at data + i * elem_size
  int32_t mode;        // PassMode: what the pass computes for this tensor (Note [Lean rows])
  // Optional previous-value snapshot, of the same dtype. With sample_stride <= 1 it holds all
  // numel elements in logical row-major order; with sample_stride > 1 it holds the sample of
  // Note [Update sample]: num_samples_of(numel, sample_stride) elements, element j the value at
  // logical index sample_index(j, sample_stride, numel). When set, the pass also computes the
  // update statistics against it (Note [Update]) over the elements it holds, and then overwrites
  // them with the current values. Never aliases `data`.
  void* snapshot;
  int64_t sample_stride;
};

// Note [Update sample]
// ~~~~~~~~~~~~~~~~~~~~
// The update statistics without a copy of the weights: a tensor of n elements is cut into strata
// of `stride` consecutive logical elements (the last one may be shorter), and each stratum keeps
// one element, at an offset inside it fixed by a hash of the stratum's number (sample_index). A
// fixed, stratified sample: the same elements at every step (so an element's previous value is
// at hand), spread evenly over the tensor, and never aligned with a row length or a channel
// count the way a plain stride would be (a frozen column or a dead channel is sampled in
// proportion to its size). The host chooses the stride (host/sanitizer_pass.cpp, Note [Update
// statistics without a snapshot]); the pass reads the sampled elements of a chunk while the chunk
// is in cache, so the sample costs no extra pass over memory.
inline int64_t num_samples_of(int64_t numel, int64_t stride) {
  return stride <= 1 ? numel : (numel + stride - 1) / stride;
}

// Note [Lean rows]
// ~~~~~~~~~~~~~~~~
// What the pass computes for one tensor:
//   kModeFull   every field of the record, the fingerprint included;
//   kModeNoHash every field but the fingerprint (the hash column is then meaningless); it saves
//               about two thirds of the CPU pass's arithmetic where nobody reads it;
//   kModeLean   the every-step tier of the step pass (Note [Every-step tier] in
//               host/overhead_budget.h) and the saved-tensor fingerprints: the exact counts
//               (numel, nan, ±inf, zero, subnormal, fp16_overflow), sum, sumsq and absmax; no
//               fingerprint, no min or max — their packed columns hold NaN (hash 0). sum and
//               sumsq are accumulated in the same order as in the other modes, so a lean row's
//               sum, l2 and absmax have the same bits as a full row's — except for a tensor that
//               is a permutation of a dense block (a transpose, channels_last): the lean pass
//               reads it in memory order, at the speed of a contiguous one, so its sum and l2
//               agree with the full row's to float64 rounding (the counts and absmax exactly);
//   kModeHash   the fingerprint only (duplicate_batch's input fingerprint, the trace's target
//               fingerprint): numel and the hash, the same bits as a full row's; every other
//               column holds 0 (counts) or NaN (floats). The CPU pass reads the elements once for
//               the hash alone, about twice as fast as a full row; the CUDA kernel computes a
//               full row (it is memory-bound there) and packs it the same way.
// A snapshot (update statistics) is honoured in every mode.
enum PassMode : int32_t { kModeFull = 0, kModeNoHash = 1, kModeLean = 2, kModeHash = 3 };

// The chunk table is `chunk_begin`: num_tensors + 1 ascending offsets, tensor i owning chunks
// [chunk_begin[i], chunk_begin[i+1]) = ceil(numel_i / kChunkSize) of them.
inline int64_t num_chunks_of(int64_t numel) { return (numel + kChunkSize - 1) / kChunkSize; }

// Note [Stats record]
// One record per chunk (partial) and per tensor (final). Counts are exact integers. min, max,
// absmax, sum and sumsq cover finite elements only (one NaN must not hide the rest); they are
// +inf/-inf/0/0/0 when there is none. sum and sumsq are accumulated in float64. hash holds the
// un-finalized fingerprint sum S (Note [Hash]); finalize_hash() turns S into the public value.
struct StatsRecord {
  int64_t numel;
  int64_t nan;
  int64_t posinf;
  int64_t neginf;
  int64_t zero;
  int64_t subnormal;
  int64_t fp16_overflow;
  uint64_t hash;
  double min;
  double max;
  double absmax;
  double sum;
  double sumsq;
  // Note [Update]: against the snapshot, when one is given (else 0): elements whose bits changed,
  // and the float64 sum of squares and max of |x - x_prev| over elements finite in both.
  int64_t changed;
  double dsumsq;
  double dmax;
};
static_assert(sizeof(StatsRecord) == 16 * 8, "StatsRecord is copied as raw words");

// Note [Packed row]
// ~~~~~~~~~~~~~~~~~
// The packed result of a pass is one int64 row and one float64 row per tensor. These enums are
// the one definition of the columns: the kernels pack with them (pack_record), the host layer
// unpacks with them (unpack_stats, the step pass), and the Python package takes the names from
// the op library (torch.ops.trainsan.stats_fields), so no other copy of the layout exists.
enum IntCol : int {
  kColNumel,
  kColNan,
  kColPosinf,
  kColNeginf,
  kColZero,
  kColSubnormal,
  kColFp16Overflow,
  kColHash,
  kColChanged,  // update rows only: elements whose bits changed
};
enum FloatCol : int {
  kColMin,
  kColMax,
  kColAbsmax,
  kColSum,
  kColL2,
  kColUpdateL2,   // update rows only: ||x - x_prev||
  kColUpdateMax,  // update rows only: max |x - x_prev|
};
constexpr const char* kIntColNames[] = {"numel",     "nan",           "posinf", "neginf", "zero",
                                        "subnormal", "fp16_overflow", "hash",   "changed"};
constexpr const char* kFloatColNames[] = {"min", "max",       "absmax",    "sum",
                                          "l2",  "update_l2", "update_max"};

// Number of int64 and float64 columns in the packed result, without and with the update columns.
constexpr int kIntFields = kColHash + 1;
constexpr int kFloatFields = kColL2 + 1;
constexpr int kIntFieldsUpdate = kColChanged + 1;
constexpr int kFloatFieldsUpdate = kColUpdateMax + 1;

// CPU backend, torch-free part: statistics of one chunk of a tensor, into *out.
// `scratch` must hold kChunkSize * dtype_size bytes; it is used to gather strided chunks.
void cpu_chunk_stats(const TensorDesc& t, int64_t start, int64_t count, void* scratch,
                     StatsRecord* out);

// Combine `n` partials in order into one record (Note [Chunking]).
void combine_records(const StatsRecord* parts, int64_t n, StatsRecord* out);

// CUDA backend (defined only when built with CUDA). All pointers are device pointers:
// `tensors` and `chunk_begin` (num_tensors + 1 entries) describe the work, `partials` has room
// for num_chunks records, `tickets` holds num_tensors int32 counters that are 0 at launch and 0
// again when the launch has run (Note [Last block] in stats.cu: reusable by the next launch on
// the same stream), and the packed results go to out_int [num_tensors x kIntFields] and
// out_float [num_tensors x kFloatFields]. One kernel launch on `stream` however many tensors, no
// host synchronisation, no allocation: capturable in a CUDA graph (with tickets zeroed in it).
// With `with_update`, out_int/out_float have kIntFieldsUpdate/kFloatFieldsUpdate columns and
// tensors with a snapshot get update statistics (and their snapshot rewritten).
void cuda_tensor_stats(const TensorDesc* tensors, int64_t num_tensors, const int64_t* chunk_begin,
                       int64_t num_chunks, StatsRecord* partials, int32_t* tickets,
                       int64_t* out_int, double* out_float, bool with_update, CUstream_st* stream);

// Device-side stop (Note [Device stop] in stats.cu): one launch on `stream` that sums the nan,
// posinf and neginf columns of `rows` packed int rows (device memory, row_stride int64 apart:
// kIntFields or kIntFieldsUpdate) and, when the sum is not 0, prints it and traps, which stops
// the CUDA context before anything enqueued after it runs. Never synchronises.
void cuda_stop_if_nonfinite(const int64_t* ints, int64_t rows, int64_t row_stride,
                            CUstream_st* stream);

bool cuda_compiled();

}  // namespace trainsan::kernels
