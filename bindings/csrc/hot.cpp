// _trainsan_hot: the per-step events of the Python package's sanitizer handle as a pybind11
// module (Note [Hot path] in handle.h). Each function takes the handle's id (hot_id()) and calls
// the same function as the torch.classes method of that name; a handle that is gone raises.
// It also binds the C++ drivers that run Python callables (Note [One orchestration]).
//
// Note [One orchestration]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// An algorithm that orchestrates evaluations of the user's code — the directional gradcheck of a
// custom Function (measure_custom_grad, host/custom_grad.cpp) — is written once, in C++, where
// LibTorch programs call it. (One that needs no Python callable is an op of the op library
// instead, which every Python can load: the loss-root walk, walk_loss_graph in check_ops.cpp.) The
// Python package calls the same driver here, passing Python callables: pybind11 wraps a Python
// function into the std::function the driver takes and takes the GIL for each call. The GIL is
// released for the driver's own work, since its backward may run a Python Function's backward on an
// autograd device thread, which needs the GIL. These drivers need pybind11, so they live in this
// module, not in the op library (torch.classes cannot take a Python callable). The module is built
// with the package wherever Python's headers are (always under pip); where it is missing (another
// Python than the build's, TRAINSAN_HOT_MODULE OFF) the checks built on a driver are off and the
// package says so in a note (drivers() in _native.py) — there is no second implementation in
// Python. TRAINSAN_HOT=0 chooses the binding of the per-step events only; the drivers are used
// either way.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "handle.h"

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

}  // namespace

PYBIND11_MODULE(_trainsan_hot, m) {
  m.doc() = "TrainSan's per-step events, bound without torch.classes (Note [Hot path]).";
  m.def("forward",
        [](int64_t id, bool training, std::vector<at::Tensor> inputs, std::vector<bool> module_eval,
           double extra_s, int64_t data_restarts, int64_t loader_pass, int64_t loader_workers,
           bool loader_worker_init, std::vector<at::Tensor> batch) {
          return guarded([&] {
            auto [reports, due] = tb::handle_forward(
                handle(id), training, std::move(inputs), std::move(module_eval), extra_s,
                data_restarts, loader_pass, loader_workers, loader_worker_init, std::move(batch));
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
  m.def("gradients_cleared", [](int64_t id, int64_t opt) {
    return guarded([&] { return to_py(tb::handle_gradients_cleared(handle(id), opt)); });
  });
}
