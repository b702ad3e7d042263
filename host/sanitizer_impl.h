// Internal state of the sanitizer, shared by the C++ API (sanitizer.cpp) and the Python binding
// (bindings/csrc/ops.cpp). Every entry point is called once per training-loop event; the gradient
// hooks (engine threads) only do bookkeeping under `mu`.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "stats_internal.h"
#include "trainsan/sanitizer.h"
#include "trainsan/stats.h"

namespace torch::autograd {
struct Node;
}

namespace trainsan {

class OpAudit;

struct ParamInfo {
  std::string name;
  at::Tensor param;
  int64_t opt = -1;  // index of the optimizer holding it, -1 when in none
};

// Identity of a .grad tensor without keeping it alive: null once the tensor is freed, so a new
// gradient at a reused address is never mistaken for the old one.
class WeakImpl {
 public:
  WeakImpl() = default;
  explicit WeakImpl(const at::Tensor& t)
      : p_(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr())) {}
  const c10::TensorImpl* get() const { return p_ ? p_->lock().get() : nullptr; }

 private:
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> p_;
};

// Per-parameter bookkeeping written by the gradient hook (under SanitizerImpl::mu).
struct GradState {
  bool got_grad = false;  // a gradient arrived since the last step of its optimizer
  bool produced_since_clear = false;
  bool step_since_clear = false;  // its optimizer stepped since the gradient was last cleared
  bool stale = false;             // accumulated onto a gradient a step had already consumed
  bool accumulated = false;       // (manual mode) accumulated onto an uncleared gradient
  bool skipped = false;           // cleared without any step of its optimizer since
  // The .grad as left by the last accumulation / as consumed by the last step.
  WeakImpl last;
  uint32_t last_version = 0;
  WeakImpl consumed;
  uint32_t consumed_version = 0;
  int64_t steps_without_grad = 0;
  int64_t unused_clears = 0;  // clears without a step of its optimizer since the last step
  int64_t vanishing_steps = 0;
};

// A launched step pass: which rows hold what, the results on their way to the host, and the
// hook observations of that step (captured at launch so that a lagged check sees its own step).
struct PendingPass {
  int64_t step = 0;
  int64_t opt = -1;
  bool lr_zero = false;
  bool manual = false;
  std::vector<size_t> indices;    // parameters in the pass
  std::vector<int64_t> grad_row;  // per entry of indices: row of its gradient, -1 when none
  std::vector<int64_t> param_row;
  bool with_update = false;
  bool hashed = true;  // fingerprints computed (else their column is 0 in last_stats/trace)
  std::vector<host::HostCopy> copies;               // one per device group
  std::vector<std::pair<size_t, int64_t>> row_map;  // global row -> (copy, row in copy)
  std::vector<GradState> observed;                  // GradState of each entry at launch
  std::vector<bool> got_grad_any;                   // per entry
  // Per entry, at the step: 0 = .grad is what the last backward left, 1 = .grad is None,
  // 2 = .grad was modified (or replaced) after the last backward (clipping, unscaling, zeroing).
  std::vector<uint8_t> grad_at_step;
  std::vector<std::string> eval_modules;
  std::optional<host::HostCopy> inputs;  // hash of the step's first training inputs
  std::vector<host::HostCopy> losses;
  double launch_overhead_s = 0.0;
};

struct SanitizerImpl {
  SanitizerImpl(std::vector<ParamInfo> params, Options options, std::string header_json);
  ~SanitizerImpl();

  void install_hooks();
  void remove_hooks();
  bool hooks_installed() const { return !hook_keys.empty(); }

  // Events. Each returns the findings that are new at this event (policy not applied: the
  // caller, C++ Sanitizer or Python, applies it).
  std::vector<Finding> on_forward(bool grad_enabled, bool training,
                                  const std::vector<std::string>& eval_modules,
                                  const std::vector<at::Tensor>& inputs, bool fp16_autocast);
  std::vector<Finding> on_loss(const at::Tensor& loss);
  std::vector<Finding> on_step_begin(int64_t opt);
  std::vector<Finding> on_step_end(int64_t opt, bool lr_zero, double extra_overhead_s);
  std::vector<Finding> on_manual_boundary(double extra_overhead_s);
  void on_amp_skip(int64_t opt);
  std::vector<Finding> close();

  // Hook body (engine threads).
  void on_grad_accumulated(size_t index);

  std::map<std::string, TensorStats> last_stats() const;

  // --- state ---
  std::vector<ParamInfo> params;
  Options opts;
  std::vector<Finding> findings;                // unique findings, with counts
  std::map<std::string, size_t> finding_index;  // kind + "\x1f" + tensor -> index
  int64_t step = 0;                             // completed optimizer steps
  int64_t backwards_since_step = 0;
  bool grad_since_forward = false;  // a gradient arrived since the last training forward
  bool in_step = false;
  bool closed = false;
  bool have_optimizer = false;

  mutable std::mutex mu;
  std::vector<GradState> grad;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;
  std::shared_ptr<SanitizerImpl*> self_token;  // hooks hold it weakly

  std::vector<at::Tensor> snapshots;  // previous parameter values (track_updates)
  // ‖θ‖ of each parameter as of its previous pass (at attach before the first): the denominator
  // of the update ratio, which must be the norm *before* the step (NaN where unknown).
  std::vector<double> prev_param_l2;
  std::unique_ptr<PendingPass> pending;  // GPU: checked one step later unless sync
  std::map<std::string, TensorStats> last;

  // grad explosion baseline (EMA of the global gradient norm)
  std::map<int64_t, double> grad_norm_ema_of;  // per optimizer
  std::map<int64_t, int64_t> grad_norm_steps_of;
  std::map<int64_t, int64_t> update_ratio_out;  // per optimizer: consecutive steps outside
  std::map<int64_t, int64_t> opt_steps;         // steps per optimizer (-1: C++ API / manual)
  bool manual_prev_changed = false;  // manual mode: the previous pass saw a parameter change
  std::optional<uint64_t> last_input_hash;
  int64_t input_hash_step = -1;
  int64_t amp_skips = 0;
  bool fp16_in_use = false;                       // a forward ran under fp16 autocast
  std::vector<std::string> current_eval_modules;  // of the last grad-enabled forward
  std::optional<host::HostCopy> pending_inputs;
  std::vector<host::HostCopy> pending_losses;

  // trace
  std::ofstream trace;
  double overhead_s = 0.0;       // total measured
  double step_overhead_s = 0.0;  // since the last step record

  // Op audits (audit.h). Last member: destroyed first, so the observer never sees a half-gone
  // sanitizer.
  std::unique_ptr<OpAudit> audit;

  // --- helpers ---
  std::vector<Finding> add(const std::string& kind, const std::string& tensor,
                           const std::string& message, std::optional<double> value,
                           int64_t at_step = -1);
  std::vector<Finding> run_pass(int64_t opt, bool lr_zero, bool manual);
  std::vector<Finding> check_between_steps();
  std::vector<Finding> check_pass(PendingPass& p);                         // checks.cpp
  std::vector<Finding> check_loss(const TensorStats& s, int64_t at_step);  // checks.cpp
  // TrainSan's own time: the run total and the part since the last step record.
  void add_overhead(double s) {
    overhead_s += s;
    step_overhead_s += s;
  }
  void write_trace_line(const std::string& json);
};

std::string severity_of(const std::string& kind);

}  // namespace trainsan
