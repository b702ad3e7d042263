// Host-side pieces of the statistics pass shared by the CPU and CUDA paths.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "stats.h"
#include "trainsan/stats.h"

namespace trainsan::host {

// Descriptors of a list of tensors of one device, with the chunk table (Note [Chunking]).
struct Described {
  std::vector<kernels::TensorDesc> descs;
  std::vector<int64_t> chunk_begin;    // descs.size() + 1 entries
  std::vector<at::Tensor> keep_alive;  // contiguous copies made for views of > kMaxDims dims
};

// Note [Dtypes the pass reads] (stats.cpp): whether the pass reads tensors of dtype `st` (the
// kernels' dtypes, and complex ones as their real and imaginary parts).
bool readable_dtype(at::ScalarType st);
// `t` as the pass reads it: itself, or for a complex tensor the real view of its memory (an alias,
// last dim 2); undefined for a dtype the pass does not read. Never enters an autograd graph.
at::Tensor readable(const at::Tensor& t);
// Values the value checks look at (gradients, module outputs, fingerprinted tensors): floating or
// complex, of a dtype the pass reads (float8 is floating but not read).
bool readable_values(at::ScalarType st);

// Checks every element (TypeError/ValueError naming it) and that all share one device.
void check_tensors(const std::vector<at::Tensor>& tensors, const char* fn);
// Note [Update sample] (kernels/stats.h): the most elements the sample of one tensor holds; a
// tensor of n elements keeps every element when n <= kUpdateSampleCap, else one element in each
// stratum of update_sample_stride(n) elements (at most kUpdateSampleCap of them).
constexpr int64_t kUpdateSampleCap = 4096;
inline int64_t update_sample_stride(int64_t numel) {
  return numel <= kUpdateSampleCap ? 1 : (numel + kUpdateSampleCap - 1) / kUpdateSampleCap;
}
// The elements of a tensor of `numel` its snapshot holds: all of them (`exact`), or its sample's.
inline int64_t update_snapshot_numel(int64_t numel, bool exact) {
  return exact ? numel : kernels::num_samples_of(numel, update_sample_stride(numel));
}
// FNV-1a over 64-bit words (each word xor-ed in whole, then the FNV prime), from `seed`: how the
// fingerprints of several tensors or statistics are combined into one (batches, inputs, targets,
// the trace's gradient digest).
inline uint64_t fnv1a_words(const std::vector<uint64_t>& words,
                            uint64_t seed = 0xcbf29ce484222325ULL) {
  uint64_t h = seed;
  for (const uint64_t w : words) h = (h ^ w) * 0x100000001b3ULL;
  return h;
}

// The previous values the update statistics of `t` compare against: a contiguous copy of all of
// it (`exact`), or its sample (Note [Update sample]; the whole of it for a small tensor), on its
// device, in its dtype.
at::Tensor make_update_snapshot(const at::Tensor& t, bool exact);

// `snapshots` (optional, one per tensor, undefined where none): contiguous tensors of the same
// dtype, with numel elements or update_sample_stride's sample of them (Note [Update sample]),
// that receive the update statistics pass (Note [Update]) and are overwritten.
// `modes` (optional, one kernels::PassMode per tensor, kModeFull where absent): what the pass
// computes for that tensor (Note [Lean rows]).
Described describe(const std::vector<at::Tensor>& tensors,
                   const std::vector<at::Tensor>* snapshots = nullptr,
                   const std::vector<char>* modes = nullptr);

// One pass over tensors of one device. With snapshots the packed rows have the update columns
// (kIntFieldsUpdate / kFloatFieldsUpdate).
PackedStats packed_cpu(const std::vector<at::Tensor>& tensors,
                       const std::vector<at::Tensor>* snapshots = nullptr,
                       const std::vector<char>* modes = nullptr);
PackedStats packed_cuda(const std::vector<at::Tensor>& tensors,
                        const std::vector<at::Tensor>* snapshots = nullptr,
                        const std::vector<char>* modes = nullptr);  // stats_cuda.cpp
PackedStats packed_meta(const std::vector<at::Tensor>& tensors);

// Packed results on their way to the host: for CUDA, an asynchronous copy into pinned memory and
// an event recorded after it on the current stream; for CPU, the results themselves.
struct HostCopy {
  PackedStats host;
  std::shared_ptr<void> event;  // CUDA event, null for CPU results
};
HostCopy start_host_copy(const PackedStats& packed);
bool host_copy_ready(const HostCopy& copy);  // never blocks
void wait_host_copy(const HostCopy& copy);   // blocks until the copy has landed

// Device-side stop (Note [Device stop] in kernels/stats.cu): for CUDA rows, one launch on the
// current stream that stops the CUDA context (printing the counts) when the nan, posinf and
// neginf columns of `packed.ints` (the rows passed, e.g. only those of the gradients) are not all
// 0; never synchronises. A no-op for CPU rows. `packed.floats` is not read.
void stop_if_nonfinite(const PackedStats& packed);

}  // namespace trainsan::host
