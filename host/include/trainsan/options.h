// Options of a Sanitizer, generated from options.def (one row per option).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainsan {

/// Options of a Sanitizer. Every check is on by default except the opt-in kinds of kinds.def
/// (nonfinite_activation, update_outside_step). Thresholds and their rules are documented in
/// docs/options.md.
struct Options {
#define TRAINSAN_OPTION_STR(name, def, choices, doc) std::string name = def;
#define TRAINSAN_OPTION_INT(name, def, range, doc) int64_t name = def;
#define TRAINSAN_OPTION_REAL(name, def, range, doc) double name = def;
#define TRAINSAN_OPTION_BOOL(name, def, doc) bool name = def;
#include "trainsan/options.def"
#undef TRAINSAN_OPTION_STR
#undef TRAINSAN_OPTION_INT
#undef TRAINSAN_OPTION_REAL
#undef TRAINSAN_OPTION_BOOL

  /// Checks switched off (or, for the opt-in ones, on) by kind name. A name that is not an
  /// implemented kind is an error when the Sanitizer is built (validate()).
  std::map<std::string, bool> checks;

  /// Whether the check of that kind runs (its entry in `checks`, else its kinds.def default).
  bool enabled(const std::string& kind) const;
  /// Set a field by name from its text form ("check.<kind>" for `checks`), as the Python binding
  /// does; throws c10::ValueError naming the option for an unknown name or a bad value.
  void set(const std::string& name, const std::string& value);
  /// Throws c10::ValueError for a value out of its choices or an unknown kind in `checks`.
  void validate() const;
  /// The options as a JSON object (the trace header's "options").
  std::string to_json() const;
};

/// One row of options.def, for the Python package's OPTIONS table and Options dataclass.
struct OptionInfo {
  const char* name;
  const char* type;           ///< "str", "int", "float" or "bool"
  std::string default_value;  ///< text form, as set() takes it
  /// "a|b|c" for a string with fixed choices; a number's range, "[1, inf)"
  const char* choices;
  const char* doc;
};
const std::vector<OptionInfo>& option_table();

}  // namespace trainsan
