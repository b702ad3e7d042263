// Facts of a checkpoint (bad_checkpoint) and the gatherer that builds them from plain descriptions
// of what the checkpoint, the model and the optimizers hold (host/checks/checkpoint_facts.cpp);
// judged and worded by host/checks/checkpoint.cpp. The descriptions are made from tensors by
// trainsan/checkpoint.h (LibTorch), whose callers are the Python package's torch.save patch and
// `trainsan.check_checkpoint` (bindings/trainsan/checkpoint.py) and LibTorch programs. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainsan/facts_table.h"

namespace trainsan {

/// A tensor of the checkpoint holding NaN or ±Inf (fields: checkpoint_nonfinite.def).
struct CheckpointNonfinite {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/checkpoint_nonfinite.def"
#undef TRAINSAN_FACT
};

/// What a checkpoint holds against its model and optimizer (fields: checkpoint_facts.def).
struct CheckpointFacts {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/checkpoint_facts.def"
#undef TRAINSAN_FACT
};

template <>
struct FactTable<CheckpointNonfinite> {
  static constexpr const char* kName = "CheckpointNonfinite";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/checkpoint_nonfinite.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<CheckpointFacts> {
  static constexpr const char* kName = "CheckpointFacts";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/checkpoint_facts.def"
#undef TRAINSAN_FACT
  }
};

// --- descriptions (what gather_checkpoint reads) ---

/// A tensor as the checkpoint rules see it.
struct TensorDesc {
  std::string key;             ///< its path in the checkpoint, or its key in a state dict
  std::vector<int64_t> sizes;  ///< its shape
  std::string dtype;           ///< "float32", "bfloat16", ... ("" for a value that is no tensor)
  int64_t numel = 0;
  int64_t nonfinite = 0;  ///< NaN and ±Inf elements (0 for a tensor that is not floating point)
};

/// A dict of tensors in the checkpoint (a state dict, or any dict whose values are all tensors).
struct StateDictDesc {
  std::string path;                 ///< where: "" (the object itself), "model", "ema", ...
  std::vector<TensorDesc> entries;  ///< by its own keys, in its order
};

/// The model's state dict: the whole model's, and for a wrapper (DistributedDataParallel) its
/// inner module's as a second one.
struct ModelDesc {
  std::vector<TensorDesc> state;  ///< state_dict() entries, in its order
  /// Its parameters that require grad (named_parameters(): each tensor once), in order: the
  /// trainable keys, and the parameters an optimizer over the model holds by position.
  std::vector<TensorDesc> trainable;
};

/// One parameter position of an optimizer (its param_groups, flattened in order).
struct OptimizerSlotDesc {
  /// A live optimizer's parameter: key = its name in the model ("?" where unknown), and its
  /// shape. Empty in a saved optimizer state.
  TensorDesc param;
  bool has_state = false;         ///< its state is not empty
  int64_t step = -1;              ///< its "step" counter; -1 where it has none (or not finite)
  std::vector<TensorDesc> state;  ///< its state entries by key ("exp_avg", "step", ...)
};

/// An optimizer: a state dict saved in the checkpoint, or a live optimizer.
struct OptimizerDesc {
  std::string path;  ///< where in the checkpoint ("optimizer"); "" for a live optimizer
  std::vector<OptimizerSlotDesc> slots;
};

/// What gather_checkpoint compares: the checkpoint's contents and what it is checked against.
struct CheckpointDesc {
  std::string source;      ///< CheckpointFacts::source
  std::string load_error;  ///< CheckpointFacts::load_error (then nothing else is looked at)
  std::vector<TensorDesc> tensors;              ///< every tensor in it, by path
  std::vector<StateDictDesc> state_dicts;       ///< its dicts of tensors
  std::vector<OptimizerDesc> saved_optimizers;  ///< its optimizer state dicts
  /// The model: none (not checked against one), its state dict, or a wrapper's then its inner
  /// module's.
  std::vector<ModelDesc> model;
  /// The optimizers it was saved from (attached) or is checked against, in the order of
  /// saved_optimizers.
  std::vector<OptimizerDesc> optimizers;
  /// A save while attached: a state dict covering less than half of the model is a part of it (a
  /// submodule's), not judged as the model.
  bool part_ok = false;
};

/// The facts of a checkpoint (Note [Checkpoint checks] in host/checks/checkpoint.cpp).
CheckpointFacts gather_checkpoint(const CheckpointDesc& desc);

/// Per parameter position of `live` whose per-element optimizer state (exp_avg, momentum_buffer,
/// ...: the entries shaped like their parameter) in `saved` has another shape than the parameter:
/// "exp_avg of parameter 3 (fc.weight): [4, 8], the parameter [8, 4]" (the first such entry of
/// each). `saved` holds the state of `live`'s parameters by position (it may be `live` itself).
std::vector<std::string> state_mismatches(const OptimizerDesc& live, const OptimizerDesc& saved);

}  // namespace trainsan
