// Private state of trainsan::Sanitizer, shared by its own two files only (sanitizer.cpp: events
// and orchestration; sanitizer_pass.cpp: the step pass and the StepView it feeds the checks).
// Everything else in host/ talks to it through FindingSink, ReadbackQueue and plain values.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "audit.h"
#include "checks/check.h"
#include "findings.h"
#include "forward_watch.h"
#include "grad_tracker.h"
#include "overhead_budget.h"
#include "readback.h"
#include "rng_state.h"
#include "trace.h"
#include "trainsan/sanitizer.h"

namespace trainsan::host {

// Note [Step numbering]
// ~~~~~~~~~~~~~~~~~~~~~
// A finding's step is the 0-based count of optimizer steps before it. With several optimizers
// (a GAN's two, or one per parameter group), each steps once per iteration: a step pass carries
// the count of its own optimizer's steps (opt_steps), and `step` (what findings of forward-time
// checks and the audits use) is the largest such count, i.e. the iteration. Manual mode (no
// optimizer) counts boundaries under the key -1; the C++ end_step() is optimizer 0. Lagged checks
// (Note [Lagged checks]) keep the step of the pass they read, not the step at which they run.

struct SanitizerImpl {
  SanitizerImpl(std::vector<Parameter> parameters, Options options, Setup setup);

  // Events (sanitizer.cpp).
  void forward(const ForwardFacts& facts);
  void manual_boundary();
  void loss(const at::Tensor& loss);
  void check_updates_outside_step(int64_t opt);
  void stop_before_step(int64_t opt);  // Note [Device stop] (option device_stop)
  void step_end(int64_t opt, bool lr_zero, bool manual,
                const std::vector<double>& group_lr = {});  // sanitizer_pass.cpp
  void scaler_step(const ScalerStep& s);
  void gradients_cleared(int64_t opt);  // Note [Discarded gradients]
  /// The outcome of the step of the losses watched since the previous one (Note [Loss stream]):
  /// skipped by a loss scaler, or a step end. Later outcomes with no loss in between are the same
  /// step's (GradScaler reports its step after the optimizer's step end) and ignored.
  void loss_outcome(bool skipped);
  void module_output(const ModuleInfo& module, const std::vector<at::Tensor>& outputs);
  // trainsan::attach (Setup::binding; Note [C++ attach] in attach.cpp): a forward seen by the
  // watch, and the end of an iteration (each optimizer whose step ran is judged).
  void forward_seen(std::vector<at::Tensor> batch, int64_t opt);
  void end_iteration(bool backward_ran);
  /// Sanitizer::backward_without_graph (Note [Mode rules]).
  void backward_without_graph();
  void write_summary() { trace.summary(step, amp_skips, overhead_s, store.all(), coverage_now()); }
  void close();
  Coverage coverage_now() const;
  // `given` (an index into the caller's parameter list) as an index into `params`, -1 for one
  // left out for its dtype; c10::ValueError naming `what` when out of range.
  int64_t tracked_index(int64_t given, const char* what) const;

  // The step pass (sanitizer_pass.cpp).
  struct Pass;
  void check_pass(const Pass& p, const std::vector<HostCopy>& copies);
  void initial_param_norms();

  // Note [Own time]
  // ~~~~~~~~~~~~~~~~
  // TrainSan's own time (overhead_seconds(), the trace's overhead_ms, the budget's measure of
  // Note [Overhead budget]) is taken whole at the per-step entries: an OwnClock on the stack of
  // forward, watch_loss, loss_reaches, step_begin, step_end, gradients_cleared and end_step
  // counts all of the call (checks, readback, report) once, and the timed sections inside it
  // (add_overhead) then add nothing. Elsewhere those sections count as before. Time spent outside
  // any entry is added as measured by whoever spent it (add_outside: the op audit's dispatcher
  // hooks, the Python side's own time, which the bindings pass in). The budget and the step
  // record read the clock up to now (flush_clock) so that the running entry's time counts for
  // its own step. Before this only sections were timed, and the Python side timed the forward's
  // C++ call besides: what ran outside the sections (the checks' reports, report() and its
  // callback) was missed and the forward's sections counted twice.
  void add_overhead(double s) {
    if (clock_depth == 0) add_outside(s);
  }
  void add_outside(double s) {
    overhead_s += s;
    step_overhead_s += s;
  }
  void flush_clock() {
    if (clock_depth == 0) return;
    const auto now = std::chrono::steady_clock::now();
    add_outside(std::chrono::duration<double>(now - clock_mark).count());
    clock_mark = now;
  }
  int clock_depth = 0;  // OwnClocks on the stack
  std::chrono::steady_clock::time_point clock_mark{};

  // --- configuration ---
  const Options opts;
  const Setup setup;
  // Parameters left out of the passes for their dtype (Note [Dtypes the pass reads]), as
  // "name (dtype)": filled by to_tracked before `params`, reported in coverage()'s `unread`.
  std::vector<std::string> unread;
  // The caller's parameter index -> its index in `params` (-1: left out), for the indices callers
  // give (Setup::mode_modules, local_shards, grad_accumulated): filled by to_tracked.
  std::vector<int64_t> tracked_of;
  std::vector<TrackedParam> params;
  bool have_optimizer = false;

  // --- collaborators, in dependency order (destroyed in reverse: the audit first) ---
  TraceWriter trace;
  FindingStore store;
  ReadbackQueue readback;
  Checks checks;
  GradTracker grads;

  // --- step state ---
  int64_t step = 0;                      // Note [Step numbering]
  std::map<int64_t, int64_t> opt_steps;  // steps per optimizer (-1: manual mode)
  bool closed = false;
  std::vector<int64_t> in_flight;  // optimizers whose step was in flight at attach (step_in_flight)
  // Note [Overhead budget]: which steps get update statistics; per optimizer, the step whose
  // pass last wrote the snapshots of its parameters (-1: at attach).
  OverheadBudget budget{opts.enabled("update_outside_step") ? 0.0 : opts.overhead_budget,
                        opts.overhead_warmup};
  std::map<int64_t, int64_t> snapshot_step;
  // Note [Version trigger] (overhead_budget.h): per optimizer, its parameters' version counters at
  // its step's begin (-1: no gradient then), whether its previous step left one of them unmoved,
  // and the step a trigger made an update step.
  std::map<int64_t, std::vector<int64_t>> versions_at_begin;
  std::map<int64_t, bool> unmoved_last;
  std::map<int64_t, int64_t> forced_update;
  void record_versions(int64_t opt);
  bool versions_unmoved(int64_t opt);
  // Note [Gradients read at the step's beginning] (sanitizer_pass.cpp): per optimizer, the lean
  // rows of its gradients read at its step's begin, and which gradient (tensor and version) each
  // row is of; the step end uses a row where the gradient is still that tensor at that version.
  struct BeginRow {
    size_t copy = 0;  // in BeginRows::copies
    int64_t row = 0;  // in that copy
    at::Tensor grad;  // the gradient read, and its version then
    int64_t version = 0;
  };
  struct BeginRows {
    std::vector<HostCopy> copies;   // one per device
    std::map<size_t, BeginRow> of;  // parameter index -> its gradient's row
  };
  std::map<int64_t, BeginRows> begin_rows;
  /// `grads_final` false: only drop what an earlier begin of `opt` left (Sanitizer::step_begin).
  void read_grads_at_begin(int64_t opt, bool grads_final);
  std::chrono::steady_clock::time_point last_step_end{};
  double overhead_at_last_step_end = 0.0;
  Coverage coverage;  // what was checked (Sanitizer::coverage)
  // Note [Faults] (sanitizer_api.cpp): the internal error after which it stopped checking, or "".
  std::string fault;
  // Previous parameter values (track_updates): each a full copy with exact_updates, else its
  // sample (Note [Update sample]); and the fingerprint of the parameter when its snapshot was
  // written (Note [Update statistics without a snapshot]; nullopt where not known).
  std::vector<at::Tensor> snapshots;
  std::vector<std::optional<uint64_t>> snapshot_hash;
  /// A parameter's update statistics read from its sample: scaled to the whole tensor, and exact
  /// where the fingerprints say the step changed nothing; `now` is its row of this pass (the
  /// fingerprint is then that of its new snapshot).
  void sampled_update(size_t i, const TensorStats& now, const std::optional<TensorStats>& grad,
                      std::optional<UpdateStats>& update);
  static constexpr int64_t kUnseenSparse = 8;
  // ||theta|| of each parameter as of its previous pass (at attach before the first): the
  // denominator of the update ratio, which must be the norm *before* the step (NaN: unknown).
  std::vector<double> prev_param_l2;
  // Each parameter's latest measured statistics (Note [Every-step tier]: steps without a
  // parameter pass show these, marked not measured).
  std::vector<TensorStats> param_stats;
  std::map<std::string, TensorStats> last;  // last_stats()
  std::optional<double> last_loss;          // the latest loss read back, for the next step record
  // Sanitizer::headroom_due's verdict for step headroom_step (Note [Bounded trace]).
  int64_t headroom_step = -1;
  bool headroom_ok = false;
  bool fp16_in_use = false;  // some forward ran under fp16 autocast
  // Note [Mode rules]: of the last grad-enabled forward, the model's own eval flag and the
  // Setup::mode_modules positions in eval mode; forwards so far (outside optimizer steps) with
  // grad enabled and under no_grad in train mode, and their totals at each optimizer's last step.
  bool current_model_eval = false;
  std::vector<size_t> current_eval_modules;
  // Forwards of ForwardFacts::opt -1 count for every optimizer, the others for theirs.
  int64_t grad_forwards_total = 0;
  int64_t no_grad_train_forwards_total = 0;
  std::map<int64_t, std::pair<int64_t, int64_t>> forwards_of_opt;   // opt -> (grad, no_grad)
  std::map<int64_t, std::pair<int64_t, int64_t>> forwards_at_step;  // opt -> (grad, no_grad)
  /// (grad, no_grad train) forwards so far that count for optimizer `opt`.
  std::pair<int64_t, int64_t> forwards_for(int64_t opt) const {
    const auto it = forwards_of_opt.find(opt);
    const auto own = it == forwards_of_opt.end() ? std::pair<int64_t, int64_t>{0, 0} : it->second;
    return {grad_forwards_total + own.first, no_grad_train_forwards_total + own.second};
  }
  // Note [Foreign backwards]: such backwards so far, the latest one, and the count at each
  // optimizer's previous step (-1: manual mode).
  int64_t foreign_total = 0;
  ForeignBackward foreign_latest;
  std::map<int64_t, int64_t> foreign_at_step;
  std::vector<const void*> param_impls;  // walk_loss: the parameters' TensorImpls, sorted
  void foreign_backward(const ForeignBackward& facts);
  /// A LibTorch loss (Setup::gathers_events false): its graph walked as Note [Loss roots] does in
  /// Python, reported to foreign_backward when it reaches none of our parameters.
  void walk_loss(const at::Tensor& loss);
  // The walk from `loss` (Note [Foreign backwards]): 1 when it reaches one of the parameters, 0
  // when it ends without (the other leaves counted in *f), -1 out of budget or no graph.
  int walk(const at::Tensor& loss, ForeignBackward* f);
  int loss_reaches(const at::Tensor& loss);
  // Note [Accumulation windows]: since the previous optimizer step (outside steps), training
  // losses and training forwards, the forwards' batch sizes summed (-1: one unknown), the first
  // one's and whether all were equal; the latest known data loader pass.
  int64_t win_losses = 0;
  int64_t win_forwards = 0;
  int64_t win_samples = 0;
  int64_t win_batch = -1;
  bool win_uniform = true;
  int64_t win_pass = -1;
  void window_forward(const ForwardFacts& facts);              // sanitizer_window.cpp
  int64_t window_end(int64_t step, int64_t opt, bool judged);  // the step's count of backwards
  void window_cleared(int64_t opt);  // zero_grad outside a step (sanitizer_window.cpp)
  int64_t no_grad_site_step = -1;    // the step whose no_grad forward's caller was looked up
  int64_t input_hash_step = -1;
  std::map<int64_t, uint64_t> input_hashes;   // step -> its inputs' fingerprint (the latest few)
  std::map<int64_t, uint64_t> target_hashes;  // step -> its loss targets' fingerprint
  int64_t target_hash_step = -1;
  void targets(const std::vector<at::Tensor>& targets);
  int64_t amp_skips = 0;
  // Note [Loss stream]: the sequence number of the next step outcome, whether a loss was watched
  // since the last one, and whether a loss scaler skipped a step since the last step end (a
  // LibTorch end_step(loss) gives its losses after the scaler's report).
  int64_t loss_seq = 0;
  bool loss_waiting = false;
  bool scaler_skipped = false;
  // rank_desync (compare_replicas, when enabled): the fingerprints of the passes checked since
  // they were last taken.
  bool replicas = false;
  std::vector<StepFingerprints> fingerprints;
  // The comparison itself where this library runs it (trainsan::compare_replicas over a c10d
  // process group, replicas_pg.cpp); told of every step event, and finished by close().
  struct ReplicaDriver {
    virtual ~ReplicaDriver() = default;
    virtual void on_event(int64_t opt, bool skipped) = 0;  // after the event's pass
    virtual void finish() = 0;                             // close(): compare what is pending
  };
  std::unique_ptr<ReplicaDriver> replica_driver;
  // nondeterminism (Sanitizer::rerun, rerun.cpp): what begin_step() found on a step due for a
  // re-run, the state each re-run starts from.
  struct RerunStart {
    int64_t step = -1;
    RngState rng;
    std::vector<at::Tensor> buffers;  // copies of Setup::buffers
  };
  std::optional<RerunStart> rerun_start;
  void capture_rerun_start();
  // Re-run attribution (Options::rerun_on_error; Note [Re-run attribution] in
  // checks/attribution.cpp; attribution.cpp). A LibTorch loop's step (Setup::rerun_step): the
  // state its training forward started from, its inputs and the losses it watched.
  struct ErrorStart {
    int64_t step = -1;
    RngState rng;
    std::vector<at::Tensor> buffers;  // copies of Setup::buffers
    std::vector<at::Tensor> inputs;   // references (the batch's fingerprint)
    std::vector<at::Tensor> losses;   // detached references, in the order watched
    int64_t forwards = 0;
  };
  std::optional<ErrorStart> error_start;
  void capture_error_start(const std::vector<at::Tensor>& inputs);
  RerunOutcome rerun_for(const Finding& f);  // runs rerun_step once
  std::function<RerunRecord()> rerun_step;   // Setup::rerun_step, or set_rerun_step's
  int64_t attribution_reruns = 0;            // re-runs made (at most opts.rerun_on_error)
  // step -> the kind whose re-run it had and the verdict (the last few steps)
  std::map<int64_t, std::pair<std::string, RerunVerdict>> attributed;
  std::set<std::string> attribution_answered;  // kind + "\x1f" + tensor
  double overhead_s = 0.0;                     // total measured
  double step_overhead_s = 0.0;                // since the last step record

  // The kinds of kinds.def whose `event` arrived at least once (coverage: an event kind that
  // never had its event is unchecked, for a caller that does not gather them itself).
  std::set<std::string> events_seen;
  // Custom functions check_custom_grad has measured (bad_custom_grad: each at its first call).
  std::set<std::string> custom_grad_checked;
  // trainsan::attach: begin_step()'s inputs, for the forward the watch sees next.
  std::vector<at::Tensor> pending_inputs;

  // Last members: destroyed first, so no observer sees a half-gone sanitizer.
  std::unique_ptr<OpAudit> audit;
  std::unique_ptr<ForwardWatch> watch;  // with Setup::binding
};

// Note [Own time]: times a per-step entry whole (nested entries count once).
class OwnClock {
 public:
  explicit OwnClock(SanitizerImpl& im) : im_(im) {
    if (im_.clock_depth++ == 0) im_.clock_mark = std::chrono::steady_clock::now();
  }
  ~OwnClock() {
    im_.flush_clock();
    --im_.clock_depth;
  }
  OwnClock(const OwnClock&) = delete;
  OwnClock& operator=(const OwnClock&) = delete;

 private:
  SanitizerImpl& im_;
};

}  // namespace trainsan::host
