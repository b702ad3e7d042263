// Ops of the op library that run a check's measurement or comparison for the Python package, so
// that it and a LibTorch program compute them with the same code: the recompute comparison of
// nondeterminism (compare_recompute; the step re-runs' compare_reruns is reached through their
// driver, Note [One re-run driver]), the walk of a loss root (walk_loss_graph),
// and rank_desync's replica row and the verdict of its payload (replica_row,
// judge_replica_payload, replica_labels).
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

// One rank's row of a replica comparison (trainsan::replica_row, Note [Replica payload]) as an
// int64 tensor, from ReplicaRowFacts flattened: header = (digest, opt, count, step, skipped,
// forwards); the step pass's fingerprints (index, param, grad, has_grad: 0/1); the parameters whose
// gradients are compared; the optimizer state's fingerprints (state_index, state_hash); the
// buffers' fingerprints (empty: not compared at this event); the set's members and buffer count.
at::Tensor replica_row_op(const std::vector<int64_t>& header, std::vector<int64_t> index,
                          std::vector<int64_t> param, std::vector<int64_t> grad,
                          const std::vector<int64_t>& has_grad, std::vector<int64_t> grads,
                          const std::vector<int64_t>& state_index,
                          const std::vector<int64_t>& state_hash, std::vector<int64_t> buffers,
                          const std::vector<int64_t>& members, int64_t n_buffers) {
  TORCH_CHECK_VALUE(header.size() == 6, "replica_row: header has ", header.size(),
                    " fields, not 6 (digest, opt, count, step, skipped, forwards)");
  TORCH_CHECK_VALUE(param.size() == index.size() && grad.size() == index.size() &&
                        has_grad.size() == index.size(),
                    "replica_row: index, param, grad and has_grad differ in length");
  TORCH_CHECK_VALUE(state_index.size() == state_hash.size(),
                    "replica_row: state_index and state_hash differ in length");
  trainsan::ReplicaRowFacts f;
  f.digest = header[0];
  f.opt = header[1];
  f.count = header[2];
  f.step = header[3];
  f.skipped = header[4] != 0;
  f.forwards = header[5];
  f.fingerprints.index = std::move(index);
  f.fingerprints.param = std::move(param);
  f.fingerprints.grad = std::move(grad);
  for (const int64_t h : has_grad) f.fingerprints.has_grad.push_back(h != 0);
  f.grads = std::move(grads);
  for (size_t k = 0; k < state_index.size(); ++k)
    f.state.emplace_back(state_index[k], state_hash[k]);
  f.buffers = std::move(buffers);
  std::vector<int64_t> row;
  try {
    row = trainsan::replica_row(f, members, static_cast<size_t>(n_buffers));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return at::tensor(c10::ArrayRef<int64_t>(row), at::TensorOptions().dtype(at::kLong)).clone();
}

// The verdict of one replica comparison from its all-reduced payload (the maximum of the rows,
// then that of their complements): (outcome, then per differing tensor its field, name, what and
// whether it is shown, the fields to gather from every rank, grads_compared, grads_differ,
// forwards_differ).
std::tuple<int64_t, std::vector<int64_t>, std::vector<std::string>, std::vector<std::string>,
           c10::List<bool>, std::vector<int64_t>, bool, bool, bool>
judge_replica_payload_op(const at::Tensor& payload, std::vector<std::string> members,
                         std::vector<std::string> buffers, std::vector<std::string> known_whats,
                         std::vector<std::string> known_tensors) {
  TORCH_CHECK_VALUE(
      payload.dim() == 1 && payload.scalar_type() == at::kLong && payload.numel() % 2 == 0,
      "judge_replica_payload: payload must be a 1-D int64 tensor of even length "
      "(a row, then its complement), got ",
      payload.sizes(), " ", payload.scalar_type());
  TORCH_CHECK_VALUE(known_whats.size() == known_tensors.size(),
                    "judge_replica_payload: known_whats and known_tensors differ in length");
  const at::Tensor p = payload.to(at::kCPU).contiguous();
  const int64_t* d = p.const_data_ptr<int64_t>();
  const auto n = static_cast<size_t>(p.numel() / 2);
  std::vector<int64_t> hi(d, d + n), lo;
  for (size_t k = 0; k < n; ++k) lo.push_back(~d[n + k]);
  std::vector<std::pair<std::string, std::string>> known;
  for (size_t k = 0; k < known_whats.size(); ++k)
    known.emplace_back(known_whats[k], known_tensors[k]);
  trainsan::ReplicaVerdict v;
  try {
    v = trainsan::judge_replica_payload(hi, lo, members, buffers, known);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  std::vector<int64_t> fields;
  std::vector<std::string> tensors, whats;
  c10::List<bool> shown;
  for (const auto& x : v.differ) {
    fields.push_back(x.field);
    tensors.push_back(x.tensor);
    whats.push_back(x.what);
    shown.push_back(x.shown);
  }
  return {static_cast<int64_t>(v.outcome),
          fields,
          tensors,
          whats,
          shown,
          v.fetch,
          v.grads_compared,
          v.grads_differ,
          v.forwards_differ};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainsan, m) {
  m.def("compare_recompute", &compare_recompute_op);
  m.def("walk_loss_graph", &walk_loss_graph_op);
  m.def("replica_row", &replica_row_op);
  m.def("judge_replica_payload", &judge_replica_payload_op);
  m.def("replica_labels(int[] values) -> int[]",
        [](std::vector<int64_t> values) { return trainsan::replica_labels(values); });
}
