// Coverage: what a sanitizer saw and checked. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainsan {

/// What a sanitizer saw and checked, so that a clean run means "checked and clean", never "saw
/// nothing" (Sanitizer::coverage, the trace's summary record, Python's summary()).
struct Coverage {
  int64_t steps_checked = 0;         ///< step passes whose checks ran
  int64_t update_steps = 0;          ///< of those, with update statistics (Note [Overhead budget])
  int64_t update_period = 1;         ///< current sampling period of the update statistics
  int64_t training_forwards = 0;     ///< forwards with grad mode on in train mode
  int64_t other_forwards = 0;        ///< forwards under no_grad or in eval mode
  int64_t losses_checked = 0;        ///< watched losses read back and checked
  int64_t inputs_fingerprinted = 0;  ///< steps whose training inputs were fingerprinted
  int64_t audited_forwards = 0;      ///< training forwards the op audit observed
  int64_t ops_audited = 0;           ///< ops the audit rules looked at
  int64_t discards_checked = 0;      ///< unused gradients read before a clear (nonfinite_grad)
  /// Gradient accumulation (Note [Accumulation windows]): optimizer steps that followed at least
  /// one training backward, the most frequent number of backwards per step, how many steps
  /// followed exactly that many, and the effective batch (samples) of the latest (-1: unknown);
  /// the declared window (Options::accumulation_steps, 0: undeclared).
  int64_t window_declared = 0;
  int64_t windows = 0;
  int64_t window_backwards = 0;
  int64_t window_steps = 0;
  int64_t window_samples = -1;
  /// The trace (Note [Bounded trace] in host/trace.h): step records with per-tensor rows, bytes
  /// written, and the error that stopped it ("" while it is written, or without a trace).
  int64_t trace_rows_steps = 0;
  int64_t trace_bytes = 0;
  std::string trace_error;
  /// Parameters whose dtype the statistics pass does not read (float8, uint16, ...), as
  /// "name (dtype)": left out of every check that reads values (Note [Dtypes the pass reads]).
  std::vector<std::string> unread;
  /// Note [Faults]: under "warn" and "record", the internal error after which the sanitizer
  /// stopped checking (told once as a warning); "" while it checks.
  std::string fault;
  /// Enabled kinds that never had what they need, with the reason.
  std::vector<std::pair<std::string, std::string>> unchecked;
};

}  // namespace trainsan
