// A finding, the error the "raise" policy throws, and how a policy answers a finding.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace trainsan {

/// One thing TrainSan found wrong (docs/kinds.md).
struct Finding {
  std::string kind;             ///< e.g. "stale_grad" (kinds.def)
  int64_t step = 0;             ///< 0-based optimizer step where it was first seen
  std::string severity;         ///< "error" or "warning"
  std::string tensor;           ///< parameter or module name; empty when none
  std::string message;          ///< what is wrong and what to look at
  std::optional<double> value;  ///< the figure that triggered it
  int64_t count = 1;            ///< how often it occurred (a repeat is reported once, then counted)
  int64_t last_step = 0;        ///< the step of the latest occurrence
  /// Re-run attribution (Options::rerun_on_error; Note [Re-run attribution]): whether a re-run of
  /// the step from its saved inputs, RNG state and buffers reproduced it (a data or code fault)
  /// or not (a transient fault); empty when not re-run or the re-run could not tell.
  std::optional<bool> reproduces;
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
