// The JSON Lines trace (docs/trace.md): a writer of plain records. It knows no
// sanitizer state: the sanitizer hands it a StepRecord and findings.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checks/check.h"
#include "json.h"
#include "trainsan/coverage.h"
#include "trainsan/finding.h"
#include "trainsan/options.h"
#include "trainsan/tensor_stats.h"

namespace trainsan::host {

std::string stats_json(const TensorStats& st);

struct TensorRecord {
  std::string name;
  TensorStats param;
  std::optional<TensorStats> grad;
  std::optional<UpdateStats> update;
  double sort_key = 0.0;  // trace_tensors="topk": the largest first (grad norm, Inf if non-finite)
};

/// One step record: the step's global figures and its tensors (all; the writer applies
/// trace_tensors / trace_topk and Note [Bounded trace]).
struct StepRecord {
  int64_t step = 0;
  int64_t opt = -1;
  bool lr_zero = false;
  bool update_stats = false;  // the step had update statistics (Note [Overhead budget])
  bool params_read = true;    // its pass read the parameters (Note [Every-step tier])
  double overhead_s = 0.0;
  int64_t backwards = -1;           // Note [Accumulation windows]; -1: not counted (manual mode)
  std::optional<uint64_t> inputs;   // fingerprint of the step's first training inputs
  std::optional<uint64_t> targets;  // ...and of the targets its loss compared them with
  std::optional<double> loss;       // the step's last training loss (NaN: not finite)
  uint64_t digest = 0;              // of the gradients' statistics (Note [Bounded trace])
  StepTotals totals;
  std::vector<TensorRecord> tensors;
};

// Note [Bounded trace]
// ~~~~~~~~~~~~~~~~~~~~
// A step record with a row per tensor costs ~0.5 KiB a tensor: 80 KiB a step on a 146-tensor
// model, gigabytes over a long run. So every step record holds what every reader needs — the
// global figures, the loss, the input and target fingerprints, and `digest`, a fingerprint of
// every gradient's statistics (FNV-1a over the bits of each gradient's norm, sum and non-finite
// counts, in parameter order: two runs whose digests agree at a step had bit-identical gradient
// statistics there; `diff` finds the first differing step with it) — and per-tensor rows only
// where they matter:
//   - the first trace_first_steps steps, and every trace_rows_every-th step ("rows":"first",
//     "sampled"; trace_rows_every = 1 writes them in every record: "all"). These steps are known
//     in advance (rows_due), so their passes compute the tensors' fingerprints;
//   - around a finding: the rows of the trace_ring steps before it are kept in memory (a ring
//     of step records' rows, no I/O) and written when it is found, as {"type":"tensors"}
//     records naming their step (a reader merges them into that step's record), and the next
//     trace_ring step records hold rows ("rows":"finding").
// The periodic per-tensor records — the sampled rows and the precision headroom's range records
// (headroom_every) — come in bursts (all tensors at one step) and share one budget of
// kBulkBytesPerStep a step: after a burst of B bytes the next one (of either kind) waits until
// B / kBulkBytesPerStep more step records have been written (bulk_ok; a kind due at its period
// before then skips that period). So any W consecutive steps hold at most 192 W bytes of them
// plus one burst: with a 146-tensor model's rows (~120 KiB) and ranges (~90 KiB) a burst comes
// every ~500-600 steps, and 300 steps cost at most 300 records (~400 bytes each: global figures,
// loss, fingerprints) + 56 KiB + 120 KiB < 1 KiB a step. The first trace_first_steps steps (rows
// and ranges alike) and the rows around findings are outside the budget, being bounded by count.
// Every line is written with one write(2) as it is made (a killed job loses at most the step in
// flight). A failure to write (disk full, the path gone) never reaches the training loop: the
// writer stops, keeps the error (errno's text, the step), and the sanitizer warns once and says
// so in summary() and coverage(). With trace_max_mb the file is renamed <trace>.1 when it
// exceeds the cap and a new one begins, with a header marked "rotated".
class TraceWriter {
 public:
  static constexpr int64_t kBulkBytesPerStep = 192;
  /// Opens (truncates) `path` and writes the header; an empty path writes nothing. A file that
  /// cannot be opened raises under policy "raise" and is warned about (no trace) otherwise.
  /// `extra` is a JSON object body (without braces) from the caller, e.g. the Python layer's
  /// provenance fields; it may be empty.
  TraceWriter(const Options& opts, const std::string& extra, size_t num_params);
  ~TraceWriter();
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;
  bool is_open() const { return fd_ >= 0; }
  /// Whether step `step` gets a step record (trace_every).
  bool traces(int64_t step) const { return is_open() && step % opts_.trace_every == 0; }
  /// Whether step `step` gets a record holding per-tensor rows for a reason known in advance
  /// (first steps, every trace_rows_every-th): its pass computes the fingerprints.
  bool rows_due(int64_t step) const;
  /// Whether the step pass should hand over the step's tensors (for its rows or the ring).
  bool wants_tensors(int64_t step) const;
  /// Whether the periodic per-tensor records are within their byte budget now.
  bool bulk_ok() const { return steps_written_ >= next_bulk_at_; }
  /// One periodic per-tensor record (a range record): line(), counted in the budget.
  void bulk_line(const std::string& json);
  void finding(const Finding& f);
  void step(StepRecord r);
  void amp_skip(int64_t step, int64_t opt);
  /// One gradient-scaler step: its scale (null where unknown) and whether it skipped.
  void scaler(int64_t step, int64_t opt, double scale, bool skipped);
  void summary(int64_t steps, int64_t amp_skips, double overhead_s,
               const std::vector<Finding>& findings, const Coverage& coverage);
  void close();
  /// One record, a JSON object on one line, written as it is (flushed like the others).
  void line(const std::string& json);
  /// The first write error ("" if none), and whether it is new since the last call (to be
  /// warned about once, on the calling thread of a sanitizer event).
  const std::string& error() const { return error_; }
  bool take_new_error();
  int64_t rows_records() const { return rows_records_; }
  int64_t bytes() const { return bytes_total_; }

 private:
  void fail(const std::string& what, int err);
  void write_raw(const std::string& text);
  void rotate();
  std::string tensors_json(const std::vector<TensorRecord>& tensors) const;

  const Options& opts_;
  int fd_ = -1;
  bool pipe_ = false;   // a pipe or socket: writes keep SIGPIPE from ending the process
  std::string header_;  // for a rotated file's first line
  std::string error_;   // the first write error
  bool error_new_ = false;
  int64_t last_step_ = -1;  // of the latest step record (for the error's message)
  int64_t bytes_ = 0;       // in the current file
  int64_t bytes_total_ = 0;
  int64_t rotations_ = 0;
  int64_t rows_records_ = 0;   // step records with per-tensor rows
  int64_t rows_after_ = 0;     // step records still to hold rows after a finding
  int64_t steps_written_ = 0;  // step records so far: the clock of the bulk budget
  int64_t next_bulk_at_ = 0;   // the clock from which a periodic burst may come again
  int64_t burst_at_ = -1;      // the clock of the latest burst, and its bytes so far
  int64_t burst_bytes_ = 0;
  void add_bulk(int64_t bytes);
  struct Held {  // the ring: rows of recent steps written without them
    int64_t step;
    int64_t opt;
    std::vector<TensorRecord> tensors;
  };
  std::vector<Held> ring_;
  size_t ring_next_ = 0;
};

}  // namespace trainsan::host
