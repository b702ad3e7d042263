// Facts of a checkpoint (bad_checkpoint), gathered by the caller — the Python package's torch.save
// patch and `trainsan.check_checkpoint` (bindings/trainsan/checkpoint.py), or a LibTorch
// program's own — and judged and worded by host/checks/checkpoint.cpp. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trainsan {

/// A tensor of the checkpoint holding NaN or ±Inf.
struct CheckpointNonfinite {
  std::string key;  ///< its path in the saved object, e.g. "model.fc1.weight"
  int64_t count = 0;
  int64_t numel = 0;
};

struct CheckpointFacts {
  std::string source;  ///< the file, or what is being saved ("torch.save to ckpt.pt")
  /// torch.load(weights_only=True) refused it (it needs arbitrary code to load): why.
  std::string load_error;
  std::vector<CheckpointNonfinite> nonfinite;
  // --- checked against a model (the attached one, or one given) ---
  bool have_model = false;
  bool model_found = false;  ///< a state dict with the model's keys was found in it
  std::string model_key;     ///< where: "" (the object itself), "model", ...
  int64_t model_keys = 0;    ///< entries in the model's state dict
  std::vector<std::string> missing_trainable;  ///< trainable parameters it does not hold
  std::vector<std::string> missing_other;      ///< other entries (frozen, buffers) it lacks
  std::vector<std::string> unexpected;         ///< keys the model does not have
  /// "key: [16, 8] float32 in the checkpoint, [8, 16] float32 in the model"
  std::vector<std::string> mismatched;
  bool ddp_prefix = false;  ///< its keys are the model's with DDP's "module." prefix
  // --- optimizer state ---
  bool have_optimizer_state = false;  ///< an optimizer state dict (state, param_groups) in it
  int64_t optimizer_params = 0;       ///< parameters in its param_groups
  int64_t optimizer_with_state = 0;   ///< of those, with state
  /// The optimizer it was saved from (attached) or checked against: parameters with state now;
  /// -1 where there is none to compare with.
  int64_t live_with_state = -1;
  /// "exp_avg of parameter 3 (fc2.weight): [4, 8], the parameter [8, 4]"
  std::vector<std::string> state_mismatched;
  /// The step counters of the optimizer state in it and of the optimizer it was saved from (the
  /// largest per-parameter "step"); -1 where unknown.
  int64_t optimizer_step_saved = -1;
  int64_t optimizer_step_live = -1;
};

}  // namespace trainsan
