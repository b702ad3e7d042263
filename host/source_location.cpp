// Python source lines of audited ops. RecordFunction carries no stack; the Python frames come from
// torch's CapturedTraceback.
#include "source_location.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <string_view>

namespace trainsan::host {

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool skipped(const std::string& file, const std::vector<std::string>& skip) {
  for (const std::string& part : skip) {
    if (!part.empty() && file.find(part) != std::string::npos) return true;
  }
  return false;
}

std::string basename(const std::string& f) {
  const size_t k = f.find_last_of('/');
  return k == std::string::npos ? f : f.substr(k + 1);
}

}  // namespace

Source python_source(const std::vector<std::string>& skip) {
  Source s;
  try {
    const std::shared_ptr<torch::CapturedTraceback> tb =
        torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
    if (!tb) return s;
    const torch::SymbolizedTracebacks st = torch::symbolize({tb.get()});
    if (st.tracebacks.empty()) return s;
    for (const uint64_t k : st.tracebacks[0]) {  // innermost frame first
      const torch::unwind::Frame& f = st.all_frames.at(k);
      if (skipped(f.filename, skip)) {
        if (s.via.empty() && ends_with(f.filename, "/torch/nn/functional.py")) {
          s.via = "torch.nn.functional." + f.funcname;
        }
        continue;
      }
      s.where = f.filename + ":" + std::to_string(f.lineno) + " in " + f.funcname;
      s.file = basename(f.filename) + ":" + std::to_string(f.lineno);
      break;
    }
  } catch (const std::exception&) {
    // no Python, or a frame that cannot be symbolised: the message goes without a source line
  }
  return s;
}

std::string finding_name(const std::string& op, const Source& src) {
  return src.file.empty() ? op : op + " (" + src.file + ")";
}

std::string op_desc(const std::string& op, const Source& src) {
  return src.via.empty() ? op : op + " (from " + src.via + ")";
}

std::string at_source(const Source& src) {
  return src.where.empty() ? std::string() : ", at " + src.where;
}

}  // namespace trainsan::host
