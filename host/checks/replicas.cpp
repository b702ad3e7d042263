// rank_desync: replicas that must be identical and are not (Note [Replica comparison],
// bindings/trainsan/replicas.py gathers the facts). The rules are simple — any difference of
// bits is a finding — so this file is mostly the wording: which tensors, which ranks, what the
// pattern of the difference says about its cause, and the fix.
#include "checks/replicas.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

namespace trainsan::host {

namespace {

constexpr size_t kNamesShown = 4;  // tensors named in one finding (and shown with their ranks)
constexpr size_t kRanksShown = 8;  // ranks listed in one set

std::string rank_list(const std::vector<int64_t>& ranks) {
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t k = 0; k < ranks.size() && k < kRanksShown; ++k) os << (k ? ", " : "") << ranks[k];
  if (ranks.size() > kRanksShown) os << ", … (" << ranks.size() << " ranks)";
  return os.str();
}

// "rank 1 differs from ranks 0, 2, 3", or the classes of equal values.
std::string split_text(const std::vector<int64_t>& ranks, const std::vector<int64_t>& labels) {
  if (labels.size() != ranks.size() || labels.empty()) return "";
  std::map<int64_t, std::vector<int64_t>> classes;
  for (size_t k = 0; k < ranks.size(); ++k) classes[labels[k]].push_back(ranks[k]);
  if (classes.size() < 2) return "";
  if (classes.size() == 2) {
    const auto& majority = classes.begin()->second;
    const auto& other = std::next(classes.begin())->second;
    return rank_list(other) + (other.size() == 1 ? " differs" : " differ") + " from " +
           rank_list(majority);
  }
  std::ostringstream os;
  os << classes.size() << " different values:";
  for (const auto& [label, rs] : classes) {
    os << " {";
    for (size_t k = 0; k < rs.size() && k < kRanksShown; ++k) os << (k ? ", " : "") << rs[k];
    if (rs.size() > kRanksShown) os << ", …";
    os << "}";
  }
  return os.str();
}

std::string per_rank(const std::vector<int64_t>& ranks, const std::vector<int64_t>& values) {
  std::ostringstream os;
  for (size_t k = 0; k < ranks.size() && k < values.size() && k < kRanksShown; ++k) {
    os << (k ? ", " : "") << "rank " << ranks[k] << ": " << values[k];
  }
  if (ranks.size() > kRanksShown) os << ", …";
  return os.str();
}

// "fc1.weight, fc2.bias — rank 1 differs from rank 0" where every tensor splits the ranks alike,
// else each tensor with its own split.
std::string names_text(const std::vector<const ReplicaMismatch*>& ms,
                       const std::vector<int64_t>& ranks) {
  const bool alike = std::all_of(ms.begin(), ms.end(), [&](const ReplicaMismatch* m) {
    return m->labels == ms.front()->labels;
  });
  std::ostringstream os;
  for (size_t k = 0; k < ms.size() && k < kNamesShown; ++k) {
    os << (k ? ", " : "") << ms[k]->tensor;
    const std::string split = alike ? "" : split_text(ranks, ms[k]->labels);
    if (!split.empty()) os << " (" << split << ")";
  }
  if (ms.size() > kNamesShown) os << " and " << ms.size() - kNamesShown << " more";
  const std::string split = alike ? split_text(ranks, ms.front()->labels) : "";
  if (!split.empty()) os << " — " << split;
  return os.str();
}

// "parameter fc.weight differs" / "4 parameters differ".
std::string count_text(size_t n, const std::string& what) {
  return n == 1 ? "a " + what : std::to_string(n) + " " + what + "s";
}

std::string group_text(const ReplicaReport& r) {
  return (r.group.empty() ? std::string("the replica group") : r.group) + " [" +
         rank_list(r.ranks) + "]";
}

}  // namespace

void ReplicaCheck::on_report(const ReplicaReport& r) {
  using Moment = ReplicaReport::Moment;
  const std::string opt_text = r.opt >= 0 ? " of optimizer " + std::to_string(r.opt) : "";
  if (r.moment == Moment::kMissing) {
    std::ostringstream os;
    os << rank_list(r.missing) << " of " << group_text(r) << " did not arrive at the replica "
       << "comparison of step " << r.step << opt_text;
    if (r.waited_s > 0) os << " within " << fmt(r.waited_s) << " s";
    for (size_t k = 0; k < r.missing_detail.size(); ++k) {
      if (!r.missing_detail[k].empty()) os << "; " << r.missing_detail[k];
    }
    os << " — a rank that took fewer optimizer steps than the others (it skipped "
          "optimizer.step() or left the loop early), or one that hangs or died. Every rank must "
          "take the same steps; the comparison stops here on this rank (raise desync_timeout if "
          "ranks legitimately fall this far behind)";
    sink_.add(Kind::rank_desync, "", os.str(), r.waited_s, r.step);
    return;
  }
  if (r.moment == Moment::kBeforeFirstStep) {
    if (r.mismatches.empty()) return;
    std::vector<const ReplicaMismatch*> ms;
    for (const auto& m : r.mismatches) ms.push_back(&m);
    sink_.add(Kind::rank_desync, r.mismatches.front().tensor,
              "replicas start from different weights: " + count_text(ms.size(), "tensor") +
                  " that must be identical across " + group_text(r) +
                  (ms.size() == 1 ? " differs" : " differ") +
                  " before the first step: " + names_text(ms, r.ranks) +
                  ". Every replica must start from the same weights: seed every rank alike "
                  "before building the model, or broadcast rank 0's parameters before training "
                  "(DDP does at construction; FSDP2/HSDP and tensor-parallel replicas do not — "
                  "torch.distributed.broadcast each parameter, or load one checkpoint on every "
                  "rank)",
              static_cast<double>(ms.size()), r.step);
    return;
  }
  // kAfterStep.
  std::string shifted;
  if (!r.forwards.empty()) {
    shifted = " (the ranks also ran different numbers of training forwards so far — " +
              per_rank(r.ranks, r.forwards) + ")";
  }
  if (!r.skipped.empty()) {
    std::vector<int64_t> skipped, stepped;
    for (size_t k = 0; k < r.ranks.size() && k < r.skipped.size(); ++k) {
      (r.skipped[k] ? skipped : stepped).push_back(r.ranks[k]);
    }
    sink_.add(Kind::rank_desync, "",
              rank_list(skipped) + " of " + group_text(r) + " skipped step " +
                  std::to_string(r.step) + opt_text +
                  " (its GradScaler found Inf/NaN in its gradients) while " + rank_list(stepped) +
                  " stepped: from here on the replicas' weights differ. The GradScaler must "
                  "decide alike on every rank — it saw gradients that were not all-reduced "
                  "(FSDP2/HSDP: use torch.distributed's ShardedGradScaler or all-reduce "
                  "found_inf; a per-rank gradient hook or clipping before unscale_)",
              std::nullopt, r.step);
  }
  if (!r.steps_at.empty()) {
    sink_.add(Kind::rank_desync, "",
              "the ranks of " + group_text(r) + " reached this comparison at different steps" +
                  opt_text + " (" + per_rank(r.ranks, r.steps_at) + ")" + shifted +
                  ": a rank skipped optimizer.step() (or called it twice) while the others "
                  "stepped, so their weights differ from here on. Every rank must take the same "
                  "steps: skip on all ranks or none (decide from an all-reduced flag)",
              std::nullopt, r.step);
  }
  if (!r.forwards.empty() && !r.mismatches.empty()) {
    // Different training forwards so far: the ranks pair different steps in this comparison.
    std::vector<const ReplicaMismatch*> ms;
    for (const auto& m : r.mismatches) ms.push_back(&m);
    sink_.add(Kind::rank_desync, "",
              "the ranks of " + group_text(r) + " are out of step at step " +
                  std::to_string(r.step) + opt_text +
                  ": they ran different numbers of training "
                  "forwards so far (" +
                  per_rank(r.ranks, r.forwards) + ") and " + count_text(ms.size(), "tensor") +
                  " differ (" + names_text(ms, r.ranks) +
                  ") — a rank skipped optimizer.step() (or stepped twice) while the others "
                  "stepped, so from here on they train different weights. Every rank must take "
                  "the same steps: skip on all ranks or none (decide from an all-reduced flag)",
              static_cast<double>(ms.size()), r.step);
    return;
  }
  std::map<std::string, std::vector<const ReplicaMismatch*>> by_what;
  for (const auto& m : r.mismatches) by_what[m.what].push_back(&m);
  const bool grads_differ = by_what.count("gradient") > 0;
  for (const auto& [what, ms] : by_what) {
    std::string cause;
    if (what == "gradient") {
      cause =
          "The gradients already differ after the reduction: a gradient that was not averaged "
          "across the ranks (the last backward of a step run under no_sync(), a gradient hook "
          "or clipping that depends on the rank, a parameter the data-parallel wrapper ignores)";
    } else if (what == "parameter") {
      cause = grads_differ ? "Their gradients differ too (see the gradient finding of this step)"
              : r.grads_agree
                  ? "The gradients agree, so the weights diverged in the update or outside it: "
                    "a write to the weights on some ranks only (under no_grad, through .data, a "
                    "rank-dependent re-init or EMA), a learning rate or other optimizer setting "
                    "that depends on the rank, optimizer state that differs (a partial restore), "
                    "or a step one rank skipped"
                  : "Causes: a write to the weights on some ranks only, an optimizer setting that "
                    "depends on the rank, gradients that were not averaged, or a step one rank "
                    "skipped";
    } else if (what == "optimizer state") {
      cause =
          "The optimizer's state (moments, step counts) differs although it must evolve alike "
          "on every replica: a partial or per-rank restore of the optimizer, or a rank-dependent "
          "setting; the weights will drift apart";
    } else {
      cause =
          "Buffers differ across replicas (batch-norm running statistics without SyncBatchNorm "
          "differ legitimately; switch desync_buffers off if that is intended)";
    }
    // One finding per kind of tensor (the key: its first tensor, suffixed but for weights).
    const std::string suffix = what == "gradient"          ? ".grad"
                               : what == "optimizer state" ? ".state"
                                                           : "";
    sink_.add(Kind::rank_desync, ms.front()->tensor + suffix,
              count_text(ms.size(), what) + " that must be identical across " + group_text(r) +
                  (ms.size() == 1 ? " differs" : " differ") + " after step " +
                  std::to_string(r.step) + opt_text + ": " + names_text(ms, r.ranks) + ". " +
                  cause + shifted,
              static_cast<double>(ms.size()), r.step);
  }
}

}  // namespace trainsan::host

namespace trainsan {

// Note [Replica payload]
// ~~~~~~~~~~~~~~~~~~~~~~
// Each rank of a replica set builds one row per comparison (ReplicaRow: the header, then per
// member parameter the presence and fingerprint of its weight, gradient and optimizer state,
// then per buffer its presence and fingerprint) and all-reduces (max) the row with its bitwise
// complement: the first half is the element-wise maximum over the ranks and the complement of the
// second the minimum, so one collective says, per field, whether every rank holds the same value.
// A tensor is compared only where it is present on every rank (the minimum of its presence is
// 1). Which ranks hold which value is not in the payload: the caller gathers the `fetch` fields
// of every rank's row only when something differs (rare), and replica_labels turns each into
// classes of ranks.
ReplicaVerdict judge_replica_payload(
    const std::vector<int64_t>& hi, const std::vector<int64_t>& lo,
    const std::vector<std::string>& members, const std::vector<std::string>& buffers,
    const std::vector<std::pair<std::string, std::string>>& known) {
  using R = ReplicaRow;
  using O = ReplicaVerdict::Outcome;
  const size_t n = static_cast<size_t>(R::kHeader) +
                   static_cast<size_t>(R::kSlot) * members.size() +
                   static_cast<size_t>(R::kBufferSlot) * buffers.size();
  if (hi.size() != n || lo.size() != n) {
    throw std::invalid_argument("judge_replica_payload: rows of " + std::to_string(n) +
                                " fields expected (a header of " + std::to_string(R::kHeader) +
                                ", " + std::to_string(R::kSlot) + " per member, " +
                                std::to_string(R::kBufferSlot) + " per buffer), got " +
                                std::to_string(hi.size()) + " and " + std::to_string(lo.size()));
  }
  ReplicaVerdict v;
  auto differs = [&](int64_t f) {
    return hi[static_cast<size_t>(f)] != lo[static_cast<size_t>(f)];
  };
  if (hi == lo) return v;
  v.forwards_differ = differs(R::kForwards);
  if (differs(R::kDigest)) {
    v.outcome = O::kNotReplicas;
    return v;
  }
  if (differs(R::kOpt) || differs(R::kCount)) {
    v.outcome = O::kOutOfStep;
    v.fetch = {R::kStep, R::kForwards};
    return v;
  }
  if (differs(R::kSkipped)) {
    v.outcome = O::kSkipsDiffer;
    v.fetch = {R::kSkipped};
    return v;
  }
  auto add = [&](int64_t present, const std::string& tensor, const std::string& what) {
    if (lo[static_cast<size_t>(present)] != 1) return false;  // absent on some rank
    if (!differs(present + 1)) return true;
    if (std::find(known.begin(), known.end(), std::make_pair(what, tensor)) == known.end()) {
      v.differ.push_back({present + 1, tensor, what, false});
    }
    return true;
  };
  static const char* const kSlotWhat[] = {"parameter", "gradient", "optimizer state"};
  for (size_t j = 0; j < members.size(); ++j) {
    const int64_t b = R::kHeader + R::kSlot * static_cast<int64_t>(j);
    for (int64_t s = 0; s < 3; ++s) {
      const bool compared = add(b + 2 * s, members[j], kSlotWhat[s]);
      if (s == 1 && compared) {
        v.grads_compared = true;
        v.grads_differ = v.grads_differ || differs(b + 3);
      }
    }
  }
  const int64_t b0 = R::kHeader + R::kSlot * static_cast<int64_t>(members.size());
  for (size_t j = 0; j < buffers.size(); ++j) {
    add(b0 + R::kBufferSlot * static_cast<int64_t>(j), buffers[j], "buffer");
  }
  if (v.differ.empty()) return v;
  v.outcome = O::kTensorsDiffer;
  v.fetch = {R::kForwards};
  std::map<std::string, size_t> per_what;
  for (ReplicaVerdict::Differ& d : v.differ) {
    d.shown = per_what[d.what]++ < host::kNamesShown;
    if (d.shown) v.fetch.push_back(d.field);
  }
  return v;
}

std::vector<int64_t> replica_row(const ReplicaRowFacts& facts, const std::vector<int64_t>& members,
                                 size_t n_buffers) {
  using R = ReplicaRow;
  if (!facts.buffers.empty() && facts.buffers.size() != n_buffers) {
    throw std::invalid_argument("replica_row: " + std::to_string(facts.buffers.size()) +
                                " buffer fingerprints for " + std::to_string(n_buffers) +
                                " buffers");
  }
  std::vector<int64_t> row(static_cast<size_t>(R::kHeader) +
                               static_cast<size_t>(R::kSlot) * members.size() +
                               static_cast<size_t>(R::kBufferSlot) * n_buffers,
                           0);
  row[R::kDigest] = facts.digest;
  row[R::kOpt] = facts.opt;
  row[R::kCount] = facts.count;
  row[R::kStep] = facts.step;
  row[R::kSkipped] = facts.skipped ? 1 : 0;
  row[R::kForwards] = facts.forwards;
  const StepFingerprints& fp = facts.fingerprints;
  // Looked up by parameter index (the first entry of an index wins), not scanned per member: a
  // row is built per step event, of every parameter.
  std::unordered_map<int64_t, size_t> at_index, at_state;
  for (size_t k = fp.index.size(); k-- > 0;) at_index[fp.index[k]] = k;
  for (size_t k = facts.state.size(); k-- > 0;) at_state[facts.state[k].first] = k;
  const std::unordered_set<int64_t> grads(facts.grads.begin(), facts.grads.end());
  for (size_t j = 0; j < members.size(); ++j) {
    const size_t b = static_cast<size_t>(R::kHeader + R::kSlot * static_cast<int64_t>(j));
    const auto at = at_index.find(members[j]);
    if (at != at_index.end()) {
      const size_t k = at->second;
      row[b] = 1;
      row[b + 1] = fp.param[k];
      if (k < fp.has_grad.size() && fp.has_grad[k] && grads.count(members[j]) > 0) {
        row[b + 2] = 1;
        row[b + 3] = fp.grad[k];
      }
    }
    const auto st = at_state.find(members[j]);
    if (st != at_state.end()) {
      row[b + 4] = 1;
      row[b + 5] = facts.state[st->second].second;
    }
  }
  const size_t b0 =
      static_cast<size_t>(R::kHeader) + static_cast<size_t>(R::kSlot) * members.size();
  for (size_t j = 0; j < facts.buffers.size(); ++j) {
    row[b0 + static_cast<size_t>(R::kBufferSlot) * j] = 1;
    row[b0 + static_cast<size_t>(R::kBufferSlot) * j + 1] = facts.buffers[j];
  }
  return row;
}

std::vector<int64_t> replica_labels(const std::vector<int64_t>& values) {
  // Distinct values by first appearance, then ordered by how many ranks hold each (stable: ties
  // keep the order of first appearance).
  std::vector<std::pair<int64_t, int64_t>> order;  // (value, count)
  for (const int64_t x : values) {
    auto it = std::find_if(order.begin(), order.end(), [&](const auto& p) { return p.first == x; });
    if (it == order.end()) {
      order.emplace_back(x, 1);
    } else {
      it->second += 1;
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<int64_t> out;
  for (const int64_t x : values) {
    const auto it =
        std::find_if(order.begin(), order.end(), [&](const auto& p) { return p.first == x; });
    out.push_back(static_cast<int64_t>(it - order.begin()));
  }
  return out;
}

}  // namespace trainsan
