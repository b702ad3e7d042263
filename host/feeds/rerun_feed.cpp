// Re-runs of a step (rerun_feed.h). nondeterminism: Sanitizer::rerun re-runs the caller's step
// twice from the state the step started from, fingerprints what each run produced and compares
// the fingerprints (compare_reruns, host/checks/determinism.cpp; Note [Re-run determinism]
// there). Re-run attribution: rerun_for runs Setup::rerun_step once. Whatever a re-run touches —
// the gradients, the RNG state, the buffers — is put back as it was found.
//
// Note [One re-run driver]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The nondeterminism re-runs are orchestrated once, here (RerunFeed::rerun(StepRerun, step)),
// for a LibTorch loop and for the Python package (which calls it through _trainsan_hot, Note
// [One orchestration] in bindings/csrc/hot.cpp). What legitimately differs between them is what
// the driver is given (trainsan::StepRerun):
//   * start() / restore(): the state a run starts from and its undoing. LibTorch: begin_step()'s
//     RNG state and Setup::buffers, copied in (copy_: a LibTorch program hands tensors, not
//     module slots), .grad cleared; RerunScope puts .grad, buffers and RNG back once after both
//     runs. Python: the state its training forward recorded, with the model's buffers swapped
//     for copies (started_from, Note [One re-run recorder] in bindings/trainsan/_rerun.py).
//   * run(): one forward and backward, as a RerunRecord. LibTorch: the caller's step function,
//     which fills .grad (read from the sanitizer's parameters, named by them). Python: the model
//     called on the recorded inputs, each module's output fingerprinted in its forward hook
//     (RerunRecord::Output::hashes), the gradients taken with torch.autograd.grad from the
//     gradients that reached the step's outputs (no .grad, no hook on it touched) and named by
//     model.named_parameters().
//   * the step's own record: LibTorch's is the caller's `own` (compared only when begin_step()
//     kept the start state); Python's the fingerprints its forward hooks took.
// The rest is the driver's: two runs, each between start() and restore() (on an exception too),
// the gradient hooks and the op audit looking away, the fingerprints of a run in one pass
// (fingerprint()), compare_reruns, and the report through rerun_result (Sanitizer::rerun).
#include "feeds/rerun_feed.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <chrono>

#include "forward_watch.h"
#include "stats_internal.h"
#include "trainsan/sanitizer.h"

namespace trainsan {
namespace host {

namespace {

bool fingerprinted(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && readable_values(t.scalar_type()) &&
         (t.device().is_cpu() || t.device().is_cuda());
}

std::vector<at::Tensor> param_tensors(const std::vector<TrackedParam>& params) {
  std::vector<at::Tensor> out;
  for (const TrackedParam& p : params) out.push_back(p.param);
  return out;
}

// One pass and one read for every tensor of a run: its outputs' tensors in order (after the
// fingerprints the caller took), then its gradients in backward order.
RerunFingerprints fingerprint(const RerunRecord& r) {
  std::vector<at::Tensor> all;
  std::vector<size_t> per_output;
  for (const RerunRecord::Output& o : r.outputs) {
    size_t n = 0;
    for (const at::Tensor& t : o.tensors) {
      if (fingerprinted(t) && t.numel() > 0) {  // as the Python package's module outputs
        all.push_back(t.detach());
        n += 1;
      }
    }
    per_output.push_back(n);
  }
  std::vector<const std::string*> grad_names;
  for (const auto& [name, g] : r.grads) {
    if (fingerprinted(g)) {
      all.push_back(g.detach());
      grad_names.push_back(&name);
    }
  }
  const std::vector<TensorStats> stats =
      all.empty() ? std::vector<TensorStats>{} : tensor_stats(all);
  RerunFingerprints out;
  size_t k = 0;
  for (size_t j = 0; j < r.outputs.size(); ++j) {
    RerunFingerprints::Output o{r.outputs[j].name, r.outputs[j].type, r.outputs[j].hashes};
    for (size_t n = 0; n < per_output[j]; ++n) o.hashes.push_back(stats[k++].hash);
    out.outputs.push_back(std::move(o));
  }
  for (const std::string* name : grad_names) out.grads.emplace_back(*name, stats[k++].hash);
  return out;
}

// The parameters' .grad, named by the sanitizer, in backward order (the output's side first).
void add_param_grads(RerunRecord& r, const std::vector<TrackedParam>& params) {
  for (size_t i = params.size(); i-- > 0;)
    r.grads.emplace_back(params[i].name, params[i].param.grad());
}

void copy_into(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < dst.size() && i < src.size(); ++i) dst[i].copy_(src[i]);
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ts) {
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : ts) out.push_back(t.detach().clone());
  return out;
}

// The sanitizer's gradient hooks and the op audit look away from a re-run.
class LookAway {
 public:
  explicit LookAway(GradTracker& grads) : grads_(grads) {
    grads_.set_paused(true);
    Sanitizer::pause_audit(true);
  }
  ~LookAway() {
    Sanitizer::pause_audit(false);
    grads_.set_paused(false);
  }
  LookAway(const LookAway&) = delete;
  LookAway& operator=(const LookAway&) = delete;

 private:
  GradTracker& grads_;
};

// What a LibTorch re-run touches, as the scope found it, put back on every way out (an
// exception of the caller's step function included).
class RerunScope {
 public:
  RerunScope(FeedContext& ctx, std::vector<c10::DeviceIndex> devices)
      : ctx_(ctx), rng_(RngState::capture(devices)), buffers_(copies(ctx.setup.buffers)) {
    for (const TrackedParam& p : ctx.params) grads_.push_back(p.param.grad());
  }
  ~RerunScope() {
    try {
      for (size_t i = 0; i < grads_.size(); ++i) ctx_.params[i].param.mutable_grad() = grads_[i];
      copy_into(ctx_.setup.buffers, buffers_);
      rng_.restore();
    } catch (...) {  // a destructor: nothing else to do with it
    }
  }
  RerunScope(const RerunScope&) = delete;
  RerunScope& operator=(const RerunScope&) = delete;

  // Before each run: the state the step started from, no gradients.
  void start(const StepStart* from) {
    start(from != nullptr ? from->rng : rng_, from != nullptr ? from->buffers : buffers_);
  }
  void start(const RngState& rng, const std::vector<at::Tensor>& buffers) {
    rng.restore();
    copy_into(ctx_.setup.buffers, buffers);
    for (const TrackedParam& p : ctx_.params) p.param.mutable_grad().reset();
  }

 private:
  FeedContext& ctx_;
  RngState rng_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> grads_;
};

// One run of a StepRerun, between its start() and, once start() returned, its restore().
RerunRecord run_once(const StepRerun& how) {
  how.start();
  RerunRecord r;
  try {
    r = how.run();
  } catch (...) {
    try {
      if (how.restore) how.restore();
    } catch (...) {  // the run's exception is the one to report
    }
    throw;
  }
  if (how.restore) how.restore();
  return r;
}

}  // namespace

void RerunFeed::capture_rerun_start() {
  rerun_start_ = StepStart{ctx_.step,
                           RngState::capture(cuda_devices(param_tensors(ctx_.params))),
                           copies(ctx_.setup.buffers),
                           {},
                           {},
                           0};
}

// Re-run attribution (Note [Re-run attribution], checks/attribution.cpp) for a LibTorch loop
// with Setup::rerun_step: the state each training forward starts from, kept for one step.
void RerunFeed::capture_error_start(const std::vector<at::Tensor>& inputs) {
  if (ctx_.opts.rerun_on_error <= 0 || !rerun_step || ctx_.closed || !at::GradMode::is_enabled()) {
    return;
  }
  const int64_t step = ctx_.step;
  const int64_t forwards = error_start_ && error_start_->step == step ? error_start_->forwards : 0;
  error_start_ = StepStart{step,
                           RngState::capture(cuda_devices(param_tensors(ctx_.params))),
                           copies(ctx_.setup.buffers),
                           inputs,
                           {},
                           forwards + 1};
}

void RerunFeed::on_loss(const at::Tensor& loss) {
  if (error_start_ && error_start_->step == ctx_.step)
    error_start_->losses.push_back(loss.detach());
}

namespace {

// 16 hex digits.
std::string hex64(uint64_t h) {
  static const char* const kDigits = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) out[static_cast<size_t>(i)] = kDigits[h & 0xf];
  return out;
}

// The fingerprint of a batch: its tensors' TensorStats::hash, in order, mixed (FNV-1a over the
// 64-bit words; bindings/trainsan/attribution.py's batch_fingerprint is the same).
uint64_t combine(const std::vector<uint64_t>& hashes) { return fnv1a_words(hashes); }

std::vector<TensorStats> stats_of(const std::vector<at::Tensor>& ts) {
  return ts.empty() ? std::vector<TensorStats>{} : tensor_stats(ts);
}

bool any_nonfinite(const std::vector<TensorStats>& s, size_t from, size_t to) {
  for (size_t i = from; i < to; ++i) {
    if (s[i].nonfinite() > 0) return true;
  }
  return false;
}

}  // namespace

RerunOutcome RerunFeed::rerun_for(const Finding& f) {
  const std::vector<TrackedParam>& params = ctx_.params;
  const std::unique_ptr<ForwardWatch>& watch = ctx_.watch;
  RerunOutcome o;
  if (!error_start_ || error_start_->step != f.step) {
    o.error = "the state step " + std::to_string(f.step) +
              " started from was not kept (begin_step(), or the forward trainsan::attach sees, "
              "keeps it for one step)";
    return o;
  }
  const StepStart& from = *error_start_;
  o.forwards = from.forwards;
  o.params_changed = ctx_.step > f.step;
  // Buffers the forward updates in place (BatchNorm's statistics) would move the version counters
  // the step's backward checks, were the re-run to run before it.
  bool backward_ran = o.params_changed;
  for (const TrackedParam& p : params) backward_ran = backward_ran || ctx_.grads.got_grad(p.opt);
  if (!ctx_.setup.buffers.empty() && !backward_ran) {
    o.error =
        "the model has buffers its forward updates in place (BatchNorm statistics) and the step's "
        "backward is still to come, which a re-run now would break; call watch_loss(loss) after "
        "loss.backward(), before optimizer.step()";
    return o;
  }
  try {
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& t : from.inputs) {
      if (t.defined() && t.layout() == at::kStrided && t.numel() > 0) inputs.push_back(t.detach());
    }
    std::vector<uint64_t> hashes;
    for (const TensorStats& s : stats_of(inputs)) {
      hashes.push_back(s.hash);
      o.tensors.push_back(hex64(s.hash));
    }
    if (!hashes.empty()) o.fingerprint = hex64(combine(hashes));
    if (o.params_changed) {
      o.params_nonfinite = any_nonfinite(stats_of(param_tensors(params)), 0, params.size());
    }
    RerunRecord r;
    std::vector<TensorStats> grads;
    // trainsan::attach's watch, armed at the step's end, must not take the re-run's forward for
    // the next step's.
    const bool armed = watch && watch->armed();
    if (armed) watch->disarm();
    struct Rearm {
      ForwardWatch* w;
      ~Rearm() {
        if (w != nullptr) w->arm();
      }
    } rearm{armed ? watch.get() : nullptr};
    {
      RerunScope scope(ctx_, cuda_devices(param_tensors(params)));
      const LookAway look_away(ctx_.grads);
      scope.start(from.rng, from.buffers);
      r = rerun_step();
      std::vector<at::Tensor> gs;
      for (const TrackedParam& p : params) {
        if (fingerprinted(p.param.grad())) gs.push_back(p.param.grad().detach());
      }
      grads = stats_of(gs);
    }  // .grad, the buffers and the RNG state as they were
    std::vector<at::Tensor> outs;
    for (const RerunRecord::Output& out : r.outputs) {
      for (const at::Tensor& t : out.tensors) {
        if (fingerprinted(t) && t.numel() > 0) outs.push_back(t.detach());
      }
    }
    const size_t n = outs.size();
    for (const at::Tensor& t : from.losses) outs.push_back(t);
    const std::vector<TensorStats> s = stats_of(outs);
    o.outputs_nonfinite = any_nonfinite(s, 0, n);
    o.outputs_compared = n > 0 && s.size() - n >= n;
    if (o.outputs_compared) {
      // The first n losses the step watched, against the re-run's n values.
      o.step_outputs_nonfinite = any_nonfinite(s, n, 2 * n);
      o.outputs_match = true;
      for (size_t i = 0; i < n; ++i) {
        o.outputs_match = o.outputs_match && s[i].hash == s[n + i].hash;
      }
    }
    o.grads_rerun = !grads.empty();
    o.grads_nonfinite = any_nonfinite(grads, 0, grads.size());
    o.ran = true;
  } catch (const std::exception& e) {  // reported in the finding, never retried
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string what = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    o.ran = false;
    o.error = what.substr(0, what.find('\n'));
  }
  return o;
}

namespace {

void check_not_in_step(const GradTracker& grads) {
  TORCH_CHECK_VALUE(!grads.in_step(),
                    "Sanitizer::rerun: called inside an optimizer step; call it after the step's "
                    "backward and before optimizer.step()");
}

}  // namespace

std::optional<RerunFacts> RerunFeed::rerun(const std::function<RerunRecord()>& step_fn,
                                           const RerunRecord& step) {
  check_not_in_step(ctx_.grads);
  const auto t0 = std::chrono::steady_clock::now();
  const StepStart* from =
      rerun_start_ && rerun_start_->step == ctx_.step ? &*rerun_start_ : nullptr;
  std::optional<RerunFacts> facts;
  {
    RerunScope scope(ctx_, cuda_devices(param_tensors(ctx_.params)));
    const StepRerun how{[&] { scope.start(from); },
                        {},  // the scope puts .grad, the buffers and the RNG state back
                        [&] {
                          RerunRecord r = step_fn();
                          if (r.grads.empty()) add_param_grads(r, ctx_.params);
                          return r;
                        }};
    // The step's own forward is comparable only when the re-runs started where it started.
    facts = rerun(how, from != nullptr ? &step : nullptr);
  }
  rerun_start_.reset();
  ctx_.time.add_overhead(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return facts;
}

std::optional<RerunFacts> RerunFeed::rerun(const StepRerun& how, const RerunRecord* step) {
  check_not_in_step(ctx_.grads);
  TORCH_CHECK_VALUE(how.start && how.run, "Sanitizer::rerun: StepRerun needs start and run");
  RerunFingerprints first, second;
  {
    const LookAway look_away(ctx_.grads);
    first = fingerprint(run_once(how));
    second = fingerprint(run_once(how));
  }
  const RerunFingerprints own = step != nullptr ? fingerprint(*step) : RerunFingerprints{};
  return compare_reruns(own, first, second);
}

}  // namespace host

std::vector<uint64_t> output_fingerprints(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> all;
  for (const at::Tensor& t : outputs) {
    if (host::fingerprinted(t) && t.numel() > 0) all.push_back(t.detach());
  }
  std::vector<uint64_t> out;
  if (all.empty()) return out;
  for (const TensorStats& s : tensor_stats(all)) out.push_back(s.hash);
  return out;
}

std::vector<uint64_t> rng_fingerprints(const std::vector<at::Tensor>& on) {
  return host::RngState::capture(host::cuda_devices(on)).fingerprints();
}

}  // namespace trainsan
