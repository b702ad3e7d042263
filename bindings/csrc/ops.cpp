// The op library behind the Python package: TORCH_LIBRARY ops callable as torch.ops.trainsan.*,
// loaded with torch.ops.load_library (no Python C API, so one build serves every Python version).
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

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
                             .typed<std::tuple<at::Tensor, at::Tensor>(
                                 at::TensorList)>();
  return op.call(tensors);
}

bool cuda_compiled_op() { return trainsan::cuda_compiled(); }

}  // namespace

TORCH_LIBRARY(trainsan, m) {
  m.def(
      "tensor_stats(Tensor[] tensors) -> (Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
  m.def("cuda_compiled() -> bool", &cuda_compiled_op);
}

TORCH_LIBRARY_IMPL(trainsan, CPU, m) { m.impl("tensor_stats", &tensor_stats_op); }

TORCH_LIBRARY_IMPL(trainsan, CUDA, m) { m.impl("tensor_stats", &tensor_stats_op); }

TORCH_LIBRARY_IMPL(trainsan, Autograd, m) { m.impl("tensor_stats", &tensor_stats_autograd); }

TORCH_LIBRARY_IMPL(trainsan, Meta, m) { m.impl("tensor_stats", &tensor_stats_meta); }
