// The checks as units (Note [Checks as units]): each family of rules is a class in one file of
// host/checks/, owns its running state, reads plain facts (StepView and the event structs below)
// and writes findings through a FindingSink. Torch-free: the rules are unit-tested on synthetic
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
#include "trainsan/checkpoint_facts.h"
#include "trainsan/determinism_facts.h"
#include "trainsan/finding.h"
#include "trainsan/options.h"
#include "trainsan/precision_facts.h"
#include "trainsan/replica_facts.h"
#include "trainsan/resume_facts.h"
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
  /// Note [Update statistics without a snapshot] (sanitizer_pass.cpp): changed and l2 estimated
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

/// Each family: one class, one file. Constructed with the sink and the options; the sanitizer
/// calls every family's event methods in the order of Checks.
class NonfiniteCheck {  // nonfinite.cpp: nonfinite_loss/grad/param/activation, fp16_overflow
 public:
  NonfiniteCheck(FindingSink& sink, const Options& opts, Origins& origins)
      : sink_(sink), opts_(opts), origins_(origins) {}
  /// `empty_targets`: the audit saw a class-index loss call of this step whose targets were all
  /// ignore_index (a mean over no element is 0/0): the NaN is empty_loss's unless the step's
  /// gradients are not finite (decided in on_step).
  void on_loss(const TensorStats& loss, int64_t step, bool empty_targets = false);
  void on_step(const StepView& v);
  /// Gradients a backward produced that are being cleared without an optimizer step having used
  /// them (Note [Discarded gradients]): (parameter name, gradient statistics). Returns whether
  /// one held NaN/Inf.
  bool on_discarded(const std::vector<std::pair<std::string, TensorStats>>& grads, int64_t step);
  void on_module_output(const ModuleRef& module, const TensorStats& output, int64_t step);

 private:
  void report_loss(const TensorStats& loss, int64_t step);
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
  Origins& origins_;
  // A NaN loss explained by an all-ignored target, waiting for its step's gradients.
  std::optional<std::pair<TensorStats, int64_t>> pending_loss_;
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
  /// A step of some optimizer already looked like Note [Foreign backwards] (its parameters got
  /// no gradient while a foreign backward ran): the caller names what such a backward reached
  /// (ForeignBackward::holder), which costs a search, only from then on.
  bool foreign_suspected() const;

 private:
  /// Note [Foreign backwards]: whether it reported.
  bool foreign_step(const StepView& v);
  FindingSink& sink_;
  const Options& opts_;
  std::vector<std::pair<int64_t, int64_t>> foreign_steps_;  // (StepView::opt, consecutive steps)
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
  /// Gradients were cleared unused (Note [Discarded gradients]); `nonfinite`: they held NaN/Inf,
  /// so the loop skipped its step on purpose (a guard): skipped_step's advice says so.
  void on_discarded(bool nonfinite) { discarded_nonfinite_ = nonfinite; }
  /// update_outside_step: the parameters that changed since the previous step's end.
  void on_step_begin(const std::vector<std::string>& changed, int64_t step);
  /// Whether the last step's gradients were all zero and modified in place before the step, with
  /// nothing to tell whether backward() left them so (Note [Zero gradients]); the sanitizer then
  /// probes the next steps' gradients as backward() leaves them. Reading resets it.
  bool take_probe_request() { return std::exchange(probe_request_, false); }

 private:
  void unchanged_tensors(const StepView& v);
  static bool visible_move(const StepView& v);
  FindingSink& sink_;
  const Options& opts_;
  bool probe_request_ = false;
  bool discarded_nonfinite_ = false;  // the latest gradients read before a clear held NaN/Inf
};

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

class ModeCheck {  // mode.cpp: no_grad_leak, eval_mode (Note [Mode rules])
 public:
  ModeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// The registered modules, once at attach; views refer to them by position.
  void set_modules(std::vector<ModeModule> modules) { modules_ = std::move(modules); }
  void on_forward(const ForwardView& v);
  void on_step(const StepView& v);
  /// A backward was called on a loss without an autograd graph (torch's "does not require grad"
  /// error follows) while the `no_grad_forwards` training forwards since the step all ran under
  /// no_grad: no_grad_leak, naming that forward.
  void on_graphless_backward(int64_t step, int64_t no_grad_forwards);

 private:
  void no_grad_step(const StepView& v);
  std::string forward_named() const;
  std::string last_site_;  // of the latest no_grad forward in train mode
  void eval_step(const StepView& v);
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
  std::vector<ModeModule> modules_;
};

/// Where a step's batch came from, as far as the caller knows (ForwardFacts::loader_*).
struct LoaderView {
  int64_t pass = -1;  ///< serial number of the data loader pass; -1: unknown
  int64_t workers = 0;
  bool worker_init = false;
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

class AutogradCheck {  // autograd.cpp: inplace_before_backward, bad_custom_grad
 public:
  AutogradCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// Whether the training forward of `step` gets the saved-tensor check: the steps the op audit
  /// samples (audit_first_steps, then every audit_every-th).
  bool inplace_sampled(int64_t step) const;
  /// Whether custom Functions are checked again at `step` (besides at their first use): every
  /// gradcheck_every-th step (0: never).
  bool gradcheck_sampled(int64_t step) const;
  /// A saved tensor changed while its version counter did not (the caller compared them).
  void on_saved_tensor_changed(const SavedTensorChange& c, int64_t step);
  /// One directional finite-difference check of a custom Function's backward.
  void on_custom_grad(const CustomGradResult& r, int64_t step);
  /// The checks of one application of custom Functions (one per differentiable input, several
  /// Functions possibly): a Function with a surrogate input (Note [Surrogate gradients]) is not
  /// judged on any input, the others as by on_custom_grad().
  void on_custom_grads(const std::vector<CustomGradResult>& results, int64_t step);

  enum class Verdict : uint8_t { kAgrees, kMismatch, kInconclusive };
  /// Whether the backward passes a gradient where the forward is flat along the direction, or
  /// one that is not the identity's through an identity output (Note [Surrogate gradients]).
  static bool surrogate(const CustomGradResult& r);
  /// The tolerance rule of bad_custom_grad (Note [Directional gradcheck], autograd.cpp).
  static Verdict judge(const CustomGradResult& r);

 private:
  FindingSink& sink_;
  const Options& opts_;
};

class ReplicaCheck {  // replicas.cpp: rank_desync (Note [Replica comparison], replicas.py)
 public:
  ReplicaCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// One comparison across a replica group (or its failure), as the caller's collective found.
  void on_report(const ReplicaReport& r);
  /// Whether the step pass of `step` fingerprints for the comparison (desync_every).
  bool fingerprint_due(int64_t step) const { return step % opts_.desync_every == 0; }
  /// Whether that pass fingerprints the gradients too (desync_state_every: sampled, as hashing
  /// them every step would double the CPU pass's cost).
  bool grads_due(int64_t step) const {
    return opts_.desync_state_every > 0 && step % opts_.desync_state_every == 0;
  }

 private:
  FindingSink& sink_;
  const Options& opts_;
};

class PrecisionCheck {  // precision.cpp: amp_scale_collapse, update_underflow,
                        // low_precision_loss, fp16_overflow of module outputs
 public:
  PrecisionCheck(FindingSink& sink, const Options& opts, Origins& origins)
      : sink_(sink), opts_(opts), origins_(origins) {}
  /// One step of a gradient scaler (amp_scale_collapse).
  void on_scaler(const ScalerStep& s, int64_t step);
  /// What the armed module hooks found (kept in Origins; fp16_overflow of the cause).
  void on_provenance(const Provenance& p);
  void on_loss(const LossView& v);  // low_precision_loss
  void on_step(const StepView& v);  // update_underflow
  /// The scale history kept for optimizer `opt`'s scaler, oldest first: (step, scale, skipped).
  struct ScaleEntry {
    int64_t step = 0;
    double scale = 0.0;
    bool skipped = false;
  };

 private:
  struct Scaler {
    int64_t opt = 0;
    bool stepped = false;       // a step was taken since attach: the scale is past its warm-up
    int64_t run = 0;            // consecutive skips
    int64_t skips = 0;          // all skips
    bool backward_nan = false;  // reported a NaN born in the backward (Note [Backward NaN])
    std::deque<bool> window;    // the last amp_skip_window events after warm-up (true: skipped)
    std::deque<ScaleEntry> history;  // the scales at the last skips and steps (bounded)
  };
  Scaler& scaler(int64_t opt);
  void backward_nan(Scaler& s, int64_t step);  // Note [Backward NaN]
  void collapse(const Scaler& s, const std::string& why, double value, int64_t step);
  FindingSink& sink_;
  const Options& opts_;
  Origins& origins_;
  std::vector<Scaler> scalers_;
  // Per parameter index: consecutive measured steps with most updates rounded away.
  std::vector<int64_t> underflow_steps_;
};

class CheckpointCheck {  // checkpoint.cpp: bad_checkpoint (Note [Checkpoint checks])
 public:
  CheckpointCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_checkpoint(const CheckpointFacts& facts, int64_t step);

 private:
  void sub_stale(const CheckpointFacts& f, const std::string& src, int64_t step);
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

class ResumeCheck {  // resume.cpp, resume_data.cpp: optimizer_reset, bad_checkpoint, data position
 public:
  ResumeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_resume(const ResumeFacts& facts, int64_t step);

 private:
  void renamed_layers(const ResumeFacts& f, int64_t step);  // resume_data.cpp
  void data_position(const ResumeFacts& f, int64_t step);   // resume_data.cpp
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

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

/// The findings of one checkpoint outside a sanitizer (python -m trainsan check): messages with
/// the "bad_checkpoint: " prefix, step 0.
std::vector<Finding> judge_checkpoint(const CheckpointFacts& facts);

/// The bad_custom_grad findings of custom-Function checks outside a sanitizer
/// (trainsan::check_custom_grad): messages with the "bad_custom_grad: " prefix, step 0.
std::vector<Finding> judge_custom_grad(const std::vector<CustomGradResult>& results);

/// Every family, in the order the sanitizer runs them on a step (the order findings appear in:
/// the hook observations, the numbers of the pass, the step-level rules, the mode).
struct Checks {
  Checks(FindingSink& sink, const Options& opts, size_t num_params)
      : origins(opts),
        flow(sink, opts, num_params),
        nonfinite(sink, opts, origins),
        magnitudes(sink, opts),
        integrity(sink, opts),
        mode(sink, opts),
        inputs(sink, opts),
        loss(sink, opts),
        autograd(sink, opts),
        replicas(sink, opts),
        precision(sink, opts, origins),
        checkpoint(sink, opts),
        resume(sink, opts),
        determinism(sink, opts),
        accumulation(sink, opts) {}
  Origins origins;
  GradientFlowCheck flow;
  NonfiniteCheck nonfinite;
  MagnitudeCheck magnitudes;
  StepIntegrityCheck integrity;
  ModeCheck mode;
  InputsCheck inputs;
  LossCheck loss;
  AutogradCheck autograd;
  ReplicaCheck replicas;
  PrecisionCheck precision;
  CheckpointCheck checkpoint;
  ResumeCheck resume;
  DeterminismCheck determinism;
  AccumulationCheck accumulation;
};

}  // namespace trainsan::host
