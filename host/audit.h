// Op-level audits of the training forward: `broadcast`, `label_range` and `batch_mismatch`
// (Note [Op audit] in audit.cpp). One process-wide ATen RecordFunction observer serves every
// sanitizer; it is switched on only while some sanitizer audits a sampled step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "trainsan/sanitizer.h"

namespace trainsan {

struct SanitizerImpl;

namespace audit {
struct Core;
}  // namespace audit

// The audit state of one sanitizer. Every method but stop() is called from the training loop's
// thread (the SanitizerImpl events); stop() may come from an autograd engine thread.
class OpAudit {
 public:
  explicit OpAudit(SanitizerImpl& owner);
  ~OpAudit();
  OpAudit(const OpAudit&) = delete;
  OpAudit& operator=(const OpAudit&) = delete;

  // A training forward starts on this thread: observe its ops (and the loss computation after
  // it) when the step is sampled (audit_first_steps, audit_every) and an audit kind is on.
  void begin_forward();
  // Stop observing: the first gradient hook of the step (backward has started), the step end,
  // close(). Cheap when not auditing.
  void stop();
  bool auditing() const;
  // Findings the observer recorded since the last call, for the caller's policy.
  std::vector<Finding> take();
  // Step end: stop, then read the device-side label checks (those of this step with sync, of
  // the previous step otherwise, so that the stream never waits).
  std::vector<Finding> step_end();
  // Stop, read every pending device check and drop this sanitizer's claim on the observer (the
  // observer is removed when the last open sanitizer closes). Idempotent.
  std::vector<Finding> close();

  // Checks a class-index target now, before the op runs (the Python layer's sync path), and
  // returns the findings that are new; they are not returned again by take(). `input` may be
  // undefined (one_hot); num_classes < 0 takes the class count from `input`.
  std::vector<Finding> check_target(const std::string& op, const at::Tensor& input,
                                    const at::Tensor& target, std::optional<int64_t> ignore_index,
                                    int64_t num_classes);

 private:
  std::shared_ptr<audit::Core> core_;
};

// True while the process-wide observer is registered (between the first audited step of any
// sanitizer and the close() of the last open one). For tests.
bool audit_observer_registered();

}  // namespace trainsan
