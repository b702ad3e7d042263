// A finding (its fields: the table finding.def), the error the "raise" policy throws, and how a
// policy answers a finding. Torch-free.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "trainsan/facts_table.h"

namespace trainsan {

/// One thing TrainSan found wrong (docs/kinds.md); its fields: finding.def.
struct Finding {
#define TRAINSAN_FINDING(type, name, init, record, summary, doc) type name = init;
#include "trainsan/finding.def"
#undef TRAINSAN_FINDING
};

template <>
struct FactTable<Finding> {
  static constexpr const char* kName = "Finding";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FINDING(type, name, init, record, summary, doc) f(#name, s.name);
#include "trainsan/finding.def"
#undef TRAINSAN_FINDING
  }
};

/// Raised by the "raise" policy on the first error-severity finding.
class TrainingBugError : public std::runtime_error {
 public:
  explicit TrainingBugError(Finding f) : std::runtime_error(f.message), finding(std::move(f)) {}
  Finding finding;
};

/// What the policy does with a new finding: the one place that decides it (Options::policy).
/// "raise": raise on an error, warn on a warning; "warn": warn on both; "record": nothing.
enum class Action : uint8_t { kNone = 0, kWarn = 1, kRaise = 2 };
Action policy_action(const std::string& policy, const Finding& finding);

}  // namespace trainsan
