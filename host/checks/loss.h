// LossCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/loss.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class LossCheck {  // loss.cpp: loss_spike, trivial_loss, empty_loss (nonfinite_loss:
                   // NonfiniteCheck)
 public:
  LossCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_loss(const LossView& v);
  /// A loss scaler reports its steps: from now on loss_spike waits for each loss's step outcome.
  void on_scaler() { scaler_ = true; }
  /// The outcome of the step whose losses carry `outcome` (LossView::outcome): `skipped` when a
  /// loss scaler skipped it (Inf/NaN in the scaled gradients), else it stepped or ended. Judges
  /// the losses that waited for it (Note [Loss stream]).
  void on_outcome(int64_t outcome, bool skipped);
  /// close(): judge the losses still waiting (their step never ended), as of steps that ran.
  void flush();
  /// The fingerprint of a step's training inputs (its first grad-enabled forward): whether the
  /// run fits one fixed batch (trivial_loss's collapse rule judges fresh batches only).
  void on_inputs(uint64_t hash);

 private:
  void spike(double x, int64_t step, bool skipped);
  bool was_skipped(int64_t outcome) const;
  void trivial(const LossView& v, double x);
  void collapse(double x, int64_t step);
  void empty(const LossView& v);
  FindingSink& sink_;
  const Options& opts_;
  // loss_spike: one stream per sanitizer, the most recent loss_spike_window finite losses that
  // were not flagged (Note [Loss stream]).
  std::vector<double> window_;  // ring buffer
  size_t next_ = 0;
  int64_t seen_ = 0;
  double largest_ = 0.0;         // the largest unflagged loss so far (the warm-up rule)
  int64_t flagged_run_ = 0;      // consecutive flagged losses (a level shift after kPersist)
  std::vector<int64_t> spikes_;  // steps of the reported spikes, the last few
  // Waiting for their step's outcome (a loss scaler in use): value, step, outcome.
  struct Waiting {
    double x;
    int64_t step;
    int64_t outcome;
  };
  bool scaler_ = false;
  std::deque<Waiting> waiting_;
  int64_t resolved_ = 0;         // outcomes below this one are known
  std::deque<int64_t> skipped_;  // the recent outcomes a loss scaler skipped
  // trivial_loss's collapse: the class count, the recent losses and whether it was reported.
  int64_t classes_ = 0;
  std::vector<double> recent_;  // ring buffer of the last kCollapseWindow losses
  size_t recent_next_ = 0;
  bool collapsed_ = false;
  uint64_t last_inputs_ = 0;
  int64_t fresh_inputs_ = 0;     // steps whose inputs differed from the step before
  int64_t repeated_inputs_ = 0;  // steps whose inputs were the step before's
  // empty_loss: audited steps with class-index targets, those with an all-ignored call.
  int64_t target_steps_ = 0;
  int64_t empty_steps_ = 0;
  int64_t last_target_step_ = -1;
  // trivial_loss: the first finite loss, and whether every loss since had its bits.
  std::optional<double> first_;
  uint64_t first_hash_ = 0;
  bool constant_ = true;
  int64_t constant_steps_ = 0;  // distinct steps whose losses all equal the first
  int64_t last_step_ = -1;
};

}  // namespace trainsan::host
