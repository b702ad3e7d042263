// Coverage: what a sanitizer saw and checked. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainsan {

/// What a sanitizer saw and checked, so that a clean run means "checked and clean", never "saw
/// nothing" (Sanitizer::coverage, the trace's summary record, Python's summary()).
struct Coverage {
  /// The counts, one field each (coverage.def).
#define TRAINSAN_COVERAGE_COUNT(name, init, doc) int64_t name = init;
#include "trainsan/coverage.def"
#undef TRAINSAN_COVERAGE_COUNT
  /// Why the trace stopped being written ("" while it is written, or without a trace).
  std::string trace_error;
  /// Parameters whose dtype the statistics pass does not read (float8, uint16, ...), as
  /// "name (dtype)": left out of every check that reads values (Note [Dtypes the pass reads]).
  std::vector<std::string> unread;
  /// Note [Faults]: under "warn" and "record", the internal error after which the sanitizer
  /// stopped checking (told once as a warning); "" while it checks.
  std::string fault;
  /// Enabled kinds that never had what they need, with the reason.
  std::vector<std::pair<std::string, std::string>> unchecked;
};

}  // namespace trainsan
