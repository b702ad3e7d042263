// The default generators' states (rng_state.h). A CUDA generator's state is its seed and offset,
// held on the host: reading or setting it launches nothing and needs no CUDA headers here.
#include "rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <algorithm>
#include <mutex>

namespace trainsan::host {

namespace {

at::Generator generator(c10::DeviceIndex cuda) {
  return cuda < 0 ? at::detail::getDefaultCPUGenerator()
                  : at::globalContext().defaultGenerator(at::Device(at::kCUDA, cuda));
}

}  // namespace

RngState RngState::capture(const std::vector<c10::DeviceIndex>& cuda) {
  RngState s;
  {
    at::Generator g = generator(-1);
    const std::lock_guard<std::mutex> lock(g.mutex());  // Note [Acquire lock when using random
    s.cpu_ = g.get_state();                             // generators] in ATen
  }
  for (const c10::DeviceIndex d : cuda) {
    at::Generator g = generator(d);
    const std::lock_guard<std::mutex> lock(g.mutex());
    s.cuda_.emplace_back(d, g.get_state());
  }
  return s;
}

void RngState::seed(uint64_t seed, const std::vector<c10::DeviceIndex>& cuda) {
  std::vector<c10::DeviceIndex> all = cuda;
  all.insert(all.begin(), -1);
  for (const c10::DeviceIndex d : all) {
    at::Generator g = generator(d);
    const std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  }
}

void RngState::restore() const {
  if (cpu_.defined()) {
    at::Generator g = generator(-1);
    const std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(cpu_);
  }
  for (const auto& [d, state] : cuda_) {
    at::Generator g = generator(d);
    const std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }
}

std::vector<uint64_t> RngState::fingerprints() const {
  auto fnv = [](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
  };
  std::vector<uint64_t> out;
  if (cpu_.defined()) out.push_back(fnv(cpu_));
  for (const auto& [d, state] : cuda_) out.push_back(fnv(state));
  return out;
}

std::vector<c10::DeviceIndex> cuda_devices(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::DeviceIndex> out;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda()) out.push_back(std::max<c10::DeviceIndex>(t.get_device(), 0));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace trainsan::host
