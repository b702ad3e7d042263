// Op-level audits of the training forward: `broadcast`, `label_range`, `batch_mismatch`.
#include "audit.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <string_view>
#include <thread>
#include <unordered_map>

#include "sanitizer_impl.h"
#include "stats_internal.h"

namespace trainsan {

// Note [Op audit]
// ~~~~~~~~~~~~~~~
// What is observed: one global ATen RecordFunction callback (scopes FUNCTION, with inputs, and
// BACKWARD_FUNCTION), added the first time any sanitizer audits and removed when the last open
// sanitizer closes. It is disabled (at::disableCallback: the dispatcher's fast path, no boxing)
// except while at least one sanitizer audits, i.e. from the training forward of a sampled step
// (Python: the root module's forward pre-hook; C++: begin_step) to the start of backward (the
// first autograd node to run, seen at scope BACKWARD_FUNCTION; the gradient hooks and the step
// end stop it too). Sampled steps: the first audit_first_steps steps, then every audit_every-th.
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
// The rules:
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
//
// Findings are recorded into the sanitizer (findings, trace) from the callback, and handed to
// the policy at the sanitizer's next event (take()): a callback cannot throw (ATen catches and
// logs exceptions from RecordFunction callbacks), so "raise" raises at the next forward,
// watch_loss or step. Class-index ops usually fail right after a bad target on their own (CPU:
// IndexError; CUDA: a device-side assert), so their findings are also printed at once unless the
// policy is "record". The Python layer's sync mode raises before the op through a
// TorchFunctionMode that calls check_target (bindings/trainsan/audit.py).
//
// CUDA targets: without sync the check enqueues a few reductions into a 3-element device tensor
// and adds no host synchronisation; the flags come back with one asynchronous copy at the step
// end and are read at the next step end (or at close). With sync they are read at once.

namespace audit {

namespace {

using Shape = std::vector<int64_t>;
using Clock = std::chrono::steady_clock;

enum class OpClass { kElementwise, kBroadcastTensors, kLoss, kClassIndex, kOneHot };

struct OpInfo {
  OpClass cls;
  int ignore_arg = -1;  // class-index ops: position of ignore_index, -1 when the op has none
};

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
      {"aten::binary_cross_entropy_with_logits", {OpClass::kLoss}},
      {"aten::soft_margin_loss", {OpClass::kLoss}},
      {"aten::kl_div", {OpClass::kLoss}},
      {"aten::poisson_nll_loss", {OpClass::kLoss}},
      {"aten::hinge_embedding_loss", {OpClass::kLoss}},
      {"aten::cross_entropy_loss", {OpClass::kClassIndex, 4}},
      {"aten::nll_loss_nd", {OpClass::kClassIndex, 4}},
      {"aten::nll_loss", {OpClass::kClassIndex, 4}},
      {"aten::nll_loss2d", {OpClass::kClassIndex, 4}},
      {"aten::multi_margin_loss", {OpClass::kClassIndex, -1}},
      {"aten::one_hot", {OpClass::kOneHot, -1}},
  };
  return *table;
}

struct Operand {
  std::string role;
  Shape shape;
  bool grad = false;
};

// Where in the user's Python code an op was called (empty for C++ callers).
struct Source {
  std::string where;  // "path/train.py:42 in loss_fn"
  std::string file;   // basename:line, for the finding's name
  std::string via;    // the torch function it went through, e.g. "torch.nn.functional.mse_loss"
};

// A broadcast_tensors call waiting to see whether a loss op consumes its result.
struct Deferred {
  bool valid = false;
  std::vector<Operand> ops;
  Shape out;
  Source src;
};

// The last class-index target checked (by check_target before the op, then by the op's callback).
struct LastTarget {
  c10::Storage storage;  // held, so that a new batch at a reused address is not mistaken for it
  int64_t offset = 0;
  int64_t numel = -1;
  int64_t version = 0;
  int64_t classes = 0;
  std::optional<int64_t> ignore;
  int64_t batch = -1;
};

struct LabelCheck {
  std::string op;
  int64_t numel = 0;
  int64_t classes = 0;  // INT64_MAX: one_hot with num_classes=-1 (only negatives are bad)
  std::optional<int64_t> ignore;
  int64_t step = 0;
  Source src;
};

struct DeviceCheck {
  LabelCheck check;
  at::Tensor flags;  // int64 [3] on the device: bad count, min and max of the non-ignored values
};

struct InFlight {
  host::HostCopy copy;
  std::vector<LabelCheck> checks;
};

}  // namespace

struct Core {
  std::mutex mu;  // owner, fresh, overhead, device state
  SanitizerImpl* owner = nullptr;
  std::atomic<bool> active{false};
  std::thread::id thread;  // the audited thread (under the registry's mutex)
  bool open = true;
  bool want_broadcast = false, want_label = false, want_batch = false;
  bool sync = false;
  bool print_failing = false;
  std::vector<Finding> fresh;
  double overhead_s = 0.0;
  std::vector<DeviceCheck> device_checks;
  std::vector<InFlight> in_flight;
  // Audit thread only.
  Deferred deferred;
  LastTarget last_target;
};

namespace {

// ---------------------------------------------------------------------------------------------
// The process-wide observer

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

struct InLoss : at::ObserverContext {};

// A broadcast_tensors call is deferred on this thread (Deferred): elementwise ops cannot take
// the fast path, they flush it.
thread_local bool t_deferred_pending = false;

// Inside the audit: TrainSan's own ops are not audited and need no autograd. (Where we issue ops,
// RecordFunction is switched off as well, which also keeps them out of a user's profile; not
// here, because toggling it rebuilds ATen's thread-local callback cache.)
class OwnOps {
 public:
  OwnOps() : prev_(t_own_ops) { t_own_ops = true; }
  ~OwnOps() { t_own_ops = prev_; }
  OwnOps(const OwnOps&) = delete;
  OwnOps& operator=(const OwnOps&) = delete;

 private:
  bool prev_;
  at::NoGradGuard no_grad_;
};

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn);
void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx);

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

// One open OpAudit fewer; the last one removes the observer.
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

// ---------------------------------------------------------------------------------------------
// Shapes

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (const int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

std::optional<Shape> broadcast_shape(const std::vector<Operand>& ops) {
  size_t rank = 0;
  for (const auto& o : ops) rank = std::max(rank, o.shape.size());
  Shape out(rank, 1);
  for (const auto& o : ops) {
    const size_t lead = rank - o.shape.size();
    for (size_t k = 0; k < o.shape.size(); ++k) {
      const int64_t d = o.shape[k];
      int64_t& r = out[lead + k];
      if (d == 1) continue;
      if (r == 1) {
        r = d;
      } else if (r != d) {
        return std::nullopt;  // not broadcastable: the op fails on its own
      }
    }
  }
  return out;
}

// Size of operand `o` along result axis `i` (right-aligned; 1 where the operand has no such dim).
int64_t dim_at(const Operand& o, size_t i, size_t rank) {
  const size_t lead = rank - o.shape.size();
  return i < lead ? 1 : o.shape[i - lead];
}

// The elementwise rule of Note [Op audit].
bool implicit_cross_broadcast(const std::vector<Operand>& ops, const Shape& out) {
  if (ops.size() < 2) return false;
  int64_t largest = 0;
  bool same_rank = true, grad = false;
  for (const auto& o : ops) {
    largest = std::max(largest, numel_of(o.shape));
    same_rank = same_rank && o.shape.size() == ops[0].shape.size();
    grad = grad || o.grad;
  }
  if (numel_of(out) <= largest || same_rank || !grad) return false;
  const size_t rank = out.size();
  for (const auto& a : ops) {
    for (const auto& b : ops) {
      if (&a == &b) continue;
      for (size_t i = 0; i < rank; ++i) {
        const int64_t s = dim_at(b, i, rank);
        if (dim_at(a, i, rank) != 1 || s <= 1) continue;  // b expands a along i by s
        for (size_t j = 0; j < rank; ++j) {
          if (j != i && dim_at(b, j, rank) == 1 && dim_at(a, j, rank) == s) return true;
        }
      }
    }
  }
  return false;
}

void collect(const c10::IValue& v, const std::string& role, std::vector<Operand>& out) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined()) out.push_back({role, t.sizes().vec(), t.requires_grad()});
  } else if (v.isTensorList()) {
    const auto list = v.toTensorList();
    for (size_t k = 0; k < list.size(); ++k) {
      const at::Tensor t = list.get(k);
      if (t.defined())
        out.push_back({role + std::to_string(k), t.sizes().vec(), t.requires_grad()});
    }
  }
}

std::string operands_str(const std::vector<Operand>& ops) {
  std::string s;
  for (size_t k = 0; k < ops.size(); ++k) {
    if (k) s += k + 1 == ops.size() ? " and " : ", ";
    if (!ops[k].role.empty()) s += ops[k].role + " ";
    s += shape_str(ops[k].shape);
  }
  return s;
}

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(4);
  os << v;
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// Source lines (Python callers only: RecordFunction carries no stack; the Python frames come from
// torch's CapturedTraceback, which the torch Python module installs)

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_torch_file(const std::string& f) {
  for (const char* p : {"/site-packages/torch/", "/dist-packages/torch/", "/torch/nn/",
                        "/torch/distributions/", "/torch/utils/", "/torch/autograd/"}) {
    if (f.find(p) != std::string::npos) return true;
  }
  return ends_with(f, "/torch/functional.py") || ends_with(f, "/torch/_tensor.py") ||
         ends_with(f, "/torch/overrides.py");
}

bool is_trainsan_file(const std::string& f) {
  return ends_with(f, "/trainsan/sanitizer.py") || ends_with(f, "/trainsan/audit.py");
}

std::string basename(const std::string& f) {
  const size_t k = f.find_last_of('/');
  return k == std::string::npos ? f : f.substr(k + 1);
}

Source python_source() {
  Source s;
  try {
    const std::shared_ptr<torch::CapturedTraceback> tb =
        torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
    if (!tb) return s;
    const torch::SymbolizedTracebacks st = torch::symbolize({tb.get()});
    if (st.tracebacks.empty()) return s;
    for (const uint64_t k : st.tracebacks[0]) {  // innermost frame first
      const torch::unwind::Frame& f = st.all_frames.at(k);
      if (is_trainsan_file(f.filename)) continue;
      if (is_torch_file(f.filename)) {
        if (s.via.empty() && ends_with(f.filename, "/torch/nn/functional.py")) {
          s.via = "torch.nn.functional." + f.funcname;
        }
        continue;
      }
      s.where = f.filename + ":" + std::to_string(f.lineno) + " in " + f.funcname;
      s.file = basename(f.filename) + ":" + std::to_string(f.lineno);
      break;
    }
  } catch (const std::exception&) {
    // no Python, or a frame that cannot be symbolised: the message goes without a source line
  }
  return s;
}

std::string finding_name(const std::string& op, const Source& src) {
  return src.file.empty() ? op : op + " (" + src.file + ")";
}

// "aten::mse_loss (from torch.nn.functional.mse_loss)"
std::string op_desc(const std::string& op, const Source& src) {
  return src.via.empty() ? op : op + " (from " + src.via + ")";
}

// ", at path/train.py:42 in loss_fn", or nothing for a C++ caller.
std::string at_source(const Source& src) {
  return src.where.empty() ? std::string() : ", at " + src.where;
}

// ---------------------------------------------------------------------------------------------
// Recording

std::vector<Finding> record(Core& c, const std::string& kind, const std::string& name,
                            const std::string& message, std::optional<double> value, bool to_fresh,
                            bool likely_to_fail, int64_t at_step = -1) {
  std::vector<Finding> fs;
  const std::lock_guard<std::mutex> lock(c.mu);
  if (c.owner == nullptr) return fs;
  fs = c.owner->add(kind, name, message, value, at_step);
  if (to_fresh) {
    c.fresh.insert(c.fresh.end(), fs.begin(), fs.end());
    // The op usually fails right after (IndexError, device-side assert), before the next event
    // could report the finding: say it now.
    if (likely_to_fail && c.print_failing) {
      for (const auto& f : fs)
        std::cerr << "[trainsan] " << f.severity << ": " << f.message << '\n';
    }
  }
  return fs;
}

void report_broadcast(Core& c, const std::string& op, const std::vector<Operand>& ops,
                      const Shape& out, const Source& src) {
  int64_t largest = 0;
  for (const auto& o : ops) largest = std::max(largest, numel_of(o.shape));
  const double ratio =
      static_cast<double>(numel_of(out)) / static_cast<double>(std::max<int64_t>(largest, 1));
  record(c, "broadcast", finding_name(op, src),
         op_desc(op, src) + " broadcast " + operands_str(ops) + " into " + shape_str(out) + " (" +
             fmt(ratio) + "x the largest input) through implicit rank promotion" + at_source(src) +
             " — every element of one operand "
             "meets every element of the other, as when an [N, 1] prediction meets an [N] target "
             "and gives [N, N]; make the shapes equal (squeeze(-1) / unsqueeze(-1)), or write the "
             "broadcast with explicit singleton dims on both operands (a[:, None] - b[None]) if "
             "it is meant",
         ratio, /*to_fresh=*/true, /*likely_to_fail=*/false);
}

void flush_deferred(Core& c) {
  t_deferred_pending = false;
  if (!c.deferred.valid) return;
  Deferred d = std::move(c.deferred);
  c.deferred = Deferred();
  if (c.want_broadcast && implicit_cross_broadcast(d.ops, d.out)) {
    report_broadcast(c, "aten::broadcast_tensors", d.ops, d.out, d.src);
  }
}

// ---------------------------------------------------------------------------------------------
// The rules

void on_elementwise(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in) {
  std::vector<Operand> ops;
  for (const auto& v : in) collect(v, "", ops);
  if (ops.size() < 2) return;
  const std::optional<Shape> out = broadcast_shape(ops);
  if (!out || !implicit_cross_broadcast(ops, *out)) return;
  report_broadcast(c, name, ops, *out, python_source());
}

void on_broadcast_tensors(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in) {
  flush_deferred(c);
  if (!c.want_broadcast && !c.want_batch) return;
  std::vector<Operand> ops;
  for (const auto& v : in) collect(v, "operand ", ops);
  const std::optional<Shape> out = broadcast_shape(ops);
  if (!out) return;
  if (ops.size() != 2) {
    if (c.want_broadcast && implicit_cross_broadcast(ops, *out)) {
      report_broadcast(c, name, ops, *out, python_source());
    }
    return;
  }
  const bool grows = numel_of(*out) > std::max(numel_of(ops[0].shape), numel_of(ops[1].shape));
  const bool batch = !ops[0].shape.empty() && ops[0].shape.size() == ops[1].shape.size() &&
                     ops[0].shape[0] != ops[1].shape[0];
  if (!grows && !batch) return;  // nothing a loss rule or the elementwise rule could flag
  c.deferred = Deferred{true, ops, *out, python_source()};
  t_deferred_pending = true;
}

void on_loss(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in) {
  static const char* const kRoles[] = {"input", "target", "weight", "pos_weight"};
  std::vector<Operand> ops;
  for (size_t k = 0; k < in.size() && k < 4; ++k) collect(in[k], kRoles[k], ops);
  Deferred d = std::move(c.deferred);
  c.deferred = Deferred();
  t_deferred_pending = false;
  if (ops.size() < 2 || ops[0].role != "input" || ops[1].role != "target") {
    if (d.valid) {
      c.deferred = std::move(d);
      flush_deferred(c);
    }
    return;
  }
  bool have_src = false;
  Source src;
  if (d.valid && ops[0].shape == d.out && ops[1].shape == d.out) {
    ops[0].shape = d.ops[0].shape;  // the shapes the user passed to F.*_loss
    ops[1].shape = d.ops[1].shape;
    src = d.src;
    have_src = true;
  } else if (d.valid) {
    c.deferred = std::move(d);
    flush_deferred(c);
  }
  const std::optional<Shape> out = broadcast_shape(ops);
  if (!out) return;
  const Shape& a = ops[0].shape;
  const Shape& b = ops[1].shape;
  const bool grows =
      c.want_broadcast && numel_of(*out) > numel_of(a) && numel_of(*out) > numel_of(b);
  const bool batch = c.want_batch && !a.empty() && a.size() == b.size() && a[0] != b[0];
  if (!grows && !batch) return;
  if (!have_src) src = python_source();
  if (grows) {
    const double ratio =
        static_cast<double>(numel_of(*out)) /
        static_cast<double>(std::max<int64_t>(std::max(numel_of(a), numel_of(b)), 1));
    record(c, "broadcast", finding_name(name, src),
           op_desc(name, src) + " got " + operands_str(ops) + ", which broadcast into " +
               shape_str(*out) + " (" + fmt(ratio) + "x the input)" + at_source(src) +
               " — the loss is taken over every (prediction, target) pair instead of "
               "matching them one to one; give input, target (and weight) the same shape, e.g. "
               "pred.squeeze(-1) or target.unsqueeze(-1) / weight.view_as(target)",
           ratio, /*to_fresh=*/true, /*likely_to_fail=*/false);
  }
  if (batch) {
    record(c, "batch_mismatch", finding_name(name, src),
           op_desc(name, src) + " got input of batch size " + std::to_string(a[0]) + " " +
               shape_str(a) + " and target of batch size " + std::to_string(b[0]) + " " +
               shape_str(b) + at_source(src) +
               " — the loss pairs samples with the wrong targets (or broadcasts one target over "
               "the batch); check that input and target come from the same batch and that no "
               "indexing, unsqueeze(0) or transpose moved the batch dimension",
           static_cast<double>(b[0]), /*to_fresh=*/true, /*likely_to_fail=*/a[0] != 1 && b[0] != 1);
  }
}

// Bad-value count, min and max over the non-ignored values of an integer target.
struct LabelStats {
  int64_t bad = 0;
  int64_t lo = std::numeric_limits<int64_t>::max();
  int64_t hi = std::numeric_limits<int64_t>::min();
};

LabelStats label_stats_host(const at::Tensor& target, int64_t classes,
                            std::optional<int64_t> ignore) {
  const at::DisableRecordFunctionGuard unobserved;
  const at::Tensor t = target.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t* p = t.const_data_ptr<int64_t>();
  LabelStats s;
  for (int64_t k = 0, n = t.numel(); k < n; ++k) {
    const int64_t v = p[k];
    if (ignore && v == *ignore) continue;
    s.lo = std::min(s.lo, v);
    s.hi = std::max(s.hi, v);
    s.bad += (v < 0 || v >= classes) ? 1 : 0;
  }
  return s;
}

at::Tensor label_flags_device(const at::Tensor& target, int64_t classes,
                              std::optional<int64_t> ignore) {
  const at::DisableRecordFunctionGuard unobserved;
  const at::Tensor v = target.to(at::kLong).reshape({-1});
  const at::Tensor valid = ignore ? v.ne(*ignore) : at::ones_like(v, v.options().dtype(at::kBool));
  const at::Tensor bad = at::logical_and(at::logical_or(v.lt(0), v.ge(classes)), valid);
  const at::Tensor lo = at::where(valid, v, at::Scalar(std::numeric_limits<int64_t>::max())).amin();
  const at::Tensor hi = at::where(valid, v, at::Scalar(std::numeric_limits<int64_t>::min())).amax();
  return at::stack({bad.sum(), lo, hi});
}

std::vector<Finding> report_labels(Core& c, const LabelCheck& k, const LabelStats& s,
                                   bool to_fresh) {
  if (s.bad == 0) return {};
  const bool one_hot = k.op == "aten::one_hot";
  const bool known = k.classes != std::numeric_limits<int64_t>::max();
  std::ostringstream msg;
  msg << "the target of " << op_desc(k.op, k.src) << " holds " << s.bad << " of " << k.numel
      << " class indices outside [0, " << (known ? std::to_string(k.classes) : "inf") << ")";
  if (k.ignore) msg << " that are not ignore_index (" << *k.ignore << ")";
  msg << " (values " << s.lo << ".." << s.hi << ")" << at_source(k.src) << " — ";
  if (known && s.lo >= 1 && s.hi == k.classes) {
    msg << "the labels look 1-based (1.." << k.classes
        << "): subtract 1 from them (or give the model " << k.classes + 1
        << " outputs if there really are that many classes)";
  } else if (s.lo < 0 && one_hot) {
    msg << "one_hot needs non-negative class indices: drop or remap padding such as " << s.lo
        << " before one_hot";
  } else if (s.lo < 0) {
    msg << "negative labels such as " << s.lo << " are neither classes nor the ignore_index";
    if (k.ignore) msg << " (" << *k.ignore << ")";
    msg << ": mark padding with the ignore_index, or pass ignore_index=" << s.lo;
  } else {
    msg << "the model has " << k.classes << " classes but the target holds class " << s.hi
        << ": check the output layer's size (num_classes) against the label set";
  }
  return record(c, "label_range", finding_name(k.op, k.src), msg.str(), static_cast<double>(s.bad),
                to_fresh, /*likely_to_fail=*/true, k.step);
}

// The class-index rules for one call; `now` reads device targets at once (sync, or the Python
// layer's check before the op).
std::vector<Finding> check_class_target(Core& c, const std::string& op, const at::Tensor& input,
                                        const at::Tensor& target, std::optional<int64_t> ignore,
                                        int64_t num_classes, bool now, bool to_fresh) {
  std::vector<Finding> out;
  if (!target.defined()) return out;
  int64_t classes = num_classes;
  if (classes < 0 && input.defined()) {
    if (input.dim() == 0) return out;
    classes = input.dim() >= 2 ? input.size(1) : input.size(0);
  }
  if (classes < 0) classes = std::numeric_limits<int64_t>::max();  // one_hot(num_classes=-1)
  // The Python sync path checks a target before the op, whose callback then sees it again.
  LastTarget& last = c.last_target;
  const bool has_storage = target.has_storage();
  const int64_t batch = input.defined() && input.dim() >= 2 ? input.size(0) : -1;
  if (has_storage && static_cast<bool>(last.storage) &&
      last.storage.is_alias_of(target.storage()) && last.offset == target.storage_offset() &&
      last.numel == target.numel() && last.version == target._version() &&
      last.classes == classes && last.ignore == ignore && last.batch == batch) {
    return out;
  }
  if (has_storage) {
    last = LastTarget{target.storage(),
                      target.storage_offset(),
                      target.numel(),
                      target._version(),
                      classes,
                      ignore,
                      batch};
  }
  Source src;
  bool have_src = false;
  auto source = [&]() -> const Source& {
    if (!have_src) src = python_source();
    have_src = true;
    return src;
  };
  if (c.want_batch && input.defined() && input.dim() >= 2 && target.dim() >= 1 &&
      target.size(0) != input.size(0)) {
    const Source& s = source();
    auto fs = record(c, "batch_mismatch", finding_name(op, s),
                     op_desc(op, s) + " got input of batch size " + std::to_string(input.size(0)) +
                         " " + shape_str(input.sizes().vec()) + " and target of batch size " +
                         std::to_string(target.size(0)) + " " + shape_str(target.sizes().vec()) +
                         at_source(s) +
                         " — input and target come from different batches, or a reshape/transpose "
                         "moved the batch dimension",
                     static_cast<double>(target.size(0)), to_fresh, /*likely_to_fail=*/true);
    out.insert(out.end(), fs.begin(), fs.end());
  }
  if (!c.want_label || !at::isIntegralType(target.scalar_type(), /*includeBool=*/false) ||
      target.numel() == 0) {
    return out;
  }
  int64_t step = 0;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (c.owner == nullptr) return out;
    step = c.owner->step;
  }
  LabelCheck k{op, target.numel(), classes, ignore, step, {}};
  if (target.is_cuda() && !now && !c.sync && cuda_compiled()) {
    k.src = source();
    at::Tensor flags = label_flags_device(target, classes, ignore);
    const std::lock_guard<std::mutex> lock(c.mu);
    c.device_checks.push_back({std::move(k), std::move(flags)});
    return out;
  }
  const LabelStats s = label_stats_host(target, classes, ignore);
  if (s.bad > 0) {
    k.src = source();
    auto fs = report_labels(c, k, s, to_fresh);
    out.insert(out.end(), fs.begin(), fs.end());
  }
  return out;
}

void on_class_index(Core& c, const OpInfo& info, const char* name,
                    c10::ArrayRef<const c10::IValue> in) {
  if (!c.want_label && !c.want_batch) return;
  if (info.cls == OpClass::kOneHot) {
    if (in.size() < 2 || !in[0].isTensor() || !in[1].isInt()) return;
    check_class_target(c, name, at::Tensor(), in[0].toTensor(), std::nullopt, in[1].toInt(),
                       /*now=*/false, /*to_fresh=*/true);
    return;
  }
  if (in.size() < 2 || !in[0].isTensor() || !in[1].isTensor()) return;
  std::optional<int64_t> ignore;
  if (info.ignore_arg >= 0) {
    ignore = -100;
    const auto k = static_cast<size_t>(info.ignore_arg);
    if (k < in.size() && in[k].isInt()) ignore = in[k].toInt();
  }
  check_class_target(c, name, in[0].toTensor(), in[1].toTensor(), ignore, -1, /*now=*/false,
                     /*to_fresh=*/true);
}

void audit_op(Core& c, const OpInfo& info, const char* name, c10::ArrayRef<const c10::IValue> in) {
  switch (info.cls) {
    case OpClass::kBroadcastTensors:
      on_broadcast_tensors(c, name, in);
      return;
    case OpClass::kLoss:
      on_loss(c, name, in);
      return;
    case OpClass::kElementwise:
      flush_deferred(c);
      if (c.want_broadcast) on_elementwise(c, name, in);
      return;
    case OpClass::kClassIndex:
    case OpClass::kOneHot:
      flush_deferred(c);
      on_class_index(c, info, name, in);
      return;
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
  }
  if (ctx) t_loss_depth += 1;
  return ctx;
}

void on_op_end(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  if (ctx != nullptr) t_loss_depth -= 1;
}

std::vector<Finding> read_in_flight(Core& c, std::vector<InFlight> flights) {
  std::vector<Finding> out;
  for (InFlight& f : flights) {
    host::wait_host_copy(f.copy);
    const int64_t* p = f.copy.host.ints.const_data_ptr<int64_t>();
    for (size_t r = 0; r < f.checks.size(); ++r) {
      const LabelStats s{p[3 * r], p[3 * r + 1], p[3 * r + 2]};
      auto fs = report_labels(c, f.checks[r], s, /*to_fresh=*/false);
      out.insert(out.end(), fs.begin(), fs.end());
    }
  }
  return out;
}

// Starts the copies of this step's device flags (one per device); `wait` reads them at once.
std::vector<Finding> ship_device_checks(Core& c, bool wait) {
  std::vector<DeviceCheck> checks;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    checks.swap(c.device_checks);
  }
  if (checks.empty()) return {};
  const OwnOps own;
  const at::DisableRecordFunctionGuard unobserved;
  std::map<std::pair<int, int>, std::vector<size_t>> by_device;
  for (size_t k = 0; k < checks.size(); ++k) {
    const at::Device d = checks[k].flags.device();
    by_device[{static_cast<int>(d.type()), d.index()}].push_back(k);
  }
  std::vector<InFlight> flights;
  for (const auto& [dev, idx] : by_device) {
    std::vector<at::Tensor> flags;
    InFlight f;
    for (const size_t k : idx) {
      flags.push_back(checks[k].flags);
      f.checks.push_back(std::move(checks[k].check));
    }
    const at::Tensor ints = at::stack(flags);
    f.copy = host::start_host_copy(
        {ints, at::empty({ints.size(0), 0}, ints.options().dtype(at::kDouble))});
    flights.push_back(std::move(f));
  }
  if (wait) return read_in_flight(c, std::move(flights));
  const std::lock_guard<std::mutex> lock(c.mu);
  for (auto& f : flights) c.in_flight.push_back(std::move(f));
  return {};
}

}  // namespace
}  // namespace audit

// ---------------------------------------------------------------------------------------------
// OpAudit

OpAudit::OpAudit(SanitizerImpl& owner) : core_(std::make_shared<audit::Core>()) {
  core_->owner = &owner;
  const Options& o = owner.opts;
  core_->want_broadcast = o.enabled("broadcast");
  core_->want_label = o.enabled("label_range");
  core_->want_batch = o.enabled("batch_mismatch");
  core_->sync = o.sync;
  core_->print_failing = o.policy != "record";
  audit::Registry& r = audit::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  r.open += 1;
}

OpAudit::~OpAudit() {
  stop();
  bool was_open = false;
  {
    const std::lock_guard<std::mutex> lock(core_->mu);
    core_->owner = nullptr;
    was_open = core_->open;
    core_->open = false;
  }
  if (was_open) audit::release();
}

void OpAudit::begin_forward() {
  audit::Core& c = *core_;
  if (!c.want_broadcast && !c.want_label && !c.want_batch) return;
  int64_t step = 0, first = 0, every = 0;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (!c.open || c.owner == nullptr) return;
    step = c.owner->step;
    first = c.owner->opts.audit_first_steps;
    every = c.owner->opts.audit_every;
  }
  if (step >= first && (every <= 0 || step % every != 0)) return;
  audit::flush_deferred(c);
  c.last_target = audit::LastTarget();
  c.active.store(true);
  audit::activate(core_);
}

void OpAudit::stop() {
  if (!core_->active.load(std::memory_order_relaxed)) return;
  if (core_->active.exchange(false)) audit::deactivate(core_);
}

bool OpAudit::auditing() const { return core_->active.load(); }

std::vector<Finding> OpAudit::take() {
  audit::Core& c = *core_;
  audit::flush_deferred(c);
  const std::lock_guard<std::mutex> lock(c.mu);
  std::vector<Finding> out;
  out.swap(c.fresh);
  if (c.owner != nullptr) {
    c.owner->add_overhead(c.overhead_s);
  }
  c.overhead_s = 0.0;
  return out;
}

std::vector<Finding> OpAudit::step_end() {
  stop();
  std::vector<Finding> out = take();
  audit::Core& c = *core_;
  c.last_target = audit::LastTarget();
  // The previous step's flags first (they have had a whole step to land), then this step's.
  std::vector<audit::InFlight> prev;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    prev.swap(c.in_flight);
  }
  auto a = audit::read_in_flight(c, std::move(prev));
  auto b = audit::ship_device_checks(c, /*wait=*/c.sync);
  out.insert(out.end(), a.begin(), a.end());
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

std::vector<Finding> OpAudit::close() {
  audit::Core& c = *core_;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (!c.open) return {};
  }
  std::vector<Finding> out = step_end();
  auto rest = audit::ship_device_checks(c, /*wait=*/true);
  std::vector<audit::InFlight> prev;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    prev.swap(c.in_flight);
    c.open = false;
  }
  auto more = audit::read_in_flight(c, std::move(prev));
  out.insert(out.end(), rest.begin(), rest.end());
  out.insert(out.end(), more.begin(), more.end());
  c.last_target = audit::LastTarget();
  audit::release();
  return out;
}

std::vector<Finding> OpAudit::check_target(const std::string& op, const at::Tensor& input,
                                           const at::Tensor& target,
                                           std::optional<int64_t> ignore_index,
                                           int64_t num_classes) {
  audit::Core& c = *core_;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    if (!c.open) return {};
  }
  const audit::OwnOps own;
  return audit::check_class_target(c, op, input, target, ignore_index, num_classes, /*now=*/true,
                                   /*to_fresh=*/false);
}

bool audit_observer_registered() {
  audit::Registry& r = audit::registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  return r.handle != at::INVALID_CALLBACK_HANDLE;
}

}  // namespace trainsan
