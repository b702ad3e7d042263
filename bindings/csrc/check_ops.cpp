// Ops of the op library that run a check's measurement or comparison for the Python package, so
// that it and a LibTorch program compute them with the same code: the recompute comparison of
// nondeterminism (compare_recompute; the step re-runs' compare_reruns is reached through their
// driver, Note [One re-run driver]) and the walk of a loss root (walk_loss_graph). (rank_desync's
// row and verdict run inside trainsan::ReplicaEngine, which the package drives through
// _trainsan_hot: Note [Replica comparison].)
// A fragment of the trainsan library that ops.cpp defines; like ops.cpp, it binds only the public
// C++ API.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "trainsan/trainsan.h"

namespace {

trainsan::RecomputeRecord recompute_record(std::string region, std::string type,
                                           const std::vector<int64_t>& hashes,
                                           const std::vector<int64_t>& rng) {
  return {std::move(region), std::move(type), std::vector<uint64_t>(hashes.begin(), hashes.end()),
          std::vector<uint64_t>(rng.begin(), rng.end())};
}

// Where a checkpointed region's recompute first differs from its forward (compare_recompute):
// RerunFacts by name, None when they agree. Hashes are the 64 bits as int64.
std::optional<trainsan::FactsDict> compare_recompute_op(std::string region, std::string type,
                                                        std::vector<int64_t> forward,
                                                        std::vector<int64_t> forward_rng,
                                                        std::vector<int64_t> recompute,
                                                        std::vector<int64_t> recompute_rng) {
  const std::optional<trainsan::RerunFacts> f =
      trainsan::compare_recompute(recompute_record(region, type, forward, forward_rng),
                                  recompute_record(region, type, recompute, recompute_rng));
  if (!f) return std::nullopt;
  return trainsan::facts_to_dict(*f);
}

// Note [Loss roots]: walk_loss_graph for the Python package, the targets flattened (target k's
// leaves are the next target_sizes[k] tensors of `targets`): (per target 1 when reached, the
// requires-grad leaves reached, walked to its end, out of budget).
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>, bool, bool> walk_loss_graph_op(
    const at::Tensor& root, const std::vector<at::Tensor>& targets,
    const std::vector<int64_t>& target_sizes) {
  std::vector<std::vector<const void*>> sets(target_sizes.size());
  size_t next = 0;
  for (size_t k = 0; k < target_sizes.size(); ++k) {
    for (int64_t j = 0; j < target_sizes[k]; ++j) {
      TORCH_CHECK_VALUE(next < targets.size(), "walk_loss_graph: target_sizes add up to more than ",
                        targets.size(), " targets");
      sets[k].push_back(targets[next++].unsafeGetTensorImpl());
    }
    std::sort(sets[k].begin(), sets[k].end(), std::less<const void*>());
  }
  std::vector<const std::vector<const void*>*> ptrs;
  for (const auto& s : sets) ptrs.push_back(&s);
  trainsan::LossWalk w = trainsan::walk_loss_graph(root, ptrs, /*keep_leaves=*/true);
  return {std::vector<int64_t>(w.reaches.begin(), w.reaches.end()), std::move(w.leaves), w.complete,
          w.out_of_budget};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainsan, m) {
  m.def("compare_recompute", &compare_recompute_op);
  m.def("walk_loss_graph", &walk_loss_graph_op);
}
