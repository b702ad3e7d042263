// ReplicaCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/replicas.cpp. Torch-free.
#pragma once

#include "checks/check.h"
#include "trainsan/replica_facts.h"

namespace trainsan::host {

class ReplicaCheck {  // replicas.cpp: rank_desync (Note [Replica comparison], replicas.py)
 public:
  ReplicaCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// One comparison across a replica group (or its failure), as the caller's collective found.
  void on_report(const ReplicaReport& r);
  /// Whether the step pass of `step` fingerprints for the comparison (desync_every).
  bool fingerprint_due(int64_t step) const { return step % opts_.desync_every == 0; }
  /// Whether that pass fingerprints the gradients too (desync_state_every: sampled, as hashing
  /// them every step would double the CPU pass's cost).
  bool grads_due(int64_t step) const {
    return opts_.desync_state_every > 0 && step % opts_.desync_state_every == 0;
  }

 private:
  FindingSink& sink_;
  const Options& opts_;
};

}  // namespace trainsan::host
