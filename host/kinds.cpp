// The kind table (kinds.def), the policy's answer to a finding, and the CollectingSink.
// Torch-free: part of trainsan_checks.
#include "trainsan/kinds.h"

#include <iostream>
#include <sstream>

#include "finding_sink.h"
#include "trainsan/finding.h"

namespace trainsan {

const std::vector<KindInfo>& kinds() {
  static const std::vector<KindInfo> table = {
#define TRAINSAN_KIND(name, severity, on, family, needs, libtorch, rule) \
  {Kind::name, #name, Severity::severity, on, #family, #needs, libtorch, rule},
#include "trainsan/kinds.def"
#undef TRAINSAN_KIND
  };
  return table;
}

const KindInfo& info(Kind kind) { return kinds()[static_cast<size_t>(kind)]; }

const char* severity_name(Severity s) { return s == Severity::kError ? "error" : "warning"; }

std::optional<Kind> kind_from_name(std::string_view name) {
  for (const KindInfo& k : kinds()) {
    if (name == k.name) return k.kind;
  }
  return std::nullopt;
}

Action policy_action(const std::string& policy, const Finding& finding) {
  if (policy == "record") return Action::kNone;
  if (policy == "raise" && finding.severity == "error") return Action::kRaise;
  return Action::kWarn;
}

namespace host {

const Finding* CollectingSink::add(Kind kind, const std::string& tensor, const std::string& message,
                                   std::optional<double> value, int64_t step,
                                   std::optional<Severity> severity) {
  Finding f;
  f.kind = name_of(kind);
  f.step = step;
  f.last_step = step;
  f.severity = severity_name(severity.value_or(info(kind).severity));
  f.tensor = tensor;
  f.message = std::string(name_of(kind)) + ": " + message;
  f.value = value;
  out.push_back(f);
  return &out.back();
}

}  // namespace host
}  // namespace trainsan
