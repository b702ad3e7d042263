// Public C++ API of the training-loop sanitizer.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/stats.h"

namespace trainsan {

/// One thing TrainSan found wrong (../shared/DESIGN.md, "Finding kinds").
struct Finding {
  std::string kind;             ///< e.g. "stale_grad"
  int64_t step = 0;             ///< 0-based optimizer step where it was first seen
  std::string severity;         ///< "error" or "warning"
  std::string tensor;           ///< parameter or module name; empty when none
  std::string message;          ///< what is wrong and what to look at
  std::optional<double> value;  ///< the figure that triggered it
  int64_t count = 1;            ///< how often it occurred (a repeat is reported once, then counted)
  int64_t last_step = 0;        ///< the step of the latest occurrence
};

/// Raised by the "raise" policy on the first error-severity finding.
class TrainingBugError : public std::runtime_error {
 public:
  explicit TrainingBugError(Finding f) : std::runtime_error(f.message), finding(std::move(f)) {}
  Finding finding;
};

/// Options of a Sanitizer. Every check is on by default except nonfinite_activation (Python only)
/// and update_outside_step (costs one extra pass per step). Thresholds are documented in the
/// README ("Checks and their options").
struct Options {
  std::string policy = "raise";       ///< "raise", "warn" or "record"
  std::string trace;                  ///< JSON Lines trace path; empty for none
  int64_t trace_every = 1;            ///< write a step record every N steps
  std::string trace_tensors = "all";  ///< "all", "topk" or "global"
  int64_t trace_topk = 8;             ///< tensors per step record with trace_tensors="topk"
  bool sync = false;                  ///< GPU: check at the same step (waits for the pass)
  bool track_updates = true;          ///< keep a snapshot of the parameters for the update checks
  /// Fingerprint (hash) every gradient and parameter at every step; by default only on steps
  /// written to the trace (no check needs them, and they are most of the CPU pass's arithmetic).
  bool fingerprints = false;

  double grad_explosion_factor = 50.0;  ///< global grad norm > factor x running baseline
  int64_t grad_explosion_warmup = 5;    ///< steps before the baseline is trusted
  double grad_explosion_limit = 0.0;    ///< absolute global grad norm limit (0: none)
  double grad_vanishing_ratio = 1e-12;  ///< ||g|| <= ratio x ||theta|| counts as vanished
  int64_t grad_vanishing_steps = 3;     ///< consecutive steps before the warning
  int64_t missing_grad_patience = 3;    ///< consecutive steps without a gradient
  double update_ratio_low = 1e-8;       ///< global ||dtheta||/||theta|| band, low end
  double update_ratio_high = 1.0;       ///< high end
  int64_t update_ratio_steps = 3;       ///< consecutive steps outside the band
  int64_t max_accumulation = 64;        ///< backward passes without any optimizer step
  double fp16_overflow_fraction = 0.0;  ///< warn when more than this fraction overflows fp16
  /// Op audits (broadcast, label_range, batch_mismatch) observe every op of the first N steps...
  int64_t audit_first_steps = 10;
  /// ...and then of every N-th step (0: none after the first ones).
  int64_t audit_every = 100;

  /// Checks switched off (or, for the opt-in ones, on) by kind name.
  std::map<std::string, bool> checks;

  bool enabled(const std::string& kind) const;
  /// Set a field by name (used by the Python binding); throws c10::ValueError for an unknown
  /// name or a bad value.
  void set(const std::string& name, const std::string& value);
};

struct SanitizerImpl;

/// Sanitizer for a LibTorch training loop:
///
///   trainsan::Sanitizer san(model->named_parameters(), opts);
///   for (...) {
///     san.begin_step();
///     auto loss = ...; san.watch_loss(loss);
///     loss.backward(); optimizer.step();
///     san.end_step();   // checks (and, with policy "raise", throws TrainingBugError)
///     optimizer.zero_grad();
///   }
///   san.close();
class Sanitizer {
 public:
  using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

  explicit Sanitizer(const NamedTensors& named_parameters, Options options = {});
  template <typename OrderedDict>
  explicit Sanitizer(const OrderedDict& named_parameters, Options options = {})
      : Sanitizer(to_named(named_parameters), std::move(options)) {}
  ~Sanitizer();
  Sanitizer(const Sanitizer&) = delete;
  Sanitizer& operator=(const Sanitizer&) = delete;

  /// Start of a training step (before forward): grad mode and input checks.
  void begin_step(const std::vector<at::Tensor>& inputs = {});
  /// Check a loss for NaN/Inf (nonfinite_loss).
  void watch_loss(const at::Tensor& loss);
  /// After optimizer.step(): the fused pass over gradients, parameters and the snapshot, then the
  /// checks. `lr_zero` says the step ran with learning rate 0 (warm-up), so "no change" is fine.
  void end_step(bool lr_zero = false);
  /// Flush pending checks, write the trace summary, remove every hook. Idempotent.
  void close();

  const std::vector<Finding>& findings() const;
  /// Statistics of the last checked step, by name: "<param>.grad", "<param>", "<param>.update".
  std::map<std::string, TensorStats> last_stats() const;
  int64_t step() const;
  /// True while the gradient hooks are installed (until close()).
  bool hooks_installed() const;

  SanitizerImpl& impl() { return *impl_; }

 private:
  template <typename OrderedDict>
  static NamedTensors to_named(const OrderedDict& d) {
    NamedTensors out;
    for (const auto& item : d) out.emplace_back(item.key(), item.value());
    return out;
  }
  std::unique_ptr<SanitizerImpl> impl_;
};

}  // namespace trainsan
