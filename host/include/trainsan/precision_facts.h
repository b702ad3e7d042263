// Facts of mixed-precision training, gathered by the caller — the Python package's GradScaler
// patch and its armed module hooks (bindings/trainsan/precision.py), or a LibTorch program's own —
// and judged and worded by the sanitizer (host/checks/precision.cpp). Torch-free.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainsan {

/// One step of a gradient scaler (torch.amp.GradScaler.step): whether it skipped the optimizer's
/// step (its gradients held Inf/NaN) and the scale this step's gradients were multiplied by.
struct ScalerStep {
  int64_t opt = 0;
  bool skipped = false;
  double scale = std::numeric_limits<double>::quiet_NaN();  ///< NaN where unknown
};

/// A module output (forward) or the gradient of one (backward) where a non-finite value first
/// appeared in a step, in execution order, as the armed module hooks' flags say.
struct ModuleOrigin {
  std::string module;  ///< its qualified name in the model ("" for the model itself)
  std::string type;    ///< its class, e.g. "Linear"
  std::string dtype;   ///< the dtype of the non-finite tensor, e.g. "float16"
  /// The autocast dtype in force when the module ran ("" outside autocast).
  std::string autocast;
  bool backward = false;  ///< the gradient of its output, not its output
  /// An input of the module that no module output before it held: made by its parent's own
  /// forward code between submodules (or, for the model itself, the batch).
  bool input = false;
  bool inf_only = false;  ///< ±Inf but no NaN (an overflow rather than 0/0, Inf-Inf, ...)
  int64_t position = 0;   ///< 1-based place among the tensors checked in that pass
  int64_t checked = 0;    ///< how many were checked in that pass
  /// Its own parameters holding finite values beyond ±65504 (name, count): under fp16 autocast
  /// they become Inf when cast.
  std::vector<std::pair<std::string, int64_t>> beyond_fp16;
  /// The largest magnitude among the tensors flagged before it in that pass (0: none), and where:
  /// a clue to an overflow that a later operation turned into NaN (Inf - Inf, softmax of Inf).
  double prior_absmax = 0.0;
  std::string prior_where;  ///< e.g. "the output of attn.qkv (float16)"
};

/// A float32/float64 module output beyond the fp16 range (±65504) in a forward under fp16
/// autocast: the next autocast op that casts it to fp16 turns those values into Inf.
struct RangeOverflow {
  std::string module;
  std::string type;
  std::string dtype;
  double absmax = 0.0;  ///< its largest finite magnitude
};

/// What the armed module hooks found in one training step (overflow provenance).
struct Provenance {
  int64_t step = 0;
  int64_t forward_checked = 0;   ///< module outputs checked in the forward
  int64_t backward_checked = 0;  ///< output gradients checked in the backward
  std::optional<ModuleOrigin> forward;
  std::optional<ModuleOrigin> backward;
  std::vector<RangeOverflow> fp16_range;
};

}  // namespace trainsan
