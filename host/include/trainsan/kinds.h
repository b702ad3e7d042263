// The finding kinds, generated from kinds.def: the one table of names, severities and defaults.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace trainsan {

enum class Severity : uint8_t { kError, kWarning };

enum class Kind : uint8_t {
#define TRAINSAN_KIND(name, severity, on, family, needs, libtorch, rule) name,
#include "trainsan/kinds.def"
#undef TRAINSAN_KIND
};

/// One row of kinds.def.
struct KindInfo {
  Kind kind;
  const char* name;
  Severity severity;
  bool default_on;  ///< false: opt-in
  const char* family;
  const char* needs;     ///< step, forward, loss, audit, event or python (kinds.def)
  const char* libtorch;  ///< how a LibTorch program gets it, or why it cannot (needs python)
  const char* rule;      ///< one line: when it fires
};

/// Every implemented kind, in kinds.def order.
const std::vector<KindInfo>& kinds();
const KindInfo& info(Kind kind);
inline const char* name_of(Kind kind) { return info(kind).name; }
inline Severity severity_of(Kind kind) { return info(kind).severity; }
/// "error" or "warning".
const char* severity_name(Severity s);
/// The kind of that name; empty for an unknown or unimplemented one.
std::optional<Kind> kind_from_name(std::string_view name);

}  // namespace trainsan
