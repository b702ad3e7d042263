// Internals of the op audit shared by audit/*.cpp: the state of one sanitizer's audit (Core) and
// the functions of each part. Not for use outside host/audit/.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "audit.h"
#include "audit/shape_rules.h"
#include "source_location.h"
#include "trainsan/kinds.h"

namespace trainsan::host::audit {

enum class OpClass { kElementwise, kBroadcastTensors, kLoss, kClassIndex, kOneHot, kEmbedding };

// What a loss op expects as its input (probs_as_logits, Note [Probabilities as logits]).
enum class Expects { kAny, kLogits, kLogProbs, kBinaryLogits };

struct OpInfo {
  OpClass cls;
  int ignore_arg = -1;  // class-index ops: position of ignore_index, -1 when the op has none
  Expects expects = Expects::kAny;
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

// One class-index target checked on the device, to be reported when its flags are read.
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
  at::Tensor flags;  // int64 [4] on the device: bad count, min and max of the non-ignored values,
                     // and their count
};

// Values reduced on the device for a rule, read without a synchronisation: `values` (double,
// 1-D) is copied to the host at the step end with the label flags (ship_device_checks) and
// handed to `judge` when the copy has landed (Note [Lagged checks]).
struct Core;
struct DeviceRead {
  at::Tensor values;
  std::function<void(Core&, const double*)> judge;
};

// probs_as_logits at one call site of a binary loss: the audited steps in a row on which every
// call's input looked like sigmoid outputs (Note [Probabilities as logits]).
struct SigmoidRun {
  int64_t last_step = -1;    // the last step counted
  int64_t broken_step = -1;  // a step on which a call of the site did not look so
  int steps = 0;
};

struct Core : std::enable_shared_from_this<Core> {
  explicit Core(AuditConfig config) : cfg(std::move(config)) {}

  const AuditConfig cfg;
  std::mutex mu;  // sink, readback, open, overhead_s, device_checks, device_reads, sigmoid_runs
  FindingSink* sink = nullptr;
  ReadbackQueue* readback = nullptr;
  bool open = true;
  double overhead_s = 0.0;
  int64_t audited_forwards = 0;  // coverage (under mu)
  int64_t ops_audited = 0;
  std::vector<DeviceCheck> device_checks;
  std::vector<DeviceRead> device_reads;
  std::map<std::string, SigmoidRun> sigmoid_runs;    // by call site (probs_as_logits)
  std::map<int64_t, ClassTargetFacts> target_facts;  // per audited step, the last few (empty_loss)
  std::atomic<bool> active{false};
  std::thread::id thread;  // the audited thread (under the registry's mutex)
  // Audit thread only.
  int64_t step = 0;  // of the audited forward
  Deferred deferred;
  LastTarget last_target;
  // label_dtype (Note [Label dtype]): the step's small-integer batch tensors, and whether it
  // was reported.
  std::vector<at::Tensor> batch;
  bool label_dtype_found = false;
  // target_leak (Note [Target leak]): the forward's inputs, this audited forward's embedding
  // lookups of integer sequences (indices of rank >= 2, and the output whose gradient confirms a
  // leak), and the gradient hooks still installed on such outputs (removed at the step end).
  struct Embedded {
    at::Tensor indices;
    at::Tensor output;
  };
  std::vector<at::Tensor> inputs;
  std::vector<Embedded> embedded;
  std::vector<std::pair<at::Tensor, unsigned>> leak_hooks;
  std::atomic<bool> target_leak_found{false};  // set by a gradient hook too
};

// ---------------------------------------------------------------------------------------------
// observer.cpp: the process-wide observer

void claim();    // one more open OpAudit
void release();  // one open OpAudit fewer; the last one removes the observer
void activate(const std::shared_ptr<Core>& core);  // start auditing this thread's ops for core
void deactivate(const std::shared_ptr<Core>& core);
// While paused (nesting), the observer ignores this thread's ops and autograd nodes.
void pause_this_thread(bool paused);
// A broadcast_tensors call is deferred on this thread (Deferred): elementwise ops cannot take
// the observer's fast path, they flush it.
void set_deferred_pending(bool pending);

// Inside the audit: TrainSan's own ops are not audited and need no autograd. (Where we issue ops,
// RecordFunction is switched off as well, which also keeps them out of a user's profile; not
// here, because toggling it rebuilds ATen's thread-local callback cache.)
class OwnOps {
 public:
  OwnOps();
  ~OwnOps();
  OwnOps(const OwnOps&) = delete;
  OwnOps& operator=(const OwnOps&) = delete;

 private:
  bool prev_;
  at::NoGradGuard no_grad_;
};

// ---------------------------------------------------------------------------------------------
// audit.cpp

// Records a finding of `step` in the sink (nothing once the OpAudit is gone). `say_now`: the op
// is likely to fail right after, before the next event could report it; print it at once.
void record(Core& c, Kind kind, const std::string& name, const std::string& message,
            std::optional<double> value, int64_t step, bool say_now);

// ---------------------------------------------------------------------------------------------
// broadcast.cpp: elementwise and loss ops

void flush_deferred(Core& c);
void on_elementwise(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in);
void on_broadcast_tensors(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in);
void on_loss(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in);

// ---------------------------------------------------------------------------------------------
// labels.cpp: class-index ops

void on_class_index(Core& c, const OpInfo& info, const char* name,
                    c10::ArrayRef<const c10::IValue> in);
// The class-index rules for one call of `step`; `now` reads device targets at once (sync, or the
// Python layer's check before the op); `from_op`: called from the op's callback.
void check_class_target(Core& c, const std::string& op, const at::Tensor& input,
                        const at::Tensor& target, std::optional<int64_t> ignore,
                        int64_t num_classes, int64_t step, bool now, bool from_op);
// ---------------------------------------------------------------------------------------------
// leaks.cpp: target_leak (Note [Target leak])

// An embedding lookup of the audited forward ended with `output`.
void on_embedding(Core& c, const at::Tensor& indices, const at::Tensor& output);
// A class-index loss (logits `input`, class targets) or a pointwise loss (prediction, target).
void check_sequence_leak(Core& c, const char* op, const at::Tensor& target,
                         std::optional<int64_t> ignore, int64_t step);
void check_column_leak(Core& c, const char* op, const at::Tensor& target, int64_t step);
// The step ended: remove the gradient hooks that did not run, forget the lookups.
void end_leak_checks(Core& c);

// ---------------------------------------------------------------------------------------------
// probs.cpp: probs_as_logits (Note [Probabilities as logits])

// A loss op that expects logits or log-probabilities (info.expects) got `in`.
void check_loss_input(Core& c, const OpInfo& info, const char* name,
                      c10::ArrayRef<const c10::IValue> in);

// Starts the copies of the device label flags and the device reads recorded so far (one per
// device and list) and queues them in the read-back queue (Phase::kLabels); its drain reports them.
void ship_device_checks(const std::shared_ptr<Core>& core);

}  // namespace trainsan::host::audit
