// The feeders: each family's host bookkeeping (the facts its rules need that no single event
// carries) in a unit of its own, behind one interface — the twin of the Python package's
// Gatherer (bindings/trainsan/_gatherers.py). Note [Feeders] says how to add one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "checks/checks.h"
#include "findings.h"
#include "grad_tracker.h"
#include "own_time.h"
#include "trace.h"
#include "trainsan/coverage.h"
#include "trainsan/sanitizer.h"

namespace trainsan::host {

class ForwardWatch;

// Note [Feeders]
// ~~~~~~~~~~~~~~~
// A check family is a rule (host/checks/<family>.cpp, torch-free, fed views) and, where the
// events do not carry its facts whole, a feeder: the host bookkeeping that gathers them across
// events (the accumulation window's counts, the foreign backwards since a step, the state a
// re-run starts from). A feeder is a class in host/feeds/<family>_feed.{h,cpp} that derives from
// Feed, owns its state, and sees the sanitizer only through FeedContext (the options, the
// parameters, the checks, the step, the finding store, the trace, the own-time clock): it never
// sees SanitizerImpl itself, whose header only its own three files include (sanitizer.cpp: the
// events, sanitizer_pass.cpp: the step pass, sanitizer_api.cpp: the front door).
//
// SanitizerImpl holds each feeder by name (for the events only that family has: foreign_backward,
// loss_reaches, rerun, attribute, check_custom_grad, compare_replicas) and lists those that take
// shared events in `feeds`, in a fixed order (the order their findings appear in: the foreign
// walk, then the window, the re-run state, the replicas); a feeder overrides what it needs, the
// rest are no-ops:
//   on_forward   a training forward (train mode, grad enabled, outside an optimizer step);
//   on_loss      a watched loss, after its argument checks and before it is read;
//   on_step_end  an optimizer step (or a manual-mode boundary) before its pass is launched: the
//                feeder writes its facts for the pass into StepEnd (they reach StepView);
//   on_scaler    a GradScaler's report (`skipped`: it skipped the step), before it is traced;
//   after_step   after a step's pass was queued, or after a skipped step (`skipped`);
//   before_clear gradients of optimizer `opt` (-1: all) are cleared outside a step;
//   close        the sanitizer closes (each feeder's close runs even if another's throws);
//   add_coverage its part of coverage().
// Adding a kind: a kinds.def row, its rule in its family's check, its tests, and — only if it
// needs facts no feeder gathers yet — a feeder (or fields of an existing one): its class here in
// host/feeds/, listed in host/CMakeLists.txt, a member of SanitizerImpl added to `feeds`, and
// its facts for the pass a field of StepEnd and of StepView. A feeder that must see an event not
// listed above gets a method of its own, called by name where that event arrives.
// Not yet feeders, still SanitizerImpl's (sanitizer.cpp, interleaved with the forward and loss
// events they serve): the mode rules' forward counts (Note [Mode rules]), the input and target
// fingerprints, and the loss stream (Note [Loss stream]). The update statistics are the step
// pass's own unit (update_stats.h), not a feeder.

/// What a feeder sees of its sanitizer: references into SanitizerImpl, which outlives its feeders.
struct FeedContext {
  const Options& opts;
  const Setup& setup;
  std::vector<TrackedParam>& params;
  Checks& checks;
  GradTracker& grads;
  FindingStore& store;
  TraceWriter& trace;
  OwnTime& time;
  Coverage& coverage;                           // what was checked (Sanitizer::coverage)
  std::set<std::string>& events_seen;           // Note [Coverage]: event kinds whose event arrived
  const int64_t& step;                          // Note [Step numbering]
  const std::map<int64_t, int64_t>& opt_steps;  // steps per optimizer (-1: manual mode)
  const bool& closed;
  const std::unique_ptr<ForwardWatch>& watch;  // trainsan::attach's, else null
};

/// A step end as the feeders see it, and the facts they give its pass (Pass, then StepView).
struct StepEnd {
  int64_t step = 0;      // the pass's step (its optimizer's count of steps before it)
  int64_t opt = -1;      // the stepping optimizer
  bool manual = false;   // a manual-mode boundary (then `opt` is -1 for the counts)
  bool partial = false;  // attached inside this step (step_in_flight)
  // Note [Foreign backwards]: such backwards since this optimizer's previous step, the latest.
  int64_t foreign_backwards = 0;
  ForeignBackward foreign;
  int64_t backwards = -1;  // Note [Accumulation windows]: the window's backwards; -1 manual mode
};

class Feed {
 public:
  explicit Feed(FeedContext& ctx) : ctx_(ctx) {}
  virtual ~Feed() = default;
  Feed(const Feed&) = delete;
  Feed& operator=(const Feed&) = delete;

  virtual void on_forward(const ForwardFacts& /*facts*/) {}
  virtual void on_loss(const at::Tensor& /*loss*/) {}
  virtual void on_step_end(StepEnd& /*e*/) {}
  virtual void on_scaler(int64_t /*opt*/, bool /*skipped*/) {}
  virtual void after_step(int64_t /*opt*/, bool /*skipped*/) {}
  virtual void before_clear(int64_t /*opt*/) {}
  virtual void close() {}
  virtual void add_coverage(Coverage& /*c*/) const {}

 protected:
  FeedContext& ctx_;
};

}  // namespace trainsan::host
