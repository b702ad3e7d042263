// nondeterminism for LibTorch loops: Sanitizer::rerun re-runs the caller's step twice from the
// state the step started from, fingerprints what each run produced and compares the fingerprints
// (compare_reruns, host/checks/determinism.cpp; Note [Re-run determinism] there). Whatever a
// re-run touches — the gradients, the RNG state, the buffers — is put back as it was found.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <chrono>

#include "sanitizer_impl.h"

namespace trainsan {
namespace host {

namespace {

bool fingerprinted(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && at::isFloatingType(t.scalar_type()) &&
         (t.device().is_cpu() || t.device().is_cuda());
}

std::vector<at::Tensor> param_tensors(const std::vector<TrackedParam>& params) {
  std::vector<at::Tensor> out;
  for (const TrackedParam& p : params) out.push_back(p.param);
  return out;
}

// One pass and one read for every tensor of a run: outputs in order, then the gradients of
// `params` (when given) in backward order.
RerunFingerprints fingerprint(const RerunRecord& r, const std::vector<TrackedParam>* params) {
  std::vector<at::Tensor> all;
  std::vector<size_t> per_output;
  for (const RerunRecord::Output& o : r.outputs) {
    size_t n = 0;
    for (const at::Tensor& t : o.tensors) {
      if (fingerprinted(t) && t.numel() > 0) {  // as the Python package's module outputs
        all.push_back(t.detach());
        n += 1;
      }
    }
    per_output.push_back(n);
  }
  std::vector<size_t> grad_of;
  if (params != nullptr) {
    for (size_t i = params->size(); i-- > 0;) {  // backward order: the output's side first
      const at::Tensor& g = (*params)[i].param.grad();
      if (fingerprinted(g)) {
        all.push_back(g.detach());
        grad_of.push_back(i);
      }
    }
  }
  const std::vector<TensorStats> stats =
      all.empty() ? std::vector<TensorStats>{} : tensor_stats(all);
  RerunFingerprints out;
  size_t k = 0;
  for (size_t j = 0; j < r.outputs.size(); ++j) {
    RerunFingerprints::Output o{r.outputs[j].name, r.outputs[j].type, {}};
    for (size_t n = 0; n < per_output[j]; ++n) o.hashes.push_back(stats[k++].hash);
    out.outputs.push_back(std::move(o));
  }
  for (const size_t i : grad_of) out.grads.emplace_back((*params)[i].name, stats[k++].hash);
  return out;
}

void copy_into(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < dst.size() && i < src.size(); ++i) dst[i].copy_(src[i]);
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ts) {
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(t.detach().clone());
  return out;
}

// What a re-run touches, as rerun() found it, put back on every way out (an exception of the
// caller's step function included); the gradient hooks and the op audit look away meanwhile.
class RerunScope {
 public:
  RerunScope(SanitizerImpl& impl, std::vector<c10::DeviceIndex> devices)
      : impl_(impl), rng_(RngState::capture(devices)), buffers_(copies(impl.setup.buffers)) {
    for (const TrackedParam& p : impl.params) grads_.push_back(p.param.grad());
    impl.grads.set_paused(true);
    Sanitizer::pause_audit(true);
  }
  ~RerunScope() {
    try {
      for (size_t i = 0; i < grads_.size(); ++i) impl_.params[i].param.mutable_grad() = grads_[i];
      copy_into(impl_.setup.buffers, buffers_);
      rng_.restore();
    } catch (...) {  // a destructor: nothing else to do with it
    }
    Sanitizer::pause_audit(false);
    impl_.grads.set_paused(false);
  }
  RerunScope(const RerunScope&) = delete;
  RerunScope& operator=(const RerunScope&) = delete;

  // Before each run: the state the step started from, no gradients.
  void start(const SanitizerImpl::RerunStart* from) {
    (from != nullptr ? from->rng : rng_).restore();
    copy_into(impl_.setup.buffers, from != nullptr ? from->buffers : buffers_);
    for (const TrackedParam& p : impl_.params) p.param.mutable_grad().reset();
  }

 private:
  SanitizerImpl& impl_;
  RngState rng_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> grads_;
};

}  // namespace

void SanitizerImpl::capture_rerun_start() {
  rerun_start = RerunStart{step, RngState::capture(cuda_devices(param_tensors(params))),
                           copies(setup.buffers)};
}

}  // namespace host

void Sanitizer::rerun(const std::function<RerunRecord()>& step_fn, const RerunRecord& step) {
  TORCH_CHECK_VALUE(static_cast<bool>(step_fn), "Sanitizer::rerun: step_fn is empty");
  if (!rerun_due()) return;
  host::SanitizerImpl& im = *impl_;
  TORCH_CHECK_VALUE(!im.grads.in_step(),
                    "Sanitizer::rerun: called inside an optimizer step; call it after the step's "
                    "backward and before optimizer.step()");
  const auto t0 = std::chrono::steady_clock::now();
  const host::SanitizerImpl::RerunStart* from =
      im.rerun_start && im.rerun_start->step == im.step ? &*im.rerun_start : nullptr;
  RerunFingerprints first, second;
  {
    host::RerunScope scope(im, host::cuda_devices(host::param_tensors(im.params)));
    scope.start(from);
    first = host::fingerprint(step_fn(), &im.params);
    scope.start(from);
    second = host::fingerprint(step_fn(), &im.params);
  }
  // The step's own forward is comparable only when the re-runs started where it started.
  const RerunFingerprints own =
      from != nullptr ? host::fingerprint(step, nullptr) : RerunFingerprints{};
  im.rerun_start.reset();
  const std::optional<RerunFacts> facts = compare_reruns(own, first, second);
  im.add_overhead(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  if (facts) {
    rerun_result(*facts);
  } else {
    report();
  }
}

std::vector<uint64_t> output_fingerprints(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> all;
  for (const at::Tensor& t : outputs) {
    if (host::fingerprinted(t) && t.numel() > 0) all.push_back(t.detach());
  }
  std::vector<uint64_t> out;
  if (all.empty()) return out;
  for (const TensorStats& s : tensor_stats(all)) out.push_back(s.hash);
  return out;
}

std::vector<uint64_t> rng_fingerprints(const std::vector<at::Tensor>& on) {
  return host::RngState::capture(host::cuda_devices(on)).fingerprints();
}

}  // namespace trainsan
