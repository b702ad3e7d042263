// Note [Foreign backwards] (host/checks/gradient_flow.cpp): the facts of a backward that reached
// none of the sanitizer's parameters but other requires-grad leaves, and, for a LibTorch loop,
// the walk of its loss's graph that finds them (the Python package walks its roots itself, in
// the walk of Note [Loss roots], and reports through Sanitizer::foreign_backward).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <functional>
#include <unordered_set>
#include <vector>

#include "sanitizer_impl.h"

namespace trainsan::host {

namespace {
// As _WALK_LIMIT in bindings/trainsan/_patches.py: past it, the root is not judged.
constexpr int64_t kWalkLimit = 20000;
}  // namespace

void SanitizerImpl::foreign_backward(const ForeignBackward& facts) {
  if (closed || facts.leaves <= 0) return;
  foreign_total += 1;
  foreign_latest = facts;
}

int SanitizerImpl::walk(const at::Tensor& loss, ForeignBackward* f) {
  if (!loss.defined() || !loss.grad_fn()) return -1;
  if (param_impls.empty()) {  // once: the parameters of a sanitizer are fixed
    for (const TrackedParam& p : params) param_impls.push_back(p.param.unsafeGetTensorImpl());
    std::sort(param_impls.begin(), param_impls.end(), std::less<const void*>());
  }
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{loss.grad_fn().get()};
  int64_t budget = kWalkLimit;
  while (!stack.empty() && budget > 0) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    budget -= 1;
    if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      const void* impl = acc->variable.unsafeGetTensorImpl();
      if (std::binary_search(param_impls.begin(), param_impls.end(), impl,
                             std::less<const void*>())) {
        return 1;  // our loss
      }
      f->leaves += 1;
      f->elements += acc->variable.numel();
    }
    for (const torch::autograd::Edge& e : node->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  return stack.empty() ? 0 : -1;  // walked to its end, or out of budget
}

void SanitizerImpl::walk_loss(const at::Tensor& loss) {
  if (closed || setup.gathers_events) return;
  ForeignBackward f;
  if (walk(loss, &f) == 0) foreign_backward(f);  // walked to its end (no graph: -1)
}

int SanitizerImpl::loss_reaches(const at::Tensor& loss) {
  ForeignBackward unused;
  return closed ? -1 : walk(loss, &unused);
}

}  // namespace trainsan::host
