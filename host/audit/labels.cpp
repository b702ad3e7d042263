// The class-index rules of the op audit (Note [Op audit] in audit/observer.cpp): `label_range`,
// `label_dtype` (Note [Label dtype]) and `batch_mismatch` of cross_entropy, nll_loss,
// multi_margin_loss and one_hot, on the host or as device flags read back a step later (Note
// [Lagged checks]).
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <utility>

#include "audit/core.h"
#include "finding_sink.h"
#include "readback.h"
#include "trainsan/stats.h"

namespace trainsan::host::audit {

namespace {

// Bad-value count, min and max over the non-ignored values of an integer target.
struct LabelStats {
  int64_t bad = 0;
  int64_t lo = std::numeric_limits<int64_t>::max();
  int64_t hi = std::numeric_limits<int64_t>::min();
  int64_t valid = 0;  // values that are not ignore_index
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
    s.valid += 1;
    s.lo = std::min(s.lo, v);
    s.hi = std::max(s.hi, v);
    s.bad += (v < 0 || v >= classes) ? 1 : 0;
  }
  return s;
}

// The same figures as an int64 [4] tensor on the target's device, with no synchronisation.
at::Tensor label_flags_device(const at::Tensor& target, int64_t classes,
                              std::optional<int64_t> ignore) {
  const at::DisableRecordFunctionGuard unobserved;
  const at::Tensor v = target.to(at::kLong).reshape({-1});
  const at::Tensor valid = ignore ? v.ne(*ignore) : at::ones_like(v, v.options().dtype(at::kBool));
  const at::Tensor bad = at::logical_and(at::logical_or(v.lt(0), v.ge(classes)), valid);
  const at::Tensor lo = at::where(valid, v, at::Scalar(std::numeric_limits<int64_t>::max())).amin();
  const at::Tensor hi = at::where(valid, v, at::Scalar(std::numeric_limits<int64_t>::min())).amax();
  return at::stack({bad.sum(), lo, hi, valid.sum()});
}

// Counts one class-index loss call of k.step for empty_loss and trivial_loss (ClassTargetFacts);
// one_hot is no loss. The last few steps are kept.
void note_targets(Core& c, const LabelCheck& k, int64_t valid) {
  if (k.op == "aten::one_hot") return;
  const std::lock_guard<std::mutex> lock(c.mu);
  ClassTargetFacts& f = c.target_facts[k.step];
  f.calls += 1;
  f.targets += k.numel;
  f.valid += valid;
  f.empty_calls += valid == 0 ? 1 : 0;
  if (k.classes != std::numeric_limits<int64_t>::max()) f.classes = std::max(f.classes, k.classes);
  while (c.target_facts.size() > 8) c.target_facts.erase(c.target_facts.begin());
}

void report_labels(Core& c, const LabelCheck& k, const LabelStats& s, bool from_op) {
  if (s.bad == 0) return;
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
  record(c, Kind::label_range, finding_name(k.op, k.src), msg.str(), static_cast<double>(s.bad),
         k.step, /*say_now=*/from_op);
}

// Note [Label dtype]
// ~~~~~~~~~~~~~~~~~~~
// Class targets kept in an integer type too small for the class count wrap silently: 300 classes
// stored as uint8 (a NumPy array, torch.tensor(labels, dtype=torch.uint8)) turn class 300 into
// 44, and the loss, which needs int64 targets, gets `y.long()` of the wrapped values — nothing
// fails and label_range sees values in range. What the op audit sees at a class-index loss is the
// int64 target and the class count C; the dtype the labels were stored in is visible only in the
// batch the step got (OpAudit::set_batch: the forward's inputs and the other tensors the data
// loader yielded with them) — or the target itself: cross_entropy and nll_loss take a uint8 target
// of a [N, C] or [C] input as it is (torch 2.11 on a CPU, tested; CUDA's nll_loss kernels are
// dispatched for Byte and Long indices alike, pytorch#59765; int8, int16 and the [N, C, d...] forms
// raise "expected scalar type Long"), so 300-class labels stored as uint8 train as wrapped classes
// with no conversion in sight.
// The rule: the target, when it is uint8/int8/int16, or a uint8/int8/int16 tensor of that batch
// with exactly the target's shape, whose values equal the target's (compared on the suspicious path
// only: its dtype holds fewer than C non-negative values), whose largest value reaches the top
// quarter of its dtype's range (wrapped labels fill the range up to its top: 192..255 for uint8),
// while C exceeds what the dtype can hold (256 for uint8, 128 for int8, 32768 for int16). Compact
// storage that fits (uint8 labels of 10 classes) is silent by C; a head larger than the label set
// (1000 outputs fine-tuned on classes 0..9 kept as uint8) by the labels' largest value; a uint8
// mask of the target's shape by the equality. Reported once per sanitizer.
void check_label_dtype(Core& c, const std::string& op, const at::Tensor& target, int64_t classes,
                       int64_t step, bool from_op, const std::function<const Source&()>& source) {
  const OwnOps own;
  const at::DisableRecordFunctionGuard unobserved;
  const at::ScalarType tt = target.scalar_type();
  const bool narrow = tt == at::kByte || tt == at::kChar || tt == at::kShort;
  std::vector<at::Tensor> stored;  // the target itself when narrow, then the batch's tensors
  if (narrow) stored.push_back(target);
  stored.insert(stored.end(), c.batch.begin(), c.batch.end());
  for (const at::Tensor& b : stored) {
    const bool itself = narrow && b.is_same(target);
    if (b.sizes() != target.sizes()) continue;
    const int64_t capacity = b.scalar_type() == at::kByte   ? 256
                             : b.scalar_type() == at::kChar ? 128
                                                            : 32768;
    if (classes <= capacity) continue;
    const at::Tensor v = b.to(at::kCPU).to(at::kLong);  // a sync only on this suspicious path
    const int64_t hi = v.max().item<int64_t>();
    if (hi < capacity - capacity / 4) continue;
    if (!itself && !at::equal(v, target.to(at::kCPU).to(at::kLong))) continue;
    const std::string dt = b.scalar_type() == at::kByte   ? "uint8"
                           : b.scalar_type() == at::kChar ? "int8"
                                                          : "int16";
    const Source& s = source();
    std::ostringstream msg;
    msg << "the target of " << op_desc(op, s) << (itself ? " is a " : " comes from a ") << dt
        << (itself ? " tensor " : " tensor of the batch ") << shape_str(b.sizes().vec())
        << ", but the loss has " << classes << " classes and " << dt << " holds only " << capacity
        << " non-negative values (this batch's largest label is " << hi << ")" << at_source(s)
        << " — labels of class " << capacity
        << " and above wrapped around when they were stored (class " << capacity + 44 << " became "
        << (capacity == 256 ? 44 : 44 - capacity)
        << "): keep the labels in int64 (torch.long) from the data set on, e.g. "
           "torch.tensor(labels, dtype=torch.long) or np.int64";
    record(c, Kind::label_dtype, finding_name(op, s), msg.str(), static_cast<double>(classes), step,
           /*say_now=*/from_op);
    c.label_dtype_found = true;
    return;
  }
}

}  // namespace

void check_class_target(Core& c, const std::string& op, const at::Tensor& input,
                        const at::Tensor& target, std::optional<int64_t> ignore,
                        int64_t num_classes, int64_t step, bool now, bool from_op) {
  if (!target.defined()) return;
  int64_t classes = num_classes;
  if (classes < 0 && input.defined()) {
    if (input.dim() == 0) return;
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
    return;
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
  const std::function<const Source&()> source = [&]() -> const Source& {
    if (!have_src) src = python_source(c.cfg.skip_frames);
    have_src = true;
    return src;
  };
  if (c.cfg.on(Kind::batch_mismatch) && input.defined() && input.dim() >= 2 && target.dim() >= 1 &&
      target.size(0) != input.size(0)) {
    const Source& s = source();
    record(c, Kind::batch_mismatch, finding_name(op, s),
           op_desc(op, s) + " got input of batch size " + std::to_string(input.size(0)) + " " +
               shape_str(input.sizes().vec()) + " and target of batch size " +
               std::to_string(target.size(0)) + " " + shape_str(target.sizes().vec()) +
               at_source(s) +
               " — input and target come from different batches, or a reshape/transpose "
               "moved the batch dimension",
           static_cast<double>(target.size(0)), step, /*say_now=*/from_op);
  }
  const at::ScalarType tt = target.scalar_type();
  const bool narrow = tt == at::kByte || tt == at::kChar || tt == at::kShort;
  if (c.cfg.on(Kind::label_dtype) && !c.label_dtype_found && (narrow || !c.batch.empty()) &&
      classes != std::numeric_limits<int64_t>::max() &&
      at::isIntegralType(target.scalar_type(), /*includeBool=*/false)) {
    check_label_dtype(c, op, target, classes, step, from_op, source);
  }
  if (!c.cfg.on(Kind::label_range) ||
      !at::isIntegralType(target.scalar_type(), /*includeBool=*/false) || target.numel() == 0) {
    return;
  }
  LabelCheck k{op, target.numel(), classes, ignore, step, {}};
  if (target.is_cuda() && !now && !c.cfg.sync && cuda_compiled()) {
    k.src = source();
    at::Tensor flags = label_flags_device(target, classes, ignore);
    const std::lock_guard<std::mutex> lock(c.mu);
    c.device_checks.push_back({std::move(k), std::move(flags)});
    return;
  }
  const LabelStats s = label_stats_host(target, classes, ignore);
  note_targets(c, k, s.valid);
  if (s.bad > 0) {
    k.src = source();
    report_labels(c, k, s, from_op);
  }
}

void on_class_index(Core& c, const OpInfo& info, const char* name,
                    c10::ArrayRef<const c10::IValue> in) {
  if (!c.cfg.on(Kind::label_range) && !c.cfg.on(Kind::batch_mismatch) &&
      !c.cfg.on(Kind::label_dtype) && !c.cfg.on(Kind::target_leak)) {
    return;
  }
  if (info.cls == OpClass::kOneHot) {
    if (in.size() < 2 || !in[0].isTensor() || !in[1].isInt()) return;
    check_class_target(c, name, at::Tensor(), in[0].toTensor(), std::nullopt, in[1].toInt(), c.step,
                       /*now=*/false, /*from_op=*/true);
    return;
  }
  if (in.size() < 2 || !in[0].isTensor() || !in[1].isTensor()) return;
  std::optional<int64_t> ignore;
  if (info.ignore_arg >= 0) {
    ignore = -100;
    const auto k = static_cast<size_t>(info.ignore_arg);
    if (k < in.size() && in[k].isInt()) ignore = in[k].toInt();
  }
  check_class_target(c, name, in[0].toTensor(), in[1].toTensor(), ignore, -1, c.step,
                     /*now=*/false, /*from_op=*/true);
  check_sequence_leak(c, name, in[1].toTensor(), ignore, c.step);
  check_column_leak(c, name, in[1].toTensor(), c.step);
}

namespace {

// Indices 0..n-1 grouped by their item's device (`device_of(k)`), each group in order: one host
// copy per device.
template <typename DeviceOf>
std::map<std::pair<int, int>, std::vector<size_t>> by_device(size_t n, DeviceOf device_of) {
  std::map<std::pair<int, int>, std::vector<size_t>> out;
  for (size_t k = 0; k < n; ++k) {
    const at::Device d = device_of(k);
    out[{static_cast<int>(d.type()), d.index()}].push_back(k);
  }
  return out;
}

// The device reads of other rules (DeviceRead): one copy per device of their values, concatenated;
// the consumer hands each judge its slice.
void ship_device_reads(const std::shared_ptr<Core>& core, std::vector<DeviceRead> reads) {
  Core& c = *core;
  for (const auto& [dev, idx] :
       by_device(reads.size(), [&](size_t k) { return reads[k].values.device(); })) {
    std::vector<at::Tensor> values;
    std::vector<std::pair<int64_t, std::function<void(Core&, const double*)>>> judges;
    int64_t offset = 0;
    for (const size_t k : idx) {
      at::Tensor v = reads[k].values.reshape({-1}).to(at::kDouble);
      judges.emplace_back(offset, std::move(reads[k].judge));
      offset += v.numel();
      values.push_back(std::move(v));
    }
    const at::Tensor doubles = at::cat(values);
    HostCopy copy = start_host_copy({at::empty({0}, doubles.options().dtype(at::kLong)), doubles});
    auto consume = [core, judges = std::move(judges)](const PackedStats& host) {
      const double* p = host.floats.const_data_ptr<double>();
      for (const auto& [at_offset, judge] : judges) judge(*core, p + at_offset);
    };
    const std::lock_guard<std::mutex> lock(c.mu);
    if (c.readback == nullptr) return;
    c.readback->push(std::move(copy), ReadbackQueue::Phase::kLabels, std::move(consume));
  }
}

}  // namespace

void ship_device_checks(const std::shared_ptr<Core>& core) {
  Core& c = *core;
  std::vector<DeviceCheck> checks;
  std::vector<DeviceRead> reads;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    checks.swap(c.device_checks);
    reads.swap(c.device_reads);
  }
  if (checks.empty() && reads.empty()) return;
  const OwnOps own;
  const at::DisableRecordFunctionGuard unobserved;
  if (!reads.empty()) ship_device_reads(core, std::move(reads));
  for (const auto& [dev, idx] :
       by_device(checks.size(), [&](size_t k) { return checks[k].flags.device(); })) {
    std::vector<at::Tensor> flags;
    std::vector<LabelCheck> ks;
    for (const size_t k : idx) {
      flags.push_back(checks[k].flags);
      ks.push_back(std::move(checks[k].check));
    }
    const at::Tensor ints = at::stack(flags);
    HostCopy copy =
        start_host_copy({ints, at::empty({ints.size(0), 0}, ints.options().dtype(at::kDouble))});
    // Row r of the copy holds the flags of ks[r]. The consumer keeps the Core alive; once the
    // OpAudit is gone its sink is null and the report records nothing.
    auto consume = [core, ks = std::move(ks)](const PackedStats& host) {
      const int64_t* p = host.ints.const_data_ptr<int64_t>();
      for (size_t r = 0; r < ks.size(); ++r) {
        const LabelStats s{p[4 * r], p[4 * r + 1], p[4 * r + 2], p[4 * r + 3]};
        note_targets(*core, ks[r], s.valid);
        report_labels(*core, ks[r], s, /*from_op=*/false);
      }
    };
    const std::lock_guard<std::mutex> lock(c.mu);
    if (c.readback == nullptr) return;
    c.readback->push(std::move(copy), ReadbackQueue::Phase::kLabels, std::move(consume));
  }
}

}  // namespace trainsan::host::audit
