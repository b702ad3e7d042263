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

#include "trainsan/facts_table.h"

namespace trainsan {

/// One step of a gradient scaler (torch.amp.GradScaler.step): whether it skipped the optimizer's
/// step (its gradients held Inf/NaN) and the scale this step's gradients were multiplied by.
struct ScalerStep {
  int64_t opt = 0;
  bool skipped = false;
  double scale = std::numeric_limits<double>::quiet_NaN();  ///< NaN where unknown
};

/// Names with counts, e.g. parameters and how many of their values are beyond a range.
using NamedCounts = std::vector<std::pair<std::string, int64_t>>;

/// A module output (forward) or the gradient of one (backward) where a non-finite value first
/// appeared in a step, in execution order, as the armed module hooks' flags say (fields:
/// module_origin.def).
struct ModuleOrigin {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/module_origin.def"
#undef TRAINSAN_FACT
};

/// A float32/float64 module output beyond the fp16 range (±65504) in a forward under fp16
/// autocast: the next autocast op that casts it to fp16 turns those values into Inf (fields:
/// range_overflow.def).
struct RangeOverflow {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/range_overflow.def"
#undef TRAINSAN_FACT
};

/// What the armed module hooks found in one training step (overflow provenance; fields:
/// provenance.def).
struct Provenance {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/provenance.def"
#undef TRAINSAN_FACT
};

template <>
struct FactTable<ModuleOrigin> {
  static constexpr const char* kName = "ModuleOrigin";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/module_origin.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<RangeOverflow> {
  static constexpr const char* kName = "RangeOverflow";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/range_overflow.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<Provenance> {
  static constexpr const char* kName = "Provenance";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/provenance.def"
#undef TRAINSAN_FACT
  }
};

}  // namespace trainsan
