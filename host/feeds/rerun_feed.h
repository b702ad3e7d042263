// Re-runs of a LibTorch loop's step: nondeterminism's (Sanitizer::rerun: twice from the state the
// step started from, Note [Re-run determinism] in host/checks/determinism.cpp) and re-run
// attribution's (Options::rerun_on_error with Setup::rerun_step: once, for a new finding, Note
// [Re-run attribution] in host/checks/attribution.cpp). The state a step starts from is kept here;
// whatever a re-run touches — the gradients, the RNG state, the buffers — is put back as found.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "feeds/feed.h"
#include "rng_state.h"

namespace trainsan::host {

/// The state a step started from, which its re-runs start from: kept at begin_step() for a step
/// due for a determinism re-run, and at each training forward for re-run attribution (then with
/// the forward's inputs, the losses the step watched and its count of training forwards).
struct StepStart {
  int64_t step = -1;
  RngState rng;
  std::vector<at::Tensor> buffers;  // copies of Setup::buffers
  std::vector<at::Tensor> inputs;   // references (the batch's fingerprint)
  std::vector<at::Tensor> losses;   // detached references, in the order watched
  int64_t forwards = 0;
};

class RerunFeed final : public Feed {
 public:
  using Feed::Feed;

  /// begin_step() of a step due for a determinism re-run.
  void capture_rerun_start();
  /// A training forward (Note [Re-run attribution]): kept for one step.
  void capture_error_start(const std::vector<at::Tensor>& inputs);
  /// The step's losses, for the attribution re-run's comparison.
  void on_loss(const at::Tensor& loss) override;
  /// Sanitizer::rerun's runs and their comparison (nullopt: nothing to compare): a LibTorch
  /// loop's step function, from begin_step()'s state, through the driver below.
  std::optional<RerunFacts> rerun(const std::function<RerunRecord()>& step_fn,
                                  const RerunRecord& step);
  /// The driver (Note [One re-run driver]): `how` run twice, fingerprinted and compared with each
  /// other and with `step` (nullptr: not compared).
  std::optional<RerunFacts> rerun(const StepRerun& how, const RerunRecord* step);
  /// Runs rerun_step once for `f`'s step (re-run attribution).
  RerunOutcome rerun_for(const Finding& f);

  std::function<RerunRecord()> rerun_step;  // Setup::rerun_step, or set_rerun_step's

 private:
  std::optional<StepStart> rerun_start_;  // determinism
  std::optional<StepStart> error_start_;  // attribution
};

}  // namespace trainsan::host
