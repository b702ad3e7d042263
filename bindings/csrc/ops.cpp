// The op library behind the Python package: TORCH_LIBRARY ops callable as torch.ops.trainsan.*,
// loaded with torch.ops.load_library (no Python C API, so one build serves every Python version).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>

#include "audit.h"
#include "sanitizer_impl.h"
#include "stats_internal.h"
#include "trainsan/stats.h"

namespace {

std::tuple<at::Tensor, at::Tensor> tensor_stats_op(at::TensorList tensors) {
  const trainsan::PackedStats p = trainsan::tensor_stats_packed(tensors.vec());
  return {p.ints, p.floats};
}

std::tuple<at::Tensor, at::Tensor> tensor_stats_meta(at::TensorList tensors) {
  const trainsan::PackedStats p = trainsan::host::packed_meta(tensors.vec());
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

// Finding as a TorchScript-friendly tuple:
// (kind, step, severity, tensor, message, value (NaN: none), count, last_step).
using FindingTuple = std::tuple<std::string, int64_t, std::string, std::string, std::string, double,
                                int64_t, int64_t>;

std::vector<FindingTuple> to_tuples(const std::vector<trainsan::Finding>& fs) {
  std::vector<FindingTuple> out;
  out.reserve(fs.size());
  for (const auto& f : fs) {
    out.emplace_back(f.kind, f.step, f.severity, f.tensor, f.message,
                     f.value ? *f.value : std::nan(""), f.count, f.last_step);
  }
  return out;
}

// The Python package's handle on a SanitizerImpl (torch.classes.trainsan.Sanitizer). Python
// calls one method per training-loop event; the gradient hooks are installed here, in C++.
struct SanitizerHandle : torch::CustomClassHolder {
  std::unique_ptr<trainsan::SanitizerImpl> impl;

  SanitizerHandle(std::vector<std::string> names, std::vector<at::Tensor> params,
                  std::vector<int64_t> opt_index, c10::Dict<std::string, std::string> options,
                  std::string header_extra) {
    TORCH_CHECK_VALUE(names.size() == params.size() && names.size() == opt_index.size(),
                      "Sanitizer: names, params and opt_index differ in length");
    trainsan::Options o;
    for (const auto& kv : options) o.set(kv.key(), kv.value());
    std::vector<trainsan::ParamInfo> ps;
    for (size_t i = 0; i < names.size(); ++i) ps.push_back({names[i], params[i], opt_index[i]});
    impl = std::make_unique<trainsan::SanitizerImpl>(std::move(ps), std::move(o),
                                                     std::move(header_extra));
    impl->install_hooks();
  }
};

}  // namespace

TORCH_LIBRARY(trainsan, m) {
  m.def("tensor_stats(Tensor[] tensors) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
  m.def("cuda_compiled() -> bool", &cuda_compiled_op);

  using H = c10::intrusive_ptr<SanitizerHandle>;
  m.class_<SanitizerHandle>("Sanitizer")
      .def(torch::init<std::vector<std::string>, std::vector<at::Tensor>, std::vector<int64_t>,
                       c10::Dict<std::string, std::string>, std::string>())
      .def("forward",
           [](const H& h, bool grad_enabled, bool training, std::vector<std::string> eval_modules,
              std::vector<at::Tensor> inputs, bool fp16) {
             return to_tuples(
                 h->impl->on_forward(grad_enabled, training, eval_modules, inputs, fp16));
           })
      .def("loss", [](const H& h, at::Tensor loss) { return to_tuples(h->impl->on_loss(loss)); })
      .def("step_begin",
           [](const H& h, int64_t opt) { return to_tuples(h->impl->on_step_begin(opt)); })
      .def("step_end",
           [](const H& h, int64_t opt, bool lr_zero, double extra_s) {
             return to_tuples(h->impl->on_step_end(opt, lr_zero, extra_s));
           })
      .def("manual_boundary",
           [](const H& h, double extra_s) {
             return to_tuples(h->impl->on_manual_boundary(extra_s));
           })
      .def("amp_skip", [](const H& h, int64_t opt) { h->impl->on_amp_skip(opt); })
      .def("close", [](const H& h) { return to_tuples(h->impl->close()); })
      .def("findings", [](const H& h) { return to_tuples(h->impl->findings); })
      .def("hooks_installed", [](const H& h) { return h->impl->hooks_installed(); })
      .def("auditing", [](const H& h) { return h->impl->audit->auditing(); })
      .def("audit_target",
           [](const H& h, std::string op, std::optional<at::Tensor> input, at::Tensor target,
              std::optional<int64_t> ignore_index, int64_t num_classes) {
             return to_tuples(h->impl->audit->check_target(op, input.value_or(at::Tensor()), target,
                                                           ignore_index, num_classes));
           })
      .def("step", [](const H& h) { return h->impl->step; })
      .def("overhead_s", [](const H& h) { return h->impl->overhead_s; })
      .def("last_stats", [](const H& h) {
        const auto last = h->impl->last_stats();
        std::vector<std::string> names;
        std::vector<trainsan::TensorStats> st;
        for (const auto& [k, v] : last) {
          names.push_back(k);
          st.push_back(v);
        }
        const int64_t n = static_cast<int64_t>(st.size());
        at::Tensor ints = at::empty({n, 8}, at::kLong);
        at::Tensor floats = at::empty({n, 5}, at::kDouble);
        auto* ip = ints.mutable_data_ptr<int64_t>();
        auto* fp = floats.mutable_data_ptr<double>();
        const double nan = std::nan("");
        for (int64_t r = 0; r < n; ++r) {
          const auto& s = st[r];
          const int64_t iv[8] = {
              s.numel, s.nan,       s.posinf,        s.neginf,
              s.zero,  s.subnormal, s.fp16_overflow, static_cast<int64_t>(s.hash)};
          const double fv[5] = {s.min.value_or(nan), s.max.value_or(nan), s.absmax.value_or(nan),
                                s.sum, s.l2};
          std::copy(iv, iv + 8, ip + r * 8);
          std::copy(fv, fv + 5, fp + r * 5);
        }
        return std::make_tuple(names, ints, floats);
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
