// nondeterminism: the same step, re-run on the same batch with the same RNG state, gave other bits;
// or an activation-checkpointed region, recomputed in the backward, gave other bits than its
// forward.
#include "checks/determinism.h"

#include <algorithm>

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
// fingerprints both callers gather — Sanitizer::rerun (host/feeds/rerun_feed.cpp) and the Python
// package's forward hooks (bindings/trainsan/determinism.py).

// Note [Recompute checks]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Activation checkpointing (torch.utils.checkpoint) runs a region's function twice: in the
// forward, keeping only its inputs, and again in the backward, whose gradients are those of the
// recompute. The two calls must compute the same thing: checkpoint() restores the RNG state the
// forward started from (preserve_rng_state=True, the default), so a dropout in the region draws
// the same mask. With preserve_rng_state=False, or a random draw the checkpoint does not restore,
// the backward differentiates another mask than the forward applied: the gradients are those of
// another function, silently (the re-runs of Note [Re-run determinism] replay the same wrong
// masks and agree). On the steps recompute_every samples (the first step the sanitizer is asked
// about, then every N-th: DeterminismCheck::recompute_due), the Python package wraps each region's
// function (bindings/trainsan/recompute.py) so that its first call (the forward) and its second
// (the recompute) fingerprint their floating outputs and the RNG states (CPU, initialised CUDA
// devices) at their starts; compare_recompute (below) decides: other outputs from other RNG
// states is the RNG not preserved; other outputs from the same RNG state is a non-deterministic
// kernel or state the region reads that changed between the two calls. Outputs that agree are
// silent whatever the RNG did (a region without random ops need not preserve it). A region
// called without grad (eval, no_grad), or whose outputs need no gradient, is never recomputed:
// nothing to compare. LibTorch has no torch.utils.checkpoint; a program with its own
// recomputation records both calls (RecomputeRecord) and calls Sanitizer::recompute.

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
    case W::kRecomputeRng:
    case W::kRecomputeState:
      msg = "the activation-checkpointed region " + f.tensor +
            (f.type.empty() || f.type == f.tensor ? "" : " (" + f.type + ")") +
            ", recomputed in step " + std::to_string(step) +
            "'s backward, gave other bits than its forward, first at its output " +
            std::to_string(f.position) + " of " + std::to_string(f.checked) + " — ";
      if (f.where == W::kRecomputeRng) {
        msg +=
            "and the RNG state at the recompute's start was not the forward's: the RNG is not "
            "preserved around the region (checkpoint(..., preserve_rng_state=False), or random "
            "numbers drawn from a generator the checkpoint does not restore), so the backward "
            "differentiates another dropout mask than the forward applied: drop "
            "preserve_rng_state=False (the default restores the CPU and CUDA RNG states)";
      } else {
        msg +=
            "from the same RNG state: a non-deterministic kernel in the region, or state it "
            "reads that changed between the forward and the backward (a buffer or attribute "
            "updated in place, a counter, a cache), so the backward differentiates another "
            "computation than the forward's: keep what a checkpointed region reads unchanged "
            "until its backward; torch.use_deterministic_algorithms(True) names such kernels";
      }
      break;
  }
  sink_.add(Kind::nondeterminism, f.tensor, msg, std::nullopt, step);
}

bool DeterminismCheck::recompute_due(int64_t step) const {
  if (opts_.recompute_every <= 0) return false;
  if (!first_recompute_) first_recompute_ = step;
  return step == *first_recompute_ || step % opts_.recompute_every == 0;
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

std::optional<RerunFacts> compare_recompute(const RecomputeRecord& forward,
                                            const RecomputeRecord& recompute) {
  const auto& a = forward.hashes;
  const auto& b = recompute.hashes;
  if (a.size() != b.size()) return std::nullopt;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    RerunFacts f;
    f.where = forward.rng == recompute.rng ? RerunFacts::Where::kRecomputeState
                                           : RerunFacts::Where::kRecomputeRng;
    f.tensor = forward.region.empty() ? "(region)" : forward.region;
    f.type = forward.type;
    f.position = static_cast<int64_t>(i) + 1;
    f.checked = static_cast<int64_t>(a.size());
    return f;
  }
  return std::nullopt;
}

}  // namespace trainsan
