// The walk of a loss's autograd graph to the leaves it reaches (Note [Loss roots] in
// bindings/trainsan/_patches.py, Note [Foreign backwards] in host/checks/gradient_flow.cpp):
// which models' parameters a backward from `root` would reach. The one implementation: a
// sanitizer's own walk (Sanitizer::loss_reaches, the LibTorch loss's foreign-backward facts) and
// the Python package's attribution of a root to its sanitizers both call it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace trainsan {

/// As far as the walk goes before it stops: past it, a root is not judged.
constexpr int64_t kLossWalkLimit = 20000;

struct LossWalk {
  std::vector<bool> reaches;       ///< per target: the walk reached one of its leaves
  std::vector<at::Tensor> leaves;  ///< the requires-grad leaves reached (keep_leaves), in order
  int64_t leaf_count = 0;          ///< how many requires-grad leaves it reached
  int64_t elements = 0;            ///< their elements
  bool complete = false;           ///< walked to its end (nothing left to visit)
  bool out_of_budget = false;      ///< stopped at `limit` nodes
};

/// Depth-first from root.grad_fn (next edges pushed in order, the last visited first), each node
/// once, at most `limit` nodes; it stops once every target is reached. A target is a set of
/// TensorImpls (sorted by std::less), a leaf one of them when its AccumulateGrad's variable is.
/// A root without a graph: nothing reached, not complete.
LossWalk walk_loss_graph(const at::Tensor& root,
                         const std::vector<const std::vector<const void*>*>& targets,
                         bool keep_leaves, int64_t limit = kLossWalkLimit);

}  // namespace trainsan
