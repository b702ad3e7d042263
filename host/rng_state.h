// The default random generators' states, saved and put back: what the re-runs
// (feeds/rerun_feed.cpp) and the custom-Function gradcheck (custom_grad.cpp) evaluate under, so
// that the training's own random stream is left as they found it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace trainsan::host {

class RngState {
 public:
  /// The CPU generator's state and those of the CUDA devices `cuda` (their default generators).
  static RngState capture(const std::vector<c10::DeviceIndex>& cuda);
  /// Seeds the same generators as torch.manual_seed does (CPU, and `cuda`'s).
  static void seed(uint64_t seed, const std::vector<c10::DeviceIndex>& cuda);
  void restore() const;
  /// A 64-bit fingerprint (FNV-1a of the bytes) of each state: the CPU generator's, then the
  /// CUDA devices' in capture order (the recompute checks compare them).
  std::vector<uint64_t> fingerprints() const;

 private:
  at::Tensor cpu_;
  std::vector<std::pair<c10::DeviceIndex, at::Tensor>> cuda_;
};

/// The CUDA devices of `tensors` (undefined ones skipped), ascending and each once.
std::vector<c10::DeviceIndex> cuda_devices(const std::vector<at::Tensor>& tensors);

}  // namespace trainsan::host
