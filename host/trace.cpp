// JSON Lines trace records.
#include "trace.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "stats.h"
#include "trainsan/version.h"

namespace trainsan::host {

namespace {

std::string opt_number(const std::optional<double>& v) { return v ? json_number(*v) : "null"; }

// A Finding field's JSON value (finding.def): an empty string and an absent optional are null.
void put_json(std::ostream& os, const std::string& s) {
  os << (s.empty() ? "null" : json_escape(s));
}
void put_json(std::ostream& os, int64_t v) { os << v; }
void put_json(std::ostream& os, const std::optional<double>& v) { os << opt_number(v); }
void put_json(std::ostream& os, const std::optional<bool>& v) {
  os << (!v ? "null" : *v ? "true" : "false");
}
template <class T>
bool absent(const T& /*v*/) {
  return false;
}
template <class T>
bool absent(const std::optional<T>& v) {
  return !v.has_value();
}

// A measured time: four significant digits are all it has.
std::string short_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

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

// A write to a pipe or socket whose reader is gone raises SIGPIPE, whose default action ends the
// process (a LibTorch program's; Python ignores the signal): SIGPIPE is blocked in this thread for
// the write and one the write raised is taken back, so the write fails with EPIPE and the trace
// ends as on a full disk (Note [Bounded trace]), the run going on.
ssize_t write_keeping_sigpipe(int fd, const char* p, size_t n) {
  sigset_t pipe_set, old, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  sigemptyset(&pending);
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;  // someone else's: left alone
  const ssize_t r = ::write(fd, p, n);
  const int err = errno;
  if (r < 0 && err == EPIPE && !was_pending) {
    const struct timespec zero = {0, 0};
    while (sigtimedwait(&pipe_set, nullptr, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  errno = err;
  return r;
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
  fd_ = ::open(opts.trace.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int err = errno;
    const std::string why = "trainsan: cannot open the trace file '" + opts.trace +
                            "' for writing (" + std::strerror(err) +
                            "); check that its directory exists and is writable, or give another "
                            "path (trace=...)";
    // Note [Bounded trace]: an error at attach under "raise"; otherwise the run goes on without a
    // trace, and is told (a warning now, a line in summary() and coverage()).
    TORCH_CHECK_VALUE(opts.policy != "raise", why);
    error_ = why + "; the run goes on without a trace";
    error_new_ = true;  // told by whoever takes it first (the Python attach, or the next event)
    return;
  }
  struct stat st {};
  pipe_ = ::fstat(fd_, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
  std::ostringstream os;
  os << "{\"type\":\"header\",\"trainsan\":\"" TRAINSAN_VERSION "\",\"cuda_kernels\":"
     << (kernels::cuda_compiled() ? "true" : "false") << ",\"num_params\":" << num_params
     << ",\"options\":" << opts.to_json();
  if (!extra.empty()) os << "," << extra;
  // No "torch" field from the caller (the Python package writes its own): a C++ program.
  if (extra.find("\"torch\":") == std::string::npos) os << "," << cpp_header_fields();
  os << "}";
  header_ = os.str();
  line(header_);
}

TraceWriter::~TraceWriter() { close(); }

void TraceWriter::fail(const std::string& what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!error_.empty()) return;
  error_ = "trainsan: the trace '" + opts_.trace + "' could not be " + what +
           (last_step_ >= 0 ? " after the record of step " + std::to_string(last_step_)
                            : std::string(" at its header")) +
           " (" + std::strerror(err) +
           "): the trace ends there and the run goes on without it; free space on its disk or "
           "give another path (trace=...)";
  error_new_ = true;
}

bool TraceWriter::take_new_error() {
  const bool n = error_new_;
  error_new_ = false;
  return n;
}

void TraceWriter::write_raw(const std::string& text) {
  const char* p = text.data();
  size_t left = text.size();
  while (left > 0 && fd_ >= 0) {
    const ssize_t n = pipe_ ? write_keeping_sigpipe(fd_, p, left) : ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      fail("written", n < 0 ? errno : EIO);
      return;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  bytes_ += static_cast<int64_t>(text.size());
  bytes_total_ += static_cast<int64_t>(text.size());
}

void TraceWriter::rotate() {
  ::close(fd_);
  fd_ = -1;
  const std::string older = opts_.trace + ".1";
  if (std::rename(opts_.trace.c_str(), older.c_str()) != 0) {
    fail("rotated to " + older, errno);
    return;
  }
  fd_ = ::open(opts_.trace.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    fail("reopened after its rotation", errno);
    return;
  }
  bytes_ = 0;
  rotations_ += 1;
  write_raw(header_.substr(0, header_.size() - 1) + ",\"rotated\":" + std::to_string(rotations_) +
            "}\n");
}

void TraceWriter::line(const std::string& json) {
  if (fd_ < 0) return;
  const auto cap = static_cast<int64_t>(opts_.trace_max_mb * 1048576.0);
  if (cap > 0 && bytes_ > 0 && bytes_ + static_cast<int64_t>(json.size()) + 1 > cap &&
      !header_.empty() && bytes_ > static_cast<int64_t>(header_.size()) + 1) {
    rotate();
    if (fd_ < 0) return;
  }
  // One write(2) a line: a killed job keeps every line written before it.
  std::string text;
  text.reserve(json.size() + 1);
  text += json;
  text += '\n';
  write_raw(text);
}

bool TraceWriter::rows_due(int64_t step) const {
  if (!traces(step) || opts_.trace_tensors == "global") return false;
  const int64_t every = opts_.trace_rows_every;
  return every == 1 || step < opts_.trace_first_steps ||
         (every > 0 && step % every == 0 && bulk_ok());
}

void TraceWriter::bulk_line(const std::string& json) {
  line(json);
  add_bulk(static_cast<int64_t>(json.size()) + 1);
}

void TraceWriter::add_bulk(int64_t bytes) {
  if (steps_written_ < opts_.trace_first_steps) return;  // the first steps: outside the budget
  if (burst_at_ != steps_written_) {
    burst_at_ = steps_written_;
    burst_bytes_ = 0;
  }
  burst_bytes_ += bytes;
  next_bulk_at_ = std::max(next_bulk_at_,
                           burst_at_ + (burst_bytes_ + kBulkBytesPerStep - 1) / kBulkBytesPerStep);
}

bool TraceWriter::wants_tensors(int64_t step) const {
  return rows_due(step) || (traces(step) && opts_.trace_tensors != "global" &&
                            (rows_after_ > 0 || opts_.trace_ring > 0));
}

void TraceWriter::finding(const Finding& f) {
  std::ostringstream os;
  os << "{\"type\":\"finding\"";
  // finding.def's rows with a record key, in its order.
#define TRAINSAN_FINDING(type, name, init, record, summary, doc) \
  if constexpr (sizeof(record) > 1) {                            \
    os << ",\"" record "\":";                                    \
    put_json(os, f.name);                                        \
  }
#include "trainsan/finding.def"
#undef TRAINSAN_FINDING
  os << "}";
  line(os.str());
  if (!is_open() || opts_.trace_tensors == "global") return;
  // Note [Bounded trace]: the rows of the steps before it, oldest first, and rows in the next
  // trace_ring step records (and in the finding's own, when its record is still to come).
  const size_t n = ring_.size();
  for (size_t k = 0; k < n; ++k) {
    Held& h = ring_[(ring_next_ + k) % n];
    if (h.tensors.empty()) continue;
    std::ostringstream t;
    t << "{\"type\":\"tensors\",\"step\":" << h.step << ",\"optimizer\":" << h.opt
      << ",\"rows\":\"before_finding\",\"tensors\":" << tensors_json(h.tensors) << "}";
    line(t.str());
    h.tensors.clear();
  }
  rows_after_ = opts_.trace_ring + 1;
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

std::string TraceWriter::tensors_json(const std::vector<TensorRecord>& tensors) const {
  std::vector<const TensorRecord*> order;
  order.reserve(tensors.size());
  for (const TensorRecord& tr : tensors) order.push_back(&tr);
  if (opts_.trace_tensors == "topk") {
    std::stable_sort(order.begin(), order.end(), [](const TensorRecord* a, const TensorRecord* b) {
      return a->sort_key > b->sort_key;
    });
    if (order.size() > static_cast<size_t>(opts_.trace_topk)) order.resize(opts_.trace_topk);
  }
  std::ostringstream os;
  os << "{";
  const char* sep = "";
  for (const TensorRecord* tr : order) {
    os << sep << json_escape(tr->name) << ":{\"param\":" << stats_json(tr->param);
    if (tr->grad) os << ",\"grad\":" << stats_json(*tr->grad);
    if (tr->update) {
      os << ",\"update\":{\"l2\":" << json_number(tr->update->l2)
         << ",\"max\":" << json_number(tr->update->max) << ",\"changed\":" << tr->update->changed;
      if (tr->update->sampled) os << ",\"sampled\":true";
      if (tr->update->unseen) os << ",\"unseen\":true";
      os << "}";
    }
    os << "}";
    sep = ",";
  }
  os << "}";
  return os.str();
}

void TraceWriter::step(StepRecord r) {
  if (!is_open()) return;
  last_step_ = r.step;
  const char* why = nullptr;
  if (rows_due(r.step)) {
    why = opts_.trace_rows_every == 1 ? "all"
                                      : (r.step < opts_.trace_first_steps ? "first" : "sampled");
  } else if (rows_after_ > 0 && opts_.trace_tensors != "global") {
    why = "finding";
  }
  if (rows_after_ > 0) rows_after_ -= 1;
  const StepTotals& t = r.totals;
  std::ostringstream os;
  os << "{\"type\":\"step\",\"step\":" << r.step << ",\"optimizer\":" << r.opt
     << ",\"lr_zero\":" << (r.lr_zero ? "true" : "false")
     << ",\"update_stats\":" << (r.update_stats ? "true" : "false")
     << ",\"overhead_ms\":" << short_number(r.overhead_s * 1e3);
  if (r.backwards >= 0) os << ",\"backwards\":" << r.backwards;
  if (r.inputs) os << ",\"inputs\":\"" << std::hex << *r.inputs << std::dec << "\"";
  if (r.targets) os << ",\"targets\":\"" << std::hex << *r.targets << std::dec << "\"";
  if (r.loss) os << ",\"loss\":" << json_number(*r.loss);
  os << ",\"global\":{\"grad_norm\":" << json_number(t.grad_norm)
     << ",\"param_norm\":" << (r.params_read ? json_number(t.param_norm) : "null")
     << ",\"update_norm\":" << (r.update_stats ? json_number(t.update_norm) : "null")
     << ",\"update_ratio\":" << (r.update_stats ? json_number(t.update_ratio) : "null")
     << ",\"changed\":" << (r.update_stats ? std::to_string(t.changed) : "null")
     << ",\"nonfinite_grad\":" << (t.any_nonfinite_grad ? "true" : "false") << ",\"digest\":\""
     << std::hex << std::setw(16) << std::setfill('0') << r.digest << std::dec << "\"}";
  if (why != nullptr && !r.tensors.empty()) {
    const std::string rows = tensors_json(r.tensors);
    os << ",\"rows\":\"" << why << "\",\"tensors\":" << rows;
    rows_records_ += 1;
    if (std::string(why) == "sampled") add_bulk(static_cast<int64_t>(rows.size()));
  }
  steps_written_ += 1;
  os << "}";
  line(os.str());
  if (why == nullptr && opts_.trace_ring > 0 && !r.tensors.empty()) {
    if (ring_.size() < static_cast<size_t>(opts_.trace_ring)) {
      ring_.push_back({r.step, r.opt, std::move(r.tensors)});
    } else {
      ring_[ring_next_] = {r.step, r.opt, std::move(r.tensors)};
      ring_next_ = (ring_next_ + 1) % ring_.size();
    }
  }
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
    os << sep << "{";
    // finding.def's rows with a summary key, in its order; an absent optional is left out.
    const char* comma = "";
#define TRAINSAN_FINDING(type, name, init, record, summary, doc) \
  if constexpr (sizeof(summary) > 1) {                           \
    if (!absent(f.name)) {                                       \
      os << comma << "\"" summary "\":";                         \
      put_json(os, f.name);                                      \
      comma = ",";                                               \
    }                                                            \
  }
#include "trainsan/finding.def"
#undef TRAINSAN_FINDING
    os << "}";
    sep = ",";
  }
  os << "],\"coverage\":{\"overhead_budget\":" << json_number(opts_.overhead_budget);
#define TRAINSAN_COVERAGE_COUNT(name, init, doc) os << ",\"" #name "\":" << c.name;
#include "trainsan/coverage.def"
#undef TRAINSAN_COVERAGE_COUNT
  os << ",\"trace_error\":" << (error_.empty() ? "null" : json_escape(error_))
     << ",\"fault\":" << (c.fault.empty() ? "null" : json_escape(c.fault)) << ",\"unread\":[";
  sep = "";
  for (const std::string& u : c.unread) {
    os << sep << json_escape(u);
    sep = ",";
  }
  os << "],\"unchecked\":{";
  sep = "";
  for (const auto& [kind, why] : c.unchecked) {
    os << sep << json_escape(kind) << ":" << json_escape(why);
    sep = ",";
  }
  os << "}}}";
  line(os.str());
}

void TraceWriter::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace trainsan::host
