// bad_checkpoint's facts: what a checkpoint holds against the model and the optimizers it belongs
// to, from plain descriptions (trainsan/checkpoint_facts.h). The rules that turn them into
// findings are host/checks/checkpoint.cpp (Note [Checkpoint checks]). Torch-free.
#include "trainsan/checkpoint_facts.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainsan {
namespace {

constexpr const char* kDdpPrefix = "module.";

// Optimizer state entries shaped like their parameter (torch.optim's Adam/AdamW/NAdam/RAdam/Adamax,
// SGD, RMSprop, Adagrad, Adadelta, ASGD, Rprop; Lion-style ones): only these are compared with
// their parameter's shape — other state (Adafactor's factored row/column variances, 8-bit
// optimizers' quantisation blocks) legitimately has other shapes.
bool per_element(const std::string& key) {
  static const std::unordered_set<std::string> kKeys = {"exp_avg",
                                                        "exp_avg_sq",
                                                        "max_exp_avg_sq",
                                                        "momentum_buffer",
                                                        "square_avg",
                                                        "grad_avg",
                                                        "sum",
                                                        "acc_delta",
                                                        "ax",
                                                        "prev",
                                                        "step_size",
                                                        "exp_inf",
                                                        "mu_product"};
  return kKeys.count(key) != 0;
}

std::string shape(const std::vector<int64_t>& sizes) {
  std::string s = "[";
  for (size_t k = 0; k < sizes.size(); ++k) s += (k ? ", " : "") + std::to_string(sizes[k]);
  return s + "]";
}

std::unordered_map<std::string, const TensorDesc*> by_key(const std::vector<TensorDesc>& ts) {
  std::unordered_map<std::string, const TensorDesc*> out;
  for (const TensorDesc& t : ts) out.emplace(t.key, &t);
  return out;
}

// Keys of `dict` that `expected` also has.
size_t overlap(const StateDictDesc& dict,
               const std::unordered_map<std::string, const TensorDesc*>& expected) {
  return static_cast<size_t>(
      std::count_if(dict.entries.begin(), dict.entries.end(),
                    [&](const TensorDesc& t) { return expected.count(t.key) != 0; }));
}

// A dict whose every key is one of the model's under DDP's "module." prefix.
bool ddp_prefixed(const StateDictDesc& dict,
                  const std::unordered_map<std::string, const TensorDesc*>& expected) {
  if (dict.entries.empty()) return false;
  bool any_known = false;
  for (const TensorDesc& t : dict.entries) {
    if (t.key.rfind(kDdpPrefix, 0) != 0) return false;
    any_known =
        any_known || expected.count(t.key.substr(std::char_traits<char>::length(kDdpPrefix))) != 0;
  }
  return any_known;
}

void compare_model(CheckpointFacts& f, const CheckpointDesc& d) {
  // The state dict in it that shares the most keys with the model's (or, for a wrapper, its inner
  // module's); the first of equals.
  const std::vector<ModelDesc>& variants = d.model;
  const StateDictDesc* best = nullptr;
  const ModelDesc* model = nullptr;
  size_t best_overlap = 0;
  for (const ModelDesc& v : variants) {
    const auto expected = by_key(v.state);
    for (const StateDictDesc& sd : d.state_dicts) {
      const size_t n = overlap(sd, expected);
      if (best == nullptr || n > best_overlap) {
        best = &sd;
        model = &v;
        best_overlap = n;
      }
    }
  }
  f.have_model = true;
  const auto inner = by_key(variants.back().state);
  f.model_keys = static_cast<int64_t>(inner.size());
  if (best == nullptr || best_overlap == 0) {
    if (d.part_ok) {  // a save of something else while attached
      f.have_model = false;
      return;
    }
    for (const StateDictDesc& sd : d.state_dicts) {
      if (ddp_prefixed(sd, inner)) {
        f.model_found = true;
        f.model_key = sd.path;
        f.ddp_prefix = true;
        return;
      }
    }
    return;
  }
  const auto expected = by_key(model->state);
  if (d.part_ok && 2 * best_overlap < expected.size()) {
    f.have_model = false;  // a part of the model (a submodule's state): not judged as the model
    return;
  }
  f.model_found = true;
  f.model_key = best->path;
  std::unordered_set<std::string> trainable;
  for (const TensorDesc& p : model->trainable) trainable.insert(p.key);
  const auto saved = by_key(best->entries);
  std::unordered_set<std::string> seen;
  for (const TensorDesc& v : model->state) {
    if (!seen.insert(v.key).second) continue;
    const auto it = saved.find(v.key);
    if (it == saved.end()) {
      (trainable.count(v.key) ? f.missing_trainable : f.missing_other).push_back(v.key);
      continue;
    }
    const TensorDesc& s = *it->second;
    if (s.dtype.empty() || v.dtype.empty()) continue;  // not tensors: nothing to compare
    if (s.sizes != v.sizes || s.dtype != v.dtype) {
      f.mismatched.push_back(v.key + ": " + shape(s.sizes) + " " + s.dtype +
                             " in the checkpoint, " + shape(v.sizes) + " " + v.dtype +
                             " in the model");
    }
  }
  for (const TensorDesc& s : best->entries) {
    if (!expected.count(s.key)) f.unexpected.push_back(s.key);
  }
}

int64_t largest_step(const std::vector<OptimizerDesc>& optimizers) {
  int64_t out = -1;
  for (const OptimizerDesc& o : optimizers) {
    for (const OptimizerSlotDesc& s : o.slots) out = std::max(out, s.step);
  }
  return out;
}

int64_t with_state(const OptimizerDesc& o) {
  return static_cast<int64_t>(std::count_if(
      o.slots.begin(), o.slots.end(), [](const OptimizerSlotDesc& s) { return s.has_state; }));
}

void compare_optimizers(CheckpointFacts& f, const CheckpointDesc& d) {
  f.have_optimizer_state = true;
  if (!d.optimizers.empty()) {
    f.live_with_state = 0;
    for (const OptimizerDesc& o : d.optimizers) f.live_with_state += with_state(o);
    f.optimizer_step_live = largest_step(d.optimizers);
    f.optimizer_step_saved = largest_step(d.saved_optimizers);
  }
  // Without a live optimizer, one saved state binds by position to the model's trainable
  // parameters in order.
  OptimizerDesc from_model;
  if (!d.model.empty()) {
    for (const TensorDesc& p : d.model.back().trainable) {
      OptimizerSlotDesc slot;
      slot.param = p;
      from_model.slots.push_back(std::move(slot));
    }
  }
  for (size_t i = 0; i < d.saved_optimizers.size(); ++i) {
    const OptimizerDesc& saved = d.saved_optimizers[i];
    f.optimizer_params += static_cast<int64_t>(saved.slots.size());
    f.optimizer_with_state += with_state(saved);
    const OptimizerDesc* live = nullptr;
    if (i < d.optimizers.size()) {
      live = &d.optimizers[i];
    } else if (!d.model.empty() && d.saved_optimizers.size() == 1) {
      live = &from_model;
    } else {
      continue;
    }
    if (live->slots.size() != saved.slots.size()) {
      f.state_mismatched.push_back(
          (saved.path.empty() ? std::string("the optimizer") : saved.path) + " holds " +
          std::to_string(saved.slots.size()) + " parameters, the optimizer it belongs to " +
          std::to_string(live->slots.size()));
      continue;
    }
    for (std::string& m : state_mismatches(*live, saved))
      f.state_mismatched.push_back(std::move(m));
  }
}

}  // namespace

std::vector<std::string> state_mismatches(const OptimizerDesc& live, const OptimizerDesc& saved) {
  std::vector<std::string> out;
  const size_t n = std::min(live.slots.size(), saved.slots.size());
  for (size_t pos = 0; pos < n; ++pos) {
    const TensorDesc& p = live.slots[pos].param;
    for (const TensorDesc& v : saved.slots[pos].state) {
      if (per_element(v.key) && !v.dtype.empty() && v.sizes != p.sizes) {
        out.push_back(v.key + " of parameter " + std::to_string(pos) + " (" +
                      (p.key.empty() ? std::string("?") : p.key) + "): " + shape(v.sizes) +
                      ", the parameter " + shape(p.sizes));
        break;
      }
    }
  }
  return out;
}

CheckpointFacts gather_checkpoint(const CheckpointDesc& d) {
  CheckpointFacts f;
  f.source = d.source;
  f.load_error = d.load_error;
  if (!f.load_error.empty()) return f;  // nothing was loaded
  for (const TensorDesc& t : d.tensors) {
    if (t.nonfinite > 0) f.nonfinite.push_back({t.key, t.nonfinite, t.numel});
  }
  if (!d.model.empty()) compare_model(f, d);
  if (!d.saved_optimizers.empty()) compare_optimizers(f, d);
  return f;
}

}  // namespace trainsan
