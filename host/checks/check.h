// The checks as units (Note [Checks as units]): each family of rules is a class in one file of
// host/checks/, owns its running state, reads plain facts (StepView and the event structs below)
// and writes findings through a FindingSink. Torch-free: the rules are unit-tested on synthetic
// views (tests/cpp/test_checks.cpp) without LibTorch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "finding_sink.h"
#include "trainsan/options.h"
#include "trainsan/tensor_stats.h"

namespace trainsan::host {

// Note [Checks as units]
// ~~~~~~~~~~~~~~~~~~~~~~
// The sanitizer gathers facts (gradient hooks, the fused pass, forward pre-hooks) and turns each
// event into a plain value: a StepView for an optimizer step (or a manual-mode boundary), a
// ForwardView for a training forward, and so on. Every check family sees every event it
// subscribes to, in a fixed order (Checks, below), and keeps whatever running state its rules
// need (baselines, consecutive-step counters) indexed by the parameter's index or the optimizer.
// A check never touches a tensor, a hook or the trace: that keeps the rules testable in
// isolation and lets a new family land without touching the sanitizer's state.

/// What the gradient hooks saw for one parameter between two steps of its optimizer
/// (captured when the step pass launched, so a lagged check sees its own step).
struct GradObservation {
  bool got_grad = false;     ///< a gradient arrived since the last step of its optimizer
  bool stale = false;        ///< accumulated onto a gradient a step had already consumed
  bool accumulated = false;  ///< (manual mode) accumulated onto an uncleared gradient
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
};

/// One parameter in a step.
struct ParamView {
  size_t index = 0;  ///< position in the sanitizer's parameter list (stable: key running state)
  std::string name;
  int64_t opt = -1;       ///< index of the optimizer holding it; -1 when in none
  bool trainable = true;  ///< requires_grad
  GradObservation observed;
  GradAtStep grad_at_step = GradAtStep::kAsBackwardLeft;
  std::optional<TensorStats> grad;    ///< empty when there was no gradient to read
  TensorStats param;                  ///< after the step
  std::optional<UpdateStats> update;  ///< with track_updates
  double param_l2_before = 0.0;       ///< ||theta|| before the step; NaN where unknown
};

struct ModuleRef {
  std::string name;
  std::string type;  ///< e.g. "Dropout"; may be empty (LibTorch callers that do not say)
};

/// Global figures of a step, computed once from the ParamViews (step_view.cpp) for the checks and
/// the trace.
struct StepTotals {
  double grad_norm = 0.0;   ///< over the finite gradients
  double param_norm = 0.0;  ///< over the finite parameters, after the step
  double update_norm = 0.0;
  double update_ratio = 0.0;  ///< update_norm / ||theta before|| (after, where unknown)
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
  bool have_optimizer = true;
  bool fp16_in_use = false;  ///< some forward so far ran under fp16 autocast
  std::vector<ParamView> params;
  std::vector<ModuleRef> eval_modules;  ///< mode-sensitive modules in eval mode at the forward
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
};

/// Each family: one class, one file. Constructed with the sink and the options; the sanitizer
/// calls every family's event methods in the order of Checks.
class NonfiniteCheck {  // nonfinite.cpp: nonfinite_loss/grad/param/activation, fp16_overflow
 public:
  NonfiniteCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_loss(const TensorStats& loss, int64_t step);
  void on_step(const StepView& v);
  void on_module_output(const ModuleRef& module, const TensorStats& output, int64_t step);

 private:
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

class GradientFlowCheck {  // gradient_flow.cpp: missing_grad, stale_grad, param_not_in_optimizer,
                           // grad_vanishing
 public:
  GradientFlowCheck(FindingSink& sink, const Options& opts, size_t num_params)
      : sink_(sink),
        opts_(opts),
        steps_without_grad_(num_params, 0),
        vanishing_steps_(num_params, 0) {}
  void on_step(const StepView& v);

 private:
  FindingSink& sink_;
  const Options& opts_;
  std::vector<int64_t> steps_without_grad_;
  std::vector<int64_t> vanishing_steps_;
  bool manual_prev_changed_ = false;  // manual mode: the previous pass saw a parameter change
};

class MagnitudeCheck {  // magnitudes.cpp: grad_explosion, update_ratio
 public:
  MagnitudeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_step(const StepView& v);

 private:
  struct PerOptimizer {
    double grad_norm_ema = 0.0;
    int64_t grad_norm_steps = 0;
    int64_t update_ratio_out = 0;  // consecutive steps outside the band
  };
  FindingSink& sink_;
  const Options& opts_;
  std::vector<std::pair<int64_t, PerOptimizer>> per_opt_;  // keyed by StepView::opt
  PerOptimizer& of(int64_t opt);
};

class StepIntegrityCheck {  // step_integrity.cpp: skipped_step (3 rules), update_outside_step
 public:
  StepIntegrityCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_forward(const ForwardView& v);  // cleared-unused gradients, max_accumulation
  void on_step(const StepView& v);        // cleared before the step, a step that changed nothing
  /// update_outside_step: the parameters that changed since the previous step's end.
  void on_step_begin(const std::vector<std::string>& changed, int64_t step);

 private:
  FindingSink& sink_;
  const Options& opts_;
};

class ModeCheck {  // mode.cpp: no_grad_leak, eval_mode
 public:
  ModeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_forward(const ForwardView& v);
  void on_step(const StepView& v);

 private:
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

class InputsCheck {  // inputs.cpp: duplicate_batch
 public:
  InputsCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// `hash`: one fingerprint of the step's first training inputs (their TensorStats hashes).
  void on_inputs(uint64_t hash, int64_t step);

 private:
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
  std::optional<uint64_t> last_hash_;
};

/// Every family, in the order the sanitizer runs them on a step (the order findings appear in:
/// the hook observations, the numbers of the pass, the step-level rules, the mode).
struct Checks {
  Checks(FindingSink& sink, const Options& opts, size_t num_params)
      : flow(sink, opts, num_params),
        nonfinite(sink, opts),
        magnitudes(sink, opts),
        integrity(sink, opts),
        mode(sink, opts),
        inputs(sink, opts) {}
  GradientFlowCheck flow;
  NonfiniteCheck nonfinite;
  MagnitudeCheck magnitudes;
  StepIntegrityCheck integrity;
  ModeCheck mode;
  InputsCheck inputs;
};

}  // namespace trainsan::host
