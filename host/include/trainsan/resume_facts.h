// Facts of a resume (optimizer_reset; bad_checkpoint for a load that dropped parameters),
// gathered by the caller — the Python package's load_state_dict and torch.load patches
// (bindings/trainsan/resume.py) — and judged and worded by host/checks/resume.cpp. Torch-free.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace trainsan {

struct ResumeFacts {
  enum class Moment : uint8_t {
    kModelLoad = 0,      ///< model.load_state_dict returned (strict=False: what it dropped)
    kOptimizerLoad = 1,  ///< optimizer.load_state_dict returned: the state against the parameters
    kFirstStep = 2,      ///< the first step of an optimizer after the model was loaded
  };
  Moment moment = Moment::kModelLoad;
  int64_t opt = -1;            ///< the optimizer concerned (its index in the sanitizer)
  std::string optimizer_type;  ///< e.g. "AdamW"
  // kModelLoad
  std::vector<std::string> dropped_frozen;       ///< missing keys of frozen parameters
  std::vector<std::string> dropped_unoptimized;  ///< missing keys of parameters in no optimizer
  /// The state dict's keys were the model's under another prefix: nothing of them was loaded.
  std::string prefix;
  int64_t prefix_keys = 0;
  // kOptimizerLoad
  std::vector<std::string> state_mismatched;  ///< "exp_avg of parameter 3 (fc.weight): ..."
  // kFirstStep
  bool checkpoint_has_optimizer_state = false;  ///< ...whose object holds a non-empty one
  bool optimizer_restored = false;   ///< optimizer.load_state_dict ran since the model's load
  bool stateful = false;             ///< the optimizer keeps state (its state fills on a step)
  int64_t optimizer_with_state = 0;  ///< parameters with state at this step, before it
  std::string progress;         ///< the checkpoint's progress, e.g. "epoch=3" ("" where unknown)
  int64_t scheduler_epoch = 0;  ///< a scheduler state's last_epoch in it (0: none)
  bool scheduler_restored = false;  ///< a scheduler of this optimizer was restored
  double lr = std::numeric_limits<double>::quiet_NaN();  ///< its first group's learning rate now
  double checkpoint_lr = std::numeric_limits<double>::quiet_NaN();  ///< ...in the checkpoint
};

}  // namespace trainsan
