// probs_as_logits of the op audit (Note [Op audit] in audit/observer.cpp): probabilities given to
// a loss that applies softmax or sigmoid itself (Note [Probabilities as logits]).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <utility>

#include "audit/core.h"

namespace trainsan::host::audit {

// Note [Probabilities as logits]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// cross_entropy applies log_softmax to its input, binary_cross_entropy_with_logits applies
// log-sigmoid, and nll_loss expects log-probabilities. Given probabilities instead — a model whose
// forward ends in softmax/sigmoid (Keras' `activation="softmax"` ported to torch), or the `log`
// forgotten before nll_loss — nothing fails: the loss still goes down, slowly, and accuracy
// plateaus, because softmax of values in [0, 1] is nearly uniform (its gradients shrink by the
// softmax's Jacobian twice), sigmoid of values in [0, 1] lies in [0.5, 0.73], and nll_loss of
// probabilities is -mean(p[target]), negative, with a gradient that vanishes as p saturates.
//
// The facts: the input of an audited loss op whose op_table row says what it expects (Expects:
// cross_entropy_loss logits, nll_loss_nd / nll_loss / nll_loss2d log-probabilities,
// binary_cross_entropy_with_logits binary logits), reduced on its own device to a ProbSummary
// (shape_rules.h): min and max (NaN propagates), the largest |row sum - 1| over the class dim
// (summed in float32, float64 for a float64 input), the count of exact zeros. Only a floating,
// nonempty input that requires grad (the loss trains something) and is a plain tensor is read.
// The rules (pure functions in shape_rules.cpp, tested in test_shape_rules.cpp):
// * class losses (rows_are_probabilities): C >= 2 classes (dim 1, or dim 0 of a 1-D input);
//   every element finite and in [0, 1]; every row's sum over the class dim within
//   row_sum_tolerance of 1: kRowSumTolerance (1e-3) for float32/float64, 4 eps for float16
//   (3.9e-3) and bfloat16 (3.1e-2). A softmax rounded to its dtype is off by at most eps/2 per
//   row (each element's relative rounding error is <= eps/2 and the row sums to 1), measured
//   2.7e-4 (float16) and 2.3e-3 (bfloat16) over 2..50257 classes, so 4 eps is 8x that bound.
//   One row is enough: one sample's softmax is the bug already. An empty input says nothing.
// * binary losses: the input was made by a sigmoid (torch.sigmoid, expit, hardsigmoid: the
//   autograd node that made it, past nodes that keep its values — view, reshape, squeeze, select,
//   slice, index, a dtype cast; producer_of), and its values look like a sigmoid's
//   (looks_like_sigmoid): at least kSigmoidMinElements (64) elements, every one finite and in
//   [0, 1], the largest at least kSigmoidMinMax (0.1: some sigmoid argument >= -2.2), at most a
//   quarter exactly 0; on kSigmoidSteps (3) audited steps in a row on which every call of the site
//   (the finding's name: op and source line; the op alone in a C++ program) was so (SigmoidRun in
//   Core; a call that was not breaks the run; steps not audited neither count nor break it). The
//   values alone are no evidence: an untrained head over features of little spread (a GRU's last
//   state) gives logits of one sign, all in [0.2, 0.49] for ten steps in the zoo's twin, as a ReLU
//   head's outputs can be, or a zero-initialised head's trained on one class; hence the producer.
//   The largest value is not asked to reach 0.5: the double sigmoid drives every value down (the
//   gradient sigmoid(p) - y is >= 0.5 for a negative, at most 0.27 in size for a positive), 0.53
//   -> 0.49 by the third step and 0.16 by the 50th in the zoo's GRU case.
// Silent twins, each by one clause: raw logits of a model into cross_entropy have rows that do not
// sum to 1 even where they are all in [0, 1] (an untrained model's logits near 0 have both signs);
// log_softmax output into cross_entropy is <= 0 and harmless (log_softmax is idempotent: same
// loss, same gradient), as are log-probabilities into nll_loss (a row of log-probabilities in
// [0, 1] is all 0, summing to 0); label smoothing, soft (probability) targets, class weights and
// ignore_index concern the target, not the input; the right pairing
// F.binary_cross_entropy(sigmoid(z), y) is another op (no row here); logits of a fresh head, a
// ReLU head and a zero-initialised head into BCE-with-logits are made by no sigmoid (besides, a
// ReLU head is exactly 0 for many outputs and a zero head everywhere at its first step, where a
// sigmoid is exactly 0 only for arguments below about -17 in float16, -104 in float32). A class
// loss needs one audited step: a model's logits are in [0, 1] with every row summing to 1 within
// 1e-3 only by a coincidence that repeats on no other batch.
// Not found: softmax computed in bfloat16 and cast to float32 before the loss (its rows sum within
// 2.3e-3, judged at float32's 1e-3); a binary loss whose site is audited fewer than 3 times, with
// fewer than 64 outputs, or whose sigmoid is written by hand (1 / (1 + exp(-z))) or followed by an
// op that changes values.
//
// Cost: audited steps only. A binary loss: a look at the names of the autograd nodes that made its
// input, values read only for a sigmoid's. A CPU input: one min/max reduction read at once, the
// row sums only when every value lies in [0, 1]. A CUDA input: min, max, row sums and zeros reduced
// into four doubles on the device with no synchronisation, shipped with the label flags at the step
// end and judged when they are read, a step later (Note [Lagged checks]); with sync, read at once.
// The input is only read (detached, under OwnOps): no gradient changes.

namespace {

// The call being judged, with what its message needs.
struct ProbCall {
  std::string op;
  Expects expects = Expects::kAny;
  Shape shape;
  ClassLayout layout;
  double tolerance = kRowSumTolerance;
  int64_t step = 0;
  Source src;
};

double epsilon_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return std::ldexp(1.0, -10);
    case at::kBFloat16:
      return std::ldexp(1.0, -7);
    case at::kDouble:
      return std::numeric_limits<double>::epsilon();
    default:
      return static_cast<double>(std::numeric_limits<float>::epsilon());
  }
}

std::string num(double v) {
  std::ostringstream os;
  os.precision(2);
  os << v;
  return os.str();
}

// [lo, hi, max |row sum - 1|, zeros] of `x` as a double [4] tensor on its device (no sync).
// `rows` false: the binary rule, no row sums.
at::Tensor summary_values(const at::Tensor& x, const ClassLayout& l, bool rows) {
  const auto [lo, hi] = at::aminmax(x);
  at::Tensor dev = at::zeros({}, x.options().dtype(at::kDouble));
  at::Tensor zeros = dev;
  if (rows) {
    const at::ScalarType acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    dev = x.sum(l.dim, /*keepdim=*/false, acc).sub(1.0).abs().amax();
  } else {
    zeros = x.eq(0).sum();
  }
  return at::stack(
      {lo.to(at::kDouble), hi.to(at::kDouble), dev.to(at::kDouble), zeros.to(at::kDouble)});
}

ProbSummary summary_of(const double* v, int64_t numel) {
  ProbSummary s;
  s.numel = numel;
  s.lo = v[0];
  s.hi = v[1];
  s.max_dev = v[2];
  s.zeros = static_cast<int64_t>(v[3]);
  return s;
}

void report_rows(Core& c, const ProbCall& k, const ProbSummary& s) {
  std::ostringstream msg;
  msg << "the input " << shape_str(k.shape) << " of " << op_desc(k.op, k.src)
      << (k.expects == Expects::kLogits ? " holds probabilities, not logits"
                                        : " holds probabilities, not log-probabilities")
      << ": every value in [0, 1] (" << num(s.lo) << ".." << num(s.hi) << ") and each of its "
      << k.layout.rows << (k.layout.rows == 1 ? " row" : " rows") << " sums to 1 over the "
      << k.layout.classes << " classes of dim " << k.layout.dim
      << " (max |sum-1| = " << num(s.max_dev) << ")" << at_source(k.src) << " — ";
  if (k.expects == Expects::kLogits) {
    msg << "softmax is applied twice in effect, the gradients shrink and training stalls; pass "
           "the logits, not softmax(logits): cross_entropy applies log_softmax itself (drop the "
           "model's final softmax and apply it only to read predictions)";
  } else {
    msg << "nll_loss expects log-probabilities, so the loss is -mean(p[target]), negative, and "
           "barely trains; use log_softmax / nn.LogSoftmax before nll_loss, or cross_entropy on "
           "the logits";
  }
  record(c, Kind::probs_as_logits, finding_name(k.op, k.src), msg.str(), s.max_dev, k.step,
         /*say_now=*/false);
}

// One call of a binary loss's site: count its run of audited steps, report at kSigmoidSteps.
void note_binary(Core& c, const ProbCall& k, const ProbSummary& s) {
  const std::string name = finding_name(k.op, k.src);
  const bool like = looks_like_sigmoid(s);
  int steps = 0;
  {
    const std::lock_guard<std::mutex> lock(c.mu);
    SigmoidRun& run = c.sigmoid_runs[name];
    if (!like) {
      run.steps = 0;
      run.broken_step = k.step;
      return;
    }
    if (run.broken_step == k.step || run.last_step == k.step) return;
    run.steps += 1;
    run.last_step = k.step;
    steps = run.steps;
  }
  if (steps < kSigmoidSteps) return;
  std::ostringstream msg;
  msg << "the input " << shape_str(k.shape) << " of " << op_desc(k.op, k.src)
      << " looks like probabilities, not logits: every value in [0, 1] (" << num(s.lo) << ".."
      << num(s.hi) << ", " << s.numel << " values) on " << steps << " audited steps in a row"
      << at_source(k.src)
      << " — binary_cross_entropy_with_logits applies sigmoid itself, so sigmoid(z) given to it "
         "is sigmoid applied twice: every prediction is squeezed into [0.5, 0.73] and training "
         "stalls; pass the logits to BCEWithLogitsLoss (drop the model's final sigmoid), or use "
         "BCELoss on probabilities";
  record(c, Kind::probs_as_logits, name, msg.str(), s.hi, k.step, /*say_now=*/false);
}

void judge(Core& c, const ProbCall& k, const ProbSummary& s) {
  if (k.expects == Expects::kBinaryLogits) {
    note_binary(c, k, s);
  } else if (rows_are_probabilities(s, k.layout, k.tolerance)) {
    report_rows(c, k, s);
  }
}

// Whether `t` was made by a sigmoid, past ops that keep its values (producer_of): a walk of at
// most 16 autograd nodes, each with one input.
bool made_by_sigmoid(const at::Tensor& t) {
  std::shared_ptr<torch::autograd::Node> fn = t.grad_fn();
  for (int hops = 0; fn && hops < 16; ++hops) {
    const Producer p = producer_of(fn->name());
    if (p == Producer::kSigmoid) return true;
    if (p == Producer::kOther || fn->next_edges().empty()) return false;
    fn = fn->next_edges()[0].function;
  }
  return false;
}

}  // namespace

void check_loss_input(Core& c, const OpInfo& info, const char* name,
                      c10::ArrayRef<const c10::IValue> in) {
  if (!c.cfg.on(Kind::probs_as_logits) || in.empty() || !in[0].isTensor()) return;
  const at::Tensor& input = in[0].toTensor();
  if (!input.defined() || input.layout() != at::kStrided || !input.requires_grad() ||
      !at::isFloatingType(input.scalar_type()) || input.numel() == 0 || !input.has_storage() ||
      input.key_set().has(c10::DispatchKey::Python)) {  // a fake or subclass tensor: not read
    return;
  }
  const bool binary = info.expects == Expects::kBinaryLogits;
  const std::optional<ClassLayout> layout = class_layout(input.sizes().vec());
  if (!binary && (!layout || layout->classes < 2)) return;
  const at::DisableRecordFunctionGuard unobserved;
  const at::Tensor x = input.detach();
  ProbCall k{name,
             info.expects,
             input.sizes().vec(),
             layout.value_or(ClassLayout()),
             row_sum_tolerance(epsilon_of(input.scalar_type())),
             c.step,
             Source()};
  if (binary && (x.numel() < kSigmoidMinElements || !made_by_sigmoid(input))) {
    // Not sigmoid outputs: a run of this site, if one is going, is broken (its source names it).
    {
      const std::lock_guard<std::mutex> lock(c.mu);
      bool running = false;
      for (const auto& [site, run] : c.sigmoid_runs) running = running || run.steps > 0;
      if (!running) return;
    }
    k.src = python_source(c.cfg.skip_frames);
    note_binary(c, k, ProbSummary());  // no elements: not like a sigmoid's outputs
    return;
  }
  if (x.is_cuda() && !c.cfg.sync) {
    // Judged when the values are read, a step later: the source is taken now.
    k.src = python_source(c.cfg.skip_frames);
    const int64_t numel = x.numel();
    DeviceRead read{summary_values(x, k.layout, !binary),
                    [k = std::move(k), numel](Core& core, const double* v) {
                      judge(core, k, summary_of(v, numel));
                    }};
    const std::lock_guard<std::mutex> lock(c.mu);
    c.device_reads.push_back(std::move(read));
    return;
  }
  if (!binary && !x.is_cuda()) {
    // One reduction says whether the row sums are worth reading (logits have both signs).
    const auto [lo, hi] = at::aminmax(x);
    const double l = lo.item<double>(), h = hi.item<double>();
    if (!(std::isfinite(l) && std::isfinite(h) && l >= 0.0 && h <= 1.0)) return;
  }
  const at::Tensor v = summary_values(x, k.layout, !binary).to(at::kCPU).contiguous();
  const ProbSummary s = summary_of(v.const_data_ptr<double>(), x.numel());
  if (!binary && !rows_are_probabilities(s, k.layout, k.tolerance)) return;
  k.src = python_source(c.cfg.skip_frames);
  judge(c, k, s);
}

}  // namespace trainsan::host::audit
