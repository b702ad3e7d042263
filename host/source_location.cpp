// Python source lines of audited ops. RecordFunction carries no stack; the Python frames come from
// torch's CapturedTraceback.
#include "source_location.h"

#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/profiler/unwind/unwind.h>

#include <cstdint>
#include <cstdio>
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

// Libraries whose frames are not the user's: torch's, TrainSan's, the C and C++ runtimes.
bool system_library(const std::string& path) {
  for (const char* lib :
       {"libtorch", "libc10", "libtrainsan", "/libc.so", "libc-", "libstdc++", "ld-linux",
        "libgomp", "libcudart", "libpthread", "libgcc_s", "libpython", "/bin/python"}) {
    if (path.find(lib) != std::string::npos) return true;
  }
  return false;
}

// Frames inside the program's binary that are not the program's own code, which
// system_library() cannot tell by the library's name: TrainSan linked statically (a static
// trainsan::trainsan, as the tests and an add_subdirectory build link it) and the LibTorch and
// C++ library headers inlined into the program. By namespace, and with debug information by
// source (TrainSan's host/ and kernels/, torch's and the C++ library's include directories).
bool not_the_programs(const torch::unwind::Frame& f) {
  static const std::string root = [] {
    const std::string here = __FILE__;  // <root>/host/source_location.cpp
    const size_t k = here.rfind("/host/");
    return k == std::string::npos ? std::string() : here.substr(0, k + 1);
  }();
  for (const char* ns : {"trainsan::", "at::", "c10::", "torch::", "std::", "__gnu_cxx::"}) {
    if (f.funcname.rfind(ns, 0) == 0) return true;
  }
  if (!root.empty() &&
      (f.filename.rfind(root + "host/", 0) == 0 || f.filename.rfind(root + "kernels/", 0) == 0)) {
    return true;
  }
  return f.filename.find("/torch/include/") != std::string::npos ||
         f.filename.find("/include/c++/") != std::string::npos;
}

// A LibTorch program (no Python frame): the innermost frame of the program's own code, its
// function and, where the program has debug information, file and line (one addr2line run).
Source cpp_source() {
  Source s;
  try {
    for (void* pc : torch::unwind::unwind()) {
      const auto lib = torch::unwind::libraryFor(pc);
      if (!lib || system_library(lib->first)) continue;
      const std::vector<torch::unwind::Frame> fs =
          torch::unwind::symbolize({pc}, torch::unwind::Mode::addr2line);
      if (!fs.empty() && not_the_programs(fs[0])) continue;
      const std::string func = fs.empty() || fs[0].funcname.empty() || fs[0].funcname == "??"
                                   ? std::string()
                                   : fs[0].funcname;
      const bool lined =
          !fs.empty() && fs[0].lineno > 0 && fs[0].filename != "??" && !fs[0].filename.empty();
      if (lined) {
        s.file = basename(fs[0].filename) + ":" + std::to_string(fs[0].lineno);
        s.where = fs[0].filename + ":" + std::to_string(fs[0].lineno);
      } else {
        char off[32];
        std::snprintf(off, sizeof(off), "+0x%llx", static_cast<unsigned long long>(lib->second));
        s.where = lib->first + off;  // not in the finding's name: it moves with every build
      }
      if (!func.empty()) s.where += " in " + func;
      break;
    }
  } catch (const std::exception&) {
    // no unwinder for this platform or build: the message goes without a source line
  }
  return s;
}

}  // namespace

Source python_source(const std::vector<std::string>& skip) {
  Source s;
  bool python = false;  // some Python frame is on the stack: not a LibTorch program
  try {
    const std::shared_ptr<torch::CapturedTraceback> tb =
        torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
    if (!tb) return cpp_source();
    const torch::SymbolizedTracebacks st = torch::symbolize({tb.get()});
    if (st.tracebacks.empty()) return cpp_source();
    python = !st.tracebacks[0].empty();
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
  if (!python) s = cpp_source();
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
