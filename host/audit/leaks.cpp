// target_leak of the op audit (Note [Op audit] in audit/observer.cpp): the answer among the inputs
// (Note [Target leak]).
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include "audit/core.h"

namespace trainsan::host::audit {

// Note [Target leak]
// ~~~~~~~~~~~~~~~~~~
// A model shown the value it must predict learns to copy it: the loss collapses (trivial_loss,
// dozens of steps later) and nothing is learned. Two forms are decidable from one audited batch.
//
// * Token sequences. The facts: the integer sequences the audited forward embeds (aten::embedding
//   with indices of rank >= 2: [B, T] token ids, [B, H, W] codes), with the lookup's output, and
//   the target of a class-index loss (cross_entropy, nll_loss) with its ignore_index. The rule:
//   the target, flattened, equals one embedded sequence position by position at every position
//   that is not ignore_index (at least kLeakMinPositions of them, not all one value); no embedded
//   sequence of that size reads the target shifted right by one (seq[t + 1] == target[t]: a
//   decoder's teacher-forced input, so the logits follow that sequence and an encoder input equal
//   to the target — a copy task — is by design); and the gradient confirms it: the loss's
//   gradient reaching the lookup's output at each row's last valid position (which only the
//   prediction at that position can read) is not negligible next to the mean over valid positions
//   (kLeakGradRatio). Silent, each by one clause: next-token targets shifted outside the model or
//   inside it (Hugging Face's labels=input_ids: the loss's target is the shifted copy); masked
//   LM labels (-100 where unmasked; at masked positions the input holds [MASK] or another token);
//   a copy or reverse task with a teacher-forced decoder; autoregressive models that mask a
//   position from itself (a PixelCNN prior over VQ codes, an internal shift: the last position
//   reads nothing, so its gradient is zero); class-conditioning labels embedded per sample
//   (indices of rank 1). The gradient is read by a hook on the lookup's output that returns
//   nothing (the gradient is unchanged) and that the step end removes if it did not run; with a
//   frozen embedding (an output that needs no gradient) nothing is confirmed and nothing said.
// * Feature tables. The facts: the forward's floating inputs of shape [B, F] (F >= 2) and the
//   target of a class-index or pointwise loss (mse, l1, smooth_l1, huber, BCE) of shape [B] or
//   [B, 1]. The rule: a column equals the target on every row (leaked_column, shape_rules.h): at
//   least kLeakRowsInteger rows for integer-valued targets (a strongly predictive feature agrees
//   with class indices on a few rows by chance), kLeakRowsReal for real-valued ones, the target
//   not constant (a GAN's real/fake targets), and the column not one of a complementary 0/1 pair
//   (a one-hot code of a two-valued label fed as conditioning). Reconstruction losses (a [B, F]
//   target), labels passed to the model as their own tensor ([B]: Hugging Face's labels=, a
//   conditional GAN's class input) are no column of a table.
// One finding per sanitizer. Cost: audited steps only; a comparison on the device and one
// synchronising read per candidate, a host copy only when it matched.

namespace {

constexpr int64_t kLeakMinPositions = 16;
constexpr double kLeakGradRatio = 1e-3;

at::Tensor host_long(const at::Tensor& t) {
  return t.detach().to(at::kCPU).to(at::kLong).contiguous().reshape({-1});
}

// The gradient hook's verdict on a token-sequence candidate: the loss's gradient at each row's
// last valid position, against its mean over the valid positions.
void confirm_by_gradient(const std::shared_ptr<Core>& core, const at::Tensor& grad, int64_t rows,
                         int64_t len, const std::vector<int64_t>& last, const at::Tensor& valid,
                         const std::string& name, const std::string& message, int64_t positions,
                         int64_t step) {
  Core& c = *core;
  if (c.target_leak_found.load()) return;
  const OwnOps own;
  const at::DisableRecordFunctionGuard unobserved;
  const at::Tensor mag =
      grad.detach().reshape({rows, len, -1}).abs().sum(-1).to(at::kCPU).to(at::kDouble);
  const double* m = mag.const_data_ptr<double>();
  const bool* ok = valid.const_data_ptr<bool>();
  double all = 0.0, at_last = 0.0;
  int64_t n_all = 0, n_last = 0;
  for (int64_t k = 0; k < rows * len; ++k) {
    if (!ok[k]) continue;
    all += m[k];
    n_all += 1;
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (last[static_cast<size_t>(r)] < 0) continue;
    at_last += m[r * len + last[static_cast<size_t>(r)]];
    n_last += 1;
  }
  if (n_all == 0 || n_last == 0 || all <= 0.0) return;
  const double ratio = (at_last / static_cast<double>(n_last)) / (all / static_cast<double>(n_all));
  if (ratio <= kLeakGradRatio) return;
  if (c.target_leak_found.exchange(true)) return;
  record(c, Kind::target_leak, name, message, static_cast<double>(positions), step,
         /*say_now=*/false);
}

}  // namespace

void on_embedding(Core& c, const at::Tensor& indices, const at::Tensor& output) {
  if (!indices.defined() || !output.defined() || !output.requires_grad() ||
      !at::isIntegralType(indices.scalar_type(), /*includeBool=*/false) || indices.dim() < 2 ||
      indices.numel() == 0 || c.embedded.size() >= 8) {
    return;
  }
  c.embedded.push_back({indices, output});
}

void check_sequence_leak(Core& c, const char* op, const at::Tensor& target,
                         std::optional<int64_t> ignore, int64_t step) {
  if (!c.cfg.on(Kind::target_leak) || c.target_leak_found.load() || c.embedded.empty() ||
      !target.defined() || !at::isIntegralType(target.scalar_type(), /*includeBool=*/false) ||
      target.numel() < kLeakMinPositions) {
    return;
  }
  const at::DisableRecordFunctionGuard unobserved;
  const int64_t n = target.numel();
  // Candidates: a lookup of the target's size whose ids equal the valid targets (one device
  // comparison and one read each).
  const Core::Embedded* hit = nullptr;
  const at::Tensor t = target.detach().reshape({-1});
  for (const Core::Embedded& e : c.embedded) {
    if (e.indices.numel() != n || e.indices.device() != target.device()) continue;
    if (target.dim() != 1 && target.sizes() != e.indices.sizes()) continue;
    at::Tensor same = e.indices.reshape({-1}).eq(t);
    if (ignore) same = at::logical_or(same, t.eq(*ignore));
    if (same.all().item<bool>()) {
      hit = &e;
      break;
    }
  }
  if (hit == nullptr) return;
  const int64_t rows = hit->indices.size(0);
  const int64_t len = n / rows;
  const at::Tensor th = host_long(target);
  const at::Tensor sh = host_long(hit->indices);
  const SequenceMatch m =
      match_sequence(th.const_data_ptr<int64_t>(), sh.const_data_ptr<int64_t>(), rows, len, ignore);
  if (!m.equal || !m.varies || m.valid < kLeakMinPositions) return;
  for (const Core::Embedded& e : c.embedded) {  // a teacher-forced decoder input
    if (e.indices.numel() != n) continue;
    const at::Tensor eh = host_long(e.indices);
    if (match_sequence(th.const_data_ptr<int64_t>(), eh.const_data_ptr<int64_t>(), rows, len,
                       ignore)
            .shifted) {
      return;
    }
  }
  const at::Tensor& out = hit->output;
  if (!out.requires_grad() || out.numel() % n != 0) return;
  const std::vector<int64_t> last =
      last_valid_positions(th.const_data_ptr<int64_t>(), rows, len, ignore);
  const at::Tensor valid = ignore ? th.ne(*ignore).contiguous() : at::ones({n}, at::kBool);
  const Source src = python_source(c.cfg.skip_frames);
  std::ostringstream msg;
  msg << "the target " << shape_str(target.sizes().vec()) << " of " << op_desc(op, src)
      << " equals, position by position, the token ids " << shape_str(hit->indices.sizes().vec())
      << " the model embeds at its input (all " << m.valid
      << " positions that are not ignore_index), and each sequence's last prediction depends on "
         "the very token it is to predict"
      << at_source(src)
      << " — the model is shown the answer and learns to copy it (the loss collapses): for "
         "next-token prediction shift the targets by one, e.g. inputs = ids[:, :-1] and targets "
         "= ids[:, 1:] (a Hugging Face causal LM given labels=input_ids shifts them itself); for "
         "masked-LM training replace the masked inputs and set ignore_index on the others";
  const std::string name = finding_name(op, src);
  const std::string message = msg.str();
  const int64_t positions = m.valid;
  const std::weak_ptr<Core> weak = c.weak_from_this();
  const unsigned h = at::Tensor(out).register_hook([=](const at::Tensor& g) {
    const std::shared_ptr<Core> core = weak.lock();
    if (!core || !g.defined()) return;
    try {
      confirm_by_gradient(core, g, rows, len, last, valid, name, message, positions, step);
    } catch (const std::exception&) {
      // an audit must never break the backward
    }
  });
  c.leak_hooks.emplace_back(out, h);
  c.embedded.clear();  // one candidate a step
}

void check_column_leak(Core& c, const char* op, const at::Tensor& target, int64_t step) {
  if (!c.cfg.on(Kind::target_leak) || c.target_leak_found.load() || c.inputs.empty() ||
      !target.defined() || target.layout() != at::kStrided || target.scalar_type() == at::kBool ||
      at::isComplexType(target.scalar_type()) || target.dim() < 1 || target.dim() > 2 ||
      (target.dim() == 2 && target.size(1) != 1) || target.size(0) < kLeakRowsReal) {
    return;
  }
  const at::DisableRecordFunctionGuard unobserved;
  const int64_t rows = target.size(0);
  const at::Tensor t = target.detach().reshape({rows, 1}).to(at::kDouble);
  for (const at::Tensor& x : c.inputs) {
    if (x.dim() != 2 || x.size(0) != rows || x.size(1) < 2 ||
        !at::isFloatingType(x.scalar_type()) || x.device() != target.device()) {
      continue;
    }
    const at::Tensor xd = x.detach().to(at::kDouble);
    if (!xd.eq(t).all(0).any().item<bool>()) continue;  // one read: no column is the target
    const at::Tensor xh = xd.to(at::kCPU).contiguous();
    const at::Tensor th = t.to(at::kCPU).contiguous();
    const std::optional<int64_t> col =
        leaked_column(xh.const_data_ptr<double>(), rows, x.size(1), th.const_data_ptr<double>());
    if (!col) continue;
    const Source src = python_source(c.cfg.skip_frames);
    std::ostringstream msg;
    msg << "column " << *col << " of the model's input " << shape_str(x.sizes().vec())
        << " equals the target " << shape_str(target.sizes().vec()) << " of " << op_desc(op, src)
        << " on all " << rows << " rows" << at_source(src)
        << " — the label column was left among the features, so the model reads the answer: "
           "drop it from the inputs (e.g. X = df.drop(columns=[label]).values) and keep it as "
           "the target only";
    if (c.target_leak_found.exchange(true)) return;
    record(c, Kind::target_leak, finding_name(op, src), msg.str(), static_cast<double>(*col), step,
           /*say_now=*/false);
    return;
  }
}

void end_leak_checks(Core& c) {
  for (auto& [out, h] : c.leak_hooks) {
    try {
      out.remove_hook(h);
    } catch (const std::exception&) {
      // already gone with its graph
    }
  }
  c.leak_hooks.clear();
  c.embedded.clear();
}

}  // namespace trainsan::host::audit
