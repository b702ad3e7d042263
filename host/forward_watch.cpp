// ForwardWatch (forward_watch.h): the thread-local op callback that sees a LibTorch forward and
// the backward of its loss.
#include "forward_watch.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/view.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>

namespace trainsan::host {

namespace {

// Pointers with a value each, looked up in a few instructions: the callback tests every tensor of
// every op it sees against the watched parameters (Note [Watch price]). Open addressing, a
// power-of-two size, at most half full; no erase (the set is fixed at construction).
class PtrTable {
 public:
  void insert(const void* key, int64_t value) {
    if (key == nullptr) return;
    if ((size_ + 1) * 2 > slots_.size()) grow();
    Slot& s = slots_[slot_of(key)];
    if (s.key == nullptr) size_ += 1;
    s = {key, value};
  }
  /// The value of `key`, or nullptr.
  const int64_t* find(const void* key) const {
    if (size_ == 0 || key == nullptr) return nullptr;
    const Slot& s = slots_[slot_of(key)];
    return s.key == key ? &s.value : nullptr;
  }
  bool contains(const void* key) const { return find(key) != nullptr; }

 private:
  struct Slot {
    const void* key = nullptr;
    int64_t value = 0;
  };
  // Where `key` is, or the empty slot where it would go.
  size_t slot_of(const void* key) const {
    const auto bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(key) >> 4);
    size_t i = static_cast<size_t>((bits * 0x9E3779B97F4A7C15ULL) >> 24) & (slots_.size() - 1);
    while (slots_[i].key != nullptr && slots_[i].key != key) i = (i + 1) & (slots_.size() - 1);
    return i;
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(std::max<size_t>(16, old.size() * 2), Slot{});
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != nullptr) insert(s.key, s.value);
    }
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace

struct ForwardWatch::State {
  PtrTable params;    // TensorImpl -> group
  PtrTable storages;  // the parameters' StorageImpls (a view of one is no batch)
  size_t group_count = 0;
  OnForward on_forward;
  OnLoss on_loss;
  bool armed = false;
  std::set<int64_t> no_grad_seen;  // groups with a no_grad forward reported since arm()
  std::set<int64_t> done;          // groups with a grad-enabled forward since arm()
  bool trained = false;            // a grad-enabled forward since arm()
  bool backward_done = false;      // the step's backward began (or its loss was taken)
  bool seeded = false;             // a backward root (ones_like) came since the training forward
  at::Tensor pending_root;  // a device loss taken at its backward: its reads are watched until
                            // the update (Note [C++ attach])
  const c10::TensorImpl* last_read = nullptr;  // the last loss read checked (item() inside isnan)
  int64_t ops = 0;                             // ops looked at since arm()
  int64_t ops_trained = 0;                     // of them, since the first grad-enabled forward
  int64_t ops_total = 0;
  double ops_untaken = 0;  // since the last take_seconds(), shared with other watches
  double seconds = 0.0;    // the callback's, not yet taken
  bool busy = false;       // inside a callback: its own ops are not the model's
  std::thread::id thread;
};

namespace {

using Clock = std::chrono::steady_clock;

// Note [Watch price]
// ~~~~~~~~~~~~~~~~~~
// The watch costs each op it sees twice: the dispatcher's price of a RecordFunction with boxed
// inputs and a call of the callback (paid before the callback runs, so the callback cannot time
// it), and the callback's own work. Both are counted in overhead_seconds() (Note [Own time]):
// - the dispatcher's price per op is measured once per process, at the first watch: the same op
//   (a view of a one-element tensor) in rounds of 256 calls without and with an empty callback
//   registered as the watch registers its own; the median over 5 rounds of the difference per
//   call, times the ops the watch saw;
// - the callback's work is timed on one op in kTimeEvery and counted for all of them (two clock
//   reads per op cost about as much as the work they would time).
// The work itself is a few loads for most ops: the op's kind from its name's first characters,
// and for a possible forward, each tensor input looked up in an open-addressing table of the
// parameters. Measured on pytorch/examples' MNIST loops in bench/bench_attach.cpp (RESULTS.md).
constexpr uint32_t kTimeEvery = 16;

std::unique_ptr<at::ObserverContext> empty_callback(const at::RecordFunction&) { return nullptr; }

at::RecordFunctionCallback watch_callback(at::RecordFunctionCallback::StartCallback start) {
  return at::RecordFunctionCallback(start).needsInputs(true).scopes(
      {at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION});
}

double measure_price() {
  const at::RecordFunctionGuard enabled(/*is_enabled=*/true);
  const at::Tensor t = at::zeros({1});
  constexpr int kCalls = 256;
  auto time_calls = [&] {
    const auto t0 = Clock::now();
    for (int k = 0; k < kCalls; ++k) (void)t.view({1});
    return std::chrono::duration<double>(Clock::now() - t0).count() / kCalls;
  };
  std::array<double, 5> diff{};
  for (double& d : diff) {
    const double without = time_calls();
    const at::CallbackHandle h = at::addThreadLocalCallback(watch_callback(&empty_callback));
    const double with = time_calls();
    at::removeCallback(h);
    d = with - without;
  }
  std::sort(diff.begin(), diff.end());
  return std::max(0.0, diff[diff.size() / 2]);
}

// The watches armed on this thread and the callback that serves them (registered while any is).
struct ThreadWatches {
  std::vector<std::shared_ptr<ForwardWatch::State>> armed;
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
  uint32_t tick = 0;  // ops seen: one in kTimeEvery is timed (Note [Watch price])
  ~ThreadWatches();
};
thread_local ThreadWatches t_watches;

bool registered(at::CallbackHandle handle);
void remove_callback_if_idle();

ThreadWatches::~ThreadWatches() {
  if (registered(handle)) at::removeCallback(handle);
}

void drop_disarmed();
void drop(const std::shared_ptr<ForwardWatch::State>& s);

// What an op is to the watch, from its name (no allocation: most ops are kOther).
enum class OpKind : uint8_t {
  kOther,         // a forward's op, or anything else
  kBackwardNode,  // a backward node or the engine's record of one, on this thread (a CPU backward)
  kInPlace,       // add_, copy_, _foreach_*: the optimizer's update, or the program's own
  kValueRead,     // item(), isnan(), isinf(), isfinite(): the program reads a value
  kOnesLike,      // ones_like: Tensor::backward() seeds its root's gradient with one
};

bool ends_in_place(const char* name) {
  const size_t n = std::strlen(name);
  return (n > 0 && name[n - 1] == '_') || std::strstr(name, "_foreach_") != nullptr;
}

OpKind classify(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) return OpKind::kBackwardNode;
  const char* name = fn.name();
  if (std::strncmp(name, "aten::", 6) == 0) {
    const char* op = name + 6;
    if (ends_in_place(op)) return OpKind::kInPlace;
    if (op[0] == 'i' && (std::strcmp(op, "item") == 0 || std::strcmp(op, "isnan") == 0 ||
                         std::strcmp(op, "isinf") == 0 || std::strcmp(op, "isfinite") == 0)) {
      return OpKind::kValueRead;
    }
    if (op[0] == 'o' && std::strcmp(op, "ones_like") == 0) return OpKind::kOnesLike;
    return OpKind::kOther;
  }
  if (std::strncmp(name, "autograd::engine::evaluate_function", 35) == 0) {
    return OpKind::kBackwardNode;
  }
  return ends_in_place(name) ? OpKind::kInPlace : OpKind::kOther;
}

// A loss as the program holds it: one element with a graph.
at::Tensor loss_like(const at::RecordFunction& fn) {
  const auto in = fn.inputs();
  if (in.empty() || !in[0].isTensor()) return {};
  const at::Tensor& t = in[0].toTensor();
  if (!t.defined() || t.numel() != 1 || !t.requires_grad() || !t.grad_fn()) return {};
  return t;
}

// The root of a backward: Tensor::backward() and torch::autograd::backward/grad without a
// gradient seed it with ones_like(root, LEGACY_CONTIGUOUS_MEMORY_FORMAT) on the calling thread,
// before the engine runs (on this thread for a CPU backward, on the device's for CUDA). A
// program's own ones_like keeps the default memory format (preserve): not a root.
at::Tensor backward_seed_root(const at::RecordFunction& fn) {
  at::Tensor root = loss_like(fn);
  if (!root.defined()) return {};
  const auto in = fn.inputs();
  const c10::IValue& format = in[in.size() - 1];
  const bool contiguous =
      format.isInt() && format.toInt() == static_cast<int64_t>(c10::MemoryFormat::Contiguous);
  return contiguous ? root : at::Tensor();
}

// Whether an in-place op writes one of the watched parameters (its first argument, or the first
// tensor of its first list: _foreach_*).
bool writes_parameter(const ForwardWatch::State& s, const at::RecordFunction& fn) {
  const auto in = fn.inputs();
  if (in.empty()) return false;
  at::Tensor t;
  if (in[0].isTensor()) {
    t = in[0].toTensor();
  } else if (in[0].isTensorList()) {
    const auto list = in[0].toTensorList();
    if (list.size() > 0) t = list.get(0);
  }
  return t.defined() && t.has_storage() && s.storages.contains(t.storage().unsafeGetStorageImpl());
}

// What one op tells one watch; the callbacks to call are gathered and called after the loop
// (they may arm and disarm watches, which edits the list).
struct Fire {
  std::shared_ptr<ForwardWatch::State> s;
  std::vector<at::Tensor> batch;
  int64_t group = 0;
  at::Tensor root;  // defined: a loss
  ForwardWatch::LossMoment moment = ForwardWatch::LossMoment::kBackward;
};

// A forward's first op on a parameter of a group not yet done, with its batch.
void look_for_forward(ForwardWatch::State& s, const at::RecordFunction& fn, std::vector<Fire>* fire,
                      const std::shared_ptr<ForwardWatch::State>& keep) {
  const auto in = fn.inputs();
  int64_t group = 0;
  bool reads_param = false;
  bool other = false;
  for (const c10::IValue& v : in) {  // no allocation for the ops that are no forward
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) continue;
    if (const int64_t* g = s.params.find(t.unsafeGetTensorImpl())) {
      if (!reads_param) group = *g;
      reads_param = true;
    } else if (t.dim() >= 1) {
      other = true;
    }
  }
  if (!reads_param || !other || s.done.count(group) != 0) return;
  const bool grad = at::GradMode::is_enabled();
  if (!grad && s.no_grad_seen.count(group) != 0) return;
  std::vector<at::Tensor> batch;
  for (const c10::IValue& v : in) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || s.params.contains(t.unsafeGetTensorImpl()) || t.dim() < 1) continue;
    if (t.has_storage() && s.storages.contains(t.storage().unsafeGetStorageImpl())) continue;
    batch.push_back(t);  // not a view of a parameter (addmm's transposed weight)
  }
  if (batch.empty()) return;
  if (grad) {
    s.done.insert(group);
    s.trained = true;
  } else {
    s.no_grad_seen.insert(group);
  }
  fire->push_back({keep, std::move(batch), group, {}});
}

// Whether the watch has seen all it waits for this step: every group's training forward, and the
// backward (or the update after a device loss's backward).
bool finished(const ForwardWatch::State& s) {
  return s.done.size() == s.group_count &&
         (!s.on_loss || (s.backward_done && !s.pending_root.defined()));
}

void look(ForwardWatch::State& s, const at::RecordFunction& fn, OpKind kind,
          std::vector<Fire>* fire, const std::shared_ptr<ForwardWatch::State>& keep) {
  s.ops += 1;
  if (s.trained) s.ops_trained += 1;
  if ((!s.trained && s.ops > ForwardWatch::kMaxIdleOps) ||
      s.ops_trained > ForwardWatch::kMaxOpsAfterForward) {
    s.armed = false;
    return;
  }
  switch (kind) {
    case OpKind::kBackwardNode:
      // A backward began on this thread (CPU) with no root seen: one given an explicit gradient.
      if (s.trained && !s.seeded) s.backward_done = true;
      break;
    case OpKind::kInPlace:
      // An update of a parameter (the optimizer's step; LibTorch's writes through .data(), a view
      // of the same storage): the backward is over, wherever it ran (a CUDA backward runs on the
      // device's thread, which this callback does not see).
      if (s.trained && (!s.backward_done || s.pending_root.defined()) && writes_parameter(s, fn)) {
        s.backward_done = true;
        s.pending_root = at::Tensor();
      }
      break;
    case OpKind::kOnesLike:
      if (s.trained && !s.backward_done && s.on_loss) {
        at::Tensor root = backward_seed_root(fn);
        if (root.defined()) {
          fire->push_back({keep, {}, 0, std::move(root), ForwardWatch::LossMoment::kBackward});
        }
      }
      break;
    case OpKind::kValueRead:
      // `AT_ASSERT(!std::isnan(loss.item<float>()))`, before the backward (pytorch/examples'
      // MNIST) or after it and before the update: read too, before the program can abort on it.
      if (s.trained && s.on_loss && (!s.backward_done || s.pending_root.defined())) {
        at::Tensor root = loss_like(fn);
        if (root.defined() && root.unsafeGetTensorImpl() != s.last_read &&
            (!s.backward_done || root.is_same(s.pending_root))) {
          fire->push_back({keep, {}, 0, std::move(root), ForwardWatch::LossMoment::kRead});
        }
      }
      break;
    case OpKind::kOther:
      if (s.done.size() < s.group_count) look_for_forward(s, fn, fire, keep);
      break;
  }
  // The rest of the step runs without the callback.
  if (finished(s)) s.armed = false;
}

// Calls what one op found (outside the loop over the watches: a callback may arm and disarm).
void call(Fire& f) {
  ForwardWatch::State& s = *f.s;
  if (!f.root.defined()) {
    s.on_forward(std::move(f.batch), f.group);
    return;
  }
  if (f.moment == ForwardWatch::LossMoment::kBackward) {
    s.seeded = true;  // this backward's nodes are not a backward the watch still waits for
    if (!s.on_loss(f.root, f.moment)) return;  // a probe's: the step's backward is still to come
    s.backward_done = true;
    if (!f.root.device().is_cpu()) s.pending_root = f.root;
  } else {
    // Only a non-finite value is the loss's trouble to report now; a finite one may be any scalar
    // the program logs, and end_step's to check.
    s.last_read = f.root.unsafeGetTensorImpl();
    const double v = f.root.detach().item<double>();
    if (std::isfinite(v) || !s.on_loss(f.root, f.moment)) return;
    s.backward_done = true;
    s.pending_root = at::Tensor();
  }
  if (finished(s)) {
    s.armed = false;
    drop(f.s);
  }
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  auto& list = t_watches.armed;
  if (list.empty()) {
    remove_callback_if_idle();  // Note [Watch removal]: back after a backward
    return nullptr;
  }
  // Note [Watch price]: one op in kTimeEvery timed, for all of them.
  const bool timed = (++t_watches.tick % kTimeEvery) == 0;
  const Clock::time_point t0 = timed ? Clock::now() : Clock::time_point();
  const OpKind kind = classify(fn);
  std::vector<Fire> fire;
  // The states looked at stay alive through this call: their owners (the sanitizers) are not
  // closed inside an op.
  constexpr size_t kTimed = 4;
  ForwardWatch::State* looked[kTimed];
  size_t n = 0;
  bool dropped = false;
  // The op's dispatcher price is paid once, whichever watches look at it.
  const double share = 1.0 / static_cast<double>(std::max<ptrdiff_t>(
                                 1, std::count_if(list.begin(), list.end(), [](const auto& s) {
                                   return s->armed && !s->busy;
                                 })));
  for (const auto& s : list) {
    if (!s->armed || s->busy) continue;
    s->ops_total += 1;
    s->ops_untaken += share;
    look(*s, fn, kind, &fire, s);
    dropped = dropped || !s->armed;
    if (n < kTimed) looked[n++] = s.get();
  }
  if (dropped) drop_disarmed();
  if (timed && n > 0) {
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count() * kTimeEvery;
    for (size_t k = 0; k < n; ++k) looked[k]->seconds += dt / static_cast<double>(n);
  }
  for (Fire& f : fire) {
    // The sanitizer times its own handling (Note [Own time]).
    f.s->busy = true;
    try {
      call(f);
    } catch (...) {
      // never fail the user's op: the sanitizer's own trouble is not the training's
    }
    f.s->busy = false;
  }
  return nullptr;
}

// Whether the callback is registered in this thread's RecordFunction state as it is now.
bool registered(at::CallbackHandle handle) {
  if (handle == at::INVALID_CALLBACK_HANDLE) return false;
  for (const auto& e : at::get_record_function_tls_().sorted_tls_callbacks_) {
    if (e.handle_ == handle) return true;
  }
  return false;
}

// Note [Watch removal]: the autograd engine runs a backward under a copy of the calling thread's
// state (at::ThreadLocalStateGuard, RecordFunction callbacks included) and puts the original
// back after it: a callback removed inside the backward (where the watch learns that the
// backward began) comes back after it. So the handle is kept, and the callback removed again at
// its next call with no watch armed (one op); arm() reuses it when it is still registered.
// (Resetting the handle made every step register one more callback, each running this one.)
void remove_callback_if_idle() {
  if (t_watches.armed.empty() && registered(t_watches.handle)) {
    // Safe inside a callback: a running op invokes its own copy of the callback list.
    at::removeCallback(t_watches.handle);
  }
}

void drop_disarmed() {
  auto& list = t_watches.armed;
  list.erase(std::remove_if(list.begin(), list.end(), [](const auto& s) { return !s->armed; }),
             list.end());
  remove_callback_if_idle();
}

void drop(const std::shared_ptr<ForwardWatch::State>& s) {
  auto& list = t_watches.armed;
  list.erase(std::remove(list.begin(), list.end(), s), list.end());
  remove_callback_if_idle();
}

}  // namespace

ForwardWatch::ForwardWatch(const std::vector<at::Tensor>& params,
                           const std::vector<int64_t>& groups, OnForward on_forward, OnLoss on_loss)
    : state_(std::make_shared<State>()) {
  std::set<int64_t> distinct;
  for (size_t k = 0; k < params.size(); ++k) {
    if (!params[k].defined()) continue;
    const int64_t g = k < groups.size() ? groups[k] : 0;
    state_->params.insert(params[k].unsafeGetTensorImpl(), g);
    if (params[k].has_storage()) {
      state_->storages.insert(params[k].storage().unsafeGetStorageImpl(), 0);
    }
    distinct.insert(g);
  }
  state_->group_count = distinct.size();
  state_->on_forward = std::move(on_forward);
  state_->on_loss = std::move(on_loss);
  (void)price_per_op();  // measured now, not inside the first op it sees
}

ForwardWatch::~ForwardWatch() { disarm(); }

double ForwardWatch::price_per_op() {
  static const double price = measure_price();
  return price;
}

void ForwardWatch::arm() {
  state_->no_grad_seen.clear();
  state_->done.clear();
  state_->trained = false;
  state_->backward_done = false;
  state_->seeded = false;
  state_->pending_root = at::Tensor();
  state_->last_read = nullptr;
  state_->ops = 0;
  state_->ops_trained = 0;
  if (state_->armed && state_->thread == std::this_thread::get_id()) return;
  disarm();
  state_->armed = true;
  state_->thread = std::this_thread::get_id();
  t_watches.armed.push_back(state_);
  if (!registered(t_watches.handle)) {
    t_watches.handle = at::addThreadLocalCallback(watch_callback(&on_op));
  }
}

void ForwardWatch::disarm() {
  state_->armed = false;
  state_->pending_root = at::Tensor();
  // Only this thread's list can be reached; a watch armed on another thread is skipped there
  // (armed is false) and dropped at that thread's next op or exit.
  if (state_->thread == std::this_thread::get_id()) drop(state_);
}

bool ForwardWatch::armed() const { return state_->armed; }

double ForwardWatch::take_seconds() {
  const double s = state_->seconds + state_->ops_untaken * price_per_op();
  state_->seconds = 0.0;
  state_->ops_untaken = 0;
  return s;
}

int64_t ForwardWatch::ops_seen() const { return state_->ops_total; }

}  // namespace trainsan::host
