// JSON Lines trace records.
#include "trace.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "stats.h"
#include "trainsan/version.h"

namespace trainsan::host {

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

namespace {

std::string opt_number(const std::optional<double>& v) { return v ? json_number(*v) : "null"; }

// The header fields the Python package writes (its header_extra), for a C++ program: versions,
// command line, working directory, seed and determinism settings.
std::string cpp_header_fields() {
  std::ostringstream os;
  os << "\"torch\":" << json_escape(TORCH_VERSION) << ",\"argv\":[";
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  std::string arg;
  bool first = true;
  while (std::getline(cmdline, arg, '\0')) {
    os << (first ? "" : ",") << json_escape(arg);
    first = false;
  }
  os << "]";
  char cwd[4096];
  if (getcwd(cwd, sizeof(cwd)) != nullptr) os << ",\"cwd\":" << json_escape(cwd);
  os << ",\"seed\":" << at::detail::getDefaultCPUGenerator().current_seed()
     << ",\"deterministic_algorithms\":"
     << (at::globalContext().deterministicAlgorithms() ? "true" : "false");
  return os.str();
}

}  // namespace

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

TraceWriter::TraceWriter(const Options& opts, const std::string& extra, size_t num_params)
    : opts_(opts) {
  if (opts.trace.empty()) return;
  out_.open(opts.trace, std::ios::out | std::ios::trunc);
  TORCH_CHECK_VALUE(out_.is_open(), "trainsan: cannot open the trace file '", opts.trace,
                    "' for writing; check that its directory exists and is writable");
  std::ostringstream os;
  os << "{\"type\":\"header\",\"trainsan\":\"" TRAINSAN_VERSION "\",\"cuda_kernels\":"
     << (kernels::cuda_compiled() ? "true" : "false") << ",\"num_params\":" << num_params
     << ",\"options\":" << opts.to_json();
  if (!extra.empty()) os << "," << extra;
  // No "torch" field from the caller (the Python package writes its own): a C++ program.
  if (extra.find("\"torch\":") == std::string::npos) os << "," << cpp_header_fields();
  os << "}";
  line(os.str());
}

void TraceWriter::line(const std::string& json) {
  if (!out_.is_open()) return;
  out_ << json << '\n';
  out_.flush();
}

void TraceWriter::finding(const Finding& f) {
  std::ostringstream os;
  os << "{\"type\":\"finding\",\"kind\":" << json_escape(f.kind) << ",\"step\":" << f.step
     << ",\"severity\":" << json_escape(f.severity)
     << ",\"tensor\":" << (f.tensor.empty() ? "null" : json_escape(f.tensor))
     << ",\"message\":" << json_escape(f.message) << ",\"value\":" << opt_number(f.value) << "}";
  line(os.str());
}

void TraceWriter::amp_skip(int64_t step, int64_t opt) {
  std::ostringstream os;
  os << "{\"type\":\"amp_skip\",\"step\":" << step << ",\"optimizer\":" << opt << "}";
  line(os.str());
}

void TraceWriter::scaler(int64_t step, int64_t opt, double scale, bool skipped) {
  std::ostringstream os;
  os << "{\"type\":\"scaler\",\"step\":" << step << ",\"optimizer\":" << opt
     << ",\"scale\":" << opt_number(std::isnan(scale) ? std::nullopt : std::optional<double>(scale))
     << ",\"skipped\":" << (skipped ? "true" : "false") << "}";
  line(os.str());
}

void TraceWriter::step(const StepRecord& r) {
  if (!out_.is_open()) return;
  const StepTotals& t = r.totals;
  std::ostringstream os;
  os << "{\"type\":\"step\",\"step\":" << r.step << ",\"optimizer\":" << r.opt
     << ",\"lr_zero\":" << (r.lr_zero ? "true" : "false")
     << ",\"update_stats\":" << (r.update_stats ? "true" : "false")
     << ",\"overhead_ms\":" << json_number(r.overhead_s * 1e3);
  if (r.backwards >= 0) os << ",\"backwards\":" << r.backwards;
  if (r.inputs) os << ",\"inputs\":\"" << std::hex << *r.inputs << std::dec << "\"";
  if (r.targets) os << ",\"targets\":\"" << std::hex << *r.targets << std::dec << "\"";
  os << ",\"global\":{\"grad_norm\":" << json_number(t.grad_norm)
     << ",\"param_norm\":" << json_number(t.param_norm)
     << ",\"update_norm\":" << json_number(t.update_norm)
     << ",\"update_ratio\":" << json_number(t.update_ratio) << ",\"changed\":" << t.changed
     << ",\"nonfinite_grad\":" << (t.any_nonfinite_grad ? "true" : "false") << "}";
  if (opts_.trace_tensors != "global" && !r.tensors.empty()) {
    std::vector<const TensorRecord*> order;
    for (const TensorRecord& tr : r.tensors) order.push_back(&tr);
    if (opts_.trace_tensors == "topk") {
      std::stable_sort(
          order.begin(), order.end(),
          [](const TensorRecord* a, const TensorRecord* b) { return a->sort_key > b->sort_key; });
      if (order.size() > static_cast<size_t>(opts_.trace_topk)) order.resize(opts_.trace_topk);
    }
    os << ",\"tensors\":{";
    const char* sep = "";
    for (const TensorRecord* tr : order) {
      os << sep << json_escape(tr->name) << ":{\"param\":" << stats_json(tr->param);
      if (tr->grad) os << ",\"grad\":" << stats_json(*tr->grad);
      if (tr->update) {
        os << ",\"update\":{\"l2\":" << json_number(tr->update->l2)
           << ",\"max\":" << json_number(tr->update->max) << ",\"changed\":" << tr->update->changed
           << "}";
      }
      os << "}";
      sep = ",";
    }
    os << "}";
  }
  os << "}";
  line(os.str());
}

void TraceWriter::summary(int64_t steps, int64_t amp_skips, double overhead_s,
                          const std::vector<Finding>& findings, const Coverage& c) {
  std::map<std::string, int64_t> counts;
  for (const auto& f : findings) counts[f.kind] += f.count;
  std::ostringstream os;
  os << "{\"type\":\"summary\",\"steps\":" << steps << ",\"amp_skips\":" << amp_skips
     << ",\"overhead_ms_total\":" << json_number(overhead_s * 1e3) << ",\"findings\":{";
  const char* sep = "";
  for (const auto& [k, n] : counts) {
    os << sep << json_escape(k) << ":" << n;
    sep = ",";
  }
  os << "},\"unique_findings\":[";
  sep = "";
  for (const auto& f : findings) {
    os << sep << "{\"kind\":" << json_escape(f.kind)
       << ",\"tensor\":" << (f.tensor.empty() ? "null" : json_escape(f.tensor))
       << ",\"first_step\":" << f.step << ",\"last_step\":" << f.last_step
       << ",\"count\":" << f.count;
    if (f.reproduces) os << ",\"reproduces\":" << (*f.reproduces ? "true" : "false");
    os << "}";
    sep = ",";
  }
  os << "],\"coverage\":{\"steps_checked\":" << c.steps_checked
     << ",\"update_steps\":" << c.update_steps << ",\"update_period\":" << c.update_period
     << ",\"overhead_budget\":" << json_number(opts_.overhead_budget)
     << ",\"training_forwards\":" << c.training_forwards
     << ",\"other_forwards\":" << c.other_forwards << ",\"losses_checked\":" << c.losses_checked
     << ",\"inputs_fingerprinted\":" << c.inputs_fingerprinted
     << ",\"audited_forwards\":" << c.audited_forwards << ",\"ops_audited\":" << c.ops_audited
     << ",\"window_declared\":" << c.window_declared << ",\"windows\":" << c.windows
     << ",\"window_backwards\":" << c.window_backwards << ",\"window_steps\":" << c.window_steps
     << ",\"window_samples\":" << c.window_samples << ",\"unchecked\":{";
  sep = "";
  for (const auto& [kind, why] : c.unchecked) {
    os << sep << json_escape(kind) << ":" << json_escape(why);
    sep = ",";
  }
  os << "}}}";
  line(os.str());
}

void TraceWriter::close() {
  if (out_.is_open()) out_.close();
}

}  // namespace trainsan::host
