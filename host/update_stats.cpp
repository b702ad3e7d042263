// The step pass's update statistics (update_stats.h): the snapshots or their samples, which steps
// get them, and update_outside_step's comparison.
#include "update_stats.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "stats.h"
#include "stats_internal.h"

namespace trainsan::host {

namespace kn = kernels;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The same tensor viewed as unsigned-width integers, for bitwise comparison.
at::Tensor as_bits(const at::Tensor& t) {
  switch (t.element_size()) {
    case 8:
      return t.view(at::kLong);
    case 4:
      return t.view(at::kInt);
    case 2:
      return t.view(at::kShort);
    default:
      return t.view(at::kByte);
  }
}

// Keyed by (device type, index): at::Device has no order.
using DevKey = std::pair<int, int>;
DevKey key_of(const at::Tensor& t) {
  return {static_cast<int>(t.device().type()), t.device().index()};
}

}  // namespace

UpdateStatistics::UpdateStatistics(FeedContext& ctx, ReadbackQueue& readback)
    : budget(ctx.opts.enabled("update_outside_step") ? 0.0 : ctx.opts.overhead_budget,
             ctx.opts.overhead_warmup),
      ctx_(ctx),
      readback_(readback) {}

void UpdateStatistics::init() {
  const std::vector<TrackedParam>& params = ctx_.params;
  prev_param_l2_.assign(params.size(), std::nan(""));
  param_stats_.assign(params.size(), TensorStats{});
  for (size_t i = 0; i < params.size(); ++i) param_stats_[i].numel = params[i].data().numel();
  if (!ctx_.opts.track_updates) return;
  snapshots_.resize(params.size());
  snapshot_hash_.assign(params.size(), std::nullopt);
  const at::NoGradGuard no_grad;
  std::map<DevKey, std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].param.requires_grad()) {
      snapshots_[i] = make_update_snapshot(params[i].data(), ctx_.opts.exact_updates);
    }
    groups[key_of(params[i].data())].push_back(i);
  }
  // Norms before the first step, for the first update ratio: one fused pass per device.
  for (const auto& [dev, idx] : groups) {
    std::vector<at::Tensor> ts;
    for (const size_t i : idx) ts.push_back(params[i].data().detach());
    try {
      const std::vector<TensorStats> st = unpack_stats(tensor_stats_packed(ts));
      for (size_t j = 0; j < idx.size(); ++j) {
        if (st[j].nonfinite() == 0) prev_param_l2_[idx[j]] = st[j].l2;
        param_stats_[idx[j]] = st[j];
        if (snapshots_[idx[j]].defined()) snapshot_hash_[idx[j]] = st[j].hash;
      }
    } catch (const c10::Error&) {
      // unsupported dtype: the first ratio of these parameters stays unknown
    }
  }
}

void UpdateStatistics::record_versions(int64_t opt) {
  if (ctx_.closed || budget.budget() <= 0.0) return;  // no budget: every step has update statistics
  std::vector<int64_t>& v = versions_at_begin_[opt];
  const std::vector<TrackedParam>& params = ctx_.params;
  v.assign(params.size(), -1);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& prm = params[i].param;
    if (params[i].opt != opt || !prm.requires_grad() || !prm.grad().defined()) continue;
    v[i] = static_cast<int64_t>(prm._version());
  }
}

UpdatePlan UpdateStatistics::plan(int64_t step, int64_t opt, bool manual, bool lr_zero,
                                  bool partial) {
  // Note [Overhead budget]: the snapshot is written at a step with update statistics and at the
  // step before one; the update is reported where the snapshot is from the step just before.
  const int64_t opt_key = manual ? -1 : opt;
  const auto last_snap = snapshot_step_.find(opt_key);
  const bool fresh = (last_snap == snapshot_step_.end() ? -1 : last_snap->second) == step - 1;
  // Note [Version trigger]: a step that wrote none of some parameter with a gradient makes the
  // next step an update step (this one writes its snapshot).
  const bool unmoved = !manual && versions_unmoved(opt);
  const bool trigger = unmoved && !lr_zero && !partial;
  if (trigger) forced_update_[opt_key] = step + 1;
  const auto forced = forced_update_.find(opt_key);
  const bool due =
      budget.update_due(step) || (forced != forced_update_.end() && forced->second == step);
  const bool due_next = trigger || budget.update_due(step + 1);
  UpdatePlan out;
  out.with_snapshot = ctx_.opts.track_updates && (due || due_next);
  out.read_params = due || due_next;
  // A partial step's snapshot is from attach, inside the step: its update is not the step's.
  out.report_update = out.with_snapshot && due && fresh && !partial;
  if (out.with_snapshot) snapshot_step_[opt_key] = step;
  return out;
}

bool UpdateStatistics::versions_unmoved(int64_t opt) {
  const auto it = versions_at_begin_.find(opt);
  if (it == versions_at_begin_.end()) return false;  // no pre-hook for this step
  const std::vector<int64_t> before = std::move(it->second);
  versions_at_begin_.erase(it);
  bool unmoved = false;
  for (size_t i = 0; i < before.size() && i < ctx_.params.size() && !unmoved; ++i) {
    unmoved = before[i] >= 0 && static_cast<int64_t>(ctx_.params[i].param._version()) == before[i];
  }
  // Only the first step of a run of such steps: an optimizer that writes through .data (no
  // version moves, LibTorch's SGD) or skips a tensor on purpose costs one update step, not all.
  bool& last = unmoved_last_[opt];
  const bool first = unmoved && !last;
  last = unmoved;
  return first;
}

at::Tensor UpdateStatistics::snapshot_for(size_t i, const at::Tensor& prm) {
  at::Tensor snap = i < snapshots_.size() ? snapshots_[i] : at::Tensor();
  if (snap.defined() &&
      (snap.device() != prm.device() ||
       snap.numel() != update_snapshot_numel(prm.numel(), ctx_.opts.exact_updates) ||
       snap.scalar_type() != prm.scalar_type())) {
    snap = at::Tensor();  // the parameter was replaced; start a new snapshot
    snapshots_[i] = make_update_snapshot(prm, ctx_.opts.exact_updates);
  }
  return snap;
}

void UpdateStatistics::fill(ParamView& pv, size_t i, const TensorStats* now,
                            const std::optional<UpdateStats>& update, bool with_snapshot) {
  pv.param_l2_before = prev_param_l2_[i];
  if (now != nullptr) {
    pv.param = *now;
    pv.update = update;
    if (with_snapshot && !ctx_.opts.exact_updates) sampled_update(i, *now, pv.grad, pv.update);
    param_stats_[i] = *now;
    prev_param_l2_[i] = now->nonfinite() == 0 ? now->l2 : std::nan("");
  } else {  // Note [Every-step tier]: the latest measurement, not this step's
    pv.param = param_stats_[i];
    pv.param.numel = ctx_.params[i].data().numel();
    pv.param_measured = false;
  }
}

void UpdateStatistics::check_outside_step(int64_t opt) {
  const Options& opts = ctx_.opts;
  const std::vector<TrackedParam>& params = ctx_.params;
  if (!opts.enabled("update_outside_step") || snapshots_.empty() || ctx_.closed || ctx_.step == 0) {
    return;
  }
  // Opt-in: one comparison per parameter against the snapshot of the previous step's end, and
  // one read of the flags (a device sync on GPU) — hence off by default.
  const auto t0 = Clock::now();
  if (!opts.exact_updates) {
    // Note [Update statistics without a snapshot]: each parameter's fingerprint now against the
    // one of its sample (the previous step's end; on a GPU still on its way: waited for here,
    // where the comparison waits for its own result anyway).
    readback_.drain_all();
    std::map<std::pair<int, int>, std::vector<size_t>> by_device;
    for (size_t i = 0; i < params.size() && i < snapshot_hash_.size(); ++i) {
      if ((opt >= 0 && params[i].opt != opt) || !snapshot_hash_[i] || !snapshots_[i].defined()) {
        continue;
      }
      const at::Tensor& prm = params[i].data();
      by_device[{static_cast<int>(prm.device().type()), prm.device().index()}].push_back(i);
    }
    std::vector<std::string> names;
    for (const auto& [dev, idx] : by_device) {
      std::vector<at::Tensor> ts;
      for (const size_t i : idx) ts.push_back(params[i].data());
      std::vector<TensorStats> st;
      try {
        st = unpack_stats(fingerprint_stats_packed(ts));
      } catch (const c10::Error&) {
        continue;  // a parameter the pass cannot read: the step pass says what is wrong with it
      }
      for (size_t k = 0; k < idx.size(); ++k) {
        if (st[k].hash != *snapshot_hash_[idx[k]]) names.push_back(params[idx[k]].name);
      }
    }
    ctx_.checks.integrity.on_step_begin(names, ctx_.step);
    ctx_.time.add_overhead(seconds_since(t0));
    return;
  }
  std::vector<size_t> idx;
  std::vector<at::Tensor> flags;
  {
    const at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (opt >= 0 && params[i].opt != opt) continue;
      const at::Tensor& snap = snapshots_[i];
      const at::Tensor& prm = params[i].data();
      if (!snap.defined() || snap.sizes() != prm.sizes() || snap.device() != prm.device() ||
          snap.scalar_type() != prm.scalar_type()) {
        continue;
      }
      idx.push_back(i);
      // Bitwise comparison (NaN == NaN, -0 != +0): any changed element counts.
      flags.push_back(at::ne(as_bits(prm.detach()), as_bits(snap)).any());
    }
  }
  if (!flags.empty()) {
    const at::Tensor changed = at::stack(flags).to(at::kCPU);
    const bool* c = changed.const_data_ptr<bool>();
    std::vector<std::string> names;
    for (size_t k = 0; k < idx.size(); ++k) {
      if (c[k]) names.push_back(params[idx[k]].name);
    }
    ctx_.checks.integrity.on_step_begin(names, ctx_.step);
  }
  ctx_.time.add_overhead(seconds_since(t0));
}

// Note [Update statistics without a snapshot]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The update statistics (||dtheta||, max |dtheta|, the elements a step changed) used to compare
// every parameter with a full copy of its previous values: +100% of the weights' memory, +25% of
// a mixed-precision Adam job's. Unless exact_updates asks for that copy, they are taken from
// bounded state instead (at most kUpdateSampleCap = 4096 elements a tensor, 16 KiB in float32,
// whatever the model's size; none of it allocated per step):
//   - whether a tensor changed at all, exactly: its fingerprint (the pass's hash, Note [Hash]:
//     any changed bit changes it, a collision is a 2^-64 event) at the pass that wrote its sample
//     against the fingerprint now. The passes that write or read a sample compute the
//     fingerprints of the parameters (on CUDA free, on CPU about the pass's arithmetic again;
//     the overhead budget measures and samples these passes like any other);
//   - how much, from the sample of Note [Update sample] (kernels/stats.h): a tensor of n <= 4096
//     elements is kept whole (its figures are exact); a larger one keeps m = ceil(n / s) elements
//     with s = ceil(n / 4096), one per stratum of s consecutive elements at a hashed offset.
//     changed = (changed in the sample) * n / m and ||dtheta|| = (its norm in the sample) *
//     sqrt(n / m); max |dtheta| is the sample's largest (a lower bound). Stratified with one
//     element a stratum, the estimates are unbiased but for the last, shorter stratum (weight
//     < 1/m), and their relative standard error is at most sqrt((1 - f) / (f m)) for a changed
//     fraction f (0.8% at f = 1/2, m = 4096) and about CV(dtheta^2) / (2 sqrt(m)) for the norm
//     (1.1% for Gaussian updates, less where neighbouring updates are alike: stratification
//     removes the variance between strata).
// What each rule reads, and why none loses a bug the copy found:
//   - skipped_step "changed no parameter" and "left <tensor> unchanged" read changed == 0,
//     which the fingerprints keep exact (a tensor whose fingerprint moved while none of its
//     sampled elements did has changed >= 1, marked `unseen`: a sparse update, e.g. embedding
//     rows, is never "unchanged"). The largest move of a step, which bounds the predicted move of
//     an unchanged tensor, is the sample's: at most the exact one, so the rule can only become
//     more cautious (it needs the predicted move above 4 ulp of the weights, which real learning
//     rates exceed by orders of magnitude); `unseen` tensors (whose max is unknown) are left out
//     of that largest move and of the learning rate it estimates when a group has none;
//   - update_ratio reads ||dtheta|| / ||theta||, judged against a band of orders of magnitude
//     ([1e-8, 1]) for update_ratio_steps steps in a row: a 1-2% error cannot move a verdict
//     except at the band's edge. A tensor that changed while none of its sampled elements did
//     is one of two cases, told apart by its gradient's nonzero elements nz (exact, from the
//     gradient's row): with nz below 8 strides (fewer than 8 sampled elements expected to have a
//     gradient: embedding rows under SGD) the change is sparse and its size unknown (`unseen`),
//     the ratio is a lower bound and the low end of the band is not judged on that step; with a
//     denser gradient the step left almost all of those elements unchanged — updates rounded
//     away, a learning rate far too low — and the estimate (0) stands, so that bug is found;
//   - update_underflow reads the fraction of elements with a nonzero gradient that the step left
//     unchanged, against update_underflow_fraction (0.5), for update_underflow_steps (3) measured
//     steps in a row: judged on a sampled tensor only when its nonzero gradient elements are at
//     least 64 strides (>= 64 of them expected in the sample, a standard error of at most ~6% on
//     the fraction; the rule's cases — bf16 weights under a small learning rate, dense gradients
//     — leave 90-100% unchanged); a sparser gradient (a bf16 embedding's few rows) is not judged
//     from the sample (the exact copy judges it);
//   - update_outside_step compares each parameter's fingerprint at the step's begin with the one
//     at the previous step's end (check_updates_outside_step): exact, as the copy was;
//   - the trace's per-tensor update rows carry the estimates (docs/trace.md says which fields).
// exact_updates keeps the full copy (exact per-element figures, the parameters' size in memory).
void UpdateStatistics::sampled_update(size_t i, const TensorStats& now,
                                      const std::optional<TensorStats>& grad,
                                      std::optional<UpdateStats>& update) {
  if (i >= snapshot_hash_.size()) return;
  std::optional<uint64_t>& before = snapshot_hash_[i];
  if (update) {
    const int64_t n = now.numel;
    const int64_t stride = update_sample_stride(n);
    if (stride > 1) {
      const double scale =
          static_cast<double>(n) / static_cast<double>(kn::num_samples_of(n, stride));
      update->sampled = true;
      update->stride = stride;
      update->changed =
          std::min<int64_t>(n, std::llround(static_cast<double>(update->changed) * scale));
      update->l2 *= std::sqrt(scale);
    }
    if (before && *before == now.hash) {
      const bool sampled = update->sampled;
      *update = UpdateStats{};
      update->sampled = sampled;
      update->stride = stride;
    } else if (before && update->changed == 0) {
      // Changed, though no sampled element did. Explained by a sparse gradient (fewer than
      // kUnseenSparse sampled elements expected to have one: embedding rows, a masked loss),
      // ||dtheta|| is unknown (a lower bound); with a dense gradient the step changed a few of
      // its elements at most — updates rounded away, the estimate 0 stands (a learning rate far
      // too low is exactly this).
      update->changed = 1;
      const int64_t nz = grad ? grad->numel - grad->zero : -1;
      update->unseen = nz < 0 || nz < kUnseenSparse * stride;
    }
  }
  before = now.hash;
}

}  // namespace trainsan::host
