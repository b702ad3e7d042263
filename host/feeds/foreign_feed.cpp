// Note [Foreign backwards] (host/checks/gradient_flow.cpp): the feeder of the foreign-backward
// facts of StepView (foreign_feed.h), and the walk of a loss's graph that finds them
// (walk_loss_graph, trainsan/loss_walk.h: also the walk of the Python package's Note [Loss
// roots], which reports through Sanitizer::foreign_backward).
#include "feeds/foreign_feed.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <functional>
#include <unordered_set>
#include <vector>

#include "trainsan/loss_walk.h"

namespace trainsan {

LossWalk walk_loss_graph(const at::Tensor& root,
                         const std::vector<const std::vector<const void*>*>& targets,
                         bool keep_leaves, int64_t limit) {
  LossWalk w;
  w.reaches.assign(targets.size(), false);
  if (!root.defined() || !root.grad_fn()) return w;
  size_t found = 0;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack{root.grad_fn().get()};
  int64_t budget = limit;
  while (!stack.empty() && budget > 0 && (found < targets.size() || targets.empty())) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    budget -= 1;
    if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      const void* impl = acc->variable.unsafeGetTensorImpl();
      for (size_t t = 0; t < targets.size(); ++t) {
        if (!w.reaches[t] && std::binary_search(targets[t]->begin(), targets[t]->end(), impl,
                                                std::less<const void*>())) {
          w.reaches[t] = true;
          found += 1;
        }
      }
      w.leaf_count += 1;
      w.elements += acc->variable.numel();
      if (keep_leaves) w.leaves.push_back(acc->variable);
    }
    for (const torch::autograd::Edge& e : node->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  w.complete = stack.empty();
  w.out_of_budget = budget <= 0;
  return w;
}

}  // namespace trainsan

namespace trainsan::host {

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
  const LossWalk w = walk_loss_graph(loss, {&param_impls_}, /*keep_leaves=*/false);
  if (w.reaches[0]) return 1;  // our loss
  f->leaves = w.leaf_count;
  f->elements = w.elements;
  return w.complete ? 0 : -1;  // walked to its end, or out of budget
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
