// The public front door (trainsan::Sanitizer): each event hands its facts to SanitizerImpl
// (sanitizer.cpp, sanitizer_pass.cpp) or to a family's feeder (feeds/) and ends by reporting the
// new findings with the policy's answer (report()).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "sanitizer_impl.h"

namespace trainsan {
// ---------------------------------------------------------------------------------------------
// The front door

namespace {

std::vector<Parameter> in_one_optimizer(const Sanitizer::NamedTensors& named) {
  std::vector<Parameter> out;
  for (const auto& [name, t] : named) out.push_back({name, t, 0});
  return out;
}

// Note [Faults] (C++ side; bindings/trainsan/_faults.py says it for Python): an exception out of
// TrainSan's own code in an event is the run's under policy "raise"; under "warn" and "record" it
// is told once (TORCH_WARN), kept in coverage().fault and the trace summary, and every later event
// returns at once (a half-done step would only make false findings), so the loop goes on.
// close() still closes every part. A TrainingBugError (the policy's answer) and device_stop's stop
// (an option's) always pass.
bool absorbed(host::SanitizerImpl& impl, const char* where, const std::exception& e) {
  const auto* c10e = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10e != nullptr ? c10e->what_without_backtrace() : e.what();
  if (impl.opts.policy == "raise" || what.rfind("trainsan: device_stop:", 0) == 0) return false;
  if (impl.fault.empty()) {
    impl.fault = std::string("trainsan: internal error in ") + where + " at step " +
                 std::to_string(impl.step) + ": " + what +
                 ". TrainSan stopped checking this run and the job goes on; please report it "
                 "with this message (policy \"raise\" raises such errors)";
    TORCH_WARN(impl.fault);
  }
  return true;
}

// Runs an event's body under Note [Faults].
template <class F>
void guarded(host::SanitizerImpl& impl, const char* where, F&& body) {
  if (!impl.fault.empty()) return;
  try {
    body();
  } catch (const TrainingBugError&) {
    throw;
  } catch (const std::exception& e) {
    if (!absorbed(impl, where, e)) throw;
  }
}

}  // namespace

Sanitizer::Sanitizer(const NamedTensors& named_parameters, Options options)
    : Sanitizer(in_one_optimizer(named_parameters), std::move(options), Setup{}) {}

Sanitizer::Sanitizer(std::vector<Parameter> parameters, Options options, Setup setup)
    : impl_(std::make_unique<host::SanitizerImpl>(std::move(parameters), std::move(options),
                                                  std::move(setup))) {
  impl_->reruns.rerun_step = impl_->setup.rerun_step;  // set_rerun_step may replace it
}

Sanitizer::~Sanitizer() {
  if (!impl_) return;  // moved from
  try {
    impl_->close();
  } catch (...) {
  }
}

Sanitizer::Sanitizer(Sanitizer&&) noexcept = default;
Sanitizer& Sanitizer::operator=(Sanitizer&&) noexcept = default;

void Sanitizer::report() {
  impl_->add_outside(impl_->audit->take_overhead());
  if (impl_->watch) impl_->add_outside(impl_->watch->take_seconds());
  // Note [Bounded trace]: a trace that could not be written is told once, on this (the event's)
  // thread, and never raised into the loop.
  if (impl_->trace.take_new_error()) TORCH_WARN(impl_->trace.error());
  for (Finding f : impl_->store.take_fresh()) {
    // Re-run attribution of a LibTorch loop (Setup::rerun_step): before the policy acts.
    if (impl_->reruns.rerun_step && !impl_->closed) {
      const RerunNeed need = rerun_needed(f);
      if (need == RerunNeed::kRun) f = attribute(f, impl_->reruns.rerun_for(f));
      if (need == RerunNeed::kKnown) f = attribute(f, std::nullopt);
    }
    // A finding printed when it was found (an op about to fail on it) is not raised or printed
    // again by close(): the job already saw it, and close() may run while the op's own error
    // propagates.
    if (impl_->closed && impl_->store.was_said(f)) continue;
    const Action a = policy_action(impl_->opts.policy, f);
    if (impl_->setup.report) {
      impl_->setup.report(f, a);
    } else if (a == Action::kRaise) {
      // An uncaught error ends the program without unwinding (std::terminate): the trace gets
      // its summary now (close() writes a later one if the program goes on; readers keep the last).
      impl_->write_summary();
      throw TrainingBugError(f);
    } else if (a == Action::kWarn && !impl_->store.was_said(f)) {  // printed when found
      host::print_finding(f);
    }
  }
}

void Sanitizer::begin_step(const std::vector<at::Tensor>& inputs,
                           const std::vector<bool>& module_eval) {
  guarded(*impl_, "begin_step", [&] {
    if (impl_->watch) {
      // trainsan::attach: the forward is seen by the watch, with its own grad mode and the modules'
      // modes; these inputs are fingerprinted then.
      impl_->pending_inputs = inputs;
      impl_->watch->arm();
      return;
    }
    impl_->updates.check_outside_step(-1);
    report();
    if (rerun_due()) impl_->reruns.capture_rerun_start();
    impl_->reruns.capture_error_start(inputs);
    ForwardFacts f;
    f.inputs = inputs;
    f.module_eval = module_eval;
    forward(f);
  });
}

void Sanitizer::watch_loss(const at::Tensor& loss) {
  guarded(*impl_, "watch_loss", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    impl_->loss(loss);
    report();
  });
}

void Sanitizer::end_step(bool lr_zero) {
  guarded(*impl_, "end_step", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    impl_->scaler_skipped = false;  // a skip reported before it is this iteration's (resolved then)
    if (!impl_->watch) {
      step_end(0, lr_zero);
      return;
    }
    impl_->end_iteration(/*backward_ran=*/false);
    report();
  });
}

void Sanitizer::end_step(const at::Tensor& loss) { end_step(std::vector<at::Tensor>{loss}); }

void Sanitizer::end_step(const std::vector<at::Tensor>& losses) {
  guarded(*impl_, "end_step", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    if (impl_->closed) return;
    bool backward_ran = false;
    for (const at::Tensor& loss : losses) {
      if (!loss.defined()) continue;
      // trainsan::attach checked it when the program read it (Note [C++ attach]).
      if (!impl_->watch || !impl_->loss_seen_at_backward(loss)) impl_->loss(loss);
      backward_ran = backward_ran || loss.requires_grad();
    }
    // A loss scaler reports its step before end_step: a skip since the last step end was this
    // iteration's, and its losses are given only now (Note [Loss stream]).
    if (impl_->scaler_skipped) impl_->loss_outcome(/*skipped=*/true);
    impl_->scaler_skipped = false;
    if (impl_->watch) {
      impl_->end_iteration(backward_ran);
    } else {
      impl_->step_end(0, /*lr_zero=*/false, /*manual=*/false);
    }
    report();
  });
}

void Sanitizer::forward(const ForwardFacts& facts) {
  guarded(*impl_, "forward", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    impl_->forward(facts);
    report();
  });
}

void Sanitizer::foreign_backward(const ForeignBackward& facts) {
  guarded(*impl_, "foreign_backward", [&] { impl_->foreign.foreign_backward(facts); });
}

bool Sanitizer::foreign_suspected() const {
  return !impl_->closed && impl_->checks.flow.foreign_suspected();
}

void Sanitizer::backward_without_graph() {
  guarded(*impl_, "backward_without_graph", [&] {
    impl_->backward_without_graph();
    report();
  });
}

void Sanitizer::step_begin(int64_t opt, bool grads_final) {
  guarded(*impl_, "step_begin", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    impl_->grads.set_in_step(true);
    impl_->updates.record_versions(opt);
    impl_->read_grads_at_begin(opt, grads_final);  // Note [Gradients read at the step's beginning]
    impl_->updates.check_outside_step(opt);
    impl_->stop_before_step(opt);
    report();
  });
}

void Sanitizer::step_end(int64_t opt, bool lr_zero, const std::vector<double>& group_lr) {
  guarded(*impl_, "step_end", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    impl_->step_end(opt, lr_zero, /*manual=*/false, group_lr);
    report();
  });
}

void Sanitizer::step_in_flight(int64_t opt) {
  guarded(*impl_, "step_in_flight", [&] {
    if (impl_->closed) return;
    impl_->grads.set_in_step(true);
    if (std::find(impl_->in_flight.begin(), impl_->in_flight.end(), opt) ==
        impl_->in_flight.end()) {
      impl_->in_flight.push_back(opt);
    }
  });
}

void Sanitizer::loss_targets(const std::vector<at::Tensor>& targets) {
  guarded(*impl_, "loss_targets", [&] { impl_->targets(targets); });
}

void Sanitizer::amp_skip(int64_t opt) {
  guarded(*impl_, "amp_skip", [&] {
    ScalerStep s;
    s.opt = opt;
    s.skipped = true;
    scaler_step(s);
  });
}

void Sanitizer::gradients_cleared(int64_t opt) {
  guarded(*impl_, "gradients_cleared", [&] {
    const host::OwnClock clock(impl_->time);  // Note [Own time]
    if (impl_->closed) return;
    impl_->gradients_cleared(opt);
    report();
  });
}

void Sanitizer::scaler_step(const ScalerStep& step) {
  guarded(*impl_, "scaler_step", [&] {
    if (impl_->closed) return;
    impl_->events_seen.insert("amp_scale_collapse");
    impl_->scaler_step(step);
    report();
  });
}

bool Sanitizer::provenance_armed() const {
  return !impl_->closed && impl_->checks.origins.armed(impl_->step);
}

void Sanitizer::provenance(const Provenance& facts) {
  guarded(*impl_, "provenance", [&] {
    if (impl_->closed) return;
    Provenance p = facts;
    p.step = impl_->step;
    impl_->checks.precision.on_provenance(p);
    report();
  });
}

void Sanitizer::local_shards(const std::vector<int64_t>& indices,
                             const std::vector<at::Tensor>& params,
                             const std::vector<at::Tensor>& grads) {
  guarded(*impl_, "local_shards", [&] {
    TORCH_CHECK_VALUE(indices.size() == params.size() && indices.size() == grads.size(),
                      "local_shards: indices, params and grads differ in length");
    for (size_t k = 0; k < indices.size(); ++k) {
      const int64_t i = impl_->tracked_index(indices[k], "local_shards");
      if (i < 0) continue;  // a parameter the pass does not read (Note [Dtypes the pass reads])
      impl_->params[i].local = params[k];
      impl_->params[i].local_grad = grads[k];
    }
  });
}

void Sanitizer::grad_accumulated(int64_t index) {
  guarded(*impl_, "grad_accumulated", [&] {
    const int64_t i = impl_->tracked_index(index, "grad_accumulated");
    if (i >= 0 && !impl_->closed) impl_->grads.external_accumulation(static_cast<size_t>(i));
  });
}

void Sanitizer::module_output(const ModuleInfo& module, const std::vector<at::Tensor>& outputs) {
  guarded(*impl_, "module_output", [&] {
    impl_->events_seen.insert("nonfinite_activation");
    impl_->module_output(module, outputs);
    report();
  });
}

void Sanitizer::check_target(const std::string& op, const at::Tensor& input,
                             const at::Tensor& target, std::optional<int64_t> ignore_index,
                             int64_t num_classes) {
  guarded(*impl_, "check_target", [&] {
    if (!impl_->closed) {
      impl_->audit->check_target(op, input, target, ignore_index, num_classes, impl_->step);
    }
    report();
  });
}

void Sanitizer::saved_tensor_changed(const SavedTensorChange& change) {
  guarded(*impl_, "saved_tensor_changed", [&] {
    if (!impl_->closed) impl_->checks.autograd.on_saved_tensor_changed(change, impl_->step);
    report();
  });
}

void Sanitizer::custom_grad_result(const CustomGradResult& result) {
  guarded(*impl_, "custom_grad_result", [&] { custom_grad_results({result}); });
}

void Sanitizer::custom_grad_results(const std::vector<CustomGradResult>& results) {
  guarded(*impl_, "custom_grad_results", [&] {
    impl_->events_seen.insert("bad_custom_grad");
    if (!impl_->closed) impl_->checks.autograd.on_custom_grads(results, impl_->step);
    report();
  });
}

void Sanitizer::compare_replicas() { impl_->replicas.enabled = impl_->opts.enabled("rank_desync"); }

std::vector<StepFingerprints> Sanitizer::take_fingerprints(bool wait_all) {
  if (wait_all && !impl_->closed) impl_->readback.drain_all();
  std::vector<StepFingerprints> out;
  out.swap(impl_->replicas.fingerprints);
  return out;
}

void Sanitizer::replica_report(const ReplicaReport& r) {
  guarded(*impl_, "replica_report", [&] {
    impl_->events_seen.insert("rank_desync");
    if (!impl_->closed) impl_->checks.replicas.on_report(r);
    report();
  });
}

bool Sanitizer::inplace_check_step() const {
  return !impl_->closed && !impl_->grads.in_step() &&
         impl_->opts.enabled("inplace_before_backward") &&
         impl_->checks.autograd.inplace_sampled(impl_->step);
}

std::vector<Finding> judge_checkpoint(const CheckpointFacts& facts) {
  return host::judge_checkpoint(facts);
}

void Sanitizer::checkpoint(const CheckpointFacts& facts) {
  guarded(*impl_, "checkpoint", [&] {
    if (impl_->closed) return;
    impl_->events_seen.insert("bad_checkpoint");
    impl_->checks.checkpoint.on_checkpoint(facts, impl_->step);
    report();
  });
}

bool Sanitizer::rerun_due() const {
  return !impl_->closed && impl_->opts.enabled("nondeterminism") &&
         impl_->checks.determinism.rerun_due(impl_->step);
}

void Sanitizer::rerun_result(const RerunFacts& facts) {
  guarded(*impl_, "rerun_result", [&] {
    if (impl_->closed) return;
    impl_->events_seen.insert("nondeterminism");
    impl_->checks.determinism.on_rerun(facts, impl_->step);
    report();
  });
}

void Sanitizer::rerun(const std::function<RerunRecord()>& step_fn, const RerunRecord& step) {
  TORCH_CHECK_VALUE(static_cast<bool>(step_fn), "Sanitizer::rerun: step_fn is empty");
  if (!rerun_due()) return;
  const std::optional<RerunFacts> facts = impl_->reruns.rerun(step_fn, step);
  if (facts) {
    rerun_result(*facts);
  } else {
    report();
  }
}

void Sanitizer::rerun(const StepRerun& how, const std::optional<RerunRecord>& step) {
  if (!rerun_due()) return;
  const std::optional<RerunFacts> facts = impl_->reruns.rerun(how, step ? &*step : nullptr);
  if (facts) {
    rerun_result(*facts);
  } else {
    report();
  }
}

Sanitizer::RerunNeed Sanitizer::rerun_needed(const Finding& f) const {
  return impl_->attribution.need(f);
}

Finding Sanitizer::attribute(const Finding& f, const std::optional<RerunOutcome>& outcome) {
  return impl_->attribution.attribute(f, outcome);
}

void Sanitizer::set_rerun_step(std::function<RerunRecord()> step_fn) {
  impl_->reruns.rerun_step = std::move(step_fn);
}

bool Sanitizer::recompute_due() const {
  return !impl_->closed && impl_->opts.enabled("nondeterminism") &&
         impl_->checks.determinism.recompute_due(impl_->step);
}

void Sanitizer::recompute(const RecomputeRecord& forward, const RecomputeRecord& recompute) {
  guarded(*impl_, "recompute", [&] {
    if (impl_->closed) return;
    impl_->events_seen.insert("nondeterminism");
    const std::optional<RerunFacts> facts = compare_recompute(forward, recompute);
    if (facts) {
      rerun_result(*facts);
    } else {
      report();
    }
  });
}

void Sanitizer::inputs_seen(const std::vector<uint64_t>& hashes,
                            const std::vector<int64_t>& steps) {
  guarded(*impl_, "inputs_seen", [&] {
    if (!impl_->closed) impl_->checks.inputs.seed(hashes, steps);
  });
}

void Sanitizer::resume(const ResumeFacts& facts) {
  guarded(*impl_, "resume", [&] {
    if (impl_->closed) return;
    impl_->events_seen.insert("optimizer_reset");
    if (facts.moment == ResumeFacts::Moment::kModelLoad && !facts.first_forward) {
      impl_->checks.inputs.on_resume(impl_->step);
    }
    impl_->checks.resume.on_resume(facts, impl_->step);
    report();
  });
}

bool Sanitizer::headroom_due() const {
  const int64_t every = impl_->opts.headroom_every;
  if (impl_->closed || !impl_->trace.is_open() || every <= 0 || impl_->step % every != 0) {
    return false;
  }
  // Note [Bounded trace]: the range records share the periodic records' byte budget, decided
  // once a step (the records of one step are gathered at several events).
  if (impl_->headroom_step != impl_->step) {
    impl_->headroom_step = impl_->step;
    impl_->headroom_ok = impl_->step < impl_->opts.trace_first_steps || impl_->trace.bulk_ok();
  }
  return impl_->headroom_ok;
}

void Sanitizer::trace_record(const std::string& json_object) {
  guarded(*impl_, "trace_record", [&] {
    TORCH_CHECK_VALUE(!json_object.empty() && json_object.front() == '{' &&
                          json_object.back() == '}' && json_object.find('\n') == std::string::npos,
                      "trace_record: expected one JSON object on one line");
    if (impl_->closed) return;
    if (json_object.rfind("{\"type\":\"range\"", 0) == 0 ||
        json_object.rfind("{\"type\": \"range\"", 0) == 0) {
      impl_->trace.bulk_line(json_object);  // Note [Bounded trace]
    } else {
      impl_->trace.line(json_object);
    }
  });
}

bool Sanitizer::gradcheck_step() const { return custom_grad_due(false); }

void Sanitizer::check_custom_grad(const std::string& name, const TensorFunction& fn,
                                  const std::vector<at::Tensor>& inputs) {
  // Its first call (by name), then on the gradcheck_every steps.
  if (!custom_grad_due(impl_->custom_grad.first_use(name))) return;
  impl_->custom_grad.check(name, fn, inputs);
  report();
}

bool Sanitizer::custom_grad_due(bool first_use) const {
  return !impl_->closed && !impl_->grads.in_step() && impl_->opts.enabled("bad_custom_grad") &&
         (first_use || impl_->checks.autograd.gradcheck_sampled(impl_->step));
}

void Sanitizer::add_overhead(double seconds) { impl_->add_outside(seconds); }

void Sanitizer::close() {
  try {  // Note [Faults]: after one, close() still runs (impl_->close() closes every part)
    impl_->close();
    report();
  } catch (const TrainingBugError&) {
    throw;
  } catch (const std::exception& e) {
    if (!absorbed(*impl_, "close", e)) throw;
  }
}

std::vector<Finding> Sanitizer::findings() const { return impl_->store.all(); }

std::map<std::string, TensorStats> Sanitizer::last_stats() const { return impl_->last; }

int64_t Sanitizer::step() const { return impl_->step; }

int64_t Sanitizer::loss_reaches(const at::Tensor& loss) {
  const host::OwnClock clock(impl_->time);  // Note [Own time]
  return impl_->foreign.loss_reaches(loss);
}

double Sanitizer::overhead_seconds() const { return impl_->time.overhead_s; }

bool Sanitizer::hooks_installed() const { return impl_->grads.installed(); }

bool Sanitizer::auditing() const { return impl_->audit->auditing(); }

void Sanitizer::pause_audit(bool paused) { host::OpAudit::pause_this_thread(paused); }

Coverage Sanitizer::coverage() const { return impl_->coverage_now(); }

std::string Sanitizer::take_trace_error() {
  return impl_->trace.take_new_error() ? impl_->trace.error() : std::string();
}

ModelBinding* Sanitizer::binding() const { return impl_->setup.binding.get(); }

}  // namespace trainsan
