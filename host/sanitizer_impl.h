// Private state of trainsan::Sanitizer, shared by its own three files only (sanitizer.cpp: events
// and orchestration; sanitizer_pass.cpp: the step pass and the StepView it feeds the checks;
// sanitizer_api.cpp: the front door). The families' own bookkeeping is in their feeders
// (host/feeds/, Note [Feeders] in feeds/feed.h), which see it through FeedContext; everything else
// in host/ talks to it through FindingSink, ReadbackQueue and plain values.
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
#include "checks/checks.h"
#include "feeds/accumulation_feed.h"
#include "feeds/attribution_feed.h"
#include "feeds/custom_grad_feed.h"
#include "feeds/feed.h"
#include "feeds/foreign_feed.h"
#include "feeds/replica_feed.h"
#include "feeds/rerun_feed.h"
#include "findings.h"
#include "forward_watch.h"
#include "grad_tracker.h"
#include "overhead_budget.h"
#include "own_time.h"
#include "readback.h"
#include "rng_state.h"
#include "trace.h"
#include "trainsan/sanitizer.h"
#include "update_stats.h"

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
  bool manual_unwritten();  // Note [Manual-mode steps]: no parameter written since the last one
  void loss(const at::Tensor& loss);
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
  /// The step's loss as the watch saw it (Note [C++ attach]): the root of a backward, or a
  /// non-finite one-element tensor with a graph that the program reads. A non-finite one is
  /// checked and said now. Returns whether it is the model's loss (a probe's is not).
  bool loss_seen(const at::Tensor& root, ForwardWatch::LossMoment moment);
  /// Whether `loss` was checked by loss_seen since the last iteration's end (end_step(loss) does
  /// not check it twice).
  bool loss_seen_at_backward(const at::Tensor& loss) const;
  void end_iteration(bool backward_ran);
  /// Sanitizer::backward_without_graph (Note [Mode rules]).
  void backward_without_graph();
  void write_summary() {
    trace.summary(step, amp_skips, time.overhead_s, store.all(), coverage_now());
  }
  void close();
  Coverage coverage_now() const;
  // `given` (an index into the caller's parameter list) as an index into `params`, -1 for one
  // left out for its dtype; c10::ValueError naming `what` when out of range.
  int64_t tracked_index(int64_t given, const char* what) const;

  // The step pass (sanitizer_pass.cpp).
  struct Pass;
  void check_pass(const Pass& p, const std::vector<HostCopy>& copies);

  // Note [Own time] (own_time.h): add_overhead for a timed section, add_outside for time spent
  // outside any entry.
  void add_overhead(double s) { time.add_overhead(s); }
  void add_outside(double s) { time.add_outside(s); }
  void flush_clock() { time.flush_clock(); }
  OwnTime time;

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
  std::vector<int64_t> manual_versions;  // the parameters' versions at the last manual boundary
  bool closed = false;
  std::vector<int64_t> in_flight;  // optimizers whose step was in flight at attach (step_in_flight)
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
  int64_t no_grad_site_step = -1;  // the step whose no_grad forward's caller was looked up
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

  // The kinds of kinds.def whose `event` arrived at least once (coverage: an event kind that
  // never had its event is unchecked, for a caller that does not gather them itself).
  std::set<std::string> events_seen;
  // trainsan::attach: begin_step()'s inputs, for the forward the watch sees next.
  std::vector<at::Tensor> pending_inputs;
  // trainsan::attach: the losses checked by loss_seen since the last iteration's end.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> backward_losses;

  // The feeders (Note [Feeders]): what each sees of this sanitizer, each by name, and all of them
  // in the order the shared events reach them.
  FeedContext ctx{opts, setup,    params,      checks, grads,     store,  trace,
                  time, coverage, events_seen, step,   opt_steps, closed, watch};
  UpdateStatistics updates{ctx, readback};  // the step pass's update statistics
  ForeignFeed foreign{ctx};
  AccumulationFeed accumulation{ctx};
  RerunFeed reruns{ctx};
  AttributionFeed attribution{ctx};
  CustomGradFeed custom_grad{ctx};
  ReplicaFeed replicas{ctx};
  const std::vector<Feed*> feeds{&foreign, &accumulation, &reruns, &replicas};

  // Last members: destroyed first, so no observer sees a half-gone sanitizer.
  std::unique_ptr<OpAudit> audit;
  std::unique_ptr<ForwardWatch> watch;  // with Setup::binding
};

}  // namespace trainsan::host
