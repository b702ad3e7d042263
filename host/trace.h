// The JSON Lines trace (docs/trace.md): a writer of plain records. It knows no
// sanitizer state: the sanitizer hands it a StepRecord and findings.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "checks/check.h"
#include "trainsan/coverage.h"
#include "trainsan/finding.h"
#include "trainsan/options.h"
#include "trainsan/tensor_stats.h"

namespace trainsan::host {

std::string json_escape(const std::string& s);
std::string json_number(double v);  // null for NaN/Inf, which JSON cannot hold
std::string stats_json(const TensorStats& st);

struct TensorRecord {
  std::string name;
  TensorStats param;
  std::optional<TensorStats> grad;
  std::optional<UpdateStats> update;
  double sort_key = 0.0;  // trace_tensors="topk": the largest first (grad norm, Inf if non-finite)
};

/// One step record: the step's global figures and its tensors (all; the writer applies
/// trace_tensors / trace_topk).
struct StepRecord {
  int64_t step = 0;
  int64_t opt = -1;
  bool lr_zero = false;
  bool update_stats = false;  // the step had update statistics (Note [Overhead budget])
  double overhead_s = 0.0;
  int64_t backwards = -1;           // Note [Accumulation windows]; -1: not counted (manual mode)
  std::optional<uint64_t> inputs;   // fingerprint of the step's first training inputs
  std::optional<uint64_t> targets;  // ...and of the targets its loss compared them with
  StepTotals totals;
  std::vector<TensorRecord> tensors;
};

class TraceWriter {
 public:
  /// Opens (truncates) `path` and writes the header; an empty path writes nothing.
  /// `extra` is a JSON object body (without braces) from the caller, e.g. the Python layer's
  /// provenance fields; it may be empty.
  TraceWriter(const Options& opts, const std::string& extra, size_t num_params);
  bool is_open() const { return out_.is_open(); }
  /// Whether step `step` gets a step record (trace_every).
  bool traces(int64_t step) const { return is_open() && step % opts_.trace_every == 0; }
  void finding(const Finding& f);
  void step(const StepRecord& r);
  void amp_skip(int64_t step, int64_t opt);
  /// One gradient-scaler step: its scale (null where unknown) and whether it skipped.
  void scaler(int64_t step, int64_t opt, double scale, bool skipped);
  void summary(int64_t steps, int64_t amp_skips, double overhead_s,
               const std::vector<Finding>& findings, const Coverage& coverage);
  void close();
  /// One record, a JSON object on one line, written as it is (flushed like the others).
  void line(const std::string& json);

 private:
  const Options& opts_;
  std::ofstream out_;
};

}  // namespace trainsan::host

namespace trainsan {
using host::json_escape;
using host::json_number;
}  // namespace trainsan
