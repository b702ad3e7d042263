// Host layer of the statistics pass: validation, tensor -> descriptor, the CPU backend's parallel
// driver, device grouping and unpacking.
#include "stats.cuh"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <sstream>

#include "dispatch.h"
#include "stats_internal.h"

namespace trainsan {

namespace kn = kernels;

namespace host {
namespace {

std::optional<kn::DType> to_dtype(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return kn::DType::kFloat32;
    case at::kHalf:
      return kn::DType::kFloat16;
    case at::kBFloat16:
      return kn::DType::kBFloat16;
    case at::kDouble:
      return kn::DType::kFloat64;
    case at::kChar:
      return kn::DType::kInt8;
    case at::kShort:
      return kn::DType::kInt16;
    case at::kInt:
      return kn::DType::kInt32;
    case at::kLong:
      return kn::DType::kInt64;
    case at::kByte:
      return kn::DType::kUInt8;
    case at::kBool:
      return kn::DType::kBool;
    default:
      return std::nullopt;
  }
}

}  // namespace

// Note [Dtypes the pass reads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every tensor reaches the kernels through describe(), and what the pass does with a dtype is
// decided here, once, for every caller (the step pass, the public ops, inputs, targets, module
// outputs, saved tensors, replicas):
//  - the dtypes of kernels::DType (to_dtype) are read as they are;
//  - a complex tensor (complex32, complex64, complex128) is read as its real and imaginary parts:
//    the real view of the same memory (view_as_real, last dim 2; a conjugate view is resolved
//    first), 2n elements of the real dtype. Its figures are those of that view, exactly: the L2
//    norm is the complex (Frobenius) norm, absmax the largest |part| (|z| is at most sqrt(2)
//    times it), NaN/Inf/zero counts count parts, and the fingerprints and the update statistics
//    are the parts'. A sanitizer reads a complex parameter the same way (TrackedParam::data()),
//    so its snapshot and its rows agree; trace rows say numel 2n.
//  - any other dtype (float8, uint16/32/64, the bit and sub-byte dtypes) is not read. describe()
//    and check_tensors() refuse it with a TypeError naming the tensor and dtype, never a guess at
//    its bits; a sanitizer leaves such parameters out of its passes at attach and names them in
//    coverage()'s `unread` and the summary (to_tracked in sanitizer.cpp). The callers that read
//    tensors the loop hands over (inputs, targets, module outputs) already skip a tensor the
//    pass refuses.
// The kernels' own dtype switches (kernels/dispatch.h) throw on the host and do nothing on the
// device for a code outside DType; only describe() makes codes, so neither is reached.
bool readable_dtype(at::ScalarType st) { return to_dtype(st).has_value() || at::isComplexType(st); }

bool readable_values(at::ScalarType st) {
  return (at::isFloatingType(st) || at::isComplexType(st)) && readable_dtype(st);
}

at::Tensor readable(const at::Tensor& t) {
  if (!t.defined() || to_dtype(t.scalar_type()).has_value()) return t;
  if (!at::isComplexType(t.scalar_type())) return at::Tensor();
  const at::Tensor plain = t.detach();
  return at::view_as_real(plain.is_conj() ? plain.resolve_conj() : plain);
}

namespace {

// Drop size-1 dims and merge neighbours that are contiguous with each other, so that most views
// (slices, transposes of 2-D blocks, expanded dims) fit kMaxDims and contiguous ones become 1-D.
int collapse(const at::Tensor& t, int64_t* sizes, int64_t* strides, int max_dims) {
  int nd = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t size = t.size(d);
    const int64_t stride = t.stride(d);
    if (size == 1) continue;
    if (nd > 0 && strides[nd - 1] == stride * size) {
      sizes[nd - 1] *= size;
      strides[nd - 1] = stride;
      continue;
    }
    if (nd == max_dims) return max_dims + 1;
    sizes[nd] = size;
    strides[nd] = stride;
    ++nd;
  }
  if (nd == 0) {
    sizes[0] = 1;
    strides[0] = 1;
    nd = 1;
  }
  return nd;
}

}  // namespace

void check_tensors(const std::vector<at::Tensor>& tensors, const char* fn) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.defined(), fn, ": tensors[", i,
                      "] is an undefined tensor; pass only defined tensors (a parameter whose "
                      ".grad is None has no gradient to inspect)");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, fn, ": tensors[", i, "] has layout ", t.layout(),
                      "; only dense (strided) tensors are supported, call .to_dense()");
    TORCH_CHECK_VALUE(!t.is_nested(), fn, ": tensors[", i,
                      "] is a nested tensor; pass its components (.unbind()) instead");
    TORCH_CHECK_VALUE(!t.is_quantized(), fn, ": tensors[", i,
                      "] is quantized; call .dequantize() first");
    TORCH_CHECK_VALUE(!t.is_meta(), fn, ": tensors[", i,
                      "] is a meta tensor, which holds no data to compute statistics of");
    TORCH_CHECK_VALUE(!t.unsafeGetTensorImpl()->is_python_dispatch(), fn, ": tensors[", i,
                      "] is a tensor subclass without storage of its own (DTensor, FakeTensor, "
                      "...); pass its local data (DTensor: ._local_tensor / .to_local())");
    TORCH_CHECK_VALUE(t.device().is_cpu() || t.device().is_cuda(), fn, ": tensors[", i,
                      "] is on device ", t.device(), "; only CPU and CUDA tensors are supported");
    TORCH_CHECK_TYPE(readable_dtype(t.scalar_type()), fn, ": tensors[", i, "] has dtype ",
                     t.scalar_type(),
                     ", which is not supported (supported: " TRAINSAN_SUPPORTED_DTYPES
                     ", and complex ones, read as their real and imaginary parts)");
  }
}

static void check_one_device(const std::vector<at::Tensor>& tensors, const char* fn) {
  for (size_t i = 1; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].device() == tensors[0].device(), fn, ": tensors[", i, "] is on ",
                      tensors[i].device(), " but tensors[0] is on ", tensors[0].device(),
                      "; this op takes tensors of one device (trainsan.tensor_stats groups a "
                      "mixed list by device for you)");
  }
}

Described describe(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>* snapshots,
                   const std::vector<char>* modes) {
  Described out;
  out.descs.resize(tensors.size());
  out.chunk_begin.resize(tensors.size() + 1);
  int64_t chunks = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i];
    if (t.defined() && !to_dtype(t.scalar_type()).has_value()) {  // Note [Dtypes the pass reads]
      at::Tensor parts = readable(t);
      TORCH_CHECK_TYPE(
          parts.defined(), "trainsan: tensors[", i, "] has dtype ", t.scalar_type(),
          ", which the statistics pass does not read (supported: " TRAINSAN_SUPPORTED_DTYPES
          ", and complex ones); convert it or leave it out");
      t = std::move(parts);
      out.keep_alive.push_back(t);
    }
    // The pass reads the data through its pointer: a tensor autograd tracks is read as it is, and
    // the two copies made here are of an alias (detach()), so that nothing enters a graph. Every
    // pass describes its tensors here, so its callers hand them over as they are (no detach()).
    if (t.is_neg()) {
      t = t.detach().resolve_neg();
      out.keep_alive.push_back(t);
    }
    kn::TensorDesc& d = out.descs[i];
    std::memset(&d, 0, sizeof(d));
    d.dtype = *to_dtype(t.scalar_type());  // readable above
    d.numel = t.numel();
    int nd = collapse(t, d.sizes, d.strides, kn::kMaxDims);
    if (nd > kn::kMaxDims) {
      t = t.detach().contiguous();
      out.keep_alive.push_back(t);
      nd = collapse(t, d.sizes, d.strides, kn::kMaxDims);
    }
    for (int k = nd; k < kn::kMaxDims; ++k) {
      d.sizes[k] = 1;
      d.strides[k] = 0;
    }
    d.ndim = nd;
    d.contiguous = (nd == 1 && d.strides[0] == 1) ? 1 : 0;
    d.mode = modes != nullptr ? static_cast<int32_t>((*modes)[i]) : kn::kModeFull;
    if (!d.contiguous && d.mode == kn::kModeLean && t.is_non_overlapping_and_dense()) {
      // Note [Lean rows]: a permutation of a dense block (a transpose, channels_last) is read in
      // memory order, as one run from logical element 0 (the lowest address: strides are >= 0).
      d.ndim = 1;
      d.sizes[0] = d.numel;
      d.strides[0] = 1;
      for (int k = 1; k < kn::kMaxDims; ++k) {
        d.sizes[k] = 1;
        d.strides[k] = 0;
      }
      d.contiguous = 1;
    }
    // A wrapper subclass (DTensor) or a tensor whose storage was freed (FSDP resizes the
    // storage of unsharded parameters to 0 between uses) has no data to read: refuse it here,
    // where every pass (the step pass included, which skips check_tensors) goes through.
    if (d.numel > 0) {
      TORCH_CHECK_VALUE(!t.unsafeGetTensorImpl()->is_python_dispatch(), "trainsan: tensors[", i,
                        "] is a tensor subclass without storage of its "
                        "own (DTensor, ...); its local data must be passed instead");
      int64_t last = t.storage_offset();
      for (int64_t k = 0; k < t.dim(); ++k) last += (t.size(k) - 1) * t.stride(k);
      const auto need = static_cast<size_t>(last + 1) * t.element_size();
      TORCH_CHECK_VALUE(t.unsafeGetTensorImpl()->unsafe_storage().nbytes() >= need,
                        "trainsan: tensors[", i, "] has no data in memory (its storage holds ",
                        t.unsafeGetTensorImpl()->unsafe_storage().nbytes(), " bytes, ", need,
                        " needed: freed or resized, e.g. an FSDP unsharded parameter)");
    }
    d.data = d.numel > 0 ? t.const_data_ptr() : nullptr;
    d.snapshot = nullptr;
    d.sample_stride = 1;
    if (snapshots != nullptr && (*snapshots)[i].defined() && d.numel > 0) {
      const at::Tensor& snap = (*snapshots)[i];
      if (snap.numel() != d.numel) d.sample_stride = update_sample_stride(d.numel);
      TORCH_INTERNAL_ASSERT(snap.is_contiguous() &&
                            snap.numel() == kn::num_samples_of(d.numel, d.sample_stride) &&
                            snap.scalar_type() == t.scalar_type() && snap.device() == t.device());
      d.snapshot = snap.mutable_data_ptr();
    }
    out.chunk_begin[i] = chunks;
    chunks += kn::num_chunks_of(d.numel);
  }
  out.chunk_begin[tensors.size()] = chunks;
  return out;
}

at::Tensor make_update_snapshot(const at::Tensor& t, bool exact) {
  const int64_t n = t.numel();
  const int64_t stride = exact ? 1 : update_sample_stride(n);
  if (stride <= 1) return t.detach().clone(at::MemoryFormat::Contiguous);
  // The sampled elements in logical row-major order, as the pass indexes them (Note [Update
  // sample]); reshape copies only a tensor that has no flat view.
  const int64_t m = kn::num_samples_of(n, stride);
  at::Tensor index = at::empty({m}, at::kLong);
  int64_t* ip = index.mutable_data_ptr<int64_t>();
  for (int64_t j = 0; j < m; ++j) ip[j] = kn::sample_index(j, stride, n);
  return t.detach().reshape({-1}).index_select(0, index.to(t.device())).contiguous();
}

namespace {
// Note [Reused host rows]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A CPU pass's results, ints [n, ni] and floats [n, nf], in buffers this thread made for an
// earlier pass of the same shape that nobody holds any more (neither the tensors nor a view of
// their storage): at::empty is a dispatcher call and an allocation, and inside a training step,
// with its code and data evicted by the step's own work, each cost ~10-15 us on the bench's CPU
// (bench/probes.py cold_events; bench/RESULTS.md, issue 23), while a step makes its passes of the
// same few shapes every time. Every element of a reused buffer is written by the pass (pack_record
// writes whole rows), so a reused buffer is indistinguishable from a new one; a buffer still held
// elsewhere (returned to a caller, kept in a HostCopy not yet read) is never handed out again.
// Passes of up to kReusedMaxRows tensors; at most kReusedRows buffers a thread (4 MiB at most).
constexpr size_t kReusedRows = 8;
constexpr int64_t kReusedMaxRows = 4096;

// Nobody holds `t` or its storage, and it is still the dense buffer it was made as (a caller that
// held it could have changed its metadata in place before dropping it).
bool unheld(const at::Tensor& t) {
  return t.use_count() == 1 && t.storage().use_count() == 1 && t.storage_offset() == 0 &&
         t.is_contiguous();
}

std::pair<at::Tensor, at::Tensor> host_rows(int64_t n, int ni, int nf) {
  thread_local std::vector<std::pair<at::Tensor, at::Tensor>> kept;
  for (auto& [ints, floats] : kept) {
    if (ints.size(0) == n && ints.size(1) == ni && floats.size(1) == nf && unheld(ints) &&
        unheld(floats)) {
      return {ints, floats};
    }
  }
  std::pair<at::Tensor, at::Tensor> made{at::empty({n, ni}, at::kLong),
                                         at::empty({n, nf}, at::kDouble)};
  if (n > kReusedMaxRows) return made;
  if (kept.size() < kReusedRows) {
    kept.push_back(made);
  } else {  // replace one nobody holds, if any
    for (auto& k : kept) {
      if (unheld(k.first) && unheld(k.second)) {
        k = made;
        break;
      }
    }
  }
  return made;
}
}  // namespace

PackedStats packed_cpu(const std::vector<at::Tensor>& tensors,
                       const std::vector<at::Tensor>* snapshots, const std::vector<char>* modes) {
  const Described w = describe(tensors, snapshots, modes);
  const bool with_update = snapshots != nullptr;
  const int ni = with_update ? kn::kIntFieldsUpdate : kn::kIntFields;
  const int nf = with_update ? kn::kFloatFieldsUpdate : kn::kFloatFields;
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t num_chunks = w.chunk_begin[n];
  std::vector<kn::StatsRecord> partials(static_cast<size_t>(num_chunks));
  // Chunk -> tensor in one sequential pass, then chunks in parallel; every chunk's record depends
  // only on its elements, so the thread count cannot change a bit of the result.
  std::vector<int32_t> owner(static_cast<size_t>(num_chunks));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = w.chunk_begin[t]; c < w.chunk_begin[t + 1]; ++c) {
      owner[c] = static_cast<int32_t>(t);
    }
  }
  // Split the chunks among the threads by estimated cost rather than by count: at::parallel_for
  // hands each thread a contiguous range, and a step pass lists all gradients (statistics only)
  // before all parameters (statistics + update against the snapshot, about twice the work), so an
  // even split by count leaves one thread with all the updates. One task per thread, each a
  // contiguous run of chunks of about equal cost; which thread computes a chunk cannot change
  // its record, so the result is the same bits as before.
  // A small pass runs on the calling thread: below about 2^16 elements, waking the pool costs
  // more than the pass (a tiny model paid its every step in thread wake-ups on a loaded machine).
  constexpr int64_t kSerialElements = int64_t{1} << 16;
  int64_t total_elements = 0;
  for (int64_t t = 0; t < n; ++t) total_elements += w.descs[t].numel;
  const int64_t num_tasks =
      total_elements < kSerialElements
          ? 1
          : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_chunks));
  std::vector<int64_t> task_begin(static_cast<size_t>(num_tasks) + 1, num_chunks);
  task_begin[0] = 0;
  if (num_tasks > 1) {
    std::vector<int64_t> cost(static_cast<size_t>(num_chunks) + 1, 0);  // prefix sums
    for (int64_t c = 0; c < num_chunks; ++c) {
      const kn::TensorDesc& d = w.descs[owner[c]];
      const int64_t start = (c - w.chunk_begin[owner[c]]) * kn::kChunkSize;
      const int64_t count = std::min(kn::kChunkSize, d.numel - start);
      // Relative cost per element: 4 for the statistics, +5 with an update against a full copy
      // (a sample's few elements cost next to nothing: Note [Update sample]), +2 to gather a
      // strided chunk; plus a fixed cost per chunk.
      const bool full_copy = d.snapshot != nullptr && d.sample_stride <= 1;
      const int64_t per = 4 + (full_copy ? 5 : 0) + (d.contiguous ? 0 : 2);
      cost[c + 1] = cost[c] + count * per + 4096;
    }
    int64_t c = 0;
    for (int64_t t = 1; t < num_tasks; ++t) {
      const int64_t target = cost[num_chunks] / num_tasks * t;
      while (c < num_chunks && cost[c] < target) ++c;
      task_begin[t] = c;
    }
  }
  const auto run_tasks = [&](int64_t task_lo, int64_t task_hi) {
    const int64_t begin = task_begin[task_lo];
    const int64_t end = task_begin[task_hi];
    std::vector<char> scratch;
    for (int64_t c = begin; c < end; ++c) {
      const kn::TensorDesc& d = w.descs[owner[c]];
      const int64_t start = (c - w.chunk_begin[owner[c]]) * kn::kChunkSize;
      const int64_t count = std::min(kn::kChunkSize, d.numel - start);
      if (!d.contiguous && scratch.empty()) {
        scratch.resize(static_cast<size_t>(kn::kChunkSize * 8));
      }
      kn::cpu_chunk_stats(d, start, count, scratch.data(), &partials[c]);
    }
  };
  if (num_tasks == 1) {
    run_tasks(0, 1);
  } else {
    at::parallel_for(0, num_tasks, 1, run_tasks);
  }
  auto [ints, floats] = host_rows(n, ni, nf);
  int64_t* ip = ints.data_ptr<int64_t>();
  double* fp = floats.data_ptr<double>();
  for (int64_t t = 0; t < n; ++t) {
    kn::StatsRecord r;
    kn::combine_records(partials.data() + w.chunk_begin[t], w.chunk_begin[t + 1] - w.chunk_begin[t],
                        &r);
    if (with_update) {
      kn::pack_record_update(r, ip + t * ni, fp + t * nf, w.descs[t].mode);
    } else {
      kn::pack_record(r, ip + t * ni, fp + t * nf, w.descs[t].mode);
    }
  }
  return {ints, floats};
}

PackedStats packed_meta(const std::vector<at::Tensor>& tensors) {
  // Meta outranks CPU in dispatch, so a [cpu, meta] list lands here: refuse it as the real
  // kernels do rather than return uninitialised rows on tensors[0]'s device.
  check_one_device(tensors, "tensor_stats");
  const int64_t n = static_cast<int64_t>(tensors.size());
  const auto dev = tensors.empty() ? at::Device(at::kMeta) : tensors[0].device();
  return {at::empty({n, kn::kIntFields}, at::TensorOptions().dtype(at::kLong).device(dev)),
          at::empty({n, kn::kFloatFields}, at::TensorOptions().dtype(at::kDouble).device(dev))};
}

#ifndef TRAINSAN_WITH_CUDA
HostCopy start_host_copy(const PackedStats& packed) {
  TORCH_INTERNAL_ASSERT(!packed.ints.is_cuda(), "CUDA results in a build without CUDA");
  return {packed, nullptr};
}
bool host_copy_ready(const HostCopy&) { return true; }
void stop_if_nonfinite(const PackedStats& packed) {
  TORCH_INTERNAL_ASSERT(!packed.ints.is_cuda(), "CUDA results in a build without CUDA");
}
void wait_host_copy(const HostCopy&) {}

PackedStats packed_cuda(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>*,
                        const std::vector<char>*) {
  TORCH_CHECK_VALUE(false, "tensor_stats: tensors[0] is on ", tensors.at(0).device(),
                    " but this TrainSan build has no CUDA support; reinstall it on a machine with "
                    "the CUDA toolkit (nvcc) so that TRAINSAN_WITH_CUDA is on");
}
#endif

}  // namespace host

PackedStats tensor_stats_packed(const std::vector<at::Tensor>& tensors) {
  host::check_tensors(tensors, "tensor_stats_packed");
  host::check_one_device(tensors, "tensor_stats_packed");
  if (!tensors.empty() && tensors[0].is_cuda()) return host::packed_cuda(tensors);
  return host::packed_cpu(tensors);
}

namespace {
// One pass over tensors of one device, every row in `mode` (Note [Lean rows]).
PackedStats packed_in_mode(const std::vector<at::Tensor>& tensors, kn::PassMode mode,
                           const char* what) {
  host::check_tensors(tensors, what);
  host::check_one_device(tensors, what);
  const std::vector<char> modes(tensors.size(), static_cast<char>(mode));
  if (!tensors.empty() && tensors[0].is_cuda()) return host::packed_cuda(tensors, nullptr, &modes);
  return host::packed_cpu(tensors, nullptr, &modes);
}
}  // namespace

PackedStats gradient_stats_packed(const std::vector<at::Tensor>& tensors) {
  return packed_in_mode(tensors, kn::kModeLean, "gradient_stats");
}

PackedStats fingerprint_stats_packed(const std::vector<at::Tensor>& tensors) {
  return packed_in_mode(tensors, kn::kModeHash, "fingerprint_stats");
}

std::vector<TensorStats> unpack_stats(const PackedStats& packed) {
  TORCH_CHECK_VALUE(
      packed.ints.dim() == 2 && packed.ints.size(1) >= kn::kIntFields && packed.floats.dim() == 2 &&
          packed.floats.size(1) >= kn::kFloatFields && packed.ints.size(0) == packed.floats.size(0),
      "unpack_stats: expected ints [N, ", kn::kIntFields, "] and floats [N, ", kn::kFloatFields,
      "], got ", packed.ints.sizes(), " and ", packed.floats.sizes());
  // Host rows as the passes make them are read in place (no dispatcher call on the step path).
  const auto on_host = [](const at::Tensor& t, at::ScalarType st) {
    return t.device().is_cpu() && t.scalar_type() == st && t.is_contiguous()
               ? t
               : t.to(at::kCPU, st).contiguous();
  };
  const at::Tensor ints = on_host(packed.ints, at::kLong);
  const at::Tensor floats = on_host(packed.floats, at::kDouble);
  const int64_t* ip = ints.const_data_ptr<int64_t>();
  const double* fp = floats.const_data_ptr<double>();
  std::vector<TensorStats> out(static_cast<size_t>(ints.size(0)));
  for (size_t t = 0; t < out.size(); ++t) {
    const int64_t* r = ip + t * ints.size(1);
    const double* f = fp + t * floats.size(1);
    TensorStats& s = out[t];
    s.numel = r[kn::kColNumel];
    s.nan = r[kn::kColNan];
    s.posinf = r[kn::kColPosinf];
    s.neginf = r[kn::kColNeginf];
    s.zero = r[kn::kColZero];
    s.subnormal = r[kn::kColSubnormal];
    s.fp16_overflow = r[kn::kColFp16Overflow];
    s.hash = static_cast<uint64_t>(r[kn::kColHash]);
    auto opt = [](double v) { return std::isnan(v) ? std::nullopt : std::optional<double>(v); };
    s.min = opt(f[kn::kColMin]);
    s.max = opt(f[kn::kColMax]);
    s.absmax = opt(f[kn::kColAbsmax]);
    s.sum = f[kn::kColSum];
    s.l2 = f[kn::kColL2];
  }
  return out;
}

std::vector<std::string> packed_field_names() {
  std::vector<std::string> out(kn::kIntColNames, kn::kIntColNames + kn::kIntFields);
  out.insert(out.end(), kn::kFloatColNames, kn::kFloatColNames + kn::kFloatFields);
  return out;
}

size_t packed_int_fields() { return kn::kIntFields; }

PackedStats pack_stats(const std::vector<TensorStats>& stats) {
  const auto n = static_cast<int64_t>(stats.size());
  at::Tensor ints = at::empty({n, kn::kIntFields}, at::kLong);
  at::Tensor floats = at::empty({n, kn::kFloatFields}, at::kDouble);
  int64_t* ip = ints.mutable_data_ptr<int64_t>();
  double* fp = floats.mutable_data_ptr<double>();
  const double nan = std::nan("");
  for (size_t t = 0; t < stats.size(); ++t) {
    const TensorStats& s = stats[t];
    int64_t* r = ip + t * kn::kIntFields;
    double* f = fp + t * kn::kFloatFields;
    r[kn::kColNumel] = s.numel;
    r[kn::kColNan] = s.nan;
    r[kn::kColPosinf] = s.posinf;
    r[kn::kColNeginf] = s.neginf;
    r[kn::kColZero] = s.zero;
    r[kn::kColSubnormal] = s.subnormal;
    r[kn::kColFp16Overflow] = s.fp16_overflow;
    r[kn::kColHash] = static_cast<int64_t>(s.hash);
    f[kn::kColMin] = s.min.value_or(nan);
    f[kn::kColMax] = s.max.value_or(nan);
    f[kn::kColAbsmax] = s.absmax.value_or(nan);
    f[kn::kColSum] = s.sum;
    f[kn::kColL2] = s.l2;
  }
  return {ints, floats};
}

PackedStats tensor_stats_packed_shapes(const std::vector<at::Tensor>& tensors) {
  return host::packed_meta(tensors);
}

std::vector<TensorStats> tensor_stats(const std::vector<at::Tensor>& tensors) {
  host::check_tensors(tensors, "tensor_stats");
  // One pass per device, launched for every device before any result is read.
  std::map<std::pair<int, int>, std::vector<size_t>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto dev = tensors[i].device();
    groups[{static_cast<int>(dev.type()), dev.index()}].push_back(i);
  }
  std::vector<std::pair<std::vector<size_t>, PackedStats>> launched;
  for (auto& [key, idx] : groups) {
    std::vector<at::Tensor> group;
    group.reserve(idx.size());
    for (size_t i : idx) group.push_back(tensors[i]);
    launched.emplace_back(idx, tensor_stats_packed(group));
  }
  std::vector<TensorStats> out(tensors.size());
  for (auto& [idx, packed] : launched) {
    const std::vector<TensorStats> part = unpack_stats(packed);
    for (size_t k = 0; k < idx.size(); ++k) out[idx[k]] = part[k];
  }
  return out;
}

bool cuda_compiled() { return kn::cuda_compiled(); }

std::string TensorStats::to_string() const {
  std::ostringstream os;
  auto opt = [&](const std::optional<double>& v) {
    if (v) {
      os << *v;
    } else {
      os << "None";
    }
  };
  os << "TensorStats(numel=" << numel << ", nan=" << nan << ", posinf=" << posinf
     << ", neginf=" << neginf << ", zero=" << zero << ", subnormal=" << subnormal
     << ", fp16_overflow=" << fp16_overflow << ", min=";
  opt(min);
  os << ", max=";
  opt(max);
  os << ", absmax=";
  opt(absmax);
  os << ", sum=" << sum << ", l2=" << l2 << ", hash=0x" << std::hex << hash << ")";
  return os.str();
}

namespace {

// One pass over a contiguous CPU tensor: per chunk its own counts, summed at the end.
template <typename scalar_t, typename cmp_t>
void range_histogram_cpu(const at::Tensor& t, const std::vector<cmp_t>& b, int64_t* out) {
  const scalar_t* x = t.const_data_ptr<scalar_t>();
  const int64_t n = t.numel();
  const size_t k = b.size();
  const size_t width = k + 3;
  const int64_t grain = 1 << 16;
  const int64_t chunks = std::max<int64_t>(1, (n + grain - 1) / grain);
  std::vector<int64_t> parts(static_cast<size_t>(chunks) * width, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cnt = parts.data() + static_cast<size_t>(c) * width;
      const int64_t e1 = std::min(n, (c + 1) * grain);
      for (int64_t e = c * grain; e < e1; ++e) {
        const cmp_t a = std::abs(static_cast<cmp_t>(x[e]));
        if (!std::isfinite(a)) {
          cnt[0] += 1;
          continue;
        }
        if (a == cmp_t(0)) {
          cnt[1] += 1;
          continue;
        }
        size_t bin = 0;  // the bounds below a: a in (b_{bin-1}, b_bin]
        for (size_t j = 0; j < k; ++j) bin += b[j] < a ? 1 : 0;
        cnt[2 + bin] += 1;
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) {
    for (size_t j = 0; j < width; ++j) out[j] += parts[static_cast<size_t>(c) * width + j];
  }
}

}  // namespace

at::Tensor range_histogram(const at::Tensor& t, const std::vector<double>& bounds) {
  TORCH_CHECK_TYPE(t.defined() && at::isFloatingType(t.scalar_type()) && t.layout() == at::kStrided,
                   "range_histogram: expected a dense floating-point tensor, got ",
                   t.defined() ? t.toString() : std::string("an undefined tensor"));
  TORCH_CHECK_VALUE(std::is_sorted(bounds.begin(), bounds.end()) && !bounds.empty(),
                    "range_histogram: bounds must be a non-empty ascending list");
  const auto k = static_cast<int64_t>(bounds.size());
  if (t.device().is_cpu()) {
    at::Tensor out = at::zeros({k + 3}, at::kLong);
    const at::Tensor c = t.detach().contiguous();
    int64_t* o = out.data_ptr<int64_t>();
    if (c.scalar_type() == at::kDouble) {
      range_histogram_cpu<double, double>(c, bounds, o);
    } else {
      const std::vector<float> bf(bounds.begin(), bounds.end());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "range_histogram",
                                      [&] { range_histogram_cpu<scalar_t, float>(c, bf, o); });
    }
    return out;
  }
  const auto cmp = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor a = t.detach().abs().to(cmp).reshape(-1);
  const at::Tensor finite = at::isfinite(a);
  const at::Tensor masked = at::where(finite, a, at::zeros({}, a.options()));
  const at::Tensor b = at::tensor(bounds, at::TensorOptions().dtype(at::kDouble)).to(a.options());
  // bucketize: bucket i holds b_{i-1} < a <= b_i; bucket 0 also the zeros and the masked.
  at::Tensor buckets = at::bincount(at::bucketize(masked, b), {}, k + 1);
  const at::Tensor nonfinite = at::logical_not(finite).sum().reshape({1});
  const at::Tensor zero = at::logical_and(finite, a == 0).sum().reshape({1});
  buckets = buckets.to(at::kLong);
  buckets.index_put_({0}, buckets[0] - zero[0] - nonfinite[0]);
  return at::cat({nonfinite, zero, buckets});
}

}  // namespace trainsan
