// Facts of a resume (optimizer_reset; bad_checkpoint for a load that dropped parameters),
// gathered by the caller — the Python package's load_state_dict and torch.load patches
// (bindings/trainsan/resume.py) — and judged and worded by host/checks/resume.cpp. Torch-free.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "trainsan/facts_table.h"

namespace trainsan {

/// One parameter's restored optimizer state against its first gradient (fields: moment_scale.def).
struct MomentScale {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/moment_scale.def"
#undef TRAINSAN_FACT
};

/// One resume event (fields: resume_facts.def).
struct ResumeFacts {
  enum class Moment : uint8_t {
    kModelLoad = 0,      ///< model.load_state_dict returned (strict=False: what it dropped)
    kOptimizerLoad = 1,  ///< optimizer.load_state_dict returned: the state against the parameters
    kFirstStep = 2,      ///< the first step of an optimizer after the model's or its own load
    kScheduleStep = 3,   ///< a later step whose learning rate changed (Note [Restarted schedule])
  };
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/resume_facts.def"
#undef TRAINSAN_FACT
};

template <>
struct FactEnum<ResumeFacts::Moment> {
  static constexpr int64_t kMax = 3;
};

template <>
struct FactTable<MomentScale> {
  static constexpr const char* kName = "MomentScale";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/moment_scale.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<ResumeFacts> {
  static constexpr const char* kName = "ResumeFacts";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/resume_facts.def"
#undef TRAINSAN_FACT
  }
};

}  // namespace trainsan
