// Note [Foreign backwards] (host/checks/gradient_flow.cpp): the feeder of the foreign-backward
// facts of StepView, and the walk of a LibTorch loss's graph (foreign_feed.h).
#include "feeds/foreign_feed.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <functional>
#include <unordered_set>
#include <vector>

namespace trainsan::host {

namespace {
// As _WALK_LIMIT in bindings/trainsan/_patches.py: past it, the root is not judged.
constexpr int64_t kWalkLimit = 20000;
}  // namespace

void ForeignFeed::foreign_backward(const ForeignBackward& facts) {
  if (ctx_.closed || facts.leaves <= 0) return;
  total_ += 1;
  latest_ = facts;
}

void ForeignFeed::on_step_end(StepEnd& e) {
  int64_t& at = at_step_[e.manual ? -1 : e.opt];
  e.foreign_backwards = total_ - at;
  e.foreign = latest_;
  at = total_;
}

bool ForeignFeed::since_step(int64_t opt) { return total_ > at_step_[opt]; }

int ForeignFeed::walk(const at::Tensor& loss, ForeignBackward* f) {
  if (!loss.defined() || !loss.grad_fn()) return -1;
  if (param_impls_.empty()) {  // once: the parameters of a sanitizer are fixed
    for (const TrackedParam& p : ctx_.params) param_impls_.push_back(p.param.unsafeGetTensorImpl());
    std::sort(param_impls_.begin(), param_impls_.end(), std::less<const void*>());
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
      if (std::binary_search(param_impls_.begin(), param_impls_.end(), impl,
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

void ForeignFeed::on_loss(const at::Tensor& loss) {
  if (ctx_.closed || ctx_.setup.gathers_events) return;
  ForeignBackward f;
  if (walk(loss, &f) == 0) foreign_backward(f);  // walked to its end (no graph: -1)
}

int ForeignFeed::loss_reaches(const at::Tensor& loss) {
  ForeignBackward unused;
  return ctx_.closed ? -1 : walk(loss, &unused);
}

}  // namespace trainsan::host
