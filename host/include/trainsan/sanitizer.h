// Public C++ API of the training-loop sanitizer: the one front door, for LibTorch loops and for
// the Python package (bindings/csrc/ops.cpp binds this class and nothing else of host/).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/autograd_facts.h"
#include "trainsan/checkpoint_facts.h"
#include "trainsan/coverage.h"
#include "trainsan/custom_grad.h"
#include "trainsan/determinism_facts.h"
#include "trainsan/facts_table.h"
#include "trainsan/finding.h"
#include "trainsan/kinds.h"
#include "trainsan/options.h"
#include "trainsan/precision_facts.h"
#include "trainsan/replica_facts.h"
#include "trainsan/resume_facts.h"
#include "trainsan/stats.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace trainsan {

/// A parameter to watch, and the optimizer that steps it (fields: parameter.def).
struct Parameter {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/parameter.def"
#undef TRAINSAN_FACT
};

/// A module named in findings (eval_mode, nonfinite_activation, no_grad_leak; fields:
/// module_info.def).
struct ModuleInfo {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/module_info.def"
#undef TRAINSAN_FACT
};

/// What the sanitizer reads of a model and its optimizers at each forward and step:
/// trainsan::attach (trainsan/attach.h) implements it over torch::nn::Module and
/// torch::optim::Optimizer (Note [C++ attach] in host/attach.cpp). With one in Setup::binding, the
/// sanitizer sees the forward itself (its first op reading a parameter together with a batch) and
/// end_step() judges each optimizer whose step ran.
struct ModelBinding {
  virtual ~ModelBinding() = default;
  /// The train/eval flag now of the model that optimizer `opt` trains (-1: the first model).
  virtual bool training(int64_t opt) const = 0;
  /// Per Setup::mode_modules: true when that module is in eval mode now.
  virtual std::vector<bool> module_eval() const = 0;
  /// The optimizers whose step ran since the previous call (their parameters changed in place:
  /// the version counters moved), in index order.
  virtual std::vector<int64_t> stepped() = 0;
  /// The learning rate of each param group of optimizer `opt` now (NaN where unknown).
  virtual std::vector<double> group_lr(int64_t opt) const = 0;
  /// The resume facts of optimizer `opt` at its first step after a model load that the binding
  /// saw (trainsan::load), asked just before that step is judged; nothing otherwise.
  virtual std::optional<ResumeFacts> first_step_after_load(int64_t /*opt*/) { return std::nullopt; }
};

/// What one run of a training step's forward and backward produced, for the nondeterminism
/// re-runs (Sanitizer::rerun): the values the caller chooses to compare, in execution order, e.g.
///   trainsan::RerunRecord r;
///   r.add("model", {out}).add("loss", {loss});
/// Their floating tensors are fingerprinted (TensorStats::hash). The gradients are the run's
/// `grads`; Sanitizer::rerun(step_fn, ...) reads them from the sanitizer's parameters' .grad
/// where step_fn leaves them empty.
struct RerunRecord {
  struct Output {
    std::string name;  ///< e.g. a module's name; "" is the model itself
    std::string type;  ///< e.g. "Linear"; may be empty
    std::vector<at::Tensor> tensors;
    /// Fingerprints (TensorStats::hash) taken by the caller while the run ran, e.g. in a module's
    /// forward hook, before a later in-place op could change the output; they come before those
    /// of `tensors`.
    std::vector<uint64_t> hashes;
  };
  std::vector<Output> outputs;
  /// (name, gradient) of the run's gradients in backward order (the output's side first); those
  /// the fingerprint cannot read (undefined, sparse, another device) are left out.
  std::vector<std::pair<std::string, at::Tensor>> grads;
  RerunRecord& add(std::string name, std::vector<at::Tensor> tensors, std::string type = "") {
    outputs.push_back({std::move(name), std::move(type), std::move(tensors), {}});
    return *this;
  }
  RerunRecord& add_hashes(std::string name, std::vector<uint64_t> hashes, std::string type = "") {
    outputs.push_back({std::move(name), std::move(type), {}, std::move(hashes)});
    return *this;
  }
};

/// How a step is re-run for the nondeterminism check (Sanitizer::rerun; Note [One re-run driver]
/// in host/feeds/rerun_feed.cpp): what differs between loops is given here, the rest — two runs,
/// each between start() and restore(), the sanitizer's gradient hooks and op audit looking away,
/// the fingerprints in one pass, compare_reruns, rerun_result — is the driver's.
struct StepRerun {
  /// Puts the state the step started from in place (RNG state, buffers, gradients cleared where
  /// the run fills .grad); called before each run.
  std::function<void()> start;
  /// Puts back what start() replaced; called after each run that start() began, on an exception
  /// too. May be empty (the caller puts the state back after rerun() returns).
  std::function<void()> restore;
  /// Runs the step's forward and backward once more: what it recorded, gradients included.
  std::function<RerunRecord()> run;
};

/// How the sanitizer is wired into a loop; the defaults suit a LibTorch loop. Its fields by name
/// (mode_modules, manual, header_extra, skip_frames, buffers, gathers_events, documented there):
/// the table setup.def, through which the Python package's handle fills it (SanitizerArgs).
struct Setup {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/setup.def"
#undef TRAINSAN_FACT
  // Not in the table (a callable or a C++ object cannot cross a dict): set from C++ only.
  /// Receives each new finding with the policy's answer, at the end of the event that found it.
  /// Default: throw TrainingBugError for Action::kRaise (after completing the trace's summary, so
  /// that an uncaught error still leaves a complete trace), print to stderr for Action::kWarn.
  std::function<void(const Finding&, Action)> report;
  /// Re-run attribution for a LibTorch loop (Options::rerun_on_error; Note [Re-run attribution]
  /// in host/checks/attribution.cpp): runs the current step's forward, and its backward
  /// (loss.backward()) where it can, again on the same batch, and returns the step's loss (or
  /// what else it compares) as a RerunRecord, e.g.
  ///   setup.rerun_step = [&] { auto loss = crit(model->forward(x), y); loss.backward();
  ///                            return trainsan::RerunRecord().add("loss", {loss}); };
  /// Called at most once per new nonfinite_loss, nonfinite_grad or loss_spike finding,
  /// before the policy acts, from the RNG state and Setup::buffers as begin_step() (or the
  /// forward trainsan::attach saw) found them; .grad, the RNG state and the buffers are put back
  /// afterwards. Its tensors are compared with the losses watched in that step (watch_loss,
  /// end_step(loss)). It must not call this sanitizer's event methods; an exception it throws is
  /// caught and reported in the finding ("could not re-run"). Empty: no re-run.
  std::function<RerunRecord()> rerun_step;
  /// The model and optimizers, read at each forward and step (trainsan::attach sets it).
  std::shared_ptr<ModelBinding> binding;
};

/// A Sanitizer's constructor arguments as one struct, by name: the dict the Python package's
/// handle (torch.classes.trainsan.Sanitizer, bindings/csrc/ops.cpp) is built from (Note [Facts by
/// name]: facts_from_dict<SanitizerArgs>). Its table: `parameters` and `options`, then the rows
/// of Setup's table (setup.def) at the same level.
struct SanitizerArgs {
  std::vector<Parameter> parameters;
  /// Options::set(name, value) for each, in order.
  std::vector<std::pair<std::string, std::string>> options;
  Setup setup;
};

template <>
struct FactTable<Parameter> {
  static constexpr const char* kName = "Parameter";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/parameter.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<ModuleInfo> {
  static constexpr const char* kName = "ModuleInfo";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/module_info.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<Setup> {
  static constexpr const char* kName = "Setup";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/setup.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<SanitizerArgs> {
  static constexpr const char* kName = "SanitizerArgs";
  template <class S, class F>
  static void each(S& s, F&& f) {
    f("parameters", s.parameters);
    f("options", s.options);
    FactTable<Setup>::each(s.setup, f);
  }
};

/// Facts of one forward of the model. Grad mode and autocast are read by the sanitizer itself.
struct ForwardFacts {
  bool training = true;            ///< the model's train/eval flag
  std::vector<at::Tensor> inputs;  ///< the forward's tensor inputs (duplicate_batch)
  std::vector<bool> module_eval;   ///< per Setup::mode_modules: true when in eval mode
  /// How many times so far a data loader was iterated anew after its previous iterator had
  /// yielded only its first batch of several (duplicate_batch; the Python package counts them).
  int64_t data_restarts = 0;
  /// The optimizer whose parameters this forward read (a GAN's generator or discriminator), so
  /// that the mode rules count it for that optimizer only; -1: every optimizer of the model.
  int64_t opt = -1;
  /// The data loader pass (one iteration over a loader: a serial number) the step's batch came
  /// from; -1 where unknown (duplicate_batch's repeats within a pass: Note [Repeated batches]).
  int64_t loader_pass = -1;
  /// That loader's worker processes, and whether it was given a worker_init_fn.
  int64_t loader_workers = 0;
  bool loader_worker_init = false;
  /// Other tensors of the step's batch than the forward's inputs (the labels a loader yields
  /// next to them): label_dtype compares a loss's class targets with the small-integer ones.
  std::vector<at::Tensor> batch = {};
  /// A sampled fingerprint of the batch a data loader yielded since the previous training forward
  /// (0: none, or unknown): duplicate_batch's Note [Ignored batches] (host/checks/inputs.cpp).
  int64_t loader_batch = 0;
};

/// For a RecomputeRecord (Note [Recompute checks]; Sanitizer::recompute): the fingerprints
/// (TensorStats::hash, one pass) of the floating tensors of `outputs`, in order...
std::vector<uint64_t> output_fingerprints(const std::vector<at::Tensor>& outputs);
/// ...and of the RNG states now: the CPU generator's, then those of the CUDA devices of `on`.
/// Take them as the region's call starts:
///   trainsan::RecomputeRecord fwd{"block", "", {}, trainsan::rng_fingerprints({x})};
///   fwd.hashes = trainsan::output_fingerprints({block(x)});
std::vector<uint64_t> rng_fingerprints(const std::vector<at::Tensor>& on = {});

namespace host {
struct SanitizerImpl;
struct ReplicaAccess;  // trainsan::compare_replicas over a c10d process group (replicas.h)
}  // namespace host

/// Sanitizer for a training loop:
///
///   trainsan::Sanitizer san(model->named_parameters(), opts);
///   for (...) {
///     san.begin_step({x});
///     auto loss = ...; san.watch_loss(loss);
///     loss.backward(); optimizer.step();
///     san.end_step();   // checks (and, with policy "raise", throws TrainingBugError)
///     optimizer.zero_grad();
///   }
///   san.close();
///
/// Every event method reports the findings that are new at that event through Setup::report
/// (by default: policy "raise" throws TrainingBugError on an error, warnings go to stderr).
class Sanitizer {
 public:
  using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

  /// Every parameter in one optimizer (index 0).
  explicit Sanitizer(const NamedTensors& named_parameters, Options options = {});
  template <typename OrderedDict>
  explicit Sanitizer(const OrderedDict& named_parameters, Options options = {})
      : Sanitizer(to_named(named_parameters), std::move(options)) {}
  Sanitizer(std::vector<Parameter> parameters, Options options, Setup setup);
  ~Sanitizer();
  Sanitizer(const Sanitizer&) = delete;
  Sanitizer& operator=(const Sanitizer&) = delete;
  Sanitizer(Sanitizer&&) noexcept;
  Sanitizer& operator=(Sanitizer&&) noexcept;

  // --- a LibTorch loop ---
  /// Start of a training step, before the forward: update_outside_step, then forward() with
  /// these inputs (grad mode, duplicate inputs) and `module_eval` (see Setup::mode_modules).
  void begin_step(const std::vector<at::Tensor>& inputs = {},
                  const std::vector<bool>& module_eval = {});
  /// Check a loss for NaN/Inf (nonfinite_loss).
  void watch_loss(const at::Tensor& loss);
  /// The targets the step's loss compared the model's output with (the first call of a step
  /// counts): fingerprinted for the trace's step record ("targets"), read back asynchronously.
  void loss_targets(const std::vector<at::Tensor>& targets);
  /// After optimizer.step(): step_end(0, lr_zero). `lr_zero` says the step ran with learning
  /// rate 0 (warm-up), so "no change" is fine. Attached with trainsan::attach: each optimizer
  /// whose step ran since the previous end_step is judged, with its groups' learning rates.
  void end_step(bool lr_zero = false);
  /// watch_loss(loss) (when defined), then end_step(): the one call per iteration of a loop
  /// attached with trainsan::attach. A loss scaler that skipped the step reports
  /// scaler_step({opt, true, scale}) before it: the skip is not a skipped_step.
  void end_step(const at::Tensor& loss);
  /// The same with every loss of the iteration (a GAN's discriminator and generator losses).
  void end_step(const std::vector<at::Tensor>& losses);

  // --- the full event vocabulary (what the Python package's hooks call) ---
  /// A forward of the model (training or not).
  void forward(const ForwardFacts& facts);
  /// A backward was called on a loss without an autograd graph (torch's "element 0 of tensors
  /// does not require grad" error follows): no_grad_leak when every training forward of the
  /// model since its optimizer's previous step ran under no_grad in train mode, naming where that
  /// forward was called (the Python package calls it from its wrapper of torch.autograd.backward).
  void backward_without_graph();
  /// A backward whose autograd graph, walked to its end, reached none of the parameters but
  /// reached other requires-grad leaves (Note [Foreign backwards], host/checks/gradient_flow.cpp:
  /// missing_grad when the stepped parameters get no gradient meanwhile). The Python package
  /// reports them from its walk of each backward's root; a LibTorch loop's watched loss (also
  /// end_step(loss)) is walked by the sanitizer itself.
  void foreign_backward(const ForeignBackward& facts);
  /// Whether a step already looked like Note [Foreign backwards]: only then is it worth naming
  /// what a foreign backward reached (ForeignBackward::holder, a search).
  bool foreign_suspected() const;
  /// Optimizer `opt` is about to step; its gradients are read now (Note [Gradients read at the
  /// step's beginning] in host/sanitizer_pass.cpp). `grads_final` false: the step itself will
  /// change them without moving their version counters (a fused optimizer that unscales them for
  /// a loss scaler), so they are read at step_end instead.
  void step_begin(int64_t opt, bool grads_final = true);
  /// Optimizer `opt` has stepped: the fused pass over its gradients, parameters and snapshot,
  /// then the checks (Note [Lagged checks]: on a GPU, of the previous step unless sync).
  /// `group_lr`: the learning rate of each of its param groups (Parameter::group), NaN where
  /// unknown; empty: unknown, taken as nonzero unless `lr_zero`.
  void step_end(int64_t opt, bool lr_zero, const std::vector<double>& group_lr = {});
  /// The sanitizer was attached inside optimizer `opt`'s step (a callback inside
  /// `step(closure)`): instead of step_begin. What remains of that step (closure forwards and
  /// backwards) is part of it, and its step_end is not judged by the step-level rules.
  void step_in_flight(int64_t opt);
  /// The local shards (DTensor._local_tensor) of parameters `indices` and of their gradients as
  /// of now (undefined: no gradient), read by the next step pass.
  void local_shards(const std::vector<int64_t>& indices, const std::vector<at::Tensor>& params,
                    const std::vector<at::Tensor>& grads);
  /// A gradient was accumulated into parameter `index` (Parameter::external_grad_hook).
  void grad_accumulated(int64_t index);
  /// The GradScaler skipped the step of optimizer `opt` because of Inf/NaN gradients (a
  /// scaler_step with an unknown scale).
  void amp_skip(int64_t opt);
  /// The gradients of optimizer `opt` (-1: every parameter) are about to be cleared
  /// (zero_grad): those a backward produced since the last optimizer step that no step used are
  /// read first (nonfinite_grad of a loop that skips its step: Note [Discarded gradients]).
  void gradients_cleared(int64_t opt);
  /// A gradient scaler's step (amp_scale_collapse; traced): skipped or taken, and its scale.
  void scaler_step(const ScalerStep& step);
  /// Whether the current step's training forward and backward get the overflow-provenance flags
  /// (Note [Overflow provenance] in host/checks/precision.cpp: sampled, and after a non-finite).
  bool provenance_armed() const;
  /// What the armed module hooks found in the current step (give the forward's before the loss
  /// is watched, the backward's before the step ends: the non-finite findings quote them).
  void provenance(const Provenance& facts);
  /// A checkpoint of this model is being saved (bad_checkpoint; Note [Checkpoint checks] in
  /// host/checks/checkpoint.cpp): the policy answers before it is written.
  void checkpoint(const CheckpointFacts& facts);
  /// A checkpoint checked through this sanitizer (bad_checkpoint, its policy answering at once): a
  /// file written by torch::save(module, path), or (key, tensor) entries, against `model` when
  /// given. trainsan/checkpoint.h has the same check without a sanitizer; its
  /// checkpoint_facts(CheckpointContents) gives checkpoint() the optimizer states too.
  void check_checkpoint(const std::string& path, const torch::nn::Module* model = nullptr);
  void check_checkpoint(const NamedTensors& entries, const torch::nn::Module* model = nullptr,
                        const std::string& source = "the checkpoint");
  /// Whether the current step is re-run for the nondeterminism check (rerun_every).
  bool rerun_due() const;
  /// Where a re-run of the current step first differed (nondeterminism).
  void rerun_result(const RerunFacts& facts);
  /// The nondeterminism check of the current step (Note [Re-run determinism]); does nothing unless
  /// rerun_due(). Call it after the step's backward, before the optimizer step. `step_fn` runs
  /// the step's forward and backward again on the same batch (loss.backward() inside) and returns
  /// what it records; it is called twice, and must not call this sanitizer's event methods.
  /// Each call starts from the RNG state (CPU, and the CUDA devices of the parameters) and the
  /// Setup::buffers as begin_step() found them (without a begin_step() of this step: as they are
  /// now), with every parameter's .grad cleared; afterwards .grad, the RNG state and the buffers
  /// are put back as rerun() found them, so the step goes on unchanged. The two calls' records,
  /// then their gradients in backward order, are compared (compare_reruns); `step`, what the
  /// step's own forward recorded (the same values), is compared with them when begin_step()
  /// started this step. A difference is reported through rerun_result().
  void rerun(const std::function<RerunRecord()>& step_fn, const RerunRecord& step = {});
  /// The same check with the re-run and its start state given by the caller (the Python
  /// package's: its runs take the gradients with torch.autograd.grad from the gradients that
  /// reached the step's outputs, and start from the state its forward recorded); does nothing
  /// unless rerun_due(). Call it after the step's backward, before the optimizer step. `how.run`
  /// is called twice, each between how.start() and how.restore(); the two records, then their
  /// gradients, are compared with each other and with `step` (the step's own forward; none: not
  /// recorded, or started elsewhere), and a difference is reported through rerun_result(). An
  /// exception of a callable propagates, with restore() called. Its time is the caller's to count
  /// (add_overhead; the Python package's step hooks count it).
  void rerun(const StepRerun& how, const std::optional<RerunRecord>& step);
  /// Re-run attribution (Options::rerun_on_error; Note [Re-run attribution] in
  /// host/checks/attribution.cpp): what the new finding `f` (its kind and tensor) needs.
  /// kNone: nothing (off, not a nonfinite_loss, nonfinite_grad or loss_spike, already
  /// answered); kRun: a re-run of its step, whose outcome attribute() takes; kKnown: no re-run, and
  /// attribute(f, std::nullopt) answers (its step was re-run for an earlier finding, or the
  /// rerun_on_error re-runs are spent). A LibTorch loop with Setup::rerun_step needs none of this:
  /// each event does it before the policy acts.
  enum class RerunNeed : uint8_t { kNone = 0, kRun = 1, kKnown = 2 };
  RerunNeed rerun_needed(const Finding& f) const;
  /// Puts the answer of a re-run of `f`'s step (`outcome`; nullopt: rerun_needed said kKnown) in
  /// the stored finding and returns it: `reproduces` and the verdict appended to the message
  /// (judge_rerun), a "rerun_attribution" trace record, and, where it reproduces, a
  /// "poison_batch" record of the batch's fingerprint (docs/trace.md). Counts against the
  /// rerun_on_error budget when `outcome` is given.
  Finding attribute(const Finding& f, const std::optional<RerunOutcome>& outcome);
  /// Sets Setup::rerun_step (re-run attribution) after construction, e.g. on the sanitizer
  /// trainsan::attach returns; an empty function turns it off.
  void set_rerun_step(std::function<RerunRecord()> step_fn);
  /// Whether the current step's recomputed regions are checked (recompute_every; Note
  /// [Recompute checks] in host/checks/determinism.cpp).
  bool recompute_due() const;
  /// The recompute check of one region: what its forward recorded and what its recompute in the
  /// backward recorded (the fingerprints of the same outputs, and of the RNG states at their
  /// starts). A difference (compare_recompute) is reported through rerun_result(). Call it on
  /// the steps recompute_due() names, before the optimizer step.
  void recompute(const RecomputeRecord& forward, const RecomputeRecord& recompute);
  /// A resume event (optimizer_reset; Note [Resume checks] in host/checks/resume.cpp).
  void resume(const ResumeFacts& facts);
  /// The input fingerprints of a previous run's steps (its trace, resume_trace): this run is its
  /// resume, and its first steps must not replay them (Note [Replayed data]).
  void inputs_seen(const std::vector<uint64_t>& hashes, const std::vector<int64_t>& steps);
  /// Whether the current step records range counts (precision headroom: a trace is written and
  /// the step is a headroom_every-th one).
  bool headroom_due() const;
  /// Writes one record (a JSON object, e.g. a range record) to the trace, if one is written.
  void trace_record(const std::string& json_object);
  /// The op audit ignores this thread's ops (and its autograd nodes) while paused: a compiled
  /// call of the model, whose tracing runs autograd nodes inside the forward (AOTAutograd's
  /// joint trace) and whose graph's ops are not audited (Note [Compiled regions]). Nests.
  static void pause_audit(bool paused);
  /// Outputs of a module (nonfinite_activation, opt-in); reads them at once.
  void module_output(const ModuleInfo& module, const std::vector<at::Tensor>& outputs);
  /// Check a class-index target before the op runs (label_range, batch_mismatch). `input` may be
  /// undefined (one_hot); num_classes < 0 takes the class count from `input`.
  void check_target(const std::string& op, const at::Tensor& input, const at::Tensor& target,
                    std::optional<int64_t> ignore_index, int64_t num_classes);
  /// A tensor saved for backward changed without its version counter moving
  /// (inplace_before_backward); the caller's saved-tensor hooks compared the two.
  void saved_tensor_changed(const SavedTensorChange& change);
  /// A directional finite-difference check of a custom autograd Function (bad_custom_grad).
  void custom_grad_result(const CustomGradResult& result);
  /// The directional checks of one application of a custom Function, one per differentiable
  /// input, judged together: a Function that passes a surrogate gradient on one input (Note
  /// [Surrogate gradients], host/checks/autograd.cpp) is not reported on any.
  void custom_grad_results(const std::vector<CustomGradResult>& results);
  /// bad_custom_grad of a custom autograd function `fn` at `inputs` (its arguments in this step):
  /// at its first call (by `name`), then on gradcheck_step() steps: measure_custom_grad()
  /// (custom_grad.h) judged as by custom_grad_results(). `name` names it in findings, e.g.
  /// "MyLinear". Pass small inputs (a few rows of the batch) where the function allows: the
  /// measurement evaluates it 1 + 2·(differentiable inputs) times in float64.
  void check_custom_grad(const std::string& name, const TensorFunction& fn,
                         const std::vector<at::Tensor>& inputs);
  /// Whether the current step's training forward gets the saved-tensor check
  /// (inplace_before_backward on, a sampled step of the op audit's schedule, not inside an
  /// optimizer step's closure).
  bool inplace_check_step() const;
  /// Whether custom Functions are checked again at the current step (bad_custom_grad,
  /// gradcheck_every): custom_grad_due(false).
  bool gradcheck_step() const;
  /// Whether a custom Function applied now is checked: bad_custom_grad on, the sanitizer open,
  /// not inside an optimizer step's closure, and `first_use` (its first application) or a
  /// gradcheck_every step.
  bool custom_grad_due(bool first_use) const;
  /// Replicas of these parameters train in other processes and the caller compares them
  /// (rank_desync; Note [Replica comparison] in bindings/trainsan/replicas.py): from now on every
  /// step pass due (desync_every) fingerprints the parameters and gradients and keeps the
  /// fingerprints for take_fingerprints().
  void compare_replicas();
  /// The fingerprints of the step passes checked since the last call, in step order (on a GPU a
  /// pass lands a step later: Note [Lagged checks]); `wait_all`: check every pass still in
  /// flight first (before close(), so its comparison can still be reported).
  std::vector<StepFingerprints> take_fingerprints(bool wait_all = false);
  /// The outcome of one comparison across a replica group (rank_desync).
  void replica_report(const ReplicaReport& report);
  /// Time spent for this sanitizer outside C++ (e.g. in Python hooks), for the overhead figures.
  void add_overhead(double seconds);
  /// Flush pending checks, write the trace summary, remove every hook. Idempotent.
  void close();

  std::vector<Finding> findings() const;
  /// Statistics of the last checked step, by name: "<param>.grad", "<param>", "<param>.update".
  std::map<std::string, TensorStats> last_stats() const;
  int64_t step() const;
  /// Whether the autograd graph of `loss` reaches one of the attached parameters: 1 yes, 0 no
  /// (walked to its end), -1 could not tell (no graph, or past 20000 nodes). A walk in C++, as
  /// the Python package's loss-root attribution makes (Note [Loss roots]).
  int64_t loss_reaches(const at::Tensor& loss);
  double overhead_seconds() const;
  /// True while the gradient hooks are installed (until close()).
  bool hooks_installed() const;
  /// True while the op audit observes this step's forward.
  bool auditing() const;
  /// What was checked so far, and which enabled checks never had what they need.
  Coverage coverage() const;
  /// The trace's failure (it could not be opened or written: Note [Bounded trace]) if it was not
  /// told yet, else "": whoever takes it tells the user; otherwise the next event warns with it
  /// (TORCH_WARN).
  std::string take_trace_error();
  /// Setup::binding (trainsan::attach's); null without one.
  ModelBinding* binding() const;

 private:
  template <typename OrderedDict>
  static NamedTensors to_named(const OrderedDict& d) {
    NamedTensors out;
    for (const auto& item : d) out.emplace_back(item.key(), item.value());
    return out;
  }
  void report();
  friend struct host::ReplicaAccess;
  std::unique_ptr<host::SanitizerImpl> impl_;
};

/// The bad_checkpoint findings of one checkpoint judged outside a sanitizer (`python -m trainsan
/// check`): messages prefixed "bad_checkpoint: ", step 0.
std::vector<Finding> judge_checkpoint(const CheckpointFacts& facts);

}  // namespace trainsan
