// Gradient bookkeeping: post-hooks on the parameters' AccumulateGrad nodes record, on the
// autograd engine's threads, which parameters got a gradient and whether it landed on a gradient
// that a step had already consumed (Note [Grad identity]). No kernel launches, no device syncs.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "checks/check.h"

namespace torch::autograd {
struct Node;
struct FunctionPreHook;
}  // namespace torch::autograd

namespace trainsan::host {

// Note [Grad identity]
// ~~~~~~~~~~~~~~~~~~~~
// Whether a backward accumulated onto an old gradient is told by the identity of the .grad
// tensor and its version counter, looked at right before the accumulation (a pre-hook on the
// parameter's AccumulateGrad node), not by its values. What .grad is then:
//   - undefined: cleared (zero_grad(set_to_none=True)), a fresh gradient;
//   - the tensor a step consumed, at the version it had then: the backward adds onto a gradient
//     that was never cleared (stale_grad, outside declared accumulation);
//   - the tensor the last backward left, at the version it had then: accumulation across
//     backwards before one step (legitimate);
//   - anything else (zeroed in place, so a newer version; replaced by another tensor): cleared.
// Looking before the accumulation, rather than inferring from the version after it, keeps this
// exact when something else owns the gradient's storage: DDP with gradient_as_bucket_view=True
// turns .grad into a view of its bucket in its own post-hook (copying into it, which bumps the
// version) and writes the all-reduced values there after backward; a .grad set to None by
// zero_grad is still seen as None here. The versions compared are those of the storage (the
// version counter views share): per storage, the version our hooks or the last step saw and a
// count of the moves found that neither made; per gradient, that count when it was last recorded.
// So an accumulation into one view of a DDP bucket does not make its siblings look zeroed, while
// a zero_grad(set_to_none=False) (moves nobody of ours made) clears each view in the bucket. The
// post-hook then records what .grad is after the accumulation (and after the post-hooks registered
// before ours, such as DDP's). Identities are held weakly (WeakImpl): a freed gradient whose
// address is reused is never mistaken for the old one.

// Identity of a .grad tensor without keeping it alive.
class WeakImpl {
 public:
  WeakImpl() = default;
  explicit WeakImpl(const at::Tensor& t)
      : p_(c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr())) {}
  const c10::TensorImpl* get() const { return p_ ? p_->lock().get() : nullptr; }

 private:
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> p_;
};

// Per-parameter bookkeeping written by the gradient hook.
struct GradState {
  bool got_grad = false;  // a gradient arrived since the last step of its optimizer
  bool produced_since_clear = false;
  bool step_since_clear = false;  // its optimizer stepped since the gradient was last cleared
  bool stale = false;             // accumulated onto a gradient a step had already consumed
  bool accumulated = false;       // (manual mode) accumulated onto an uncleared gradient
  bool skipped = false;           // cleared twice without any step of its optimizer since
  uint64_t produced_gen = 0;      // GradTracker::steps_ at its last accumulation
  bool discard_read = false;      // its unused gradient was read before a clear (discarded())
  WeakImpl last;                  // the .grad as left by the last accumulation
  WeakImpl consumed;              // the .grad as consumed by the last step
  bool consumed_latest = false;   // no accumulation since that step
  uint64_t clears_seen = 0;       // its storage's clear count when last recorded
  int64_t unused_clears = 0;      // clears without a step of its optimizer since the last step
  // Note [Micro-batches cleared]: the parameter's version when its gradient was last produced;
  // whether this step's gradient followed a micro-batch's gradient cleared unused (no optimizer
  // step, no change of the parameter since it was produced); consecutive steps of its optimizer
  // that did.
  int64_t param_version = 0;
  uint64_t produced_any = 0;  // optimizer steps of every sanitizer in the process at production
  bool micro_discard = false;
  int64_t micro_steps = 0;
  at::Tensor probe;  // while probing: .grad as the last backward left it had a nonzero
  // What .grad was right before the current accumulation (set by the pre-hook).
  enum class Before : uint8_t { kFresh, kConsumed, kLast } before = Before::kFresh;
};

struct TrackedParam {
  std::string name;
  at::Tensor param;
  int64_t opt = -1;       // index of the optimizer holding it, -1 when in none
  int64_t group = 0;      // its param group in that optimizer
  at::Tensor local;       // distributed: this process's shard of the parameter (else undefined)
  at::Tensor local_grad;  // distributed: the shard of its gradient at the last local_shards()
  bool external = false;  // accumulations reported by the caller (FSDP2), no AccumulateGrad hook
  /// What the statistics passes read of it: its shard or itself, a complex one as its real and
  /// imaginary parts (Note [Dtypes the pass reads] in host/stats.cpp).
  at::Tensor data() const;
};

/// What a step consumes of one parameter's gradient (GradTracker::consume).
struct Consumed {
  GradObservation observed;
  GradAtStep at_step = GradAtStep::kAsBackwardLeft;
  std::optional<bool> left_nonzero;  // probed (Note [Zero gradients]): nonzero as backward left it
};

class GradTracker {
 public:
  /// `on_backward` runs on the engine thread at every accumulation (the op audit stops there).
  GradTracker(const std::vector<TrackedParam>& params, bool have_optimizer,
              std::function<void()> on_backward);
  ~GradTracker();
  GradTracker(const GradTracker&) = delete;
  GradTracker& operator=(const GradTracker&) = delete;

  void install();
  void remove();
  bool installed() const { return !hook_keys_.empty(); }

  /// Between an optimizer's step pre- and post-hook, accumulations are the optimizer's business.
  void set_in_step(bool in_step);
  bool in_step() const;
  /// A training forward: counts the backward that ran since the previous one; returns the count
  /// of backward passes since the last step, and takes the parameters whose gradients were
  /// cleared unused twice (GradState::skipped).
  int64_t training_forward(std::vector<std::string>* skipped);
  /// A step consumes the gradients of `indices` as they are now: fills `out` with what the hooks
  /// saw for each; `manual` (no optimizer) only resets the flags.
  void consume(const std::vector<size_t>& indices, bool manual, std::vector<Consumed>* out);
  /// Whether .grad of parameter i is still exactly what the last backward left.
  bool as_backward_left(size_t i) const;
  /// Any gradient produced since the last manual boundary.
  bool any_produced() const;
  /// Whether a parameter of optimizer `opt` got a gradient since that optimizer's last step (or
  /// the scaler's skip of it).
  bool got_grad(int64_t opt) const;
  /// The GradScaler skipped the step of optimizer `opt` on purpose (Inf/NaN found).
  void amp_skip(int64_t opt);
  /// Note [Discarded gradients]: the parameters of optimizer `opt` (-1: all) whose gradient a
  /// backward produced since their optimizer's last step, with no optimizer step (or scaler skip)
  /// since that backward, not yet returned by a previous call.
  std::vector<size_t> discarded(int64_t opt);
  /// Note [Zero gradients]: for the next `steps` steps, record at each accumulation whether the
  /// gradient holds a nonzero element (one reduction per parameter per backward; read at the step).
  void arm_probe(int64_t steps);

  /// While paused (the re-runs of Sanitizer::rerun), accumulations are not recorded: they belong
  /// to a backward that no step consumes, onto gradients that are put back afterwards.
  void set_paused(bool paused) { paused_.store(paused); }

  void before_accumulation(size_t index);  // the pre-hook body (engine threads)
  void on_grad_accumulated(size_t index);  // the post-hook body (engine threads)
  /// TrackedParam::external: FSDP2 has assigned or accumulated the gradient (its accumulation,
  /// grad._local_tensor += ..., leaves the DTensor's identity and version as they were before, so
  /// what it was accumulated onto can still be told now).
  void external_accumulation(size_t index) {
    before_accumulation(index);
    on_grad_accumulated(index);
  }

  /// Runs after the rest of the backward's final callbacks (DDP's finalize): the versions the
  /// gradients have then are the backward's (Note [Grad identity]).
  void end_of_backward();

  /// The key of a gradient's version counter: its storage (views of one DDP bucket share it).
  static const void* storage_key(const at::Tensor& g);

 private:
  const std::vector<TrackedParam>& params_;
  const bool have_optimizer_;
  std::function<void()> on_backward_;
  mutable std::mutex mu_;
  std::vector<GradState> grad_;
  // Note [Grad identity]: per gradient storage, the version our hooks or a step last saw, and how
  // many times it was found moved by something else since (each such move clears every gradient
  // living there); a gradient is untouched while both match its own record.
  struct StorageSeen {
    uint32_t version = 0;
    uint64_t clears = 0;
  };
  std::unordered_map<const void*, StorageSeen> seen_version_;
  bool untouched(const at::Tensor& g, const GradState& s) const;  // under mu_
  void queue_end_of_backward();                                   // engine thread, under mu_
  std::vector<size_t> this_backward_;  // parameters accumulated since the last end_of_backward
  bool end_queued_ = false;
  void record(const at::Tensor& g, GradState* s);  // under mu_
  bool in_step_ = false;
  std::atomic<bool> paused_{false};
  bool grad_since_forward_ = false;  // a gradient arrived since the last training forward
  int64_t backwards_since_step_ = 0;
  uint64_t steps_ = 0;       // optimizer steps and scaler skips of any optimizer so far
  int64_t probe_steps_ = 0;  // Note [Zero gradients]: steps left to probe
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  std::vector<torch::autograd::FunctionPreHook*> pre_hooks_;  // owned by the accumulators
  std::shared_ptr<GradTracker*> self_token_;                  // hooks hold it weakly
};

}  // namespace trainsan::host
