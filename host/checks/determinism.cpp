// nondeterminism: the same step, re-run on the same batch with the same RNG state, gave other bits.
#include <algorithm>

#include "checks/check.h"

namespace trainsan::host {

// Note [Re-run determinism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Opt-in (rerun_every=N): on every N-th step whose gradients come from one training forward and
// one backward (no accumulation, no closure, no distributed wrapper: a re-run there would issue
// collectives), the caller — before the optimizer step — restores the RNG state and the buffers
// the step's forward started from, re-runs the model's forward on the same inputs and the
// backward from the same output gradient twice (torch.autograd.grad: .grad is not touched), and
// compares fingerprints: every module's output in forward order, then every parameter's gradient
// in backward order. Two re-runs that differ are nondeterminism in the computation itself (a
// non-deterministic kernel: atomics in scatter/index_add/embedding backward, cuDNN autotuning,
// an unseeded generator); re-runs that agree with each other but not with the step's own forward
// are state that changes between calls (a counter, a cache, a generator of the module's own).
// The buffers and the RNG are put back as the step left them: the re-runs change nothing the
// training sees. The comparison itself (compare_reruns, below) is torch-free: it reads the
// fingerprints both callers gather — Sanitizer::rerun (host/rerun.cpp) and the Python package's
// forward hooks (bindings/trainsan/determinism.py).

void DeterminismCheck::on_rerun(const RerunFacts& f, int64_t step) {
  using W = RerunFacts::Where;
  const std::string where =
      "(the " + std::to_string(f.position) + "-th of " + std::to_string(f.checked) + " compared)";
  std::string msg;
  switch (f.where) {
    case W::kForward:
      msg = "re-running step " + std::to_string(step) +
            "'s forward twice on the same batch with the same RNG state gave different bits, "
            "first at the output of " +
            f.tensor + (f.type.empty() ? "" : " (" + f.type + ")") + " " + where +
            " — a non-deterministic kernel, an unseeded generator, or state the module changes "
            "at every call (a counter) in that module: torch.use_deterministic_algorithms(True) "
            "raises at such kernels (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA, "
            "torch.backends.cudnn.benchmark=False)";
      break;
    case W::kBackward:
      msg = "re-running step " + std::to_string(step) +
            "'s backward twice from the same output gradient gave different gradients, first "
            "for " +
            f.tensor + " " + where +
            " in backward order, while the forwards agreed — a non-deterministic backward "
            "kernel (atomic adds: index_add/scatter_add/embedding/interpolation backward on "
            "CUDA): torch.use_deterministic_algorithms(True) names it";
      break;
    case W::kBetweenCalls:
      msg = "re-running step " + std::to_string(step) +
            "'s forward on the same batch with the same RNG state and buffers gives bits that "
            "agree with each other but not with the step's own forward, first at the output "
            "of " +
            f.tensor + (f.type.empty() ? "" : " (" + f.type + ")") + " " + where +
            " — state that changes between calls (a counter, a cache, the module's own "
            "generator or attributes updated in forward())";
      break;
  }
  sink_.add(Kind::nondeterminism, f.tensor, msg, std::nullopt, step);
}

}  // namespace trainsan::host

namespace trainsan {

std::optional<RerunFacts> compare_reruns(const RerunFingerprints& step,
                                         const RerunFingerprints& first,
                                         const RerunFingerprints& second) {
  using W = RerunFacts::Where;
  const auto& a = first.outputs;
  const auto& b = second.outputs;
  auto at_output = [&](W where, size_t i) {
    RerunFacts f;
    f.where = where;
    f.tensor = a[i].name.empty() ? "(model)" : a[i].name;
    f.type = a[i].type;
    f.position = static_cast<int64_t>(i) + 1;
    f.checked = static_cast<int64_t>(a.size());
    return f;
  };
  // Outputs are compared only where the runs recorded as many: a module called a different
  // number of times is a different computation, not a difference of bits at one place.
  if (a.size() == b.size()) {
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].hashes != b[i].hashes) return at_output(W::kForward, i);
    }
  }
  for (size_t i = 0; i < first.grads.size(); ++i) {
    const auto& [name, hash] = first.grads[i];
    const auto it = std::find_if(second.grads.begin(), second.grads.end(),
                                 [&](const auto& g) { return g.first == name; });
    if (it == second.grads.end() || it->second != hash) {
      RerunFacts f;
      f.where = W::kBackward;
      f.tensor = name;
      f.position = static_cast<int64_t>(i) + 1;
      f.checked = static_cast<int64_t>(first.grads.size());
      return f;
    }
  }
  const auto& s = step.outputs;
  if (s.size() == a.size()) {
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i].name == a[i].name && s[i].hashes != a[i].hashes) {
        RerunFacts f = at_output(W::kBetweenCalls, i);
        f.type = s[i].type;
        return f;
      }
    }
  }
  return std::nullopt;
}

}  // namespace trainsan
