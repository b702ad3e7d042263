// ForwardWatch (forward_watch.h): the thread-local op callback that sees a LibTorch forward.
#include "forward_watch.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
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
  bool armed = false;
  std::set<int64_t> no_grad_seen;  // groups with a no_grad forward reported since arm()
  std::set<int64_t> done;          // groups with a grad-enabled forward since arm()
  int64_t ops = 0;                 // ops looked at since arm()
  bool busy = false;               // inside on_forward: its own ops are not the model's
  std::thread::id thread;
};

namespace {

// The watches armed on this thread and the callback that serves them (registered while any is).
struct ThreadWatches {
  std::vector<std::shared_ptr<ForwardWatch::State>> armed;
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
  ~ThreadWatches() {
    if (handle != at::INVALID_CALLBACK_HANDLE) at::removeCallback(handle);
  }
};
thread_local ThreadWatches t_watches;

// In-place ops (the optimizer's add_, copy_, _foreach_*) update parameters; they are no forward.
bool updates_in_place(std::string_view name) {
  return (!name.empty() && name.back() == '_') || name.find("_foreach_") != std::string_view::npos;
}

void drop(const std::shared_ptr<ForwardWatch::State>& s);

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (t_watches.armed.empty() || updates_in_place(fn.name())) return nullptr;
  // Copy: on_forward may disarm (and so erase from) the list.
  const auto watches = t_watches.armed;
  for (const auto& s : watches) {
    if (!s->armed || s->busy) continue;
    if (++s->ops > ForwardWatch::kMaxOps) {
      s->armed = false;
      drop(s);
      continue;
    }
    const bool grad = at::GradMode::is_enabled();
    int64_t group = 0;
    bool reads_param = false;
    std::vector<at::Tensor> batch;
    for (const c10::IValue& v : fn.inputs()) {
      if (!v.isTensor()) continue;
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) continue;
      const auto it = s->params.find(t.unsafeGetTensorImpl());
      if (it != s->params.end()) {
        if (!reads_param) group = it->second;
        reads_param = true;
      } else if (t.dim() >= 1 &&
                 !(t.has_storage() && s->storages.count(t.storage().unsafeGetStorageImpl()) != 0)) {
        batch.push_back(t);  // not a view of a parameter (addmm's transposed weight)
      }
    }
    if (!reads_param || batch.empty() || s->done.count(group) != 0) continue;
    if (grad) {
      s->done.insert(group);
      if (s->done.size() == s->groups.size()) {
        s->armed = false;
        drop(s);
      }
    } else if (!s->no_grad_seen.insert(group).second) {
      continue;
    }
    s->busy = true;
    try {
      s->on_forward(std::move(batch), group);
    } catch (...) {
      // never fail the user's op: the sanitizer's own trouble is not the training's
    }
    s->busy = false;
  }
  return nullptr;
}

void drop(const std::shared_ptr<ForwardWatch::State>& s) {
  auto& list = t_watches.armed;
  list.erase(std::remove(list.begin(), list.end(), s), list.end());
  if (list.empty() && t_watches.handle != at::INVALID_CALLBACK_HANDLE) {
    // Safe inside a callback: a running op invokes its own copy of the callback list.
    at::removeCallback(t_watches.handle);
    t_watches.handle = at::INVALID_CALLBACK_HANDLE;
  }
}

}  // namespace

ForwardWatch::ForwardWatch(const std::vector<at::Tensor>& params,
                           const std::vector<int64_t>& groups, OnForward on_forward)
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
}

ForwardWatch::~ForwardWatch() { disarm(); }

void ForwardWatch::arm() {
  state_->no_grad_seen.clear();
  state_->done.clear();
  state_->ops = 0;
  if (state_->armed && state_->thread == std::this_thread::get_id()) return;
  disarm();
  state_->armed = true;
  state_->thread = std::this_thread::get_id();
  t_watches.armed.push_back(state_);
  if (t_watches.handle == at::INVALID_CALLBACK_HANDLE) {
    t_watches.handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_op).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
}

void ForwardWatch::disarm() {
  state_->armed = false;
  // Only this thread's list can be reached; a watch armed on another thread is skipped there
  // (armed is false) and dropped at that thread's exit.
  if (state_->thread == std::this_thread::get_id()) drop(state_);
}

bool ForwardWatch::armed() const { return state_->armed; }

}  // namespace trainsan::host
