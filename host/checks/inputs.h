// InputsCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/inputs.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

/// Where a step's batch came from, as far as the caller knows (ForwardFacts::loader_*).
struct LoaderView {
  int64_t pass = -1;  ///< serial number of the data loader pass; -1: unknown
  int64_t workers = 0;
  bool worker_init = false;
  /// A sampled fingerprint of the batch a loader yielded since the previous training forward
  /// (ForwardFacts::loader_batch; 0: none, or not readable on the host). Note [Ignored batches].
  int64_t batch = 0;
};

class InputsCheck {  // inputs.cpp: duplicate_batch (Note [Stuck data], Note [Repeated batches])
 public:
  InputsCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// `hash`: one fingerprint of the step's first training inputs (their TensorStats hashes).
  /// `restarts`: how many times so far a data loader was iterated anew after its previous
  /// iterator had yielded only its first batch (of more than one; ForwardFacts::data_restarts).
  /// `loader`: the data loader pass the batch came from (Note [Repeated batches]).
  void on_inputs(uint64_t hash, int64_t step, int64_t restarts = 0, const LoaderView& loader = {});
  /// A resume at `step` (the model's state was loaded): the next steps' inputs are compared with
  /// those of the steps trained before it (Note [Replayed data]).
  void on_resume(int64_t step);
  /// Inputs trained before this process (a previous run's trace): fingerprints and their steps.
  void seed(const std::vector<uint64_t>& hashes, const std::vector<int64_t>& steps);

 private:
  std::unordered_map<uint64_t, int64_t> seen_;  // fingerprint -> the first step that had it
  int64_t replay_left_ = 0;                     // steps after a resume still compared
  int64_t resumed_at_ = -1;
  bool repeated_ = false;  // some fingerprint was seen twice before a resume
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
  std::optional<uint64_t> last_hash_;
  int64_t last_restarts_ = 0;
  int64_t changes_in_row_ = 0;  // consecutive steps whose inputs differed from the step before
  bool advancing_ = false;      // the inputs once changed at two consecutive steps
  // Note [Repeated batches]: the last steps of the current loader pass, (fingerprint, step).
  void repeated(uint64_t hash, int64_t step, const LoaderView& loader);
  std::deque<std::pair<uint64_t, int64_t>> recent_;
  int64_t pass_ = -1;
  int64_t pass_repeats_ = 0;  // steps of this pass whose batch equals one of its recent ones
  // Note [Ignored batches]: the previous step's loader batch, and consecutive steps whose inputs
  // stayed the same while their loader batches changed.
  int64_t last_batch_ = 0;
  int64_t ignored_in_row_ = 0;
  void ignored(uint64_t hash, int64_t step, const LoaderView& loader);
};

}  // namespace trainsan::host
