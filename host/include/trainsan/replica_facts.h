// Facts of the replica comparison (rank_desync), gathered by the collectives of
// trainsan::ReplicaEngine (replica_engine.h; driven by the Python package's
// bindings/trainsan/replicas.py or by trainsan::compare_replicas) and judged and worded by the
// sanitizer (host/checks/replicas.cpp). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/facts_table.h"

namespace trainsan {

/// Fingerprints of one step pass (Sanitizer::take_fingerprints): what this process holds after
/// the step, to compare with its replicas. `param[k]`/`grad[k]` are the 64-bit fingerprints
/// (TensorStats::hash, bits as int64) of parameter `index[k]` (its local shard for a distributed
/// parameter) and of its gradient as the step left it; `has_grad[k]` is false when there was no
/// gradient to read (then grad[k] is 0).
struct StepFingerprints {
  int64_t step = 0;
  int64_t opt = -1;  ///< the stepping optimizer; -1 in manual mode
  std::vector<int64_t> index;
  std::vector<int64_t> param;
  std::vector<int64_t> grad;
  std::vector<bool> has_grad;
};

/// A tensor that differs across the replicas of one comparison (fields: replica_mismatch.def).
struct ReplicaMismatch {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/replica_mismatch.def"
#undef TRAINSAN_FACT
};

/// One comparison across a replica group, or its failure (fields: replica_report.def).
struct ReplicaReport {
  enum class Moment : uint8_t {
    kBeforeFirstStep = 0,  ///< the weights replicas start training from
    kAfterStep = 1,        ///< after a step (or an AMP-skipped step) of optimizer `opt`
    kMissing = 2,          ///< some ranks did not arrive at the comparison in time
  };
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/replica_report.def"
#undef TRAINSAN_FACT
};

template <>
struct FactEnum<ReplicaReport::Moment> {
  static constexpr int64_t kMax = 2;
};

template <>
struct FactTable<ReplicaMismatch> {
  static constexpr const char* kName = "ReplicaMismatch";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/replica_mismatch.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<ReplicaReport> {
  static constexpr const char* kName = "ReplicaReport";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/replica_report.def"
#undef TRAINSAN_FACT
  }
};

/// The row one rank contributes to a comparison (Note [Replica payload], host/checks/replicas.cpp):
/// int64 fields, a header, then a slot per member parameter, then a slot per buffer.
struct ReplicaRow {
  static constexpr int64_t kDigest = 0;    ///< of the members' names, shapes and placements
  static constexpr int64_t kOpt = 1;       ///< the optimizer whose step is compared
  static constexpr int64_t kCount = 2;     ///< step events (steps and skips) of it so far
  static constexpr int64_t kStep = 3;      ///< its step count
  static constexpr int64_t kSkipped = 4;   ///< 1: the GradScaler skipped this step
  static constexpr int64_t kForwards = 5;  ///< training forwards so far
  static constexpr int64_t kHeader = 6;
  /// Per member: (present, fingerprint) of its weight, of its gradient, of its optimizer state.
  static constexpr int64_t kSlot = 6;
  static constexpr int64_t kBufferSlot = 2;  ///< per buffer: (present, fingerprint)
};

/// What one rank knows of one comparison, laid out as its row by replica_row().
struct ReplicaRowFacts {
  int64_t digest = 0;  ///< of the members' names, shapes and placements (equal on every replica)
  int64_t opt = -1;    ///< the optimizer whose step is compared; -1: manual mode, or before it
  int64_t count = 0;   ///< step events (steps and skips) of it before this one
  int64_t step = 0;    ///< its step count before this event
  bool skipped = false;
  int64_t forwards = 0;  ///< training forwards so far
  /// The step pass's fingerprints (an empty index: the event has none, e.g. not due).
  StepFingerprints fingerprints;
  /// Compare the gradients of these parameter indices (where the pass hashed them).
  std::vector<int64_t> grads;
  /// Per parameter index, one fingerprint of its optimizer state (sampled steps).
  std::vector<std::pair<int64_t, int64_t>> state;
  /// Per buffer of the set, its fingerprint; empty: buffers not compared at this event.
  std::vector<int64_t> buffers;
};

/// The row (ReplicaRow; Note [Replica payload]) of a set whose slots are parameters `members`
/// (indices, as StepFingerprints::index) and `n_buffers` buffers. Throws std::invalid_argument
/// when `facts.buffers` is neither empty nor `n_buffers` long.
std::vector<int64_t> replica_row(const ReplicaRowFacts& facts, const std::vector<int64_t>& members,
                                 size_t n_buffers);

/// What one comparison's all-reduced rows say (judge_replica_payload).
struct ReplicaVerdict {
  enum class Outcome : uint8_t {
    kAgree = 0,          ///< nothing differs, or only tensors reported before
    kNotReplicas = 1,    ///< the digests differ: the ranks hold different parameters
    kOutOfStep = 2,      ///< the optimizer or the event count differs: the steps do not pair up
    kSkipsDiffer = 3,    ///< the GradScaler skipped this step on some ranks only
    kTensorsDiffer = 4,  ///< `differ` lists tensors that differ and were not reported before
  };
  struct Differ {
    int64_t field = 0;  ///< the row field of its fingerprint (its value per rank: the classes)
    std::string tensor;
    std::string what;    ///< "parameter", "gradient", "optimizer state" or "buffer"
    bool shown = false;  ///< among the first of its kind a finding names with their ranks
  };
  Outcome outcome = Outcome::kAgree;
  std::vector<Differ> differ;   ///< kTensorsDiffer, in row order
  bool grads_compared = false;  ///< some gradient was present on every rank
  bool grads_differ = false;    ///< and some such gradient differs
  bool forwards_differ = false;
  /// The fields whose value on every rank the report needs (the caller gathers every rank's
  /// row): kOutOfStep: kStep, kForwards; kSkipsDiffer: kSkipped; kTensorsDiffer: kForwards and
  /// the shown tensors' fields.
  std::vector<int64_t> fetch;
};

/// Judges one comparison from the element-wise maximum `hi` and minimum `lo` of the ranks' rows
/// (ReplicaRow; `members`, `buffers`: the names of their slots): whether they agree, and if not,
/// where. `known`: (what, tensor) pairs reported before, not reported again. Throws
/// std::invalid_argument when the rows do not have the layout's length.
ReplicaVerdict judge_replica_payload(const std::vector<int64_t>& hi, const std::vector<int64_t>& lo,
                                     const std::vector<std::string>& members,
                                     const std::vector<std::string>& buffers,
                                     const std::vector<std::pair<std::string, std::string>>& known);

/// Per rank, the class of its value (ReplicaMismatch::labels): 0 for the value most ranks hold,
/// ties to the one the lowest-placed rank holds, then 1, ...
std::vector<int64_t> replica_labels(const std::vector<int64_t>& values);

}  // namespace trainsan
