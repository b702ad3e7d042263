// ForwardWatch (forward_watch.h): the thread-local op callback that sees a LibTorch forward and
// the backward of its loss.
#include "forward_watch.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

namespace trainsan::host {

struct ForwardWatch::State {
  std::unordered_map<const c10::TensorImpl*, int64_t> params;  // -> group
  std::unordered_set<const void*> storages;  // the parameters' (a view of one is no batch)
  std::set<int64_t> groups;
  OnForward on_forward;
  OnBackward on_backward;
  bool armed = false;
  std::set<int64_t> no_grad_seen;  // groups with a no_grad forward reported since arm()
  std::set<int64_t> done;          // groups with a grad-enabled forward since arm()
  bool trained = false;            // a grad-enabled forward since arm()
  bool backward_done = false;      // the first backward after it began (or is not watched)
  int64_t ops = 0;                 // ops looked at since arm()
  int64_t ops_trained = 0;         // of them, since the first grad-enabled forward
  int64_t ops_total = 0;
  double seconds = 0.0;  // in the callback, not yet taken
  bool busy = false;     // inside a callback: its own ops are not the model's
  std::thread::id thread;
};

namespace {

using Clock = std::chrono::steady_clock;

// The watches armed on this thread and the callback that serves them (registered while any is).
struct ThreadWatches {
  std::vector<std::shared_ptr<ForwardWatch::State>> armed;
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
  ~ThreadWatches();
};
thread_local ThreadWatches t_watches;

bool registered(at::CallbackHandle handle);
void remove_callback_if_idle();

ThreadWatches::~ThreadWatches() {
  if (registered(handle)) at::removeCallback(handle);
}

// In-place ops (the optimizer's add_, copy_, _foreach_*) update parameters; they are no forward.
bool updates_in_place(std::string_view name) {
  return (!name.empty() && name.back() == '_') || name.find("_foreach_") != std::string_view::npos;
}

void drop_disarmed();
void drop(const std::shared_ptr<ForwardWatch::State>& s);

// A loss as the program reads it: one element with a graph.
at::Tensor backward_root(const at::RecordFunction& fn) {
  const auto in = fn.inputs();
  if (in.empty() || !in[0].isTensor()) return {};
  const at::Tensor& t = in[0].toTensor();
  if (!t.defined() || t.numel() != 1 || !t.requires_grad() || !t.grad_fn()) return {};
  return t;
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
  return t.defined() && t.has_storage() &&
         s.storages.count(t.storage().unsafeGetStorageImpl()) != 0;
}

// What one op tells one watch; the callbacks to call are gathered and called after the loop
// (they may arm and disarm watches, which edits the list).
struct Fire {
  std::shared_ptr<ForwardWatch::State> s;
  std::vector<at::Tensor> batch;
  int64_t group = 0;
  at::Tensor root;    // defined: the backward's
  bool read = false;  // root is a loss the program reads (item()) before its backward
};

void look(ForwardWatch::State& s, const at::RecordFunction& fn, bool backward_node,
          bool backward_entry, bool reads_value, bool in_place, std::vector<Fire>* fire,
          const std::shared_ptr<ForwardWatch::State>& keep) {
  s.ops += 1;
  if (s.trained) s.ops_trained += 1;
  if ((!s.trained && s.ops > ForwardWatch::kMaxIdleOps) ||
      s.ops_trained > ForwardWatch::kMaxOpsAfterForward) {
    s.armed = false;
    return;
  }
  if (backward_node || backward_entry) {
    // The backward began (on this thread: a CPU backward): no loss read before it is to come.
    if (s.trained) s.backward_done = true;
  } else if (in_place) {
    // An update of a parameter (the optimizer's step; LibTorch's writes through .data(), a view
    // of the same storage): the backward is over, wherever it ran (a CUDA backward runs on the
    // device's thread, which this callback does not see).
    if (s.trained && !s.backward_done && writes_parameter(s, fn)) s.backward_done = true;
  } else if (reads_value) {
    // `AT_ASSERT(!std::isnan(loss.item<float>()))` before loss.backward() (pytorch/examples'
    // MNIST): a one-element tensor with a graph, read after a training forward and before the
    // backward; checked for a non-finite value before the program can abort on it.
    if (s.trained && !s.backward_done && s.on_backward) {
      at::Tensor root = backward_root(fn);
      if (root.defined()) fire->push_back({keep, {}, 0, std::move(root), /*read=*/true});
    }
  } else if (!in_place) {
    const bool grad = at::GradMode::is_enabled();
    int64_t group = 0;
    bool reads_param = false;
    bool other = false;
    const auto in = fn.inputs();
    for (const c10::IValue& v : in) {  // no allocation for the ops that are no forward
      if (!v.isTensor()) continue;
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) continue;
      const auto it = s.params.find(t.unsafeGetTensorImpl());
      if (it != s.params.end()) {
        if (!reads_param) group = it->second;
        reads_param = true;
      } else if (t.dim() >= 1) {
        other = true;
      }
    }
    if (!reads_param || !other || s.done.count(group) != 0) return;
    std::vector<at::Tensor> batch;
    for (const c10::IValue& v : in) {
      if (!v.isTensor()) continue;
      const at::Tensor& t = v.toTensor();
      if (!t.defined() || s.params.count(t.unsafeGetTensorImpl()) != 0 || t.dim() < 1) continue;
      if (t.has_storage() && s.storages.count(t.storage().unsafeGetStorageImpl()) != 0) continue;
      batch.push_back(t);  // not a view of a parameter (addmm's transposed weight)
    }
    if (batch.empty()) return;
    if (grad) {
      s.done.insert(group);
      s.trained = true;
    } else if (!s.no_grad_seen.insert(group).second) {
      return;
    }
    fire->push_back({keep, std::move(batch), group, {}});
  }
  // Every group's training forward and the backward after them seen: the rest of the step runs
  // without the callback.
  if (s.done.size() == s.groups.size() && (s.backward_done || !s.on_backward)) s.armed = false;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  auto& list = t_watches.armed;
  if (list.empty()) {
    remove_callback_if_idle();  // Note [Watch removal]: back after a backward
    return nullptr;
  }
  const auto t0 = Clock::now();
  const bool backward_node = fn.scope() == at::RecordScope::BACKWARD_FUNCTION;
  const std::string_view name = backward_node ? std::string_view() : std::string_view(fn.name());
  // A backward that began on this thread (CPU): its nodes, or the engine's record of one.
  const bool backward_entry = name.rfind("autograd::engine::evaluate_function", 0) == 0;
  const bool reads_value = name == "aten::item";
  const bool in_place = !backward_node && updates_in_place(name);
  std::vector<Fire> fire;
  // The states looked at stay alive through this call: their owners (the sanitizers) are not
  // closed inside an op.
  constexpr size_t kTimed = 4;
  ForwardWatch::State* looked[kTimed];
  size_t n = 0;
  bool dropped = false;
  for (const auto& s : list) {
    if (!s->armed || s->busy) continue;
    s->ops_total += 1;
    look(*s, fn, backward_node, backward_entry, reads_value, in_place, &fire, s);
    dropped = dropped || !s->armed;
    if (n < kTimed) looked[n++] = s.get();
  }
  if (dropped) drop_disarmed();
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  for (size_t k = 0; k < n; ++k) looked[k]->seconds += dt / static_cast<double>(n);
  for (Fire& f : fire) {
    // The sanitizer times its own handling (Note [Own time]).
    f.s->busy = true;
    try {
      if (f.read) {
        // Only a non-finite value is the loss's trouble to report now; a finite one may be any
        // scalar the program logs, and the backward is still watched.
        const double v = f.root.detach().item<double>();
        if (!std::isfinite(v) && !f.s->backward_done) {
          f.s->backward_done = true;
          f.s->on_backward(f.root);
          if (f.s->done.size() == f.s->groups.size()) {
            f.s->armed = false;
            drop(f.s);
          }
        }
      } else {
        f.s->on_forward(std::move(f.batch), f.group);
      }
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
                           const std::vector<int64_t>& groups, OnForward on_forward,
                           OnBackward on_backward)
    : state_(std::make_shared<State>()) {
  for (size_t k = 0; k < params.size(); ++k) {
    if (!params[k].defined()) continue;
    const int64_t g = k < groups.size() ? groups[k] : 0;
    state_->params.emplace(params[k].unsafeGetTensorImpl(), g);
    if (params[k].has_storage()) {
      state_->storages.insert(params[k].storage().unsafeGetStorageImpl());
    }
    state_->groups.insert(g);
  }
  state_->on_forward = std::move(on_forward);
  state_->on_backward = std::move(on_backward);
}

ForwardWatch::~ForwardWatch() { disarm(); }

void ForwardWatch::arm() {
  state_->no_grad_seen.clear();
  state_->done.clear();
  state_->trained = false;
  state_->backward_done = false;
  state_->ops = 0;
  state_->ops_trained = 0;
  if (state_->armed && state_->thread == std::this_thread::get_id()) return;
  disarm();
  state_->armed = true;
  state_->thread = std::this_thread::get_id();
  t_watches.armed.push_back(state_);
  if (!registered(t_watches.handle)) {
    t_watches.handle =
        at::addThreadLocalCallback(at::RecordFunctionCallback(&on_op).needsInputs(true).scopes(
            {at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }
}

void ForwardWatch::disarm() {
  state_->armed = false;
  // Only this thread's list can be reached; a watch armed on another thread is skipped there
  // (armed is false) and dropped at that thread's next op or exit.
  if (state_->thread == std::this_thread::get_id()) drop(state_);
}

bool ForwardWatch::armed() const { return state_->armed; }

double ForwardWatch::take_seconds() {
  const double s = state_->seconds;
  state_->seconds = 0.0;
  return s;
}

int64_t ForwardWatch::ops_seen() const { return state_->ops_total; }

}  // namespace trainsan::host
