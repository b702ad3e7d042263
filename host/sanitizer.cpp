// The sanitizer's events (SanitizerImpl): facts come in, the checks (checks/), the feeders
// (feeds/), the op audit (audit/) and the read-back queue do the work; the public front door
// (sanitizer_api.cpp) reports the new findings of each event with the policy's answer.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <fstream>
#include <tuple>

#include "nvtx.h"
#include "sanitizer_impl.h"
#include "source_location.h"
#include "stats_internal.h"

namespace trainsan {
namespace host {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The fingerprints of a pass's rows, and the seed the input and target fingerprints mix them
// from (traces compare these values across runs: --resume-trace, diff).
constexpr uint64_t kInputsSeed = 0x84222325cbf29ce4ULL;
std::vector<uint64_t> hashes_of(const PackedStats& host) {
  std::vector<uint64_t> out;
  for (const auto& s : unpack_stats(host)) out.push_back(s.hash);
  return out;
}

// The parameters the passes read; those of a dtype the pass does not read (Note [Dtypes the pass
// reads] in host/stats.cpp: float8, uint16, ...) are left out and named in `unread`.
std::vector<TrackedParam> to_tracked(std::vector<Parameter> ps, std::vector<std::string>* unread,
                                     std::vector<int64_t>* tracked_of) {
  TORCH_CHECK_VALUE(!ps.empty(),
                    "trainsan::Sanitizer: no parameters given; pass "
                    "model->named_parameters()");
  std::vector<TrackedParam> out;
  for (auto& p : ps) {
    TORCH_CHECK_TYPE(p.tensor.defined(), "trainsan::Sanitizer: parameter '", p.name,
                     "' is undefined");
    const at::Tensor& read = p.local.defined() ? p.local : p.tensor;
    if (!readable_dtype(read.scalar_type())) {
      unread->push_back(p.name + " (" + c10::getDtypeNames(read.scalar_type()).first + ")");
      tracked_of->push_back(-1);
      continue;
    }
    tracked_of->push_back(static_cast<int64_t>(out.size()));
    TrackedParam t;
    t.name = std::move(p.name);
    t.param = std::move(p.tensor);
    t.opt = p.optimizer;
    t.group = p.group;
    if (p.local.defined() && !p.local.is_same(t.param)) t.local = std::move(p.local);
    t.external = p.external_grad_hook;
    out.push_back(std::move(t));
  }
  return out;
}

const Options& validated(const Options& o) {
  o.validate();
  return o;
}

// Note [Replayed data]'s resume_trace: the input fingerprints of the previous run's step records
// ("inputs": hex) and their steps. Read before any hook is installed, so that a bad path fails
// the attach cleanly.
void read_resume_trace(const std::string& path, std::vector<uint64_t>* hashes,
                       std::vector<int64_t>* steps) {
  std::ifstream in(path);
  TORCH_CHECK_VALUE(in.is_open(), "trainsan: resume_trace='", path,
                    "' cannot be read (no such file, or not readable): give the trace of the run "
                    "this one resumes, or leave resume_trace empty");
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("\"type\":\"step\"") == std::string::npos) continue;
    const size_t i = line.find("\"inputs\":\"");
    const size_t st = line.find("\"step\":");
    if (i == std::string::npos || st == std::string::npos) continue;
    try {
      hashes->push_back(std::stoull(line.substr(i + 10, 16), nullptr, 16));
      steps->push_back(std::stoll(line.substr(st + 7)));
    } catch (const std::exception&) {
      TORCH_CHECK_VALUE(false, "trainsan: resume_trace='", path,
                        "' is not a TrainSan trace (a step record's inputs or step is malformed): ",
                        line.substr(0, 200));
    }
  }
}

bool fp16_autocast() {
  for (const auto d : {at::kCUDA, at::kCPU}) {
    if (at::autocast::is_autocast_enabled(d) && at::autocast::get_autocast_dtype(d) == at::kHalf) {
      return true;
    }
  }
  return false;
}

}  // namespace

SanitizerImpl::SanitizerImpl(std::vector<Parameter> parameters, Options options, Setup s)
    : opts(validated(options)),
      setup(std::move(s)),
      params(to_tracked(std::move(parameters), &unread, &tracked_of)),
      have_optimizer(std::any_of(params.begin(), params.end(),
                                 [](const TrackedParam& p) { return p.opt >= 0; })),
      trace(opts, setup.header_extra, params.size()),
      store(opts, trace),
      readback(opts.sync),
      checks(store, opts, params.size()),
      grads(params, have_optimizer, [this] {
        if (audit) audit->stop();
      }) {
  if (!opts.resume_trace.empty()) {
    std::vector<uint64_t> hashes;
    std::vector<int64_t> steps;
    read_resume_trace(opts.resume_trace, &hashes, &steps);
    checks.inputs.seed(hashes, steps);
  }
  updates.init();
  AuditConfig cfg;
  cfg.kinds_on.assign(kinds().size(), false);
  for (const KindInfo& k : kinds()) {
    if (std::string_view(k.family) == "audit") {
      cfg.kinds_on[static_cast<size_t>(k.kind)] = opts.enabled(k.name);
    }
  }
  cfg.sync = opts.sync;
  cfg.print_failing = opts.policy != "record";
  cfg.first_steps = opts.audit_first_steps;
  cfg.every = opts.audit_every;
  cfg.skip_frames = setup.skip_frames;
  audit = std::make_unique<OpAudit>(store, readback, std::move(cfg));
  std::vector<ModeModule> modes;
  for (const ModuleInfo& m : setup.mode_modules) {
    ModeModule mm;
    mm.ref = {m.name.empty() ? "<model>" : m.name, m.type};
    for (const int64_t given : m.params) {
      const int64_t i = tracked_index(given, "trainsan::Setup::mode_modules");
      if (i >= 0) mm.params.push_back(static_cast<size_t>(i));
    }
    mm.mode_dependent = m.mode_dependent;
    modes.push_back(std::move(mm));
  }
  checks.mode.set_modules(std::move(modes));
  grads.install();
  if (setup.binding) {
    // Parameters in no optimizer (frozen parts) are not watched when there are optimizers: the
    // forward is the one that reads what an optimizer trains.
    std::vector<at::Tensor> ps;
    std::vector<int64_t> groups;
    for (const TrackedParam& p : params) {
      if (have_optimizer && p.opt < 0) continue;
      ps.push_back(p.param);
      groups.push_back(p.opt);
    }
    watch = std::make_unique<ForwardWatch>(
        ps, groups,
        [this](std::vector<at::Tensor> batch, int64_t opt) {
          forward_seen(std::move(batch), have_optimizer ? opt : -1);
        },
        [this](const at::Tensor& root, ForwardWatch::LossMoment moment) {
          return loss_seen(root, moment);
        });
    watch->arm();
  }
}

// Note [C++ attach]'s forward: the watch saw the model's first op on a parameter and a batch.
// Inside that op's dispatch: nothing here may throw into it (the findings are reported at the
// next event, end_step).
void SanitizerImpl::forward_seen(std::vector<at::Tensor> batch, int64_t opt) {
  if (closed) return;
  const bool grad_enabled = at::GradMode::is_enabled();
  updates.check_outside_step(-1);
  ForwardFacts f;
  f.training = setup.binding->training(opt);
  f.module_eval = setup.binding->module_eval();
  f.inputs = pending_inputs.empty() ? std::move(batch) : pending_inputs;
  f.opt = opt;
  if (f.training) reruns.capture_error_start(f.inputs);  // Note [Re-run attribution]
  if (grad_enabled) pending_inputs.clear();
  forward(f);
}

// Note [C++ attach]'s loss: the root of the step's backward, or a non-finite one-element tensor
// with a graph that the program reads after a training forward. Inside that op's dispatch:
// nothing here may throw into it; a finding is written to the trace at once (one write(2) a line)
// and printed under policies warn and raise, before a program that asserts on the value can
// abort; "raise" raises at the next event.
bool SanitizerImpl::loss_seen(const at::Tensor& root, ForwardWatch::LossMoment moment) {
  if (closed || !fault.empty() || grads.in_step()) return false;  // a closure's: its step's
  const OwnClock clock(time);                                     // Note [Own time]
  try {
    // Our own ops: seen by no observer (the op audit of a sampled step is still on).
    const at::RecordFunctionGuard unobserved(/*is_enabled=*/false);
    if (!loss_seen_at_backward(root)) {
      if (foreign.loss_reaches(root) == 0) return false;  // another model's (a probe, a copy)
      // At its backward a loss is only read where that costs no wait (on the CPU); a device
      // loss is end_step's, or checked here when the program reads it before the update. It is
      // not taken into the loss stream here: the root may be a scaled loss
      // ((loss * scale).backward()), and end_step(loss) gives the loss itself.
      if (moment == ForwardWatch::LossMoment::kBackward &&
          (!root.device().is_cpu() || std::isfinite(root.detach().item<double>()))) {
        return true;
      }
      loss(root);
      backward_losses.emplace_back(root.getIntrusivePtr());
    }
    // A device loss's check waits in the read-back queue: the program reads the value now (it
    // waits for it anyway), so the queue is drained now, before it can abort.
    readback.drain_all();
    if (!setup.report) store.say_fresh(opts.policy);
  } catch (const std::exception&) {
    // end_step(loss) checks it again
  }
  return true;
}

bool SanitizerImpl::loss_seen_at_backward(const at::Tensor& loss) const {
  for (const auto& w : backward_losses) {
    if (w._unsafe_get_target() == loss.unsafeGetTensorImpl() && !w.expired()) return true;
  }
  return false;
}

void SanitizerImpl::backward_without_graph() {
  if (closed || grads.in_step()) return;
  std::set<int64_t> opts;
  for (const TrackedParam& p : params) {
    if (p.opt >= 0 && p.param.requires_grad()) opts.insert(p.opt);
  }
  for (const int64_t opt : opts) {
    const auto [grad_now, no_grad_now] = forwards_for(opt);
    const auto at = forwards_at_step[opt];
    if (no_grad_now > at.second && grad_now == at.first) {
      checks.mode.on_graphless_backward(step, no_grad_now - at.second);
      return;
    }
  }
}

void SanitizerImpl::end_iteration(bool backward_ran) {
  if (closed) return;
  add_outside(watch->take_seconds());  // Note [Own time]: the watch's, for this step's record
  backward_losses.clear();
  const std::vector<int64_t> stepped = setup.binding->stepped();
  std::set<int64_t> opts_of_params;
  for (const TrackedParam& p : params) {
    if (p.opt >= 0) opts_of_params.insert(p.opt);
  }
  for (const int64_t opt : opts_of_params) {
    // Judged: an optimizer whose parameters changed in place (their versions moved), or got a
    // gradient since its previous step that no scaler skip consumed (an update through .data(),
    // as LibTorch's SGD makes, moves no version; a step that was forgotten is then "changed
    // nothing"), or whose model's only forwards since its previous step ran under no_grad while
    // a backward did run (its parameters got no gradient: Note [Mode rules]).
    bool judge =
        std::find(stepped.begin(), stepped.end(), opt) != stepped.end() || grads.got_grad(opt);
    if (!judge && backward_ran) {
      const auto [grad_now, no_grad_now] = forwards_for(opt);
      const auto at = forwards_at_step[opt];
      judge = no_grad_now > at.second && grad_now == at.first;
    }
    // A foreign backward since its previous step (Note [Foreign backwards]): a step that moved
    // nothing, as its parameters got no gradient, is judged too.
    judge = judge || foreign.since_step(opt);
    if (!judge) continue;
    if (const auto resumed = setup.binding->first_step_after_load(opt)) {
      events_seen.insert("optimizer_reset");
      checks.resume.on_resume(*resumed, step);
    }
    const std::vector<double> lr = setup.binding->group_lr(opt);
    const bool lr_zero =
        !lr.empty() && std::all_of(lr.begin(), lr.end(), [](double v) { return v == 0.0; });
    step_end(opt, lr_zero, /*manual=*/false, lr);
  }
  watch->arm();
}

void SanitizerImpl::forward(const ForwardFacts& facts) {
  const auto t0 = Clock::now();
  TRAINSAN_NVTX_RANGE("trainsan/forward");
  if (closed) return;
  const bool grad_enabled = at::GradMode::is_enabled();
  const bool training = facts.training;
  if (grad_enabled) {
    // The modes of the last grad-enabled forward before a step (eval_mode), a closure's included.
    current_model_eval = !training;
    current_eval_modules.clear();
    const size_t n = std::min(facts.module_eval.size(), setup.mode_modules.size());
    for (size_t k = 0; k < n; ++k) {
      if (facts.module_eval[k]) current_eval_modules.push_back(k);
    }
  }
  // A forward inside an optimizer step is the step's closure (LBFGS): part of the step.
  if (grads.in_step()) return;
  audit->flush();  // a held-back broadcast_tensors no loss consumed: before this event's findings
  // Note [Mode rules]: forwards since each optimizer's previous step (StepView).
  if (facts.opt >= 0) {
    auto& [g, ng] = forwards_of_opt[facts.opt];
    (grad_enabled ? g : ng) += grad_enabled || training ? 1 : 0;
  } else if (grad_enabled) {
    grad_forwards_total += 1;
  } else if (training) {
    no_grad_train_forwards_total += 1;
  }
  (grad_enabled && training ? coverage.training_forwards : coverage.other_forwards) += 1;
  // Note [Manual-mode steps]: every grad-enabled forward, whatever the module's mode.
  if (setup.manual && grad_enabled) manual_boundary();
  ForwardView fv;
  fv.step = step;
  fv.grad_enabled = grad_enabled;
  fv.training = training;
  fv.have_optimizer = have_optimizer;
  if (!grad_enabled && training) {
    if (no_grad_site_step != step) {  // where it was called: once a step (a stack walk)
      no_grad_site_step = step;
      fv.site = python_source(setup.skip_frames).where;
    }
    for (size_t k = 0; k < setup.mode_modules.size(); ++k) {
      const bool eval = k < facts.module_eval.size() && facts.module_eval[k];
      if (setup.mode_modules[k].mode_dependent && !eval) fv.train_mode_dependent.push_back(k);
    }
  }
  checks.mode.on_forward(fv);
  if (grad_enabled && training) {
    for (Feed* f : feeds) f->on_forward(facts);  // Note [Feeders]
  }
  if (grad_enabled && training) {
    fv.backwards_since_step = grads.training_forward(&fv.skipped);
    checks.integrity.on_forward(fv);
  }
  fp16_in_use = fp16_in_use || fp16_autocast();
  if (grad_enabled && training && input_hash_step != step && !facts.inputs.empty()) {
    input_hash_step = step;
    std::vector<at::Tensor> ok;
    const at::Device dev = facts.inputs[0].device();
    for (const auto& t : facts.inputs) {
      if (t.defined() && t.layout() == at::kStrided && !t.is_meta() &&
          (t.device().is_cpu() || t.device().is_cuda()) && t.device() == dev) {
        ok.push_back(t);
      }
    }
    if (!ok.empty()) {
      try {
        check_tensors(ok, "trainsan inputs");
        const int64_t at_step = step;
        const int64_t restarts = facts.data_restarts;
        const LoaderView loader{facts.loader_pass, facts.loader_workers, facts.loader_worker_init,
                                facts.loader_batch};
        // Only the fingerprints are read (Note [Lean rows], kModeHash).
        readback.push(start_host_copy(fingerprint_stats_packed(ok)), ReadbackQueue::Phase::kInputs,
                      [this, at_step, restarts, loader](const PackedStats& host) {
                        const uint64_t h = fnv1a_words(hashes_of(host), kInputsSeed);
                        checks.inputs.on_inputs(h, at_step, restarts, loader);
                        checks.loss.on_inputs(h);
                        input_hashes[at_step] = h;
                        while (input_hashes.size() > 64) input_hashes.erase(input_hashes.begin());
                        coverage.inputs_fingerprinted += 1;
                      });
      } catch (const c10::Error&) {
        // unsupported input dtypes: no duplicate-batch check
      }
    }
  }
  if (grad_enabled && training && opts.enabled("label_dtype")) {
    std::vector<at::Tensor> batch = facts.inputs;
    batch.insert(batch.end(), facts.batch.begin(), facts.batch.end());
    audit->set_batch(std::move(batch));
  }
  if (grad_enabled && training) audit->set_inputs(facts.inputs);
  add_overhead(seconds_since(t0));
  // Note [Op audit]: a grad-enabled forward is audited in any module mode (a model trained in
  // eval mode is audited on the same schedule). Last: our own ops stay out.
  if (grad_enabled) audit->begin_forward(step);
}

void SanitizerImpl::targets(const std::vector<at::Tensor>& ts) {
  // The first loss of a step: its targets' fingerprint for the trace (diff: data or numerics).
  if (closed || target_hash_step == step || ts.empty() || !trace.is_open()) return;
  std::vector<at::Tensor> ok;
  for (const auto& t : ts) {
    if (t.defined() && t.layout() == at::kStrided && !t.is_meta() &&
        (t.device().is_cpu() || t.device().is_cuda()) && t.device() == ts[0].device()) {
      ok.push_back(t.detach());
    }
  }
  if (ok.empty()) return;
  const auto t0 = Clock::now();
  target_hash_step = step;
  const int64_t at_step = step;
  try {
    check_tensors(ok, "trainsan targets");
    readback.push(start_host_copy(fingerprint_stats_packed(ok)), ReadbackQueue::Phase::kInputs,
                  [this, at_step](const PackedStats& host) {
                    const uint64_t h = fnv1a_words(hashes_of(host), kInputsSeed);
                    target_hashes[at_step] = h;
                    while (target_hashes.size() > 64) target_hashes.erase(target_hashes.begin());
                  });
  } catch (const c10::Error&) {
    // unsupported target dtypes: not fingerprinted
  }
  add_overhead(seconds_since(t0));
}

// Note [Manual-mode steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Without an optimizer (manual mode: a loop that updates p.data by hand, or an optimizer TrainSan
// cannot see — Keras's, one an integration hides), a step ends at the next grad-enabled forward of
// the model after a backward produced gradients: the loop has applied its update by then, if it
// applies one. Every grad-enabled forward counts, in train or eval mode: a model trained in eval
// mode (frozen BatchNorm statistics, a model.eval() left over from validation) has one step per
// batch like any other; a forward that no backward follows (validation without no_grad) ends no
// step, as no gradient was produced since the last one.
// Such a step need not have applied an update: a loop that accumulates gradients over several
// backwards (fastai's GradientAccumulation, a closure-driven optimizer) updates at some of them
// only. A judgement of the update (update_ratio) belongs to a step at which one was applied: the
// boundary records each watched parameter's version counter, and a step at which none moved
// since the previous boundary (StepView::unwritten) is judged only where its values changed
// (a loop that writes through .data moves no version counter; its changes are the update). A
// step that wrote nothing and changed nothing is not an update of 0: update_ratio neither counts
// nor breaks its run of low ratios there.
void SanitizerImpl::manual_boundary() {
  if (grads.any_produced()) step_end(-1, /*lr_zero=*/false, /*manual=*/true);
}

bool SanitizerImpl::manual_unwritten() {
  bool moved = manual_versions.size() != params.size();  // unknown (the first step): judged
  if (!moved) {
    for (size_t i = 0; i < params.size() && !moved; ++i) {
      moved = manual_versions[i] != static_cast<int64_t>(params[i].param._version());
    }
  }
  manual_versions.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    manual_versions[i] = static_cast<int64_t>(params[i].param._version());
  }
  return !moved;
}

void SanitizerImpl::loss(const at::Tensor& loss) {
  const auto t0 = Clock::now();
  audit->flush();
  TORCH_CHECK_TYPE(loss.defined(), "watch_loss: loss is an undefined tensor");
  check_tensors({loss}, "watch_loss");
  // Note [Feeders]: a LibTorch loop's walk (Note [Foreign backwards]), a training loss of the
  // accumulation window, the losses a re-run of the step compares.
  for (Feed* f : feeds) f->on_loss(loss);
  LossView v;
  v.step = step;
  v.outcome = loss_seq;
  loss_waiting = true;
  v.in_step = grads.in_step();  // a closure's evaluation (LBFGS): nonfinite_loss only
  v.dtype = c10::toString(loss.scalar_type());
  if (v.dtype == "Half") v.dtype = "float16";
  if (v.dtype == "BFloat16") v.dtype = "bfloat16";
  if (v.dtype == "Float") v.dtype = "float32";
  readback.push_or_consume(start_host_copy(tensor_stats_packed({loss})),
                           ReadbackQueue::Phase::kLoss, [this, v](const PackedStats& host) mutable {
                             v.stats = unpack_stats(host)[0];
                             // The trace's loss (Note [Bounded trace]): the step's latest.
                             if (v.stats.numel > 0) {
                               last_loss = v.stats.nonfinite() > 0
                                               ? std::nan("")
                                               : v.stats.sum / static_cast<double>(v.stats.numel);
                             }
                             // The audit's class-index facts of this step are in by now (Note
                             // [Lagged checks]: label flags drain before the losses).
                             const ClassTargetFacts t = audit->class_targets(v.step);
                             v.class_calls = t.calls;
                             v.class_targets = t.targets;
                             v.class_valid = t.valid;
                             v.class_empty_calls = t.empty_calls;
                             v.classes = t.classes;
                             checks.nonfinite.on_loss(v.stats, v.step,  // first
                                                      t.empty_calls > 0);
                             checks.loss.on_loss(v);
                             checks.precision.on_loss(v);
                             coverage.losses_checked += 1;
                           });
  add_overhead(seconds_since(t0));
}

void SanitizerImpl::loss_outcome(bool skipped) {
  if (!loss_waiting) return;
  loss_waiting = false;
  checks.loss.on_outcome(loss_seq, skipped);
  loss_seq += 1;
}

void SanitizerImpl::scaler_step(const ScalerStep& s) {
  checks.loss.on_scaler();
  loss_outcome(s.skipped);
  scaler_skipped = scaler_skipped || s.skipped;
  for (Feed* f : feeds) f->on_scaler(s.opt, s.skipped);  // a skipped step consumed its window
  if (s.skipped) {
    grads.amp_skip(s.opt);
    amp_skips += 1;
    trace.amp_skip(step, s.opt);
    for (Feed* f : feeds) f->after_step(s.opt, /*skipped=*/true);
  }
  trace.scaler(step, s.opt, s.scale, s.skipped);
  checks.precision.on_scaler(s, step);
}

// Note [Discarded gradients]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A loop that guards its step — `if not all(torch.isfinite(p.grad).all() for p in params):
// optimizer.zero_grad(); continue` — never lets a NaN gradient reach the step pass, which is
// where nonfinite_grad reads the gradients; the model then stops training while the only trace
// is skipped_step (gradients cleared unused). So when gradients are about to be cleared
// (gradients_cleared: Python's zero_grad of an optimizer or of the model) and some parameter of
// that optimizer got a gradient since the last step that no optimizer step (nor a GradScaler
// skip) consumed, with no optimizer stepping since that backward (a GAN's discriminator
// gradients left by the generator's backward are cleared after the generator's step: not read),
// those gradients are read once, as a step pass reads them (one fused pass, read back like a
// step's: Note [Lagged checks]), and a non-finite one is nonfinite_grad with the step's overflow
// provenance. skipped_step's advice then names the non-finite gradients instead of a missing
// optimizer.step(). Healthy loops never clear unused gradients: no cost to them.
void SanitizerImpl::gradients_cleared(int64_t opt) {
  if (closed || grads.in_step()) return;
  // Rows a step began with and did not end (its update raised): not kept past its gradients.
  if (opt < 0) {
    begin_rows.clear();
  } else {
    begin_rows.erase(opt);
  }
  for (Feed* f : feeds) f->before_clear(opt);
  if (!opts.enabled("nonfinite_grad")) return;
  const auto t0 = Clock::now();
  const std::vector<size_t> idx = grads.discarded(opt);
  std::vector<at::Tensor> ts;
  std::vector<std::string> names;
  for (const size_t i : idx) {
    const at::Tensor& g = params[i].param.grad();
    if (!g.defined() || g.layout() != at::kStrided || !readable_values(g.scalar_type()) ||
        params[i].local.defined() || (!ts.empty() && g.device() != ts[0].device())) {
      continue;
    }
    ts.push_back(g);
    names.push_back(params[i].name);
  }
  if (!ts.empty()) {
    try {
      check_tensors(ts, "trainsan discarded gradients");
      const int64_t at_step = step;
      readback.push_or_consume(
          start_host_copy(tensor_stats_packed(ts)), ReadbackQueue::Phase::kLoss,
          [this, at_step, names = std::move(names)](const PackedStats& host) {
            const std::vector<TensorStats> st = unpack_stats(host);
            std::vector<std::pair<std::string, TensorStats>> grads_read;
            for (size_t k = 0; k < st.size() && k < names.size(); ++k) {
              grads_read.emplace_back(names[k], st[k]);
            }
            const bool bad = checks.nonfinite.on_discarded(grads_read, at_step);
            checks.integrity.on_discarded(bad);
            coverage.discards_checked += 1;
          });
    } catch (const c10::Error&) {
      // gradients the pass cannot read: not checked
    }
  }
  add_overhead(seconds_since(t0));
}

void SanitizerImpl::module_output(const ModuleInfo& module, const std::vector<at::Tensor>& outs) {
  if (closed || !opts.enabled("nonfinite_activation")) return;
  const auto t0 = Clock::now();
  std::vector<at::Tensor> floats;
  for (const auto& t : outs) {
    if (t.defined() && t.layout() == at::kStrided && readable_values(t.scalar_type()) &&
        (t.device().is_cpu() || t.device().is_cuda())) {
      floats.push_back(t.detach());
    }
  }
  if (!floats.empty()) {
    for (const TensorStats& s : tensor_stats(floats)) {
      if (s.nonfinite() == 0) continue;
      checks.nonfinite.on_module_output({module.name, module.type}, s, step);
      break;
    }
  }
  add_overhead(seconds_since(t0));
}

int64_t SanitizerImpl::tracked_index(int64_t given, const char* what) const {
  TORCH_CHECK_VALUE(given >= 0 && static_cast<size_t>(given) < tracked_of.size(), what,
                    ": no parameter ", given, " (", tracked_of.size(), " were given)");
  return tracked_of[static_cast<size_t>(given)];
}

namespace {

// The rules that judge an optimizer's step and return at once in manual mode (ModeCheck::on_step,
// StepIntegrityCheck, the GradTracker's discarded gradients, param_not_in_optimizer,
// update_underflow, the resume facts of an optimizer): unchecked there, with the reason.
bool judges_an_optimizer_step(Kind kind) {
  switch (kind) {
    case Kind::eval_mode:
    case Kind::skipped_step:
    case Kind::param_not_in_optimizer:
    case Kind::update_outside_step:
    case Kind::update_underflow:
    case Kind::optimizer_reset:
      return true;
    default:
      return false;
  }
}

}  // namespace

// Note [Coverage]: what each enabled kind needs comes from kinds.def's `needs` column; a kind
// whose need never arrived is listed in `unchecked` with the reason. The `event` and `python`
// kinds are listed only for a caller that does not gather their facts itself (a C++ program;
// the Python package gathers them: Setup::gathers_events).
Coverage SanitizerImpl::coverage_now() const {
  Coverage c = coverage;
  std::tie(c.audited_forwards, c.ops_audited) = audit->coverage();
  for (const Feed* f : feeds) f->add_coverage(c);
  c.trace_rows_steps = trace.rows_records();
  c.trace_bytes = trace.bytes();
  c.trace_error = trace.error();
  c.unread = unread;
  c.fault = fault;
  const bool attached = setup.binding != nullptr;
  const std::string no_forward =
      attached ? "no training forward was seen: no op read a parameter of the model together with "
                 "a batch while gradients were enabled (is the attached model the one trained?)"
               : "no training forward was seen: the model's forward hook never fired (submodules "
                 "called through .forward(x) instead of module(x), or the attached model is not "
                 "the one trained; LibTorch: call begin_step(), or attach with trainsan::attach)";
  const std::string no_step =
      attached ? "no optimizer step was seen (no parameter of an attached optimizer changed "
                 "between two end_step() calls)"
               : "no optimizer step was seen (the optimizer passed to attach() never stepped; "
                 "LibTorch: call end_step())";
  const std::string no_loss = "no loss was watched (san.watch_loss(loss), or san.end_step(loss))";
  const std::string no_optimizer =
      "no optimizer was attached (manual mode: steps are delimited by training forwards, and "
      "this rule judges an optimizer's step); pass the optimizer to attach() — a "
      "torch.optim.Optimizer, or any object with step() and param_groups";
  for (const KindInfo& k : kinds()) {
    if (!opts.enabled(k.name)) continue;
    const std::string needs = k.needs;
    std::string why;
    if (needs == "step") {
      if (c.steps_checked == 0) {
        // nonfinite_grad: gradients read before a clear count (Note [Discarded gradients])
        if (k.kind != Kind::nonfinite_grad || c.discards_checked == 0) why = no_step;
      } else if (k.kind == Kind::update_ratio && c.update_steps == 0) {
        why = opts.track_updates ? "no step had update statistics (Note [Overhead budget])"
                                 : "track_updates=False";
      } else if (k.kind == Kind::skipped_step && c.training_forwards == 0) {
        why = no_forward;  // its rule runs at the next training forward
      }
    } else if (needs == "forward") {
      if (c.training_forwards == 0) {
        why = no_forward;
      } else if (k.kind == Kind::duplicate_batch && c.inputs_fingerprinted == 0) {
        why =
            "no training input could be fingerprinted (no tensor arguments, or sparse, nested or "
            "meta inputs, or inputs on another device than the first)";
      }
    } else if (needs == "audit") {
      // (a grad-enabled forward in eval mode is audited too: Note [Op audit])
      if (c.training_forwards == 0 && c.audited_forwards == 0) {
        why = no_forward;
      } else if (c.audited_forwards == 0) {
        why = "no training forward was audited (audit_first_steps/audit_every)";
      } else if (c.ops_audited == 0) {
        why =
            "the audited forwards ran none of the ops these rules read (loss, class-index and "
            "broadcasting elementwise ops)";
      }
    } else if (needs == "loss") {
      if (c.losses_checked == 0) why = no_loss;
    } else if (!setup.gathers_events && events_seen.count(k.name) == 0) {
      why = needs == "python"
                ? std::string("needs the Python package: ") + k.libtorch
                : std::string("its facts never arrived (LibTorch: ") + k.libtorch + ")";
    }
    if (why.empty() && setup.manual && judges_an_optimizer_step(k.kind)) why = no_optimizer;
    if (!why.empty()) c.unchecked.emplace_back(k.name, why);
  }
  return c;
}

ReplicaFeed& replica_feed(SanitizerImpl& impl) { return impl.replicas; }

void SanitizerImpl::close() {
  if (closed) return;
  // Every part is closed, the hooks removed and the summary written even when a part before it
  // fails (Note [Faults] in sanitizer_api.cpp); the first failure is raised at the end.
  std::exception_ptr first;
  auto part = [&first](auto&& fn) {
    try {
      fn();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  };
  part([&] {
    if (watch) watch->disarm();
  });
  part([&] { audit->close(); });
  part([&] { readback.drain_all(); });
  part([&] { checks.loss.flush(); });               // losses whose step never ended
  for (Feed* f : feeds) part([&] { f->close(); });  // Note [Feeders]
  part([&] { grads.remove(); });
  begin_rows.clear();
  closed = true;
  part([&] { add_outside(audit->take_overhead()); });
  part([&] { write_summary(); });
  trace.close();
  if (first) std::rethrow_exception(first);
}

}  // namespace host

}  // namespace trainsan
