// Op-level audits of the training forward: `broadcast`, `label_range`, `label_dtype`,
// `batch_mismatch` and `target_leak`
// (Note [Op audit] in audit/observer.cpp). One process-wide ATen RecordFunction observer serves
// every sanitizer; it is switched on only while some sanitizer audits a sampled step. The audit
// writes its findings into a FindingSink and ships device-side label checks through the
// ReadbackQueue; it knows nothing else of the sanitizer.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/kinds.h"

namespace trainsan {

namespace host {

class FindingSink;
class ReadbackQueue;

namespace audit {
struct Core;
}  // namespace audit

/// What the audit saw of one step's class-index loss calls (cross_entropy, nll_loss,
/// multi_margin_loss; not one_hot): calls, targets, targets that are not ignore_index, calls
/// whose targets were all ignore_index, the largest class count. Read with label_range on.
struct ClassTargetFacts {
  int64_t calls = 0;
  int64_t targets = 0;
  int64_t valid = 0;
  int64_t empty_calls = 0;
  int64_t classes = 0;
};

/// What the audit needs of the sanitizer's options, fixed at construction.
struct AuditConfig {
  /// The kinds switched on, indexed by Kind: filled from the kinds table's rows of family `audit`
  /// (kinds.def), so a new audit kind needs no field here and no line where the sanitizer builds
  /// this (SanitizerImpl's constructor).
  std::vector<bool> kinds_on;
  bool on(Kind k) const {
    const auto i = static_cast<size_t>(k);
    return i < kinds_on.size() && kinds_on[i];
  }
  /// Some kind of the audit family is on: the audit runs on sampled steps.
  bool any() const { return std::find(kinds_on.begin(), kinds_on.end(), true) != kinds_on.end(); }
  /// Read CUDA targets at once instead of shipping their flags.
  bool sync = false;
  /// Print a finding at once when its op is likely to fail (the policy is not "record").
  bool print_failing = false;
  /// Sampled steps: the first `first_steps` (audit_first_steps), then every `every`-th
  /// (audit_every; <= 0: none).
  int64_t first_steps = 0;
  int64_t every = 0;
  /// Path substrings of the Python frames that are not the user's code (source_location.h).
  std::vector<std::string> skip_frames;
};

/// The audit state of one sanitizer. Every method but stop() is called from the training loop's
/// thread; stop() may come from an autograd engine thread. The sink and the queue must outlive
/// the OpAudit (the observer, which may outlive it, stops using them in ~OpAudit).
class OpAudit {
 public:
  OpAudit(FindingSink& sink, ReadbackQueue& readback, AuditConfig cfg);
  ~OpAudit();
  OpAudit(const OpAudit&) = delete;
  OpAudit& operator=(const OpAudit&) = delete;

  /// A training forward of `step` starts on this thread: observe its ops (and the loss
  /// computation after it) when the step is sampled (first_steps, every) and an audit kind is
  /// on. Findings of the callbacks are recorded in the sink at once, with this step.
  void begin_forward(int64_t step);
  /// The step's batch as the caller knows it (the forward's inputs and the other tensors a data
  /// loader yielded with them): label_dtype compares class targets with its small-integer
  /// tensors (Note [Label dtype]). Held until the next call.
  void set_batch(std::vector<at::Tensor> batch);
  /// The forward's inputs: target_leak compares the loss's target with the columns of its
  /// floating [B, F] tables (Note [Target leak]). Held until the next call.
  void set_inputs(std::vector<at::Tensor> inputs);
  /// Stop observing: the first gradient hook of the step (backward has started), the step end,
  /// close(). Cheap when not auditing.
  void stop();
  /// While paused (nesting), the observer ignores the calling thread's ops and autograd nodes.
  static void pause_this_thread(bool paused);
  bool auditing() const;
  /// A sanitizer event on the training thread (forward, watch_loss): record what the audit holds
  /// back, a broadcast_tensors whose result no loss took, so that it reaches this event's policy.
  void flush();
  /// Seconds spent in op callbacks since the last call.
  double take_overhead();
  /// Coverage: training forwards audited, and ops the audit rules looked at.
  std::pair<int64_t, int64_t> coverage() const;
  /// Step end: stop, flush, and ship this step's device-side label checks into the read-back
  /// queue (Phase::kLabels), whose drain reports them.
  void step_end();
  /// Stop, flush, ship what is pending and drop this sanitizer's claim on the observer (the
  /// observer is removed when the last open sanitizer closes). Idempotent.
  void close();

  /// Checks a class-index target of `step` now, before the op runs (the Python layer's sync
  /// path); findings go to the sink. `input` may be undefined (one_hot); num_classes < 0 takes
  /// the class count from `input`.
  void check_target(const std::string& op, const at::Tensor& input, const at::Tensor& target,
                    std::optional<int64_t> ignore_index, int64_t num_classes, int64_t step);
  /// The class-index facts of `step` known so far (host targets: at the op; device targets: once
  /// their flags are read, before the losses of that step in the read-back order).
  ClassTargetFacts class_targets(int64_t step) const;

 private:
  std::shared_ptr<audit::Core> core_;
};

}  // namespace host

/// True while the process-wide observer is registered (between the first audited step of any
/// sanitizer and the close() of the last open one). For tests.
bool audit_observer_registered();

}  // namespace trainsan
