// _trainsan_hot: the per-step events of the Python package's sanitizer handle as a pybind11
// module (Note [Hot path] in handle.h). Each function takes the handle's id (hot_id()) and calls
// the same function as the torch.classes method of that name; a handle that is gone raises.
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

}  // namespace

PYBIND11_MODULE(_trainsan_hot, m) {
  m.doc() = "TrainSan's per-step events, bound without torch.classes (Note [Hot path]).";
  m.def("forward",
        [](int64_t id, bool training, std::vector<at::Tensor> inputs, std::vector<bool> module_eval,
           double extra_s, int64_t data_restarts, int64_t loader_pass, int64_t loader_workers,
           bool loader_worker_init, std::vector<at::Tensor> batch) {
          return guarded([&] {
            return tb::handle_forward(handle(id), training, std::move(inputs),
                                      std::move(module_eval), extra_s, data_restarts, loader_pass,
                                      loader_workers, loader_worker_init, std::move(batch));
          });
        });
  m.def("loss", [](int64_t id, const at::Tensor& loss) {
    return guarded([&] { return tb::handle_loss(handle(id), loss); });
  });
  m.def("loss_reaches", [](int64_t id, const at::Tensor& loss) {
    return guarded([&] { return tb::handle_loss_reaches(handle(id), loss); });
  });
  m.def("step_begin", [](int64_t id, int64_t opt, bool grads_final) {
    return guarded([&] { return tb::handle_step_begin(handle(id), opt, grads_final); });
  });
  m.def("step_end", [](int64_t id, int64_t opt, bool lr_zero, double extra_s,
                       const std::vector<double>& group_lr) {
    return guarded(
        [&] { return tb::handle_step_end(handle(id), opt, lr_zero, extra_s, group_lr); });
  });
  m.def("gradients_cleared", [](int64_t id, int64_t opt) {
    return guarded([&] { return tb::handle_gradients_cleared(handle(id), opt); });
  });
}
