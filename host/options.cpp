// Options: the parser, validation, the header JSON and the Python table, all generated from
// options.def; enablement from kinds.def.
#include "trainsan/options.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>

#include "json.h"
#include "trainsan/kinds.h"

namespace trainsan {

namespace {

double parse_double(const std::string& name, const std::string& value) {
  try {
    size_t pos = 0;
    const double v = std::stod(value, &pos);
    if (pos == value.size()) return v;
  } catch (const std::exception&) {
  }
  TORCH_CHECK_VALUE(false, "trainsan option ", name, " expects a number, got '", value, "'");
}

// `v`, already parsed from `value` and checked against the option's range, as an integer.
int64_t to_int(const std::string& name, const std::string& value, double v) {
  TORCH_CHECK_VALUE(v == std::floor(v) && std::abs(v) < 9.0e15, "trainsan option ", name,
                    " expects an integer, got '", value, "'");
  return static_cast<int64_t>(v);
}

// An option's range, "[1, inf)" or "(0, 1]", as options.def writes it.
struct Range {
  double lo = 0, hi = 0;
  bool lo_open = false, hi_open = false;
  bool holds(double v) const {  // false for NaN
    return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
};

Range parse_range(const char* text) {
  const std::string t = text;
  Range r;
  const size_t comma = t.find(',');
  TORCH_INTERNAL_ASSERT(t.size() >= 5 && comma != std::string::npos &&
                            (t.front() == '[' || t.front() == '(') &&
                            (t.back() == ']' || t.back() == ')'),
                        "options.def: bad range '", t, "'");
  r.lo_open = t.front() == '(';
  r.hi_open = t.back() == ')';
  r.lo = std::stod(t.substr(1, comma - 1));  // "inf" and "-inf" read as infinities
  r.hi = std::stod(t.substr(comma + 1, t.size() - comma - 2));
  return r;
}

void check_range(const char* name, double v, const char* range) {
  const Range r = parse_range(range);
  std::ostringstream got;
  got.precision(17);
  got << v;
  TORCH_CHECK_VALUE(r.holds(v), "trainsan: option ", name, " must be in ", range, ", got ",
                    got.str(), " (docs/options.md says what each value means)");
}

bool parse_bool(const std::string& name, const std::string& value) {
  TORCH_CHECK_VALUE(value == "1" || value == "0" || value == "true" || value == "false",
                    "trainsan option ", name, " expects a bool, got '", value, "'");
  return value == "1" || value == "true";
}

// "raise|warn|record" -> "'raise', 'warn' or 'record'"
std::string choices_text(const std::string& choices) {
  std::vector<std::string> parts;
  std::stringstream ss(choices);
  for (std::string p; std::getline(ss, p, '|');) parts.push_back("'" + p + "'");
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) {
    if (k > 0) out += k + 1 == parts.size() ? " or " : ", ";
    out += parts[k];
  }
  return out;
}

void check_choice(const char* name, const std::string& value, const char* choices) {
  const std::string c = choices;
  if (c.empty()) return;
  std::stringstream ss(c);
  for (std::string p; std::getline(ss, p, '|');) {
    if (p == value) return;
  }
  TORCH_CHECK_VALUE(false, "trainsan: ", name, " must be ", choices_text(c), ", got '", value, "'");
}

// Shortest text that reads back as the same double ("50", "1e-12").
std::string real_text(double v) {
  for (int precision = 6; precision < 17; ++precision) {
    std::ostringstream os;
    os.precision(precision);
    os << v;
    if (std::stod(os.str()) == v) return os.str();
  }
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

}  // namespace

bool Options::enabled(const std::string& kind) const {
  auto it = checks.find(kind);
  if (it != checks.end()) return it->second;
  const std::optional<Kind> k = kind_from_name(kind);
  return k && info(*k).default_on;
}

void Options::set(const std::string& name, const std::string& value) {
  if (name.rfind("check.", 0) == 0) {
    checks[name.substr(6)] = parse_bool(name, value);
    return;
  }
#define TRAINSAN_OPTION_STR(n, def, choices, doc) \
  if (name == #n) {                               \
    check_choice(#n, value, choices);             \
    n = value;                                    \
    return;                                       \
  }
#define TRAINSAN_OPTION_INT(n, def, range, doc) \
  if (name == #n) {                             \
    const double v = parse_double(name, value); \
    check_range(#n, v, range);                  \
    n = to_int(name, value, v);                 \
    return;                                     \
  }
#define TRAINSAN_OPTION_REAL(n, def, range, doc) \
  if (name == #n) {                              \
    const double v = parse_double(name, value);  \
    check_range(#n, v, range);                   \
    n = v;                                       \
    return;                                      \
  }
#define TRAINSAN_OPTION_BOOL(n, def, doc) \
  if (name == #n) {                       \
    n = parse_bool(name, value);          \
    return;                               \
  }
#include "trainsan/options.def"
#undef TRAINSAN_OPTION_STR
#undef TRAINSAN_OPTION_INT
#undef TRAINSAN_OPTION_REAL
#undef TRAINSAN_OPTION_BOOL
  TORCH_CHECK_VALUE(false, "trainsan: unknown option '", name,
                    "'; see the README's option table for the valid names");
}

void Options::validate() const {
#define TRAINSAN_OPTION_STR(n, def, choices, doc) check_choice(#n, n, choices);
#define TRAINSAN_OPTION_INT(n, def, range, doc) check_range(#n, static_cast<double>(n), range);
#define TRAINSAN_OPTION_REAL(n, def, range, doc) check_range(#n, n, range);
#define TRAINSAN_OPTION_BOOL(n, def, doc)
#include "trainsan/options.def"
#undef TRAINSAN_OPTION_STR
#undef TRAINSAN_OPTION_INT
#undef TRAINSAN_OPTION_REAL
#undef TRAINSAN_OPTION_BOOL
  TORCH_CHECK_VALUE(update_ratio_low < update_ratio_high, "trainsan: option update_ratio_low (",
                    update_ratio_low, ") must be below update_ratio_high (", update_ratio_high,
                    "): they are the two ends of the band of healthy update ratios");
  std::string valid;
  for (const KindInfo& k : kinds()) valid += std::string(valid.empty() ? "" : ", ") + k.name;
  for (const auto& [kind, on] : checks) {
    TORCH_CHECK_VALUE(kind_from_name(kind).has_value(), "trainsan: unknown check '", kind,
                      "' (not a finding kind TrainSan implements); valid kinds: ", valid);
  }
}

std::string Options::to_json() const {
  std::ostringstream os;
  os << "{";
  const char* sep = "";
#define TRAINSAN_OPTION_STR(n, def, choices, doc) \
  os << sep << "\"" #n "\":" << json_escape(n);   \
  sep = ",";
#define TRAINSAN_OPTION_INT(n, def, range, doc) \
  os << sep << "\"" #n "\":" << n;              \
  sep = ",";
#define TRAINSAN_OPTION_REAL(n, def, range, doc) \
  os << sep << "\"" #n "\":" << json_number(n);  \
  sep = ",";
#define TRAINSAN_OPTION_BOOL(n, def, doc)               \
  os << sep << "\"" #n "\":" << (n ? "true" : "false"); \
  sep = ",";
#include "trainsan/options.def"
#undef TRAINSAN_OPTION_STR
#undef TRAINSAN_OPTION_INT
#undef TRAINSAN_OPTION_REAL
#undef TRAINSAN_OPTION_BOOL
  os << ",\"checks\":{";
  sep = "";
  for (const KindInfo& k : kinds()) {
    os << sep << "\"" << k.name << "\":" << (enabled(k.name) ? "true" : "false");
    sep = ",";
  }
  os << "}}";
  return os.str();
}

const std::vector<OptionInfo>& option_table() {
  static const std::vector<OptionInfo> table = {
#define TRAINSAN_OPTION_STR(n, def, choices, doc) {#n, "str", def, choices, doc},
#define TRAINSAN_OPTION_INT(n, def, range, doc) {#n, "int", std::to_string(def), range, doc},
#define TRAINSAN_OPTION_REAL(n, def, range, doc) {#n, "float", real_text(def), range, doc},
#define TRAINSAN_OPTION_BOOL(n, def, doc) {#n, "bool", def ? "true" : "false", "", doc},
#include "trainsan/options.def"
#undef TRAINSAN_OPTION_STR
#undef TRAINSAN_OPTION_INT
#undef TRAINSAN_OPTION_REAL
#undef TRAINSAN_OPTION_BOOL
  };
  return table;
}

}  // namespace trainsan
