// The op library behind the Python package: TORCH_LIBRARY ops callable as torch.ops.trainsan.*,
// loaded with torch.ops.load_library (no Python C API, so one build serves every Python version).
// It binds the public C++ API (trainsan/trainsan.h) and nothing else of host/.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

#include "handle.h"
#include "trainsan/trainsan.h"

namespace {

// Facts cross by name (Note [Facts by name], trainsan/facts_dict.h).
using trainsan::facts_from_dict;
using FactsDict = trainsan::FactsDict;

// A checkpoint outside a sanitizer: its findings by field name (finding.def), and its facts.
std::tuple<std::vector<FactsDict>, FactsDict> check_checkpoint_op(FactsDict contents) {
  const trainsan::CheckpointFacts facts =
      trainsan::checkpoint_facts(facts_from_dict<trainsan::CheckpointContents>(contents));
  std::vector<FactsDict> out;
  for (const trainsan::Finding& f : trainsan::judge_checkpoint(facts)) {
    out.push_back(trainsan::facts_to_dict(f));
  }
  return {out, trainsan::facts_to_dict(facts)};
}

// An optimizer's state against its own parameters (a resume's optimizer.load_state_dict).
std::vector<std::string> state_mismatches_op(FactsDict optimizer) {
  const trainsan::OptimizerDesc d =
      trainsan::describe_optimizer(facts_from_dict<trainsan::OptimizerTensors>(optimizer));
  return trainsan::state_mismatches(d, d);
}

std::tuple<at::Tensor, at::Tensor> tensor_stats_op(at::TensorList tensors) {
  const trainsan::PackedStats p = trainsan::tensor_stats_packed(tensors.vec());
  return {p.ints, p.floats};
}

std::tuple<at::Tensor, at::Tensor> tensor_stats_meta(at::TensorList tensors) {
  const trainsan::PackedStats p = trainsan::tensor_stats_packed_shapes(tensors.vec());
  return {p.ints, p.floats};
}

// Statistics are not differentiable: the autograd kernel steps below autograd and returns
// results that do not require grad, so parameters with requires_grad=True can be passed as is.
std::tuple<at::Tensor, at::Tensor> tensor_stats_autograd(at::TensorList tensors) {
  const c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("trainsan::tensor_stats", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(at::TensorList)>();
  return op.call(tensors);
}

bool cuda_compiled_op() { return trainsan::cuda_compiled(); }

// Column names of the packed rows (Note [Packed row]): int64 columns, float64 columns.
std::tuple<std::vector<std::string>, std::vector<std::string>> stats_fields_op() {
  const std::vector<std::string> names = trainsan::packed_field_names();
  const auto ints = static_cast<std::ptrdiff_t>(trainsan::packed_int_fields());
  return {{names.begin(), names.begin() + ints}, {names.begin() + ints, names.end()}};
}

// kinds.def as columns: name, severity, on by default, family, rule.
std::tuple<std::vector<std::string>, std::vector<std::string>, c10::List<bool>,
           std::vector<std::string>, std::vector<std::string>>
kinds_op() {
  std::vector<std::string> name, severity, family, rule;
  c10::List<bool> on;
  for (const trainsan::KindInfo& k : trainsan::kinds()) {
    name.emplace_back(k.name);
    severity.emplace_back(trainsan::severity_name(k.severity));
    on.push_back(k.default_on);
    family.emplace_back(k.family);
    rule.emplace_back(k.rule);
  }
  return {name, severity, on, family, rule};
}

// options.def as columns: name, type, default (text), choices ("a|b"), doc.
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>>
options_op() {
  std::vector<std::string> name, type, def, choices, doc;
  for (const trainsan::OptionInfo& o : trainsan::option_table()) {
    name.emplace_back(o.name);
    type.emplace_back(o.type);
    def.push_back(o.default_value);
    choices.emplace_back(o.choices);
    doc.emplace_back(o.doc);
  }
  return {name, type, def, choices, doc};
}

}  // namespace

namespace trainsan::bindings {

namespace {
// The live handles by id (Note [Hot path]); the events are called with the GIL held, the mutex is
// for a handle released on another thread.
std::mutex registry_mutex;
std::unordered_map<int64_t, SanitizerHandle*>& registry() {
  static std::unordered_map<int64_t, SanitizerHandle*> r;
  return r;
}
int64_t next_id = 1;
}  // namespace

SanitizerHandle* handle_by_id(int64_t id) {
  const std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second;
}

SanitizerHandle::SanitizerHandle(const trainsan::FactsDict& args) {
  trainsan::SanitizerArgs a = facts_from_dict<trainsan::SanitizerArgs>(args);
  trainsan::Options o;
  for (const auto& [name, value] : a.options) o.set(name, value);
  a.setup.report = [this](const trainsan::Finding& f, trainsan::Action act) {
    reports.emplace_back(trainsan::facts_to_dict(f), static_cast<int64_t>(act));
  };
  san = std::make_unique<trainsan::Sanitizer>(std::move(a.parameters), std::move(o),
                                              std::move(a.setup));
  const std::lock_guard<std::mutex> lock(registry_mutex);
  id = next_id++;
  registry()[id] = this;
}

SanitizerHandle::~SanitizerHandle() {
  if (id == 0) return;
  const std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(id);
}

Reports SanitizerHandle::take() {
  Reports out;
  out.swap(reports);
  return out;
}

DueFields due_fields(const trainsan::Sanitizer& s) {
  return std::make_tuple(s.step(), s.inplace_check_step(), s.rerun_due(), s.recompute_due(),
                         s.headroom_due(), s.provenance_armed());
}

std::tuple<Reports, DueFields> handle_forward(SanitizerHandle& h, bool training,
                                              std::vector<at::Tensor> inputs,
                                              std::vector<bool> module_eval, double extra_s,
                                              int64_t data_restarts, int64_t loader_pass,
                                              int64_t loader_workers, bool loader_worker_init,
                                              std::vector<at::Tensor> batch, int64_t loader_batch) {
  h.san->add_overhead(extra_s);
  trainsan::ForwardFacts f;
  f.training = training;
  f.inputs = std::move(inputs);
  f.module_eval = std::move(module_eval);
  f.data_restarts = data_restarts;
  f.loader_pass = loader_pass;
  f.loader_workers = loader_workers;
  f.loader_worker_init = loader_worker_init;
  f.batch = std::move(batch);
  f.loader_batch = loader_batch;
  h.san->forward(f);
  return std::make_tuple(h.take(), due_fields(*h.san));
}

Reports handle_loss(SanitizerHandle& h, const at::Tensor& loss) {
  h.san->watch_loss(loss);
  return h.take();
}

int64_t handle_loss_reaches(SanitizerHandle& h, const at::Tensor& loss) {
  return h.san->loss_reaches(loss);
}

std::tuple<Reports, int64_t> handle_step_begin(SanitizerHandle& h, int64_t opt, bool grads_final) {
  const int64_t headroom = h.san->headroom_due() ? h.san->step() : -1;
  h.san->step_begin(opt, grads_final);
  return std::make_tuple(h.take(), headroom);
}

Reports handle_step_end(SanitizerHandle& h, int64_t opt, bool lr_zero, double extra_s,
                        const std::vector<double>& group_lr) {
  h.san->add_overhead(extra_s);
  h.san->step_end(opt, lr_zero, group_lr);
  return h.take();
}

Reports handle_gradients_cleared(SanitizerHandle& h, int64_t opt) {
  h.san->gradients_cleared(opt);
  return h.take();
}

}  // namespace trainsan::bindings

namespace {

namespace tb = trainsan::bindings;
using trainsan::bindings::Report;
using trainsan::bindings::SanitizerHandle;

// Note [Lean rows]: the every-step pass over detached views of `tensors` (one device).
trainsan::PackedStats lean_stats(at::TensorList tensors) {
  std::vector<at::Tensor> ts;
  ts.reserve(tensors.size());
  for (const at::Tensor& t : tensors) ts.push_back(t.detach());
  return trainsan::gradient_stats_packed(ts);
}

}  // namespace

TORCH_LIBRARY(trainsan, m) {
  m.def("tensor_stats(Tensor[] tensors) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  // Note [Lean rows]: the every-step tier's pass over tensors of one device (bench, tests).
  m.def("gradient_stats(Tensor[] tensors) -> (Tensor, Tensor)", [](at::TensorList tensors) {
    const trainsan::PackedStats p = lean_stats(tensors);
    return std::make_tuple(p.ints, p.floats);
  });
  // Note [Saved-tensor fingerprint] (autograd_checks.py): the lean rows of tensors of one device
  // as one int64 [N, 13] tensor (the int columns, then the float columns' bits), on that device.
  m.def("fingerprints(Tensor[] tensors) -> Tensor", [](at::TensorList tensors) {
    const trainsan::PackedStats p = lean_stats(tensors);
    return at::cat({p.ints, p.floats.view(at::kLong)}, 1);
  });
  m.def("cuda_compiled() -> bool", &cuda_compiled_op);
  m.def("check_checkpoint", &check_checkpoint_op);
  m.def("state_mismatches", &state_mismatches_op);
  m.def("facts_defaults", [](std::string name) { return trainsan::facts_defaults(name); });
  m.def("range_histogram(Tensor t, float[] bounds) -> Tensor",
        [](const at::Tensor& t, std::vector<double> bounds) {
          return trainsan::range_histogram(t, bounds);
        });
  m.def("stats_fields", &stats_fields_op);
  m.def("kinds", &kinds_op);
  m.def("options", &options_op);
  // Options::set for each name=value, then validate(): the launcher's check of its flags before
  // the script runs (a ValueError naming the option, the value and its range).
  m.def("check_options", [](c10::Dict<std::string, std::string> options) {
    trainsan::Options o;
    for (const auto& kv : options) o.set(kv.key(), kv.value());
    o.validate();
  });

  using H = c10::intrusive_ptr<SanitizerHandle>;
  m.class_<SanitizerHandle>("Sanitizer")
      // Built from one dict by name (Note [Facts by name]): SanitizerArgs's table — parameters,
      // options, then Setup's rows (setup.def); the Python package starts from
      // facts_defaults("SanitizerArgs").
      .def(torch::init<FactsDict>())
      // The per-step events (Note [Hot path]): the same functions as the _trainsan_hot module's.
      .def("hot_id", [](const H& h) { return h->id; })
      .def(
          "forward",
          [](const H& h, bool training, std::vector<at::Tensor> inputs, c10::List<bool> module_eval,
             double extra_s, int64_t data_restarts, int64_t loader_pass, int64_t loader_workers,
             bool loader_worker_init, std::vector<at::Tensor> batch, int64_t loader_batch) {
            return tb::handle_forward(*h, training, std::move(inputs), module_eval.vec(), extra_s,
                                      data_restarts, loader_pass, loader_workers,
                                      loader_worker_init, std::move(batch), loader_batch);
          })
      .def("gradients_cleared",
           [](const H& h, int64_t opt) { return tb::handle_gradients_cleared(*h, opt); })
      .def("loss", [](const H& h, at::Tensor loss) { return tb::handle_loss(*h, loss); })
      .def("foreign_backward",
           [](const H& h, FactsDict facts) {
             h->san->foreign_backward(facts_from_dict<trainsan::ForeignBackward>(facts));
           })
      .def("foreign_suspected", [](const H& h) { return h->san->foreign_suspected(); })
      .def("backward_without_graph",
           [](const H& h) {
             h->san->backward_without_graph();
             return h->take();
           })
      .def("step_begin",
           [](const H& h, int64_t opt, bool grads_final) {
             return tb::handle_step_begin(*h, opt, grads_final);
           })
      .def("step_end",
           [](const H& h, int64_t opt, bool lr_zero, double extra_s, std::vector<double> group_lr) {
             return tb::handle_step_end(*h, opt, lr_zero, extra_s, group_lr);
           })
      .def("step_in_flight", [](const H& h, int64_t opt) { h->san->step_in_flight(opt); })
      .def("scaler_step",
           [](const H& h, int64_t opt, bool skipped, double scale) {
             trainsan::ScalerStep s;
             s.opt = opt;
             s.skipped = skipped;
             s.scale = scale;
             h->san->scaler_step(s);
             return h->take();
           })
      .def("headroom_due", [](const H& h) { return h->san->headroom_due(); })
      .def("loss_targets",
           [](const H& h, std::vector<at::Tensor> targets) { h->san->loss_targets(targets); })
      .def("loss_reaches",
           [](const H& h, at::Tensor loss) { return tb::handle_loss_reaches(*h, loss); })
      // due_fields() outside a training forward (forward() returns them with its reports).
      .def("due", [](const H& h) { return tb::due_fields(*h->san); })
      .def("rerun_result",
           [](const H& h, FactsDict facts) {
             h->san->rerun_result(facts_from_dict<trainsan::RerunFacts>(facts));
             return h->take();
           })
      // Re-run attribution (Note [Re-run attribution]): a finding new at the event just
      // reported, as that event reported it (its dict, finding.def).
      .def("rerun_needed",
           [](const H& h, FactsDict finding) {
             return static_cast<int64_t>(
                 h->san->rerun_needed(facts_from_dict<trainsan::Finding>(finding)));
           })
      .def("attribute",
           [](const H& h, FactsDict finding, std::optional<FactsDict> outcome) {
             std::optional<trainsan::RerunOutcome> o;
             if (outcome) o = facts_from_dict<trainsan::RerunOutcome>(*outcome);
             return trainsan::facts_to_dict(
                 h->san->attribute(facts_from_dict<trainsan::Finding>(finding), o));
           })
      .def("inputs_seen",
           [](const H& h, std::vector<int64_t> hashes, std::vector<int64_t> steps) {
             std::vector<uint64_t> u(hashes.begin(), hashes.end());  // the bits, as int64
             h->san->inputs_seen(u, steps);
           })
      .def("resume",
           [](const H& h, FactsDict facts) {
             h->san->resume(facts_from_dict<trainsan::ResumeFacts>(facts));
             return h->take();
           })
      .def("checkpoint",
           [](const H& h, FactsDict contents) {
             h->san->checkpoint(trainsan::checkpoint_facts(
                 facts_from_dict<trainsan::CheckpointContents>(contents)));
             return h->take();
           })
      .def("trace_record", [](const H& h, std::string json) { h->san->trace_record(json); })
      .def("provenance",
           [](const H& h, FactsDict facts) {
             h->san->provenance(facts_from_dict<trainsan::Provenance>(facts));
             return h->take();
           })
      .def("local_shards",
           [](const H& h, std::vector<int64_t> indices, std::vector<at::Tensor> params,
              std::vector<std::optional<at::Tensor>> grads) {
             std::vector<at::Tensor> g;
             for (auto& t : grads) g.push_back(t.value_or(at::Tensor()));
             h->san->local_shards(indices, params, g);
           })
      .def("grad_accumulated", [](const H& h, int64_t i) { h->san->grad_accumulated(i); })
      .def("module_output",
           [](const H& h, std::string name, std::string type, std::vector<at::Tensor> outputs) {
             h->san->module_output({std::move(name), std::move(type)}, outputs);
             return h->take();
           })
      .def("check_target",
           [](const H& h, std::string op, std::optional<at::Tensor> input, at::Tensor target,
              std::optional<int64_t> ignore_index, int64_t num_classes) {
             h->san->check_target(op, input.value_or(at::Tensor()), target, ignore_index,
                                  num_classes);
             return h->take();
           })
      .def("saved_tensor_changed",
           [](const H& h, FactsDict facts) {
             h->san->saved_tensor_changed(facts_from_dict<trainsan::SavedTensorChange>(facts));
             return h->take();
           })
      .def("custom_grad_result",
           [](const H& h, FactsDict facts) {
             h->san->custom_grad_result(facts_from_dict<trainsan::CustomGradResult>(facts));
             return h->take();
           })
      .def("custom_grad_results",
           [](const H& h, std::vector<FactsDict> facts) {
             std::vector<trainsan::CustomGradResult> results;
             for (const FactsDict& f : facts) {
               results.push_back(facts_from_dict<trainsan::CustomGradResult>(f));
             }
             h->san->custom_grad_results(results);
             return h->take();
           })
      .def("compare_replicas", [](const H& h) { h->san->compare_replicas(); })
      .def("take_fingerprints",
           [](const H& h, bool wait_all) {
             // Per pass: (step, optimizer, [n, 4] int64: index, fingerprint, has_grad, grad's).
             std::vector<std::tuple<int64_t, int64_t, at::Tensor>> out;
             for (const auto& fp : h->san->take_fingerprints(wait_all)) {
               const auto n = static_cast<int64_t>(fp.index.size());
               at::Tensor t = at::empty({n, 4}, at::kLong);
               int64_t* d = t.data_ptr<int64_t>();
               for (int64_t k = 0; k < n; ++k) {
                 const auto u = static_cast<size_t>(k);
                 d[4 * k] = fp.index[u];
                 d[4 * k + 1] = fp.param[u];
                 d[4 * k + 2] = fp.has_grad[u] ? 1 : 0;
                 d[4 * k + 3] = fp.grad[u];
               }
               out.emplace_back(fp.step, fp.opt, t);
             }
             return out;
           })
      .def("replica_report",
           [](const H& h, FactsDict facts) {
             h->san->replica_report(facts_from_dict<trainsan::ReplicaReport>(facts));
             return h->take();
           })
      .def("gradcheck_step", [](const H& h) { return h->san->gradcheck_step(); })
      .def("custom_grad_due",
           [](const H& h, bool first_use) { return h->san->custom_grad_due(first_use); })
      .def("add_overhead", [](const H& h, double s) { h->san->add_overhead(s); })
      .def("close",
           [](const H& h) {
             h->san->close();
             return h->take();
           })
      .def("findings",
           [](const H& h) {
             std::vector<FactsDict> out;
             for (const auto& f : h->san->findings()) out.push_back(trainsan::facts_to_dict(f));
             return out;
           })
      .def("hooks_installed", [](const H& h) { return h->san->hooks_installed(); })
      .def("take_trace_error", [](const H& h) { return h->san->take_trace_error(); })
      .def("auditing", [](const H& h) { return h->san->auditing(); })
      .def("pause_audit",
           [](const H& /*h*/, bool paused) { trainsan::Sanitizer::pause_audit(paused); })
      .def("coverage",
           [](const H& h) {
             const trainsan::Coverage c = h->san->coverage();
             c10::Dict<std::string, int64_t> counts;
#define TRAINSAN_COVERAGE_COUNT(name, init, doc) counts.insert(#name, c.name);
#include "trainsan/coverage.def"
#undef TRAINSAN_COVERAGE_COUNT
             std::vector<std::string> kinds, reasons;
             for (const auto& [k, why] : c.unchecked) {
               kinds.push_back(k);
               reasons.push_back(why);
             }
             return std::make_tuple(counts, kinds, reasons, c.trace_error, c.unread, c.fault);
           })
      .def("step", [](const H& h) { return h->san->step(); })
      .def("overhead_s", [](const H& h) { return h->san->overhead_seconds(); })
      .def("last_stats", [](const H& h) {
        std::vector<std::string> names;
        std::vector<trainsan::TensorStats> st;
        for (const auto& [k, v] : h->san->last_stats()) {
          names.push_back(k);
          st.push_back(v);
        }
        const trainsan::PackedStats p = trainsan::pack_stats(st);
        return std::make_tuple(names, p.ints, p.floats);
      });
}

TORCH_LIBRARY_IMPL(trainsan, CPU, m) { m.impl("tensor_stats", &tensor_stats_op); }

TORCH_LIBRARY_IMPL(trainsan, CUDA, m) { m.impl("tensor_stats", &tensor_stats_op); }

TORCH_LIBRARY_IMPL(trainsan, Autograd, m) { m.impl("tensor_stats", &tensor_stats_autograd); }

TORCH_LIBRARY_IMPL(trainsan, Meta, m) { m.impl("tensor_stats", &tensor_stats_meta); }

// Calls without a backend kernel: an empty list (no tensor, so no dispatch key) gets its [0, 8]
// and [0, 5] CPU results, and sparse or quantized tensors get the host layer's error naming the
// element instead of the dispatcher's "could not run" (nested tensors are not covered by this
// alias; the Python wrapper names them).
TORCH_LIBRARY_IMPL(trainsan, CompositeExplicitAutograd, m) {
  m.impl("tensor_stats", &tensor_stats_op);
}
