// Gradient bookkeeping (Note [Grad identity] in grad_tracker.h).
#include "grad_tracker.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "stats_internal.h"

namespace trainsan::host {

at::Tensor TrackedParam::data() const { return readable(local.defined() ? local : param); }

namespace {

// Consecutive steps after a cleared micro-batch that are skipped_step (Note [Micro-batches
// cleared]).
constexpr int64_t kMicroSteps = 2;
// Optimizer steps (and scaler skips) seen by every GradTracker of the process: a step of another
// sanitizer's optimizer (a GAN's other model) between a gradient and its clear.
std::atomic<uint64_t> any_steps{0};

// Post-hook on a parameter's AccumulateGrad node (the pattern of DDP's reducer): runs after the
// gradient has been accumulated into .grad, on the autograd engine's thread. Bookkeeping only.
struct AccumulatePostHook : torch::autograd::FunctionPostHook {
  AccumulatePostHook(std::weak_ptr<GradTracker*> owner, size_t index)
      : owner_(std::move(owner)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (auto o = owner_.lock()) (*o)->on_grad_accumulated(index_);
    return outputs;
  }

 private:
  std::weak_ptr<GradTracker*> owner_;
  size_t index_;
};

// Pre-hook on the same node: sees .grad right before the accumulation (Note [Grad identity]).
struct AccumulatePreHook : torch::autograd::FunctionPreHook {
  AccumulatePreHook(std::weak_ptr<GradTracker*> owner, size_t index)
      : owner_(std::move(owner)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto o = owner_.lock()) (*o)->before_accumulation(index_);
    return grads;
  }

 private:
  std::weak_ptr<GradTracker*> owner_;
  size_t index_;
};

}  // namespace

GradTracker::GradTracker(const std::vector<TrackedParam>& params, bool have_optimizer,
                         std::function<void()> on_backward)
    : params_(params),
      have_optimizer_(have_optimizer),
      on_backward_(std::move(on_backward)),
      grad_(params.size()) {}

GradTracker::~GradTracker() {
  try {
    remove();
  } catch (...) {
  }
}

void GradTracker::install() {
  if (!hook_keys_.empty()) return;
  self_token_ = std::make_shared<GradTracker*>(this);
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].param;
    if (!p.requires_grad() || !p.is_leaf() || params_[i].external) {
      accumulators_.emplace_back();
      hook_keys_.push_back(0);
      pre_hooks_.push_back(nullptr);
      continue;
    }
    // Holding the accumulator keeps it (and the hook) alive across graphs, as DDP does.
    auto acc = torch::autograd::impl::grad_accumulator(p);
    const uintptr_t key = acc->add_post_hook(std::make_unique<AccumulatePostHook>(self_token_, i));
    auto pre = std::make_unique<AccumulatePreHook>(self_token_, i);
    pre_hooks_.push_back(pre.get());
    acc->add_pre_hook(std::move(pre));
    accumulators_.push_back(std::move(acc));
    hook_keys_.push_back(key);
  }
}

void GradTracker::remove() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (!accumulators_[i]) continue;
    accumulators_[i]->del_post_hook(hook_keys_[i]);
    auto& pre = accumulators_[i]->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(),
                             [&](const auto& h) { return h.get() == pre_hooks_[i]; }),
              pre.end());
  }
  accumulators_.clear();
  hook_keys_.clear();
  pre_hooks_.clear();
  self_token_.reset();  // a hook still running elsewhere sees the owner gone
}

void GradTracker::set_in_step(bool in_step) {
  const std::lock_guard<std::mutex> lock(mu_);
  in_step_ = in_step;
}

bool GradTracker::in_step() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return in_step_;
}

int64_t GradTracker::training_forward(std::vector<std::string>* skipped) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (grad_since_forward_) backwards_since_step_ += 1;
  grad_since_forward_ = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (grad_[i].skipped && skipped != nullptr) skipped->push_back(params_[i].name);
    grad_[i].skipped = false;
  }
  return backwards_since_step_;
}

// Note [Micro-batches cleared]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Gradient accumulation with zero_grad() inside the micro-batch loop: each micro-batch's backward
// is cleared before the next one, so the step uses only the last micro-batch's gradient. With two
// micro-batches a step there is one unused clear per step, which the "cleared twice without a step"
// rule above never sees. What tells such a clear from the legitimate ones: the cleared gradient was
// produced with no optimizer step since — of this sanitizer's optimizers or of any other
// sanitizer's in the process (a GAN's generator gradients from the discriminator's backward are
// cleared after the discriminator's step; in Lightning's order, zero_grad() after each step, the
// discriminator's gradients from the generator's backward are cleared after the generator's step) —
// the parameter did not change since (SAM's first step moves the weights with that gradient, then
// clears it), and it repeats: kMicroSteps consecutive steps of the parameter's optimizer each used
// a gradient made after such a clear (a one-off probe backward before the loop, or a batch skipped
// once, is not). A step of an optimizer no sanitizer watches is not seen: a discriminator attached
// alone, its generator stepped outside TrainSan, in Lightning's order, would read as this (the
// launcher attaches every optimizer). It is skipped_step at that step (StepIntegrityCheck::on_step,
// GradObservation::micro_cleared), naming the parameters.
void GradTracker::consume(const std::vector<size_t>& indices, bool manual,
                          std::vector<Consumed>* out) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (!manual && probe_steps_ > 0) probe_steps_ -= 1;
  if (!manual) {
    steps_ += 1;
    any_steps.fetch_add(1);
  }
  in_step_ = false;
  backwards_since_step_ = 0;
  grad_since_forward_ = false;
  out->clear();
  // Two passes: what each gradient is at the step (before any is recorded: recording one view of
  // a DDP bucket would hide a change to its siblings), then the record.
  for (const size_t i : indices) {
    GradState& s = grad_[i];
    Consumed c;
    c.observed = {s.got_grad, s.stale, s.accumulated};
    // Note [Micro-batches cleared]: this step is the kMicroSteps-th in a row.
    c.observed.micro_cleared = !manual && params_[i].opt >= 0 && s.got_grad && s.micro_discard &&
                               s.micro_steps + 1 >= kMicroSteps;
    const at::Tensor& g = params_[i].param.grad();
    c.at_step = !g.defined() ? GradAtStep::kNone
                : (s.last.get() == g.unsafeGetTensorImpl() && untouched(g, s))
                    ? GradAtStep::kAsBackwardLeft
                    : GradAtStep::kModified;
    if (s.probe.defined()) {
      c.left_nonzero = s.probe.item<bool>();  // a device sync on GPU, only while probing
      s.probe = at::Tensor();
    }
    out->push_back(c);
  }
  for (const size_t i : indices) {
    GradState& s = grad_[i];
    const at::Tensor& g = params_[i].param.grad();
    const bool orphan = params_[i].opt < 0;
    if (!manual && !orphan) {
      if (g.defined()) {
        s.consumed = WeakImpl(g);
        s.consumed_latest = true;
        record(g, &s);
      }
      s.step_since_clear = true;
      s.unused_clears = 0;
      // Note [Micro-batches cleared]: a step whose gradient followed a cleared micro-batch's.
      if (s.got_grad) s.micro_steps = s.micro_discard ? s.micro_steps + 1 : 0;
      s.micro_discard = false;
    }
    s.got_grad = false;
    s.stale = false;
    s.accumulated = false;
    if (manual) s.produced_since_clear = false;
  }
  if (seen_version_.size() > 2 * params_.size() + 16) {
    // Forget the storages no parameter's .grad uses any more (fresh gradients every step).
    std::unordered_map<const void*, StorageSeen> keep;
    for (const auto& tp : params_) {
      const at::Tensor& g = tp.param.grad();
      if (!g.defined()) continue;
      auto it = seen_version_.find(storage_key(g));
      if (it != seen_version_.end()) keep.insert(*it);
    }
    seen_version_.swap(keep);
  }
}

const void* GradTracker::storage_key(const at::Tensor& g) {
  const c10::TensorImpl* impl = g.unsafeGetTensorImpl();
  if (impl->has_storage() && impl->unsafe_storage().unsafeGetStorageImpl() != nullptr) {
    return impl->unsafe_storage().unsafeGetStorageImpl();
  }
  return impl;  // no storage (a wrapper subclass such as DTensor): its own version counter
}

bool GradTracker::untouched(const at::Tensor& g, const GradState& s) const {
  auto it = seen_version_.find(storage_key(g));
  return it != seen_version_.end() && it->second.version == g._version() &&
         it->second.clears == s.clears_seen;
}

void GradTracker::record(const at::Tensor& g, GradState* s) {
  StorageSeen& st = seen_version_[storage_key(g)];
  st.version = g._version();
  s->clears_seen = st.clears;
}

bool GradTracker::as_backward_left(size_t i) const {
  const at::Tensor& g = params_[i].param.grad();
  const std::lock_guard<std::mutex> lock(mu_);
  const GradState& s = grad_[i];
  return g.defined() && s.last.get() == g.unsafeGetTensorImpl() && untouched(g, s);
}

bool GradTracker::any_produced() const {
  const std::lock_guard<std::mutex> lock(mu_);
  for (const auto& g : grad_) {
    if (g.produced_since_clear) return true;
  }
  return false;
}

bool GradTracker::got_grad(int64_t opt) const {
  const std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].opt == opt && grad_[i].got_grad) return true;
  }
  return false;
}

void GradTracker::amp_skip(int64_t opt) {
  const std::lock_guard<std::mutex> lock(mu_);
  steps_ += 1;
  any_steps.fetch_add(1);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (opt < 0 || params_[i].opt == opt) {
      grad_[i].step_since_clear = true;  // the scaler consumed the gradient, on purpose
      grad_[i].unused_clears = 0;
      grad_[i].got_grad = false;
    }
  }
  in_step_ = false;
}

std::vector<size_t> GradTracker::discarded(int64_t opt) {
  const std::lock_guard<std::mutex> lock(mu_);
  std::vector<size_t> out;
  if (in_step_ || !have_optimizer_) return out;
  for (size_t i = 0; i < params_.size(); ++i) {
    GradState& s = grad_[i];
    if (params_[i].opt < 0 || (opt >= 0 && params_[i].opt != opt)) continue;
    if (!s.got_grad || s.discard_read || s.produced_gen != steps_) continue;
    s.discard_read = true;
    out.push_back(i);
  }
  return out;
}

void GradTracker::arm_probe(int64_t steps) {
  const std::lock_guard<std::mutex> lock(mu_);
  probe_steps_ = std::max(probe_steps_, steps);
}

// Note [Grad identity]: what hooks and callbacks do to the gradients at the end of a backward
// (DDP's reducer copies the all-reduced bucket back into .grad, in place) is the backward's
// result, not a clear. The engine runs a graph task's final callbacks in the order queued, and
// those a callback queues run after the rest; DDP queues its finalize when its last bucket is
// ready (after our first post-hook), so ours re-queues itself once and runs after DDP's.
void GradTracker::queue_end_of_backward() {
  std::weak_ptr<GradTracker*> token = self_token_;
  auto& engine = torch::autograd::Engine::get_default_engine();
  engine.queue_callback([token] {
    if (token.expired()) return;
    torch::autograd::Engine::get_default_engine().queue_callback([token] {
      if (auto o = token.lock()) (*o)->end_of_backward();
    });
  });
}

void GradTracker::end_of_backward() {
  const std::lock_guard<std::mutex> lock(mu_);
  end_queued_ = false;
  for (const size_t i : this_backward_) {
    GradState& s = grad_[i];
    const at::Tensor& g = params_[i].param.grad();
    if (!g.defined() || s.last.get() != g.unsafeGetTensorImpl()) continue;
    // Its storage as the backward (and what ran at its end) left it.
    StorageSeen& st = seen_version_[storage_key(g)];
    if (s.clears_seen == st.clears) st.version = g._version();
  }
  this_backward_.clear();
}

void GradTracker::before_accumulation(size_t i) {
  if (paused_.load()) return;
  const at::Tensor& g = params_[i].param.grad();
  const std::lock_guard<std::mutex> lock(mu_);
  GradState& s = grad_[i];
  using Before = GradState::Before;
  if (!g.defined()) {
    s.before = Before::kFresh;
    return;
  }
  const c10::TensorImpl* impl = g.unsafeGetTensorImpl();
  // A version of its storage that neither our hooks nor a step made: touched by someone else
  // (zeroed in place), which clears every gradient living in that storage.
  auto it = seen_version_.find(storage_key(g));
  if (it != seen_version_.end() && it->second.version != g._version()) {
    it->second.version = g._version();
    it->second.clears += 1;
  }
  // (the version matches now: untouched() is whether no clear came since p's own record)
  if (it == seen_version_.end() || it->second.clears != s.clears_seen) {
    s.before = Before::kFresh;
  } else if (s.consumed_latest && s.consumed.get() == impl) {
    s.before = Before::kConsumed;
  } else if (s.last.get() == impl) {
    s.before = Before::kLast;
  } else {
    s.before = Before::kFresh;
  }
}

void GradTracker::on_grad_accumulated(size_t i) {
  if (paused_.load()) return;
  if (on_backward_) on_backward_();  // backward has started: the op audit covers forward only
  const at::Tensor& g = params_[i].param.grad();
  if (!g.defined()) return;
  const std::lock_guard<std::mutex> lock(mu_);
  GradState& s = grad_[i];
  using Before = GradState::Before;
  const bool onto_consumed = s.before == Before::kConsumed;
  const bool onto_last = s.before == Before::kLast;
  s.before = Before::kFresh;
  if (!in_step_) {
    if (onto_consumed && have_optimizer_) {
      s.stale = true;
    } else if (onto_last) {
      s.accumulated = true;
    } else if (s.produced_since_clear && !s.step_since_clear && have_optimizer_ &&
               params_[i].opt >= 0) {
      // Cleared (zero_grad) although no step used the previous gradient. Once is legitimate:
      // another model's backward (GAN) leaves gradients here that this model's zero_grad
      // discards before its own backward. Twice in a row with no step of this parameter's
      // optimizer in between means its steps are missing.
      s.unused_clears += 1;
      if (s.unused_clears >= 2) s.skipped = true;
      // Note [Micro-batches cleared]: no optimizer's step since that gradient was produced and
      // the parameter unchanged: a micro-batch of this step, cleared before the next one.
      if (s.produced_gen == steps_ && s.produced_any == any_steps.load() &&
          s.param_version == params_[i].param._version()) {
        s.micro_discard = true;
      }
    }
    if (!onto_last && !onto_consumed) s.step_since_clear = false;
  }
  if (!onto_last && !onto_consumed) {
    // A fresh .grad: whatever was accumulated onto a consumed gradient before has been cleared
    // (zero_grad / set to None) without a step using it, so it can no longer be stale.
    s.stale = false;
    s.accumulated = false;
  }
  s.produced_since_clear = true;
  s.got_grad = true;
  s.produced_gen = steps_;
  s.param_version = static_cast<int64_t>(params_[i].param._version());
  s.produced_any = any_steps.load();
  s.discard_read = false;
  grad_since_forward_ = true;
  s.last = WeakImpl(g);
  s.consumed_latest = false;
  record(g, &s);
  this_backward_.push_back(i);
  if (!end_queued_) {
    try {
      queue_end_of_backward();
      end_queued_ = true;
    } catch (const c10::Error&) {
      // No graph task to queue on (an accumulation reported outside a backward): nothing ran
      // at its end to absorb; never fail the caller's backward over it.
    }
  }
  if (probe_steps_ > 0) {  // Note [Zero gradients]
    if (g.layout() == at::kStrided && !params_[i].local.defined()) {
      const at::NoGradGuard no_grad;
      s.probe = g.ne(0).any();
    } else {
      s.probe = at::Tensor();
    }
  }
}

}  // namespace trainsan::host
