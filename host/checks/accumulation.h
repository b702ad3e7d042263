// AccumulationCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/accumulation.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

/// One optimizer step as gradient accumulation sees it (Note [Accumulation windows]).
struct WindowView {
  int64_t step = 0;       ///< the step's number (Note [Step numbering])
  int64_t opt = -1;       ///< the stepping optimizer
  int64_t backwards = 0;  ///< micro-batches (training backwards) since the previous step
  int64_t samples = -1;   ///< their batch sizes summed; -1 where unknown
  int64_t pass = -1;      ///< the data loader pass of the latest of them; -1 where unknown
};

/// What the run's windows were (Sanitizer::coverage, the summary).
struct WindowsSeen {
  int64_t counted = 0;    ///< optimizer steps that followed at least one backward
  int64_t common = 0;     ///< the most frequent number of backwards per step (0: none counted)
  int64_t at_common = 0;  ///< steps that followed exactly `common`
  int64_t samples = -1;   ///< the effective batch of the latest such step; -1 where unknown
};

class AccumulationCheck {  // accumulation.cpp: accumulation_mismatch (Note [Accumulation windows])
 public:
  AccumulationCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_step(const WindowView& w);
  /// A training forward outside an optimizer step, with its loader pass (-1: unknown): decides a
  /// short window pending since the last step (the end of a loader pass, or the middle of one).
  void on_forward(int64_t pass);
  /// The end of the run: a short window still pending was the run's last.
  void on_close();
  WindowsSeen seen() const;

 private:
  enum class Where { kMidPass, kPassEnd, kRunEnd, kUnknown };
  void judge(const WindowView& w, Where where);
  FindingSink& sink_;
  const Options& opts_;
  std::map<int64_t, int64_t> steps_at_;    // backwards per step -> steps (at most 64 keys)
  std::map<int64_t, int64_t> samples_at_;  // backwards per step -> the latest step's samples
  int64_t counted_ = 0;
  std::optional<WindowView> pending_;  // a short window not yet judged
  bool full_seen_ = false;             // some step followed the declared window
  int64_t shorts_in_row_ = 0;          // short windows judged since the last full one
  int64_t full_samples_ = -1;          // the effective batch of the latest full window
};

}  // namespace trainsan::host
