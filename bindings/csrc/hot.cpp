// _trainsan_hot: the per-step events of the Python package's sanitizer handle as a pybind11
// module (Note [Hot path] in handle.h). Each function takes the handle's id (hot_id()) and calls
// the same function as the torch.classes method of that name; a handle that is gone raises.
// It also binds the C++ drivers that run Python callables (Note [One orchestration]).
//
// Note [One orchestration]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// An algorithm that orchestrates evaluations of the user's code — the directional gradcheck of a
// custom Function (measure_custom_grad, host/custom_grad.cpp), the nondeterminism re-runs of a
// step (Sanitizer::rerun, Note [One re-run driver] in host/feeds/rerun_feed.cpp: Python gives its
// start state and one run as callables, the driver runs, fingerprints, compares and reports) — or a
// schedule of collectives — rank_desync's per replica set (trainsan::ReplicaEngine, Note [Replica
// comparison over c10d] in host/replicas_pg.cpp) — is written once, in C++, where LibTorch programs
// call it. (One that needs no Python callable is an op of the op library instead, which every
// Python can load: the loss-root walk, walk_loss_graph in check_ops.cpp.) The Python package calls
// the same driver here, passing Python callables: pybind11 wraps a Python function into the
// std::function the driver takes and takes the GIL for each call. The GIL is released for the
// driver's own work, since its backward may run a Python Function's backward on an autograd device
// thread, which needs the GIL (and the replica engine waits for other ranks). The replica engine
// takes the side group the package made (torch.distributed.new_group) as the c10d::ProcessGroup it
// is: torch's pybind11 class, holder c10::intrusive_ptr, shared with this module through pybind11's
// internals (torch's own pybind11 headers); its Python steps read the store (replicas.py's
// _StoreSteps), and its reports go to the handle, whose findings go back to Python. These drivers
// need pybind11, so they live in this module, not in the op library (torch.classes cannot take a
// Python callable). The module is built with the package wherever Python's headers are (always
// under pip); where it is missing (another Python than the build's, TRAINSAN_HOT_MODULE OFF) the
// checks built on a driver are off and the package says so in a note (drivers() in _native.py) —
// there is no second implementation in Python. TRAINSAN_HOT=0 chooses the binding of the per-step
// events only; the drivers are used either way.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <utility>
#include <vector>

#include "handle.h"
#include "trainsan/replica_engine.h"

namespace py = pybind11;
namespace tb = trainsan::bindings;

namespace {

tb::SanitizerHandle& handle(int64_t id) {
  tb::SanitizerHandle* h = tb::handle_by_id(id);
  if (h == nullptr) {
    throw py::value_error("trainsan: sanitizer handle " + std::to_string(id) +
                          " is gone (its torch.classes object was released)");
  }
  return *h;
}

// A C++ exception as the Python exception torch.classes would raise for it (c10::TypeError ->
// TypeError, c10::ValueError -> ValueError, c10::Error -> RuntimeError), TORCH_WARN as a warning.
template <typename F>
auto guarded(F&& f) -> decltype(f()) {
  HANDLE_TH_ERRORS
  return f();
  END_HANDLE_TH_ERRORS_PYBIND
}

// A facts struct's fields by name (Note [Facts by name]) as a Python dict: scalar fields only (a
// Finding's, a CustomGradResult's).
py::dict to_py(const trainsan::FactsDict& d) {
  py::dict out;
  for (const auto& kv : d) {
    const c10::IValue& v = kv.value();
    py::object o;
    if (v.isString()) {
      o = py::str(v.toStringRef());
    } else if (v.isBool()) {
      o = py::bool_(v.toBool());
    } else if (v.isInt()) {
      o = py::int_(v.toInt());
    } else if (v.isDouble()) {
      o = py::float_(v.toDouble());
    } else if (v.isNone()) {
      o = py::none();
    } else {
      throw py::type_error("trainsan: facts field " + kv.key() + " is not a scalar");
    }
    out[py::str(kv.key())] = o;
  }
  return out;
}

// Reports as the torch.classes methods return them: a list of (finding dict, action).
py::list to_py(const tb::Reports& reports) {
  py::list out;
  for (const auto& [finding, action] : reports) out.append(py::make_tuple(to_py(finding), action));
  return out;
}

using Rows = std::optional<std::vector<std::vector<int64_t>>>;

// rank_desync's engine for one replica set of the Python package (Note [Replica comparison],
// replicas.py): its reports go to the handle `id`, and the handle's findings to `apply`; the
// store steps are Python callables (None: the c10d default).
std::unique_ptr<trainsan::ReplicaEngine> make_replica_engine(
    int64_t id, c10::intrusive_ptr<c10d::ProcessGroup> group, std::string context,
    std::vector<int64_t> ranks, int64_t rank, std::vector<int64_t> members,
    std::vector<std::string> member_names, std::vector<std::string> buffer_names, int64_t digest,
    double timeout_s, std::string switch_off, std::function<void(py::list)> apply,
    std::function<bool(int64_t)> gone,
    std::function<std::tuple<std::vector<int64_t>, std::vector<std::string>>(int64_t, bool)>
        missing,
    std::function<Rows(int64_t, const std::vector<int64_t>&, const std::vector<int64_t>&)> rows,
    std::function<void(const std::string&)> warn) {
  handle(id);  // there now
  trainsan::ReplicaSetSpec spec;
  spec.context = std::move(context);
  spec.ranks = std::move(ranks);
  spec.rank = rank;
  spec.members = std::move(members);
  spec.member_names = std::move(member_names);
  spec.buffer_names = std::move(buffer_names);
  spec.digest = digest;
  spec.timeout_s = timeout_s;
  spec.switch_off = std::move(switch_off);  // collective_timeout unset: the side group's own
  trainsan::ReplicaSteps steps;
  // Called with the GIL released (launch and drain are bound so, below): taken back to reach
  // the handle, which the training's Python threads reach under it too.
  steps.report = [id, apply = std::move(apply)](const trainsan::ReplicaReport& r) {
    const py::gil_scoped_acquire gil;
    tb::SanitizerHandle& h = handle(id);
    h.san->replica_report(r);
    const tb::Reports reports = h.take();
    if (apply) apply(to_py(reports));
  };
  steps.gone = std::move(gone);
  if (missing) {
    steps.missing = [missing = std::move(missing)](int64_t seq, bool timed_out) {
      auto [who, detail] = missing(seq, timed_out);
      return trainsan::ReplicaMissing{std::move(who), std::move(detail)};
    };
  }
  steps.rows = std::move(rows);
  steps.warn = std::move(warn);
  return std::make_unique<trainsan::ReplicaEngine>(std::move(group), std::move(spec),
                                                   std::move(steps));
}

}  // namespace

PYBIND11_MODULE(_trainsan_hot, m) {
  m.doc() = "TrainSan's per-step events, bound without torch.classes (Note [Hot path]).";
  m.def("forward", [](int64_t id, bool training, std::vector<at::Tensor> inputs,
                      std::vector<bool> module_eval, double extra_s, int64_t data_restarts,
                      int64_t loader_pass, int64_t loader_workers, bool loader_worker_init,
                      std::vector<at::Tensor> batch, int64_t loader_batch) {
    return guarded([&] {
      auto [reports, due] = tb::handle_forward(
          handle(id), training, std::move(inputs), std::move(module_eval), extra_s, data_restarts,
          loader_pass, loader_workers, loader_worker_init, std::move(batch), loader_batch);
      return py::make_tuple(to_py(reports), due);
    });
  });
  m.def("loss", [](int64_t id, const at::Tensor& loss) {
    return guarded([&] { return to_py(tb::handle_loss(handle(id), loss)); });
  });
  m.def("loss_reaches", [](int64_t id, const at::Tensor& loss) {
    return guarded([&] { return tb::handle_loss_reaches(handle(id), loss); });
  });
  m.def("step_begin", [](int64_t id, int64_t opt, bool grads_final) {
    return guarded([&] {
      auto [reports, headroom] = tb::handle_step_begin(handle(id), opt, grads_final);
      return py::make_tuple(to_py(reports), headroom);
    });
  });
  m.def("step_end", [](int64_t id, int64_t opt, bool lr_zero, double extra_s,
                       const std::vector<double>& group_lr) {
    return guarded(
        [&] { return to_py(tb::handle_step_end(handle(id), opt, lr_zero, extra_s, group_lr)); });
  });
  // Note [One orchestration]: the drivers.
  m.def(
      "measure_custom_grad",
      [](const std::string& name, const trainsan::TensorFunction& fn,
         const std::vector<at::Tensor>& inputs) {
        return guarded([&] {
          std::vector<trainsan::CustomGradResult> results;
          {
            const py::gil_scoped_release no_gil;
            results = trainsan::measure_custom_grad_or_throw(name, fn, inputs);
          }
          py::list out;
          for (const auto& r : results) out.append(to_py(trainsan::facts_to_dict(r)));
          return out;
        });
      },
      "trainsan::measure_custom_grad_or_throw: CustomGradResult dicts; fn's exceptions propagate");
  // The engine's calls release the GIL: they wait for the other ranks (up to desync_timeout),
  // taking it back for the Python steps.
  py::class_<trainsan::ReplicaEngine>(m, "ReplicaEngine",
                                      "trainsan::ReplicaEngine (trainsan/replica_engine.h)")
      .def(
          py::init([](int64_t id, c10::intrusive_ptr<c10d::ProcessGroup> group, std::string context,
                      std::vector<int64_t> ranks, int64_t rank, std::vector<int64_t> members,
                      std::vector<std::string> member_names, std::vector<std::string> buffer_names,
                      int64_t digest, double timeout_s, std::string switch_off,
                      std::function<void(py::list)> apply, std::function<bool(int64_t)> gone,
                      std::function<std::tuple<std::vector<int64_t>, std::vector<std::string>>(
                          int64_t, bool)>
                          missing,
                      std::function<Rows(int64_t, const std::vector<int64_t>&,
                                         const std::vector<int64_t>&)>
                          rows,
                      std::function<void(const std::string&)> warn) {
            return guarded([&] {
              return make_replica_engine(id, std::move(group), std::move(context), std::move(ranks),
                                         rank, std::move(members), std::move(member_names),
                                         std::move(buffer_names), digest, timeout_s,
                                         std::move(switch_off), std::move(apply), std::move(gone),
                                         std::move(missing), std::move(rows), std::move(warn));
            });
          }),
          py::arg("handle_id"), py::arg("group"), py::arg("context"), py::arg("ranks"),
          py::arg("rank"), py::arg("members"), py::arg("member_names"), py::arg("buffer_names"),
          py::arg("digest"), py::arg("timeout_s"), py::arg("switch_off"), py::arg("apply"),
          py::arg("gone") = py::none(), py::arg("missing") = py::none(),
          py::arg("rows") = py::none(), py::arg("warn") = py::none())
      .def(
          "launch",
          [](trainsan::ReplicaEngine& e, int64_t opt, int64_t count, int64_t step, bool skipped,
             int64_t forwards, std::vector<int64_t> index, std::vector<int64_t> param,
             std::vector<int64_t> grad, std::vector<bool> has_grad, std::vector<int64_t> grads,
             std::vector<std::pair<int64_t, int64_t>> state, std::vector<int64_t> buffers,
             bool first) {
            trainsan::ReplicaRowFacts f;
            f.opt = opt;
            f.count = count;
            f.step = step;
            f.skipped = skipped;
            f.forwards = forwards;
            f.fingerprints.index = std::move(index);
            f.fingerprints.param = std::move(param);
            f.fingerprints.grad = std::move(grad);
            f.fingerprints.has_grad = std::move(has_grad);
            f.grads = std::move(grads);
            f.state = std::move(state);
            f.buffers = std::move(buffers);
            guarded([&] {
              const py::gil_scoped_release no_gil;
              e.launch(std::move(f), first);
            });
          },
          "one event's comparison (ReplicaRowFacts without the digest; first: before the first "
          "step)")
      .def("drain",
           [](trainsan::ReplicaEngine& e, size_t keep) {
             guarded([&] {
               const py::gil_scoped_release no_gil;
               e.drain(keep);
             });
           })
      .def("stop", &trainsan::ReplicaEngine::stop)
      .def_property_readonly("stopped", &trainsan::ReplicaEngine::stopped)
      .def_property_readonly("launched", &trainsan::ReplicaEngine::launched);
  // Note [One re-run driver] (host/feeds/rerun_feed.cpp): the nondeterminism re-runs. `run`
  // returns a RerunRecord; `step` is the step's own forward's (None: not compared).
  py::class_<trainsan::RerunRecord>(m, "RerunRecord",
                                    "trainsan::RerunRecord: what one run of a step recorded")
      .def(py::init<>())
      .def(
          "add_hashes",
          [](trainsan::RerunRecord& r, std::string name, std::string type,
             const std::vector<int64_t>& hashes) {
            // The bits, as int64 (torch.ops.trainsan.tensor_stats' hash column).
            r.add_hashes(std::move(name), std::vector<uint64_t>(hashes.begin(), hashes.end()),
                         std::move(type));
          },
          "an output (a module's) by the fingerprints taken of it while the run ran")
      .def(
          "add_grad",
          [](trainsan::RerunRecord& r, std::string name, at::Tensor grad) {
            r.grads.emplace_back(std::move(name), std::move(grad));
          },
          "a gradient, in backward order (the output's side first)");
  m.def(
      "rerun",
      [](int64_t id, std::function<void()> start, std::function<void()> restore,
         std::function<trainsan::RerunRecord()> run,
         const std::optional<trainsan::RerunRecord>& step) {
        return guarded([&] {
          tb::SanitizerHandle& h = handle(id);
          const trainsan::StepRerun how{std::move(start), std::move(restore), std::move(run)};
          {
            const py::gil_scoped_release no_gil;
            h.san->rerun(how, step);
          }
          return to_py(h.take());
        });
      },
      "trainsan::Sanitizer::rerun(StepRerun, step): the reports; the callables' exceptions "
      "propagate");
  m.def("gradients_cleared", [](int64_t id, int64_t opt) {
    return guarded([&] { return to_py(tb::handle_gradients_cleared(handle(id), opt)); });
  });
}
