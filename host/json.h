// The JSON text of the trace's values (docs/trace.md): strings and numbers. Torch-free (part of
// trainsan_checks), for the trace writer and whatever else writes a JSON value (the options'
// header entry, the re-run attribution record).
#pragma once

#include <string>

namespace trainsan::host {

/// `s` as a JSON string literal, quotes included (control characters escaped).
std::string json_escape(const std::string& s);
/// `v` as a JSON number; null for NaN/Inf, which JSON cannot hold.
std::string json_number(double v);

}  // namespace trainsan::host

namespace trainsan {
using host::json_escape;
using host::json_number;
}  // namespace trainsan
