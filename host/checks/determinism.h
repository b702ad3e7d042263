// DeterminismCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/determinism.cpp. Torch-free.
#pragma once

#include "checks/check.h"
#include "trainsan/determinism_facts.h"

namespace trainsan::host {

class DeterminismCheck {  // determinism.cpp: nondeterminism (Note [Re-run determinism])
 public:
  DeterminismCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_rerun(const RerunFacts& facts, int64_t step);
  /// Whether the step `step` is re-run (rerun_every; 0: never).
  bool rerun_due(int64_t step) const {
    return opts_.rerun_every > 0 && step % opts_.rerun_every == 0;
  }
  /// Whether the step `step`'s checkpointed regions are checked against their recompute
  /// (Note [Recompute checks]): the first step asked about (attached mid-run: at once), then
  /// every recompute_every-th (0: never).
  bool recompute_due(int64_t step) const;  // determinism.cpp

 private:
  FindingSink& sink_;
  const Options& opts_;
  mutable std::optional<int64_t> first_recompute_;  // the first step recompute_due was asked
};

}  // namespace trainsan::host
