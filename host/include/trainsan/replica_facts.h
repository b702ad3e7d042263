// Facts of the replica comparison (rank_desync), gathered by the caller — the Python package's
// collectives over torch.distributed (bindings/trainsan/replicas.py), or a LibTorch program's own —
// and judged and worded by the sanitizer (host/checks/replicas.cpp). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

/// A tensor that differs across the replicas of one comparison.
struct ReplicaMismatch {
  std::string tensor;  ///< the parameter's (or buffer's) name
  /// What differs: "parameter", "gradient", "optimizer state" or "buffer".
  std::string what;
  /// Per rank of ReplicaReport::ranks, the class of equal values it falls in (0: the class of
  /// the most ranks, ties to the one holding the lowest rank); empty when unknown.
  std::vector<int64_t> labels;
};

/// One comparison across a replica group, or its failure.
struct ReplicaReport {
  enum class Moment : uint8_t {
    kBeforeFirstStep = 0,  ///< the weights replicas start training from
    kAfterStep = 1,        ///< after a step (or an AMP-skipped step) of optimizer `opt`
    kMissing = 2,          ///< some ranks did not arrive at the comparison in time
  };
  Moment moment = Moment::kAfterStep;
  int64_t step = 0;  ///< the step compared (Note [Step numbering])
  int64_t opt = -1;
  std::string group;           ///< e.g. "the data-parallel group (DDP)"
  std::vector<int64_t> ranks;  ///< global ranks of the group, ascending
  std::vector<ReplicaMismatch> mismatches;
  /// kAfterStep: per rank (as `ranks`), whether the GradScaler skipped this step there; empty
  /// when every rank did the same.
  std::vector<bool> skipped;
  /// kAfterStep: per rank, the step count of `opt` it was at; empty when every rank was at the
  /// same one (a rank that skipped or repeated optimizer.step() shifts the sequence).
  std::vector<int64_t> steps_at;
  /// Per rank, the training forwards it ran so far; empty when equal (explains a shift).
  std::vector<int64_t> forwards;
  /// Gradients were compared and agree (localises a parameter mismatch to the update).
  bool grads_agree = false;
  /// kMissing: the ranks that never arrived, the seconds waited, and per missing rank what is
  /// known of it ("closed its sanitizer after 9 comparisons", ...; may be empty).
  std::vector<int64_t> missing;
  double waited_s = 0.0;
  std::vector<std::string> missing_detail;
};

}  // namespace trainsan
