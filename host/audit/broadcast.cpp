// The broadcast rules of the op audit (Note [Op audit] in audit/observer.cpp): elementwise ops,
// loss ops on (input, target) pairs, and the broadcast_tensors that F.*_loss issue before them.
#include <ATen/core/List.h>

#include <algorithm>
#include <utility>

#include "audit/core.h"
#include "finding_sink.h"

namespace trainsan::host::audit {

namespace {

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

void report_broadcast(Core& c, const std::string& op, const std::vector<Operand>& ops,
                      const Shape& out, const Source& src) {
  int64_t largest = 0;
  for (const auto& o : ops) largest = std::max(largest, numel_of(o.shape));
  const double ratio =
      static_cast<double>(numel_of(out)) / static_cast<double>(std::max<int64_t>(largest, 1));
  record(c, Kind::broadcast, finding_name(op, src),
         op_desc(op, src) + " broadcast " + operands_str(ops) + " into " + shape_str(out) + " (" +
             fmt(ratio) + "x the largest input) through implicit rank promotion" + at_source(src) +
             " — every element of one operand "
             "meets every element of the other, as when an [N, 1] prediction meets an [N] target "
             "and gives [N, N]; make the shapes equal (squeeze(-1) / unsqueeze(-1)), or write the "
             "broadcast with explicit singleton dims on both operands (a[:, None] - b[None]) if "
             "it is meant",
         ratio, c.step, /*say_now=*/false);
}

}  // namespace

void flush_deferred(Core& c) {
  set_deferred_pending(false);
  if (!c.deferred.valid) return;
  Deferred d = std::move(c.deferred);
  c.deferred = Deferred();
  if (c.cfg.on(Kind::broadcast) && implicit_cross_broadcast(d.ops, d.out)) {
    report_broadcast(c, "aten::broadcast_tensors", d.ops, d.out, d.src);
  }
}

void on_elementwise(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in) {
  std::vector<Operand> ops;
  for (const auto& v : in) collect(v, "", ops);
  if (ops.size() < 2) return;
  const std::optional<Shape> out = broadcast_shape(ops);
  if (!out || !implicit_cross_broadcast(ops, *out)) return;
  report_broadcast(c, name, ops, *out, python_source(c.cfg.skip_frames));
}

void on_broadcast_tensors(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in) {
  flush_deferred(c);
  if (!c.cfg.on(Kind::broadcast) && !c.cfg.on(Kind::batch_mismatch)) return;
  std::vector<Operand> ops;
  for (const auto& v : in) collect(v, "operand ", ops);
  const std::optional<Shape> out = broadcast_shape(ops);
  if (!out) return;
  if (ops.size() != 2) {
    if (c.cfg.on(Kind::broadcast) && implicit_cross_broadcast(ops, *out)) {
      report_broadcast(c, name, ops, *out, python_source(c.cfg.skip_frames));
    }
    return;
  }
  const bool grows = numel_of(*out) > std::max(numel_of(ops[0].shape), numel_of(ops[1].shape));
  const bool batch = !ops[0].shape.empty() && ops[0].shape.size() == ops[1].shape.size() &&
                     ops[0].shape[0] != ops[1].shape[0];
  if (!grows && !batch) return;  // nothing a loss rule or the elementwise rule could flag
  c.deferred = Deferred{true, ops, *out, python_source(c.cfg.skip_frames)};
  set_deferred_pending(true);
}

void on_loss(Core& c, const char* name, c10::ArrayRef<const c10::IValue> in) {
  static const char* const kRoles[] = {"input", "target", "weight", "pos_weight"};
  std::vector<Operand> ops;
  for (size_t k = 0; k < in.size() && k < 4; ++k) collect(in[k], kRoles[k], ops);
  Deferred d = std::move(c.deferred);
  c.deferred = Deferred();
  set_deferred_pending(false);
  if (ops.size() < 2 || ops[0].role != "input" || ops[1].role != "target") {
    if (d.valid) {
      c.deferred = std::move(d);
      flush_deferred(c);
    }
    return;
  }
  if (in[1].isTensor()) check_column_leak(c, name, in[1].toTensor(), c.step);
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
      c.cfg.on(Kind::broadcast) && numel_of(*out) > numel_of(a) && numel_of(*out) > numel_of(b);
  const bool batch =
      c.cfg.on(Kind::batch_mismatch) && !a.empty() && a.size() == b.size() && a[0] != b[0];
  if (!grows && !batch) return;
  if (!have_src) src = python_source(c.cfg.skip_frames);
  if (grows) {
    const double ratio =
        static_cast<double>(numel_of(*out)) /
        static_cast<double>(std::max<int64_t>(std::max(numel_of(a), numel_of(b)), 1));
    record(c, Kind::broadcast, finding_name(name, src),
           op_desc(name, src) + " got " + operands_str(ops) + ", which broadcast into " +
               shape_str(*out) + " (" + fmt(ratio) + "x the input)" + at_source(src) +
               " — the loss is taken over every (prediction, target) pair instead of "
               "matching them one to one; give input, target (and weight) the same shape, e.g. "
               "pred.squeeze(-1) or target.unsqueeze(-1) / weight.view_as(target)",
           ratio, c.step, /*say_now=*/false);
  }
  if (batch) {
    record(c, Kind::batch_mismatch, finding_name(name, src),
           op_desc(name, src) + " got input of batch size " + std::to_string(a[0]) + " " +
               shape_str(a) + " and target of batch size " + std::to_string(b[0]) + " " +
               shape_str(b) + at_source(src) +
               " — the loss pairs samples with the wrong targets (or broadcasts one target over "
               "the batch); check that input and target come from the same batch and that no "
               "indexing, unsqueeze(0) or transpose moved the batch dimension",
           static_cast<double>(b[0]), c.step, /*say_now=*/a[0] != 1 && b[0] != 1);
  }
}

}  // namespace trainsan::host::audit
