// Facts of a re-run (nondeterminism): a step's forward and backward re-run twice on the same batch
// with the same RNG state and buffers (Sanitizer::rerun, or bindings/trainsan/determinism.py),
// fingerprinted, and compared by compare_reruns(); host/checks/determinism.cpp words where the
// bits first differed. Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/facts_table.h"

namespace trainsan {

/// Where re-runs of a step first differed (fields: rerun_facts.def).
struct RerunFacts {
  enum class Where : uint8_t {
    kForward = 0,       ///< two re-runs' forwards differ: first at module `tensor`'s output
    kBackward = 1,      ///< the forwards agree, two re-runs' gradients differ: first `tensor`
    kBetweenCalls = 2,  ///< the re-runs agree with each other, not with the step's own forward
    /// A checkpointed region's recompute in the backward differs from its forward, first at
    /// output `position`; the RNG state at the recompute's start was not the forward's.
    kRecomputeRng = 3,
    /// The same, from the same RNG state: kernels or state that changed between the two calls.
    kRecomputeState = 4,
  };
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/rerun_facts.def"
#undef TRAINSAN_FACT
};

template <>
struct FactEnum<RerunFacts::Where> {
  static constexpr int64_t kMax = 4;
};

template <>
struct FactTable<RerunFacts> {
  static constexpr const char* kName = "RerunFacts";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/rerun_facts.def"
#undef TRAINSAN_FACT
  }
};

/// What one re-run of a step found, for re-run attribution (fields: rerun_outcome.def).
struct RerunOutcome {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/rerun_outcome.def"
#undef TRAINSAN_FACT
};

template <>
struct FactTable<RerunOutcome> {
  static constexpr const char* kName = "RerunOutcome";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/rerun_outcome.def"
#undef TRAINSAN_FACT
  }
};

/// Re-run attribution's answer on a finding of `kind` (Note [Re-run attribution],
/// host/checks/attribution.cpp): `reproduces` (empty: the re-run could not tell) and the words
/// appended to the finding's message.
struct RerunVerdict {
  std::optional<bool> reproduces;
  std::string text;
};

/// The kinds re-run attribution applies to: nonfinite_loss, nonfinite_grad, loss_spike.
bool rerun_attributable(const std::string& kind);

/// Judges a re-run of the step of a `kind` finding (rerun_attributable(kind)).
RerunVerdict judge_rerun(const std::string& kind, const RerunOutcome& outcome);

/// The fingerprints of one run of a step (TensorStats::hash of each tensor).
struct RerunFingerprints {
  /// One module's output (or another named value the caller records, e.g. the loss).
  struct Output {
    std::string name;              ///< the module's name; "" is the model itself
    std::string type;              ///< its class, e.g. "Linear"; may be empty
    std::vector<uint64_t> hashes;  ///< of its floating outputs, in order
  };
  std::vector<Output> outputs;  ///< in execution order
  /// (parameter name, fingerprint of its gradient), in backward order (the output's side first);
  /// parameters without a gradient are left out. Empty for the step's own forward.
  std::vector<std::pair<std::string, uint64_t>> grads;
};

/// Where two re-runs of a step (`first`, `second`) and the step's own forward (`step`: outputs
/// only; empty when not recorded) first differ, or nothing when they agree (Note [Re-run
/// determinism], host/checks/determinism.cpp), checked in this order:
///   * kForward: the re-runs recorded as many outputs and some output's fingerprints differ;
///   * kBackward: a gradient of `first` is missing from `second` or has other bits;
///   * kBetweenCalls: `step` recorded as many outputs as `first`, and an output of the same name
///     has other fingerprints.
/// Outputs are named by their name, or "(model)" for the model itself ("").
std::optional<RerunFacts> compare_reruns(const RerunFingerprints& step,
                                         const RerunFingerprints& first,
                                         const RerunFingerprints& second);

/// One call of an activation-checkpointed region (Note [Recompute checks],
/// host/checks/determinism.cpp): its forward, or its recompute in the backward.
struct RecomputeRecord {
  std::string region;            ///< where it is: a module's name, or the function's
  std::string type;              ///< the module's class or the function's qualified name
  std::vector<uint64_t> hashes;  ///< fingerprints of its floating outputs, in order
  /// Fingerprints of the RNG states at the call's start (the CPU generator, then the CUDA
  /// devices'); empty when not recorded.
  std::vector<uint64_t> rng;
};

/// Where a checkpointed region's recompute (`recompute`) first differs from its forward
/// (`forward`): kRecomputeRng when the RNG states at their starts differ, else kRecomputeState
/// (also when neither recorded them); `tensor` is the region, `type` its type, `position` the
/// 1-based output, `checked` the outputs compared. Nothing when they agree, or when they recorded
/// different numbers of outputs (another computation, not a difference of bits at one place).
std::optional<RerunFacts> compare_recompute(const RecomputeRecord& forward,
                                            const RecomputeRecord& recompute);

}  // namespace trainsan
