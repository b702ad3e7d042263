// JSON Lines trace records.
#include "trace.h"

#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "sanitizer_impl.h"
#include "stats.h"

namespace trainsan {

std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
  return out;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

static std::string opt_number(const std::optional<double>& v) {
  return v ? json_number(*v) : "null";
}

std::string trace_header_json(const Options& o, const std::string& extra, size_t num_params) {
  std::ostringstream os;
  os << "{\"type\":\"header\",\"trainsan\":\"0.1.0\",\"cuda_kernels\":"
     << (kernels::cuda_compiled() ? "true" : "false") << ",\"num_params\":" << num_params
     << ",\"options\":{\"policy\":" << json_escape(o.policy)
     << ",\"sync\":" << (o.sync ? "true" : "false")
     << ",\"track_updates\":" << (o.track_updates ? "true" : "false")
     << ",\"trace_every\":" << o.trace_every
     << ",\"trace_tensors\":" << json_escape(o.trace_tensors) << "}";
  if (!extra.empty()) os << "," << extra;
  os << "}";
  return os.str();
}

std::string finding_json(const Finding& f) {
  std::ostringstream os;
  os << "{\"type\":\"finding\",\"kind\":" << json_escape(f.kind) << ",\"step\":" << f.step
     << ",\"severity\":" << json_escape(f.severity)
     << ",\"tensor\":" << (f.tensor.empty() ? "null" : json_escape(f.tensor))
     << ",\"message\":" << json_escape(f.message) << ",\"value\":" << opt_number(f.value) << "}";
  return os.str();
}

std::string amp_skip_json(int64_t step, int64_t opt) {
  std::ostringstream os;
  os << "{\"type\":\"amp_skip\",\"step\":" << step << ",\"optimizer\":" << opt << "}";
  return os.str();
}

std::string stats_json(const TensorStats& st) {
  std::ostringstream os;
  os << "{\"numel\":" << st.numel << ",\"nan\":" << st.nan << ",\"posinf\":" << st.posinf
     << ",\"neginf\":" << st.neginf << ",\"zero\":" << st.zero << ",\"subnormal\":" << st.subnormal
     << ",\"fp16_overflow\":" << st.fp16_overflow << ",\"min\":" << opt_number(st.min)
     << ",\"max\":" << opt_number(st.max) << ",\"absmax\":" << opt_number(st.absmax)
     << ",\"sum\":" << json_number(st.sum) << ",\"l2\":" << json_number(st.l2) << ",\"hash\":\""
     << std::hex << st.hash << std::dec << "\"}";
  return os.str();
}

std::string step_json(const SanitizerImpl& s, const PendingPass& p, const std::string& global,
                      const std::string& tensors, double overhead_s) {
  std::ostringstream os;
  os << "{\"type\":\"step\",\"step\":" << p.step << ",\"optimizer\":" << p.opt
     << ",\"lr_zero\":" << (p.lr_zero ? "true" : "false")
     << ",\"overhead_ms\":" << json_number(overhead_s * 1e3) << ",\"global\":{" << global << "}";
  if (!tensors.empty()) os << ",\"tensors\":{" << tensors << "}";
  os << "}";
  return os.str();
}

std::string summary_json(const SanitizerImpl& s) {
  std::map<std::string, int64_t> counts;
  for (const auto& f : s.findings) counts[f.kind] += f.count;
  std::ostringstream os;
  os << "{\"type\":\"summary\",\"steps\":" << s.step << ",\"amp_skips\":" << s.amp_skips
     << ",\"overhead_ms_total\":" << json_number(s.overhead_s * 1e3) << ",\"findings\":{";
  bool first = true;
  for (const auto& [k, n] : counts) {
    os << (first ? "" : ",") << json_escape(k) << ":" << n;
    first = false;
  }
  os << "},\"unique_findings\":[";
  first = true;
  for (const auto& f : s.findings) {
    os << (first ? "" : ",") << "{\"kind\":" << json_escape(f.kind)
       << ",\"tensor\":" << (f.tensor.empty() ? "null" : json_escape(f.tensor))
       << ",\"first_step\":" << f.step << ",\"last_step\":" << f.last_step
       << ",\"count\":" << f.count << "}";
    first = false;
  }
  os << "]}";
  return os.str();
}

}  // namespace trainsan
