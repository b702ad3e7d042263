// The process-wide RecordFunction observer of the op audits: registration, the audited thread,
// and the dispatch of an observed op to its rule.
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iostream>
#include <string_view>
#include <unordered_map>

#include "audit/core.h"

namespace trainsan::host {

// Note [Op audit]
// ~~~~~~~~~~~~~~~
// What is observed: one global ATen RecordFunction callback (scopes FUNCTION, with inputs and
// outputs, and BACKWARD_FUNCTION), added the first time any sanitizer audits and removed when the
// last open sanitizer closes. It is disabled (at::disableCallback: the dispatcher's fast path, no
// boxing) except while at least one sanitizer audits, i.e. from the grad-enabled forward of a
// sampled step, in train or eval mode alike (a model trained in eval mode stays on the schedule;
// Python: the root module's forward pre-hook; C++: begin_step) to the start of backward (the first
// autograd node to run, seen at scope BACKWARD_FUNCTION; the gradient hooks and the step end stop
// it too). Sampled steps: the first audit_first_steps steps, then every audit_every-th.
//
// Which ops count: only calls made on the thread that started the audit, with grad mode on (so
// no_grad validation and backward are out), that are not issued from inside another op's
// autograd kernel (autograd keys excluded in TLS) nor from inside an audited loss or class-index
// call (kl_div's mul, cross_entropy_loss's nll_loss: t_loss_depth) — those are the op's
// internals, not the user's code — and not issued by TrainSan itself (thread-local guard; the
// few ops we issue also run with RecordFunction off). Of those, a small table of names
// (op_table) is looked at; everything else returns after one hash lookup, and elementwise ops
// that cannot match the rule return after a look at their sizes (elementwise_candidate).
//
// The rules (audit/shape_rules.h, audit/broadcast.cpp, audit/labels.cpp):
// * elementwise ops (add, sub, mul, div, pow, where, ...): `broadcast` when the result has more
//   elements than every input, the inputs differ in rank (implicit rank promotion), some input
//   requires grad (the training signal passes through it), and the growth is the [N,1]-vs-[N]
//   signature: one input is expanded along an axis by a size s that the other brings, and the
//   other along another axis by the same s. Bias and scale adds, attention masks added to
//   scores, positional encodings added to embeddings do not grow the result; pairwise terms
//   written with explicit singleton dims on both sides (a[:, None] - b[None]) have equal ranks;
//   encodings and masks built from constants (t[:, None] * freqs, pad | causal) need no grad;
//   pairwise terms against another set (x[:, None] - centroids, N != K) lack the equal sizes.
// * loss ops on (input, target) pairs (mse, l1, smooth_l1, huber, BCE, ...): `broadcast` when
//   input, target (and weight) broadcast into more elements than both input and target — a loss
//   never means that; `batch_mismatch` when input and target have the same rank and different
//   sizes in dim 0. Python's F.mse_loss/l1_loss/smooth_l1_loss/huber_loss expand both with
//   broadcast_tensors before calling the op (as do the LibTorch functional wrappers): a
//   broadcast_tensors whose result the next audited op takes as its input and target is judged
//   with the shapes the user passed (Deferred).
// * class-index ops (cross_entropy_loss, nll_loss(_nd, 2d), multi_margin_loss, one_hot):
//   `label_range` when a target value is outside [0, C) and is not ignore_index, checked before
//   the op runs; `batch_mismatch` when target.size(0) != input.size(0). A target the Python
//   layer has just checked (sync mode) is not checked again by the op's callback (LastTarget).
// * `probs_as_logits` (audit/probs.cpp, Note [Probabilities as logits]): the input of a loss
//   that applies softmax or sigmoid itself (the rows' `expects`) holds probabilities.
// * `target_leak` (audit/leaks.cpp, Note [Target leak]): embedding lookups of integer sequences
//   are noted with their output (the op's end: the only op whose outputs are read); the targets
//   of class-index and loss ops are compared with them and with the forward's feature tables.
//
// Findings are written into the sanitizer's FindingSink from the callback (which runs on the
// training thread: only the thread that started the audit is observed), with the step of the
// audited forward; the sink queues them for the policy, which answers at the sanitizer's next
// event: a callback cannot throw (ATen catches and logs exceptions from RecordFunction
// callbacks), so "raise" raises at the next forward, watch_loss or step. A broadcast_tensors
// that no loss took is recorded at the next audited op or sanitizer event (OpAudit::flush).
// Class-index ops usually fail right after a bad target on their own (CPU: IndexError; CUDA: a
// device-side assert), so their findings are also printed at once unless the policy is
// "record". The Python layer's sync mode raises before the op through a TorchFunctionMode that
// calls check_target (bindings/trainsan/audit.py). Source lines come from the Python frames
// (source_location.h), past the frames the bindings name as not the user's.
//
// CUDA targets: without sync the check enqueues a few reductions into a 3-element device tensor
// and adds no host synchronisation; at the step end the flags of each device are stacked and
// copied to the host asynchronously as one entry of the sanitizer's ReadbackQueue (Phase
// kLabels), read one step later (Note [Lagged checks]). With sync they are read at once.
//
// Lifetime: the observer is process-wide and may outlive a sanitizer; it reaches a sanitizer's
// audit through a shared Core, whose sink and queue pointers ~OpAudit nulls under Core::mu.

namespace audit {

namespace {

using Clock = std::chrono::steady_clock;

const std::unordered_map<std::string_view, OpInfo>& op_table() {
  static const auto* table = new std::unordered_map<std::string_view, OpInfo>{
      {"aten::add", {OpClass::kElementwise}},
      {"aten::sub", {OpClass::kElementwise}},
      {"aten::rsub", {OpClass::kElementwise}},
      {"aten::mul", {OpClass::kElementwise}},
      {"aten::div", {OpClass::kElementwise}},
      {"aten::pow", {OpClass::kElementwise}},
      {"aten::maximum", {OpClass::kElementwise}},
      {"aten::minimum", {OpClass::kElementwise}},
      {"aten::fmax", {OpClass::kElementwise}},
      {"aten::fmin", {OpClass::kElementwise}},
      {"aten::where", {OpClass::kElementwise}},
      {"aten::atan2", {OpClass::kElementwise}},
      {"aten::fmod", {OpClass::kElementwise}},
      {"aten::remainder", {OpClass::kElementwise}},
      {"aten::hypot", {OpClass::kElementwise}},
      {"aten::logaddexp", {OpClass::kElementwise}},
      {"aten::xlogy", {OpClass::kElementwise}},
      {"aten::lerp", {OpClass::kElementwise}},
      {"aten::addcmul", {OpClass::kElementwise}},
      {"aten::addcdiv", {OpClass::kElementwise}},
      {"aten::clamp", {OpClass::kElementwise}},
      {"aten::broadcast_tensors", {OpClass::kBroadcastTensors}},
      {"aten::mse_loss", {OpClass::kLoss}},
      {"aten::l1_loss", {OpClass::kLoss}},
      {"aten::smooth_l1_loss", {OpClass::kLoss}},
      {"aten::huber_loss", {OpClass::kLoss}},
      {"aten::binary_cross_entropy", {OpClass::kLoss}},
      {"aten::binary_cross_entropy_with_logits", {OpClass::kLoss, -1, Expects::kBinaryLogits}},
      {"aten::soft_margin_loss", {OpClass::kLoss}},
      {"aten::kl_div", {OpClass::kLoss}},
      {"aten::poisson_nll_loss", {OpClass::kLoss}},
      {"aten::hinge_embedding_loss", {OpClass::kLoss}},
      {"aten::cross_entropy_loss", {OpClass::kClassIndex, 4, Expects::kLogits}},
      {"aten::nll_loss_nd", {OpClass::kClassIndex, 4, Expects::kLogProbs}},
      {"aten::nll_loss", {OpClass::kClassIndex, 4, Expects::kLogProbs}},
      {"aten::nll_loss2d", {OpClass::kClassIndex, 4, Expects::kLogProbs}},
      {"aten::multi_margin_loss", {OpClass::kClassIndex, -1}},
      {"aten::one_hot", {OpClass::kOneHot, -1}},
      {"aten::embedding", {OpClass::kEmbedding}},
  };
  return *table;
}

struct Registry {
  std::mutex mu;
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
  bool enabled = false;
  int64_t open = 0;  // open OpAudits
  std::vector<std::shared_ptr<Core>> active;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: ops may run during static destruction
  return *r;
}

thread_local bool t_own_ops = false;
// Depth of audited loss and class-index calls on this thread: the ops they issue (kl_div's mul,
// cross_entropy_loss's nll_loss_nd and nll_loss) are part of the call, not the user's code.
thread_local int t_loss_depth = 0;
thread_local bool t_deferred_pending = false;
thread_local int t_paused = 0;  // pause_this_thread() depth

struct InLoss : at::ObserverContext {};
// An embedding lookup: its output, seen when the op ends, is target_leak's (Note [Target leak]).
struct InEmbedding : at::ObserverContext {
  std::shared_ptr<Core> core;
  at::Tensor indices;
};

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn);
void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx);

// The first autograd node of a backward: every audit window ends here (the gradient hooks,
// which also stop audits, may come much later: AccumulateGrad runs last for a parameter used
// throughout the graph).
void stop_all() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& core : r.active) core->active.store(false);
  r.active.clear();
  if (r.enabled) {
    at::disableCallback(r.handle);
    r.enabled = false;
  }
}

// The most recent audit started on this thread (several sanitizers, e.g. a GAN's two models,
// can audit at once; an op belongs to the forward that started last).
std::shared_ptr<Core> auditor_of_this_thread() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  const std::thread::id me = std::this_thread::get_id();
  for (auto it = r.active.rbegin(); it != r.active.rend(); ++it) {
    if ((*it)->thread == me) return *it;
  }
  return nullptr;
}

void audit_op(Core& c, const OpInfo& info, const char* name, c10::ArrayRef<const c10::IValue> in) {
  switch (info.cls) {
    case OpClass::kBroadcastTensors:
      on_broadcast_tensors(c, name, in);
      return;
    case OpClass::kLoss:
      on_loss(c, name, in);
      if (info.expects != Expects::kAny) check_loss_input(c, info, name, in);
      return;
    case OpClass::kElementwise:
      flush_deferred(c);
      if (c.cfg.on(Kind::broadcast)) on_elementwise(c, name, in);
      return;
    case OpClass::kClassIndex:
    case OpClass::kOneHot:
      flush_deferred(c);
      on_class_index(c, info, name, in);
      if (info.expects != Expects::kAny) check_loss_input(c, info, name, in);
      return;
    case OpClass::kEmbedding:
      return;  // on_op_end: the lookup's output
  }
}

// Could the elementwise rule fire on these inputs? The common case (equal ranks, a scalar
// operand, no growth, nothing requiring grad) answers without a lock or an allocation.
bool elementwise_candidate(c10::ArrayRef<const c10::IValue> in) {
  constexpr size_t kMaxRank = 16;
  size_t rank = 0, n = 0;
  int64_t largest = 0;
  int64_t first_rank = -1;
  bool grad = false, same_rank = true;
  for (const auto& v : in) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) continue;
    const auto r = static_cast<int64_t>(t.dim());
    if (first_rank < 0) first_rank = r;
    same_rank = same_rank && r == first_rank;
    rank = std::max(rank, static_cast<size_t>(r));
    largest = std::max(largest, t.numel());
    grad = grad || t.requires_grad();
    n += 1;
  }
  if (n < 2 || same_rank || !grad) return false;
  if (rank > kMaxRank) return true;  // the full rule decides
  int64_t out[kMaxRank];
  std::fill(out, out + rank, int64_t{1});
  for (const auto& v : in) {
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const at::IntArrayRef sizes = v.toTensor().sizes();
    const size_t lead = rank - sizes.size();
    for (size_t k = 0; k < sizes.size(); ++k) {
      if (sizes[k] != 1) out[lead + k] = sizes[k];
    }
  }
  int64_t numel = 1;
  for (size_t k = 0; k < rank; ++k) numel *= out[k];
  return numel > largest;
}

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (t_paused > 0) return nullptr;
  if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
    stop_all();
    return nullptr;
  }
  if (t_own_ops || t_loss_depth > 0 || !c10::GradMode::is_enabled()) return nullptr;
  const char* name = fn.name();
  if (name == nullptr) return nullptr;
  const auto& table = op_table();
  const auto it = table.find(std::string_view(name));
  if (it == table.end()) return nullptr;
  // Called from inside another op's autograd kernel: that op's internals, not the user's code.
  if (c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutogradFunctionality)) {
    return nullptr;
  }
  const OpClass cls = it->second.cls;
  if (cls == OpClass::kElementwise && !t_deferred_pending && !elementwise_candidate(fn.inputs())) {
    return nullptr;
  }
  const std::shared_ptr<Core> core = auditor_of_this_thread();
  if (!core) return nullptr;
  if (cls == OpClass::kEmbedding) {
    // aten::embedding(weight, indices, ...): integer sequences the model reads.
    const auto in = fn.inputs();
    if (!core->cfg.on(Kind::target_leak) || core->target_leak_found.load() || in.size() < 2 ||
        !in[1].isTensor() || in[1].toTensor().dim() < 2) {
      return nullptr;
    }
    auto e = std::make_unique<InEmbedding>();
    e->core = core;
    e->indices = in[1].toTensor();
    return e;
  }
  std::unique_ptr<at::ObserverContext> ctx;
  if (cls == OpClass::kLoss || cls == OpClass::kClassIndex || cls == OpClass::kOneHot) {
    ctx = std::make_unique<InLoss>();  // on_op_end closes it, also when the op throws
  }
  const auto t0 = Clock::now();
  try {
    const OwnOps own;
    audit_op(*core, it->second, name, fn.inputs());
  } catch (const std::exception& e) {
    // An audit must never break the training step.
    static std::once_flag once;
    std::call_once(once, [&] {
      std::cerr << "[trainsan] the op audit of " << name << " failed and is skipped: " << e.what()
                << '\n';
    });
  }
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  {
    const std::lock_guard<std::mutex> lock(core->mu);
    core->overhead_s += dt;
    core->ops_audited += 1;
  }
  if (ctx) t_loss_depth += 1;
  return ctx;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  if (ctx == nullptr) return;
  auto* e = dynamic_cast<InEmbedding*>(ctx);
  if (e == nullptr) {
    t_loss_depth -= 1;
    return;
  }
  const auto& out = fn.outputs();
  if (out.empty() || !out[0].isTensor()) return;
  try {
    const OwnOps own;
    on_embedding(*e->core, e->indices, out[0].toTensor());
  } catch (const std::exception&) {
    // an audit must never break the training step
  }
}

}  // namespace

OwnOps::OwnOps() : prev_(t_own_ops) { t_own_ops = true; }
OwnOps::~OwnOps() { t_own_ops = prev_; }

void set_deferred_pending(bool pending) { t_deferred_pending = pending; }

void claim() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.open += 1;
}

void release() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.open -= 1;
  if (r.open == 0 && r.handle != at::INVALID_CALLBACK_HANDLE) {
    at::removeCallback(r.handle);
    r.handle = at::INVALID_CALLBACK_HANDLE;
    r.enabled = false;
  }
}

void activate(const std::shared_ptr<Core>& core) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  core->thread = std::this_thread::get_id();
  r.active.erase(std::remove(r.active.begin(), r.active.end(), core), r.active.end());
  r.active.push_back(core);
  if (r.handle == at::INVALID_CALLBACK_HANDLE) {
    r.handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_op, &on_op_end)
            .needsInputs(true)
            .needsOutputs(true)  // an embedding's output (target_leak)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    r.enabled = true;
  } else if (!r.enabled) {
    at::reenableCallback(r.handle);
    r.enabled = true;
  }
}

void deactivate(const std::shared_ptr<Core>& core) {
  Registry& r = registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.active.erase(std::remove(r.active.begin(), r.active.end(), core), r.active.end());
  if (r.active.empty() && r.enabled) {
    at::disableCallback(r.handle);
    r.enabled = false;
  }
}

void pause_this_thread(bool paused) {
  t_paused = paused ? t_paused + 1 : std::max(0, t_paused - 1);
}

}  // namespace audit
}  // namespace trainsan::host

namespace trainsan {

bool audit_observer_registered() {
  host::audit::Registry& r = host::audit::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return r.handle != at::INVALID_CALLBACK_HANDLE;
}

}  // namespace trainsan
