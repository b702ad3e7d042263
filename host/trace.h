// JSON Lines trace records (../shared/DESIGN.md, "Trace"). Each function returns one line.
#pragma once

#include <cstdint>
#include <string>

#include "trainsan/sanitizer.h"

namespace trainsan {

struct SanitizerImpl;
struct PendingPass;

std::string json_escape(const std::string& s);
std::string json_number(double v);  // null for NaN/Inf, which JSON cannot hold

// `extra` is a JSON object body (without braces) from the caller, e.g. the Python layer's
// provenance fields; it may be empty.
std::string trace_header_json(const Options& opts, const std::string& extra, size_t num_params);
std::string finding_json(const Finding& f);
std::string amp_skip_json(int64_t step, int64_t opt);
std::string step_json(const SanitizerImpl& s, const PendingPass& p, const std::string& global,
                      const std::string& tensors, double overhead_s);
std::string stats_json(const TensorStats& st);
std::string summary_json(const SanitizerImpl& s);

}  // namespace trainsan
