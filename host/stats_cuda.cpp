// CUDA path of the statistics pass: descriptors and chunk table go to the device in one
// asynchronous copy from pinned memory, then the one kernel of kernels/stats.cu runs on the
// current stream. Nothing here synchronises with the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "stats.h"
#include "stats_internal.h"

namespace trainsan::host {

namespace kn = kernels;

namespace {

// The ticket counters of the single-launch pass (Note [Last block] in kernels/stats.cu): at least
// `n` int32 zeros in device memory, for a launch on `stream`. Outside graph capture, one buffer
// per (device, stream), kept for the life of the process: the kernel leaves every counter at 0,
// so the next launch on the same stream (which runs after this one) finds them zero; a larger
// pass reallocates it and zeroes it with cudaMemsetAsync on the stream (no kernel launch). While
// the stream is being captured into a CUDA graph the counters are a fresh buffer of the pass
// instead, zeroed by a memset node of the graph: each replay starts from zeros whatever stream
// it runs on, and no persistent buffer is allocated from the graph's private pool.
at::Tensor ticket_counters(int64_t n, const c10::cuda::CUDAStream& stream) {
  const auto zeroed = [&](int64_t size) {
    at::Tensor t = at::empty({size}, at::TensorOptions().device(stream.device()).dtype(at::kInt));
    C10_CUDA_CHECK(cudaMemsetAsync(t.mutable_data_ptr<int32_t>(), 0,
                                   static_cast<size_t>(size) * sizeof(int32_t), stream.stream()));
    return t;
  };
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  if (capture != cudaStreamCaptureStatusNone) return zeroed(n);
  static std::mutex mutex;
  // Never destroyed: the buffers must not be freed after the CUDA runtime has shut down.
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  at::Tensor& buf = (*buffers)[{stream.device_index(), stream.stream()}];
  if (!buf.defined() || buf.numel() < n) {
    buf = zeroed(std::max<int64_t>(n, 1024));
  }
  return buf;  // a reference: stays alive for this pass even if another one regrows the buffer
}

}  // namespace

PackedStats packed_cuda(const std::vector<at::Tensor>& tensors,
                        const std::vector<at::Tensor>* snapshots, const std::vector<char>* modes) {
  const at::Device device = tensors.at(0).device();
  const c10::cuda::CUDAGuard guard(device);
  const Described w = describe(tensors, snapshots, modes);
  const bool with_update = snapshots != nullptr;
  const int64_t n = static_cast<int64_t>(tensors.size());
  const int64_t num_chunks = w.chunk_begin[n];

  // One host buffer [descs | chunk_begin], pinned so the copy is truly asynchronous; the caching
  // host allocator keeps it alive until the copy has run.
  const int64_t desc_bytes = n * static_cast<int64_t>(sizeof(kn::TensorDesc));
  const int64_t table_bytes = (n + 1) * static_cast<int64_t>(sizeof(int64_t));
  at::Tensor host_buf = at::empty({desc_bytes + table_bytes},
                                  at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* hp = host_buf.mutable_data_ptr<uint8_t>();
  std::memcpy(hp, w.descs.data(), static_cast<size_t>(desc_bytes));
  std::memcpy(hp + desc_bytes, w.chunk_begin.data(), static_cast<size_t>(table_bytes));
  at::Tensor dev_buf = host_buf.to(device, /*non_blocking=*/true);

  const auto opts = at::TensorOptions().device(device);
  at::Tensor partials =
      at::empty({std::max<int64_t>(num_chunks, 1) * static_cast<int64_t>(sizeof(kn::StatsRecord))},
                opts.dtype(at::kByte));
  at::Tensor ints =
      at::empty({n, with_update ? kn::kIntFieldsUpdate : kn::kIntFields}, opts.dtype(at::kLong));
  at::Tensor floats = at::empty({n, with_update ? kn::kFloatFieldsUpdate : kn::kFloatFields},
                                opts.dtype(at::kDouble));

  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  at::Tensor tickets = ticket_counters(n, stream);

  auto* dp = dev_buf.mutable_data_ptr<uint8_t>();
  kn::cuda_tensor_stats(reinterpret_cast<const kn::TensorDesc*>(dp), n,
                        reinterpret_cast<const int64_t*>(dp + desc_bytes), num_chunks,
                        reinterpret_cast<kn::StatsRecord*>(partials.mutable_data_ptr<uint8_t>()),
                        tickets.mutable_data_ptr<int32_t>(), ints.mutable_data_ptr<int64_t>(),
                        floats.mutable_data_ptr<double>(), with_update, stream.stream());
  // Keep the inputs' memory from being reused by the caching allocator on another stream before
  // the kernel has read it.
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 0) t.record_stream(stream);
  }
  for (const at::Tensor& t : w.keep_alive) t.record_stream(stream);
  return {ints, floats};
}

void stop_if_nonfinite(const PackedStats& packed) {
  if (!packed.ints.is_cuda()) return;
  const at::Tensor& ints = packed.ints;
  TORCH_CHECK_VALUE(ints.dim() == 2 && ints.size(1) > kn::kColNeginf &&
                        ints.scalar_type() == at::kLong && ints.stride(1) == 1,
                    "stop_if_nonfinite: expected packed int rows [N, ", kn::kIntFields,
                    " or more] of int64 with contiguous rows, got ", ints.sizes(), " ",
                    ints.scalar_type(), " with strides ", ints.strides());
  const c10::cuda::CUDAGuard guard(ints.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(ints.device().index());
  kn::cuda_stop_if_nonfinite(ints.const_data_ptr<int64_t>(), ints.size(0), ints.stride(0),
                             stream.stream());
  // The kernel reads `ints` on this stream, which may not be the one it was made on.
  ints.record_stream(stream);
}

HostCopy start_host_copy(const PackedStats& packed) {
  if (!packed.ints.is_cuda()) return {packed, nullptr};
  const c10::cuda::CUDAGuard guard(packed.ints.device());
  const auto pinned = at::TensorOptions().pinned_memory(true);
  PackedStats host{at::empty(packed.ints.sizes(), pinned.dtype(at::kLong)),
                   at::empty(packed.floats.sizes(), pinned.dtype(at::kDouble))};
  host.ints.copy_(packed.ints, /*non_blocking=*/true);
  host.floats.copy_(packed.floats, /*non_blocking=*/true);
  cudaEvent_t ev = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream().stream()));
  std::shared_ptr<void> event(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
  return {host, event};
}

bool host_copy_ready(const HostCopy& copy) {
  if (!copy.event) return true;
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(copy.event.get()));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

void wait_host_copy(const HostCopy& copy) {
  if (copy.event) C10_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(copy.event.get())));
}

}  // namespace trainsan::host
