// The views the check families share (Note [Checks as units]): StepView, ForwardView, LossView and
// what they hold, and the overflow provenance two families word (Origins). Each family of rules is
// a class in its own header and file of host/checks/ (<family>.h, <family>.cpp; checks/checks.h
// holds them all as Checks), owns its running state, reads plain facts and writes findings
// through a FindingSink. Torch-free: the rules are unit-tested on synthetic
// views (tests/cpp/test_checks.cpp) without LibTorch.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "finding_sink.h"
#include "trainsan/autograd_facts.h"
#include "trainsan/finding.h"
#include "trainsan/options.h"
#include "trainsan/precision_facts.h"
#include "trainsan/tensor_stats.h"

namespace trainsan::host {

// Note [Checks as units]
// ~~~~~~~~~~~~~~~~~~~~~~
// The sanitizer gathers facts (gradient hooks, the fused pass, forward pre-hooks) and turns each
// event into a plain value: a StepView for an optimizer step (or a manual-mode boundary), a
// ForwardView for a training forward, and so on. Every check family sees every event it
// subscribes to, in a fixed order (Checks, checks/checks.h), and keeps whatever running state its
// rules need (baselines, consecutive-step counters) indexed by the parameter's index or the
// optimizer. A check never touches a tensor, a hook or the trace: that keeps the rules testable in
// isolation and lets a new family land without touching the sanitizer's state.

/// What the gradient hooks saw for one parameter between two steps of its optimizer
/// (captured when the step pass launched, so a lagged check sees its own step).
struct GradObservation {
  bool got_grad = false;     ///< a gradient arrived since the last step of its optimizer
  bool stale = false;        ///< accumulated onto a gradient a step had already consumed
  bool accumulated = false;  ///< (manual mode) accumulated onto an uncleared gradient
  /// This step, like the one before it, used only the last micro-batch's gradient, the earlier
  /// ones cleared unused (Note [Micro-batches cleared] in host/grad_tracker.cpp).
  bool micro_cleared = false;
};

/// The state of a parameter's .grad when its optimizer stepped.
enum class GradAtStep : uint8_t {
  kAsBackwardLeft = 0,  ///< what the last backward left
  kNone = 1,            ///< .grad is None
  kModified = 2,        ///< modified or replaced after the last backward (clip, unscale, zero_)
};

struct UpdateStats {
  int64_t changed = 0;  ///< elements whose bits changed in this step
  double l2 = 0.0;      ///< ||dtheta||
  double max = 0.0;     ///< max |dtheta|
  /// Note [Update statistics without a snapshot] (update_stats.cpp): changed and l2 estimated
  /// from the tensor's sample, max the largest of the sample; changed == 0 stays exact.
  bool sampled = false;
  int64_t stride = 1;  ///< of the sample: one element in `stride` (Note [Update sample])
  /// The tensor changed (its fingerprint moved) but none of its sampled elements did: l2 and max
  /// are unknown (0 here), changed is a lower bound.
  bool unseen = false;
};

/// One parameter in a step.
struct ParamView {
  size_t index = 0;  ///< position in the sanitizer's parameter list (stable: key running state)
  std::string name;
  int64_t opt = -1;       ///< index of the optimizer holding it; -1 when in none
  bool trainable = true;  ///< requires_grad
  /// Its statistics are this process's shard of a larger parameter (FSDP2, tensor parallel).
  bool sharded = false;
  GradObservation observed;
  GradAtStep grad_at_step = GradAtStep::kAsBackwardLeft;
  std::optional<TensorStats> grad;    ///< empty when there was no gradient to read
  TensorStats param;                  ///< after the step, or (not measured) the latest measured
  bool param_measured = true;         ///< Note [Every-step tier]: read at this step
  std::optional<UpdateStats> update;  ///< with track_updates
  double param_l2_before = 0.0;       ///< ||theta|| before the step; NaN where unknown
  /// Learning rate of its optimizer group at the step; NaN where unknown (C++ end_step() without
  /// group rates, a learning rate held in a device tensor).
  double lr = std::numeric_limits<double>::quiet_NaN();
  double eps = 0.0;  ///< machine epsilon of the parameter's dtype (0: not floating point)
  /// Whether .grad as the last backward left it held a nonzero element; probed only on the steps
  /// after one whose gradients were all zero and modified before the step (Note [Zero gradients]).
  std::optional<bool> grad_left_nonzero;
};

struct ModuleRef {
  std::string name;
  std::string type;  ///< e.g. "Dropout"; may be empty (LibTorch callers that do not say)
};

/// A module registered once at attach for the mode rules (Setup::mode_modules; ModeCheck).
struct ModeModule {
  ModuleRef ref;
  /// The parameters whose training makes its eval mode matter (eval_mode): its own for a module
  /// with parameters, those of its nearest ancestor with parameters for a parameterless one
  /// (Dropout). Empty: every parameter.
  std::vector<size_t> params;
  /// Its forward depends on train/eval (Dropout, BatchNorm tracking running statistics, ...): a
  /// no_grad forward in train mode runs it as in training (no_grad_leak's warning).
  bool mode_dependent = true;
};

/// Global figures of a step, computed once from the ParamViews (step_view.cpp) for the checks and
/// the trace.
struct StepTotals {
  double grad_norm = 0.0;   ///< over the finite gradients
  double param_norm = 0.0;  ///< over the finite parameters, after the step
  double update_norm = 0.0;
  double update_ratio = 0.0;  ///< update_norm / ||theta before|| (after, where unknown)
  /// Some tensor changed where its sample saw no change (UpdateStats::unseen): update_norm and
  /// update_ratio are then lower bounds.
  bool update_lower_bound = false;
  double ratio_denom = 0.0;
  int64_t changed = 0;
  bool any_update = false;
  bool any_nonfinite_grad = false;
  int64_t with_grad = 0;           ///< parameters whose hooks saw a gradient
  std::optional<size_t> top_grad;  ///< position in StepView::params of the largest finite grad
};

/// One optimizer step (or, in manual mode, the boundary before the next training forward).
struct StepView {
  int64_t step = 0;  ///< Note [Step numbering]
  int64_t opt = -1;  ///< the stepping optimizer; -1 for the C++ end_step() and manual mode
  bool lr_zero = false;
  bool manual = false;
  /// Manual mode: no parameter's version moved since the previous boundary (Note [Manual-mode
  /// steps] in host/sanitizer.cpp): an update is judged only where the values changed.
  bool unwritten = false;
  bool have_optimizer = true;
  bool fp16_in_use = false;  ///< some forward so far ran under fp16 autocast
  /// The sanitizer was attached inside this step (Sanitizer::step_in_flight): the hooks and the
  /// snapshot saw only its end, so the step-level rules do not judge it.
  bool partial = false;
  std::vector<ParamView> params;
  /// At the last grad-enabled forward of the model before the step: its own train flag was false
  /// (the whole model in eval mode), and the registered modules (ModeCheck::set_modules
  /// positions) that were in eval mode.
  bool model_eval = false;
  std::vector<size_t> eval_modules;
  /// Forwards of the model since its optimizer's previous step, outside optimizer steps: under
  /// no_grad in train mode, and with grad enabled (no_grad_leak).
  int64_t no_grad_train_forwards = 0;
  int64_t grad_forwards = 0;
  /// Backwards since the stepping optimizer's previous step whose graph reached none of the
  /// sanitizer's parameters but reached requires-grad leaves outside them (the Python package
  /// reports one per set of leaves between steps: only "> 0" is read), and the latest of them
  /// (Note [Foreign backwards], gradient_flow.cpp).
  int64_t foreign_backwards = 0;
  ForeignBackward foreign;
  StepTotals totals;
};
/// Fills view.totals from view.params.
void compute_totals(StepView& view);

/// A training forward (grad mode on or off) or a no_grad forward in train mode.
struct ForwardView {
  int64_t step = 0;
  bool grad_enabled = true;
  bool training = true;
  bool have_optimizer = true;
  /// Read (with `skipped`) only when grad_enabled && training, as before: collect and reset
  /// them for such a forward only.
  int64_t backwards_since_step = 0;
  /// Parameters whose gradient was cleared twice without a step of their optimizer (GradState).
  std::vector<std::string> skipped;
  /// For a no_grad forward in train mode: the registered mode-dependent modules in train mode
  /// (ModeCheck::set_modules positions).
  std::vector<size_t> train_mode_dependent;
  /// For a no_grad forward in train mode: where it was called ("path/train.py:42 in step"; empty
  /// for a caller without a Python frame), named by no_grad_leak.
  std::string site;
};

/// One loss: the root of a training backward (Python: every scalar backward while attached) or a
/// loss given to watch_loss. Read back like the other device results (Note [Lagged checks]).
struct LossView {
  int64_t step = 0;
  TensorStats stats;     ///< value: sum / numel (a scalar's value)
  std::string dtype;     ///< "float16", "bfloat16", "float32", ... ("" where unknown)
  bool in_step = false;  ///< evaluated inside an optimizer step (a closure): not a step's loss
  /// What the op audit saw of this step's class-index loss ops (cross_entropy, nll_loss; audited
  /// steps with label_range on): calls, targets that are not ignore_index summed over them, calls
  /// whose targets were all ignore_index, and the largest class count C. calls == 0: none seen
  /// (not audited, or no such op).
  int64_t class_calls = 0;
  int64_t class_targets = 0;
  int64_t class_valid = 0;
  int64_t class_empty_calls = 0;
  int64_t classes = 0;
  /// The step outcome this loss belongs to (SanitizerImpl's sequence of the outcomes of steps
  /// with losses: LossCheck::on_outcome); -1: none, judged at once.
  int64_t outcome = -1;
};

/// Overflow provenance (Note [Overflow provenance], precision.cpp): which steps arm the module
/// hooks, and what the armed steps found, for the families that word where a non-finite value
/// came from (NonfiniteCheck, PrecisionCheck).
class Origins {
 public:
  explicit Origins(const Options& opts) : opts_(opts) {}
  /// Whether the training forward of `step` is armed: every provenance_every-th step, and the
  /// provenance_rearm steps after one where a non-finite value or a scaler skip was seen.
  bool armed(int64_t step) const;
  /// A non-finite value (loss, gradient) or a scaler skip at `step`: arm the following steps.
  void rearm(int64_t step);
  /// Keeps the facts of one armed step (merged with those already kept for that step).
  void record(const Provenance& p);
  /// The facts kept for `step`, or nullptr.
  const Provenance* at(int64_t step) const;
  /// The most recent kept step at or before `step` (within `window` steps) with an origin.
  const Provenance* latest(int64_t step, int64_t window) const;
  /// " It first appeared at ..." for the origin(s) kept for `step`; "" when none.
  std::string describe(int64_t step) const;

 private:
  const Options& opts_;
  std::deque<Provenance> recent_;  // the last few armed steps, oldest first
  int64_t armed_until_ = -1;       // steps <= this one are armed (rearm)
};

/// Words one origin: "at the output of mid (Linear, float16 under float16 autocast; 2nd of 3
/// outputs checked), +Inf only: an fp16 overflow ...".
std::string origin_text(const ModuleOrigin& o);

}  // namespace trainsan::host
