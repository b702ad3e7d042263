// The step pass: one fused statistics pass per device over the stepping optimizer's gradients,
// parameters and snapshot, queued for read-back (Note [Lagged checks]); when it lands, the
// StepView that every check family reads, last_stats() and the trace's step record.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "nvtx.h"
#include "sanitizer_impl.h"
#include "stats.h"
#include "stats_internal.h"

namespace trainsan::host {

namespace kn = kernels;
using Clock = std::chrono::steady_clock;

// A launched step pass: which rows hold what, and what the hooks saw at launch.
struct SanitizerImpl::Pass {
  int64_t step = 0;
  int64_t opt = -1;
  bool lr_zero = false;
  bool manual = false;
  bool partial = false;          // attached inside this step (step_in_flight)
  std::vector<double> group_lr;  // per param group of the stepping optimizer
  bool hashed = true;          // fingerprints computed (else their column is 0 in last_stats/trace)
  bool replica = false;        // weights fingerprinted for the replica comparison
  bool replica_grads = false;  // gradients too (sampled: desync_state_every)
  bool report_update =
      false;                // update statistics against a fresh snapshot (Note [Overhead budget])
  bool with_params = true;  // the parameters were read (Note [Every-step tier])
  bool with_snapshot = false;      // the pass rewrote the snapshots (samples) of its parameters
  std::vector<size_t> indices;     // parameters in the pass
  std::vector<Consumed> consumed;  // per entry of indices
  std::vector<int64_t> grad_row;   // per entry: row of its gradient, -1 when none
  std::vector<int64_t> param_row;
  std::vector<std::pair<size_t, int64_t>> row_map;  // global row -> (copy, row in copy)
  bool model_eval = false;
  std::vector<size_t> eval_modules;
  int64_t grad_forwards = 0;
  int64_t no_grad_train_forwards = 0;
  StepEnd fed;  // the feeders' facts (Note [Feeders]): foreign backwards, the window's backwards
};

namespace {

struct Row {
  TensorStats stats;
  std::optional<UpdateStats> update;
};

std::vector<Row> unpack_rows(const SanitizerImpl::Pass& p, const std::vector<HostCopy>& copies) {
  std::vector<std::vector<Row>> per_copy;
  for (const auto& c : copies) {
    const std::vector<TensorStats> st = unpack_stats(c.host);
    std::vector<Row> rows(st.size());
    const bool upd = c.host.ints.size(1) == kn::kIntFieldsUpdate;
    const int64_t* ip = c.host.ints.const_data_ptr<int64_t>();
    const double* fp = c.host.floats.const_data_ptr<double>();
    for (size_t r = 0; r < st.size(); ++r) {
      rows[r].stats = st[r];
      if (upd && p.report_update) {
        UpdateStats u;
        u.changed = ip[r * kn::kIntFieldsUpdate + kn::kColChanged];
        u.l2 = fp[r * kn::kFloatFieldsUpdate + kn::kColUpdateL2];
        u.max = fp[r * kn::kFloatFieldsUpdate + kn::kColUpdateMax];
        rows[r].update = u;
      }
    }
    per_copy.push_back(std::move(rows));
  }
  std::vector<Row> out(p.row_map.size());
  for (size_t g = 0; g < p.row_map.size(); ++g) {
    const auto [c, r] = p.row_map[g];
    out[g] = per_copy[c][static_cast<size_t>(r)];
  }
  return out;
}

// Note [Bounded trace] (trace.h): the step record's digest of the gradients' statistics, FNV-1a
// over the 64-bit words of each gradient's norm and sum (their bits) and non-finite counts, in
// parameter order (a parameter without a gradient contributes a marker).
uint64_t grads_digest(const StepView& v) {
  std::vector<uint64_t> words;
  words.reserve(v.params.size() * 5);
  for (const ParamView& p : v.params) {
    if (!p.grad) {
      words.push_back(0x9e3779b97f4a7c15ull);
      continue;
    }
    uint64_t l2 = 0, sum = 0;
    std::memcpy(&l2, &p.grad->l2, sizeof(l2));
    std::memcpy(&sum, &p.grad->sum, sizeof(sum));
    words.insert(words.end(),
                 {l2, sum, static_cast<uint64_t>(p.grad->nan),
                  static_cast<uint64_t>(p.grad->posinf), static_cast<uint64_t>(p.grad->neginf)});
  }
  return fnv1a_words(words);
}

// Machine epsilon of a floating dtype (ParamView::eps); 0 for the others.
double dtype_eps(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return std::numeric_limits<double>::epsilon();
    case at::kFloat:
      return std::numeric_limits<float>::epsilon();
    case at::kHalf:
      return 0.0009765625;  // 2^-10
    case at::kBFloat16:
      return 0.0078125;  // 2^-7
    default:
      return 0.0;
  }
}

// Rows grouped by device, one pass each. Keyed by (device type, index): at::Device has no order.
using DevKey = std::pair<int, int>;
DevKey key_of(const at::Tensor& t) {
  return {static_cast<int>(t.device().type()), t.device().index()};
}

// The gradients an early read takes (step begin, device stop), by device, with their parameters'
// indices: optimizer `opt`'s (all with opt < 0), and those in no optimizer with `orphans`. Left
// out: distributed parameters (DTensor, FSDP2: their local shards reach the sanitizer after the
// step, local_shards(), and the gradient itself is a tensor subclass) and gradients the lean pass
// has nothing to read in.
struct GradsByDevice {
  std::map<DevKey, std::vector<at::Tensor>> grads;
  std::map<DevKey, std::vector<size_t>> which;
};
GradsByDevice grads_by_device(const std::vector<TrackedParam>& params, int64_t opt, bool orphans) {
  GradsByDevice out;
  for (size_t i = 0; i < params.size(); ++i) {
    const bool orphan = orphans && params[i].opt < 0;
    if (opt >= 0 && params[i].opt != opt && !orphan) continue;
    if (params[i].local.defined()) continue;
    const at::Tensor& g = params[i].param.grad();
    if (!g.defined() || g.layout() != at::kStrided || g.numel() == 0 ||
        g.unsafeGetTensorImpl()->is_python_dispatch()) {
      continue;
    }
    out.grads[key_of(g)].push_back(g);
    out.which[key_of(g)].push_back(i);
  }
  return out;
}

}  // namespace

void SanitizerImpl::initial_param_norms() {
  prev_param_l2.assign(params.size(), std::nan(""));
  param_stats.assign(params.size(), TensorStats{});
  for (size_t i = 0; i < params.size(); ++i) param_stats[i].numel = params[i].data().numel();
  if (!opts.track_updates) return;
  snapshots.resize(params.size());
  snapshot_hash.assign(params.size(), std::nullopt);
  const at::NoGradGuard no_grad;
  std::map<DevKey, std::vector<size_t>> groups;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].param.requires_grad()) {
      snapshots[i] = make_update_snapshot(params[i].data(), opts.exact_updates);
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
        if (st[j].nonfinite() == 0) prev_param_l2[idx[j]] = st[j].l2;
        param_stats[idx[j]] = st[j];
        if (snapshots[idx[j]].defined()) snapshot_hash[idx[j]] = st[j].hash;
      }
    } catch (const c10::Error&) {
      // unsupported dtype: the first ratio of these parameters stays unknown
    }
  }
}

void SanitizerImpl::step_end(int64_t opt, bool lr_zero, bool manual,
                             const std::vector<double>& group_lr) {
  const auto t0 = Clock::now();
  TRAINSAN_NVTX_RANGE("trainsan/step");
  if (closed) return;
  loss_outcome(/*skipped=*/false);  // this step's losses (Note [Loss stream])
  scaler_skipped = false;
  audit->step_end();
  auto p = std::make_shared<Pass>();
  int64_t& opt_count = opt_steps[manual ? -1 : opt];  // Note [Step numbering]
  p->step = opt_count;
  opt_count += 1;
  p->opt = opt;
  p->lr_zero = lr_zero;
  p->manual = manual;
  p->group_lr = group_lr;
  if (!manual) {
    const auto it = std::find(in_flight.begin(), in_flight.end(), opt);
    if (it != in_flight.end()) {
      p->partial = true;
      in_flight.erase(it);
    }
  }
  // Note [Mode rules]: each optimizer of the model judges the modes of the last grad-enabled
  // forward, and the forwards since its own previous step.
  p->model_eval = current_model_eval;
  p->eval_modules = current_eval_modules;
  {
    const int64_t key = manual ? -1 : opt;
    auto& [grad_at, no_grad_at] = forwards_at_step[key];
    const auto [grad_now, no_grad_now] = forwards_for(key);
    p->grad_forwards = grad_now - grad_at;
    p->no_grad_train_forwards = no_grad_now - no_grad_at;
    grad_at = grad_now;
    no_grad_at = no_grad_now;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    // A step covers its optimizer's parameters and those in no optimizer
    // (param_not_in_optimizer).
    const bool orphan = params[i].opt < 0;
    if (!manual && opt >= 0 && params[i].opt != opt && !orphan) continue;
    p->indices.push_back(i);
  }
  p->fed.step = p->step;
  p->fed.opt = opt;
  p->fed.manual = manual;
  p->fed.partial = p->partial;
  for (Feed* f : feeds) f->on_step_end(p->fed);  // Note [Feeders]
  grads.consume(p->indices, manual, &p->consumed);
  std::vector<HostCopy> copies;
  bool with_snapshot = false;
  {
    TRAINSAN_NVTX_RANGE("trainsan/stats");
    std::map<DevKey, std::vector<at::Tensor>> tensors, snaps;
    std::map<DevKey, std::vector<char>> modes;
    // Fingerprints (hash) cost about two thirds of the CPU pass's arithmetic and no check of the
    // pass reads them: computed on traced steps (for `trainsan diff`), every step with
    // `fingerprints`, and for the replica comparison on its steps (weights, sampled gradients).
    // Note [Every-step tier]: elsewhere the gradients get the lean rows of Note [Lean rows].
    // Note [Bounded trace]: the steps whose records hold per-tensor rows for a reason known now.
    p->hashed = opts.fingerprints || trace.rows_due(p->step);
    p->replica = replicas.enabled && checks.replicas.fingerprint_due(p->step);
    p->replica_grads = p->replica && checks.replicas.grads_due(p->step);
    // Note [Overhead budget]: the snapshot is written at a step with update statistics and at the
    // step before one; the update is reported where the snapshot is from the step just before.
    const int64_t opt_key = manual ? -1 : opt;
    const auto last_snap = snapshot_step.find(opt_key);
    const bool fresh = (last_snap == snapshot_step.end() ? -1 : last_snap->second) == p->step - 1;
    // Note [Version trigger]: a step that wrote none of some parameter with a gradient makes the
    // next step an update step (this one writes its snapshot).
    const bool unmoved = !manual && versions_unmoved(opt);
    const bool trigger = unmoved && !lr_zero && !p->partial;
    if (trigger) forced_update[opt_key] = p->step + 1;
    const auto forced = forced_update.find(opt_key);
    const bool due =
        budget.update_due(p->step) || (forced != forced_update.end() && forced->second == p->step);
    const bool due_next = trigger || budget.update_due(p->step + 1);
    with_snapshot = opts.track_updates && (due || due_next);
    p->with_snapshot = with_snapshot;
    // Note [Every-step tier]: the parameters are read with the update statistics (the step that
    // writes the snapshot and the step that reads it), on traced and replica steps.
    p->with_params = due || due_next || p->hashed || p->replica;
    // A partial step's snapshot is from attach, inside the step: its update is not the step's.
    p->report_update = with_snapshot && due && fresh && !p->partial;
    if (with_snapshot) snapshot_step[opt_key] = p->step;
    std::map<DevKey, std::vector<int64_t>> global_rows;
    int64_t row = 0;
    auto push = [&](const at::Tensor& t, const at::Tensor& snap, kn::PassMode mode) {
      const DevKey d = key_of(t);
      tensors[d].push_back(t);
      modes[d].push_back(static_cast<char>(mode));
      snaps[d].push_back(snap);
      global_rows[d].push_back(row);
      return row++;
    };
    // Note [Gradients read at the step's beginning]: this step's rows read at its begin.
    BeginRows early;
    if (!manual) {
      const auto b = begin_rows.find(opt);
      if (b != begin_rows.end()) {
        early = std::move(b->second);
        begin_rows.erase(b);
      }
    }
    std::vector<std::pair<int64_t, std::pair<size_t, int64_t>>> early_rows;  // row -> early's
    const size_t n = p->indices.size();
    p->grad_row.assign(n, -1);
    p->param_row.assign(n, -1);
    for (size_t k = 0; k < n; ++k) {
      const TrackedParam& tp = params[p->indices[k]];
      // A distributed parameter: the local shard of its gradient (local_shards()).
      const at::Tensor g = tp.local.defined() ? tp.local_grad : tp.param.grad();
      // Manual loops clear gradients (zero_ / None) after their update and before the next
      // forward, where this pass runs: only a gradient as the backward left it is checked.
      const bool untouched = !manual || !g.defined() || grads.as_backward_left(p->indices[k]);
      if (g.defined() && g.layout() == at::kStrided && untouched) {
        const bool hash = p->hashed || p->replica_grads;
        const auto at = early.of.find(p->indices[k]);
        if (!hash && at != early.of.end() &&
            at->second.grad.unsafeGetTensorImpl() == g.unsafeGetTensorImpl() &&
            static_cast<int64_t>(g._version()) == at->second.version) {
          early_rows.push_back({row, {at->second.copy, at->second.row}});
          p->grad_row[k] = row++;
        } else {
          p->grad_row[k] = push(g, at::Tensor(), hash ? kn::kModeFull : kn::kModeLean);
        }
      }
    }
    for (size_t k = 0; k < n && p->with_params; ++k) {
      const size_t i = p->indices[k];
      const at::Tensor& prm = params[i].data();
      at::Tensor snap = with_snapshot && i < snapshots.size() ? snapshots[i] : at::Tensor();
      if (snap.defined() &&
          (snap.device() != prm.device() ||
           snap.numel() != update_snapshot_numel(prm.numel(), opts.exact_updates) ||
           snap.scalar_type() != prm.scalar_type())) {
        snap = at::Tensor();  // the parameter was replaced; start a new snapshot
        snapshots[i] = make_update_snapshot(prm, opts.exact_updates);
      }
      // Note [Update statistics without a snapshot]: the fingerprints say exactly whether a
      // tensor changed, so the passes that write or read a sample compute them.
      const bool fingerprint = p->hashed || p->replica || (with_snapshot && !opts.exact_updates);
      p->param_row[k] = push(prm, snap, fingerprint ? kn::kModeFull : kn::kModeNoHash);
    }
    p->row_map.assign(static_cast<size_t>(row), {0, 0});
    if (!early_rows.empty()) {
      const size_t base = copies.size();
      for (HostCopy& c : early.copies) copies.push_back(std::move(c));
      for (const auto& [r, at] : early_rows) {
        p->row_map[static_cast<size_t>(r)] = {base + at.first, at.second};
      }
    }
    for (auto& [dev, ts] : tensors) {
      const std::vector<at::Tensor>& sn = snaps[dev];
      const bool any_snap =
          std::any_of(sn.begin(), sn.end(), [](const at::Tensor& t) { return t.defined(); });
      const std::vector<char>& md = modes[dev];
      PackedStats packed = ts.front().is_cuda() ? packed_cuda(ts, any_snap ? &sn : nullptr, &md)
                                                : packed_cpu(ts, any_snap ? &sn : nullptr, &md);
      const size_t c = copies.size();
      copies.push_back(start_host_copy(packed));
      const auto& gr = global_rows[dev];
      for (size_t r = 0; r < gr.size(); ++r) {
        p->row_map[static_cast<size_t>(gr[r])] = {c, static_cast<int64_t>(r)};
      }
    }
  }
  step = std::max(step, opt_count);
  readback.push(std::move(copies), ReadbackQueue::Phase::kPass,
                [this, p](const std::vector<HostCopy>& c) { check_pass(*p, c); });
  add_overhead(std::chrono::duration<double>(Clock::now() - t0).count());
  readback.step_end();  // the previous pass (GPU), or this one (CPU, or sync)
  flush_clock();        // this entry's time so far is this step's (Note [Own time])
  const auto now = Clock::now();
  if (last_step_end != Clock::time_point{}) {
    budget.observe(std::chrono::duration<double>(now - last_step_end).count(),
                   time.overhead_s - overhead_at_last_step_end, p->with_params);
  }
  last_step_end = now;
  overhead_at_last_step_end = time.overhead_s;
  coverage.update_period = budget.period();
  for (Feed* f : feeds) f->after_step(manual ? -1 : opt, /*skipped=*/false);
}

void SanitizerImpl::record_versions(int64_t opt) {
  if (closed || budget.budget() <= 0.0) return;  // no budget: every step has update statistics
  std::vector<int64_t>& v = versions_at_begin[opt];
  v.assign(params.size(), -1);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& prm = params[i].param;
    if (params[i].opt != opt || !prm.requires_grad() || !prm.grad().defined()) continue;
    v[i] = static_cast<int64_t>(prm._version());
  }
}

// Note [Gradients read at the step's beginning]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The every-step tier's one read of the gradients (Note [Every-step tier]) is taken when the
// optimizer's step begins (step_begin: its pre-hook, or a closure's first return) rather than at
// its end. Read after the update, the gradients evict from the caches what the update has just
// written and the next forward reads first (the parameters; on a CPU the optimizer's moments too);
// read before it, they are where the update is about to read them. On the bench's CPU MLP a
// gradient read cost the whole step 78-441 us less before the update than after it, in four of
// four paired processes (bench/RESULTS.md, issue 23). The step end still judges everything, with
// a begin row for each gradient that is still the same tensor at the same version (nothing wrote
// it during the step: torch.optim's updates only read the gradients, and an in-place write moves
// the version) and a new read of any other (a closure or line search that recomputed them, an
// optimizer that changed them in place, a gradient that appeared during the step). The pass is
// deterministic, so a row read early has the bits the step end's read would have had: no finding
// changes, nor the step it is reported at. A write during the step that moves no version is not
// seen by the step's rows: the rows are the gradients as the step began. The one such write known
// to torch.optim is a fused optimizer's in-place unscale when a GradScaler hands it `grad_scale`
// (then `step_begin(opt, grads_final=false)`: the Python package passes it, and the gradients are
// read at the end). Read at the end as before: a step with no beginning
// (in flight at attach, manual mode, a LibTorch loop's end_step), the steps whose gradients are
// fingerprinted (option fingerprints, a trace open, the replica comparison), and distributed
// parameters (their local shards arrive at the step end). Rows not used by the step end are
// dropped at the next begin of that optimizer, at its gradients' clearing and at close.
void SanitizerImpl::read_grads_at_begin(int64_t opt, bool grads_final) {
  begin_rows.erase(opt);
  if (!grads_final || closed || opts.fingerprints || replicas.enabled) return;
  if (trace.is_open()) {  // the steps fingerprinted for the trace's rows (Note [Bounded trace])
    const auto it = opt_steps.find(opt);
    const int64_t upcoming = it == opt_steps.end() ? 0 : it->second;
    if (trace.rows_due(upcoming)) return;
  }
  const auto t0 = Clock::now();
  BeginRows b;
  // As step_end picks them: this optimizer's parameters and those in none.
  const GradsByDevice by = grads_by_device(params, opt, /*orphans=*/true);
  for (const auto& [dev, gs] : by.grads) {
    PackedStats packed;
    try {
      packed = gradient_stats_packed(gs);
    } catch (const c10::Error&) {
      continue;  // the step end reads them (and says what is wrong with them)
    }
    const size_t c = b.copies.size();
    b.copies.push_back(start_host_copy(packed));
    const std::vector<size_t>& w = by.which.at(dev);
    for (size_t r = 0; r < w.size(); ++r) {
      const at::Tensor& g = params[w[r]].param.grad();
      b.of[w[r]] = {c, static_cast<int64_t>(r), g, static_cast<int64_t>(g._version())};
    }
  }
  if (!b.of.empty()) begin_rows[opt] = std::move(b);
  add_overhead(std::chrono::duration<double>(Clock::now() - t0).count());
}

bool SanitizerImpl::versions_unmoved(int64_t opt) {
  const auto it = versions_at_begin.find(opt);
  if (it == versions_at_begin.end()) return false;  // no pre-hook for this step
  const std::vector<int64_t> before = std::move(it->second);
  versions_at_begin.erase(it);
  bool unmoved = false;
  for (size_t i = 0; i < before.size() && i < params.size() && !unmoved; ++i) {
    unmoved = before[i] >= 0 && static_cast<int64_t>(params[i].param._version()) == before[i];
  }
  // Only the first step of a run of such steps: an optimizer that writes through .data (no
  // version moves, LibTorch's SGD) or skips a tensor on purpose costs one update step, not all.
  bool& last = unmoved_last[opt];
  const bool first = unmoved && !last;
  last = unmoved;
  return first;
}

// Note [Device stop] (kernels/stats.cu) with option device_stop: before optimizer `opt` steps, a
// lean read of its gradients (Note [Lean rows]); on CUDA a one-block kernel fails a device-side
// assertion when one holds NaN/Inf (the host never waits: the job stops at its next CUDA call,
// the update is never applied); on CPU the same counts are read at once and the step raises.
// A GradScaler's skipped step never gets here (Python's _pre_step leaves it out).
void SanitizerImpl::stop_before_step(int64_t opt) {
  if (!opts.device_stop || closed) return;
  const auto t0 = Clock::now();
  const GradsByDevice by = grads_by_device(params, opt, /*orphans=*/false);
  for (const auto& [dev, gs] : by.grads) {
    PackedStats packed;
    try {
      packed = gradient_stats_packed(gs);
    } catch (const c10::Error&) {
      continue;  // a gradient the pass cannot read (dtype, freed storage): never stop for that
    }
    if (packed.ints.is_cuda()) {
      stop_if_nonfinite(packed);
      continue;
    }
    const std::vector<TensorStats> st = unpack_stats(packed);
    int64_t bad = 0;
    std::string first;
    for (size_t k = 0; k < st.size(); ++k) {
      bad += st[k].nonfinite();
      if (first.empty() && st[k].nonfinite() > 0) first = params[by.which.at(dev)[k]].name;
    }
    TORCH_CHECK(bad == 0, "trainsan: device_stop: ", bad,
                " non-finite gradient elements (first in ", first,
                ".grad); the optimizer step was not applied. Find where the NaN/Inf is made "
                "(trainsan's nonfinite_grad / nonfinite_loss findings at this step, or "
                "torch.autograd.set_detect_anomaly(True)); switch device_stop off to let the "
                "sanitizer only report it");
  }
  add_overhead(std::chrono::duration<double>(Clock::now() - t0).count());
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
void SanitizerImpl::sampled_update(size_t i, const TensorStats& now,
                                   const std::optional<TensorStats>& grad,
                                   std::optional<UpdateStats>& update) {
  if (i >= snapshot_hash.size()) return;
  std::optional<uint64_t>& before = snapshot_hash[i];
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

void SanitizerImpl::check_pass(const Pass& p, const std::vector<HostCopy>& copies) {
  TRAINSAN_NVTX_RANGE("trainsan/checks");
  const auto t0 = Clock::now();
  const std::vector<Row> rows = unpack_rows(p, copies);
  StepView v;
  v.step = p.step;
  v.opt = p.opt;
  v.lr_zero = p.lr_zero;
  v.manual = p.manual;
  v.partial = p.partial;
  v.have_optimizer = have_optimizer;
  v.fp16_in_use = fp16_in_use;
  v.model_eval = p.model_eval;
  v.eval_modules = p.eval_modules;
  v.grad_forwards = p.grad_forwards;
  v.no_grad_train_forwards = p.no_grad_train_forwards;
  v.foreign_backwards = p.fed.foreign_backwards;
  v.foreign = p.fed.foreign;
  v.params.resize(p.indices.size());
  for (size_t k = 0; k < p.indices.size(); ++k) {
    const size_t i = p.indices[k];
    ParamView& pv = v.params[k];
    pv.index = i;
    pv.name = params[i].name;
    pv.opt = params[i].opt;
    pv.trainable = params[i].param.requires_grad();
    pv.sharded = params[i].local.defined() && params[i].local.numel() != params[i].param.numel();
    pv.observed = p.consumed[k].observed;
    pv.grad_at_step = p.consumed[k].at_step;
    if (p.grad_row[k] >= 0) pv.grad = rows[static_cast<size_t>(p.grad_row[k])].stats;
    pv.param_l2_before = prev_param_l2[i];
    if (p.param_row[k] >= 0) {
      const Row& pr = rows[static_cast<size_t>(p.param_row[k])];
      pv.param = pr.stats;
      pv.update = pr.update;
      if (p.with_snapshot && !opts.exact_updates) sampled_update(i, pr.stats, pv.grad, pv.update);
      param_stats[i] = pr.stats;
      prev_param_l2[i] = pr.stats.nonfinite() == 0 ? pr.stats.l2 : std::nan("");
    } else {  // Note [Every-step tier]: the latest measurement, not this step's
      pv.param = param_stats[i];
      pv.param.numel = params[i].data().numel();
      pv.param_measured = false;
    }
    const int64_t grp = params[i].group;
    if (pv.opt == p.opt && grp >= 0 && static_cast<size_t>(grp) < p.group_lr.size()) {
      pv.lr = p.group_lr[static_cast<size_t>(grp)];
    }
    pv.eps = dtype_eps(params[i].data().scalar_type());
    pv.grad_left_nonzero = p.consumed[k].left_nonzero;
  }
  if (p.replica) {
    StepFingerprints fp;
    fp.step = p.step;
    fp.opt = p.manual ? -1 : p.opt;
    for (const ParamView& pv : v.params) {
      fp.index.push_back(static_cast<int64_t>(pv.index));
      fp.param.push_back(static_cast<int64_t>(pv.param.hash));
      const bool g = pv.grad.has_value() && p.replica_grads;
      fp.has_grad.push_back(g);
      fp.grad.push_back(g ? static_cast<int64_t>(pv.grad->hash) : 0);
    }
    replicas.fingerprints.push_back(std::move(fp));
  }
  if (!p.hashed) {  // fingerprints only for the replica comparison: not in last_stats/the trace
    for (ParamView& pv : v.params) {
      pv.param.hash = 0;
      if (pv.grad) pv.grad->hash = 0;
    }
  }
  compute_totals(v);
  coverage.steps_checked += 1;
  coverage.update_steps += v.totals.any_update ? 1 : 0;
  checks.flow.on_step(v);
  checks.nonfinite.on_step(v);
  checks.magnitudes.on_step(v);
  checks.integrity.on_step(v);
  checks.precision.on_step(v);
  if (checks.integrity.take_probe_request()) grads.arm_probe(4);  // Note [Zero gradients]
  checks.mode.on_step(v);

  // last_stats() and the step record.
  last.clear();
  StepRecord rec;
  const bool traced = trace.traces(p.step);
  const bool with_rows = traced && trace.wants_tensors(p.step);
  for (const ParamView& pv : v.params) {
    last[pv.name] = pv.param;
    double key = pv.param.l2;
    if (pv.grad) {
      last[pv.name + ".grad"] = *pv.grad;
      key = pv.grad->nonfinite() > 0 ? INFINITY : pv.grad->l2;
    }
    if (pv.update) {
      TensorStats u;
      u.numel = pv.param.numel;
      u.l2 = pv.update->l2;
      u.absmax = pv.update->max;
      u.zero = pv.param.numel - pv.update->changed;
      last[pv.name + ".update"] = u;
    }
    if (with_rows) rec.tensors.push_back({pv.name, pv.param, pv.grad, pv.update, key});
  }
  add_overhead(std::chrono::duration<double>(Clock::now() - t0).count());
  if (traced) {
    rec.step = p.step;
    rec.opt = p.opt;
    rec.lr_zero = p.lr_zero;
    rec.update_stats = v.totals.any_update;
    rec.params_read = p.with_params;
    flush_clock();  // Note [Own time]
    rec.overhead_s = time.step_overhead_s;
    rec.backwards = p.fed.backwards;
    rec.totals = v.totals;
    if (const auto it = input_hashes.find(p.step); it != input_hashes.end()) {
      rec.inputs = it->second;
    }
    if (const auto it = target_hashes.find(p.step); it != target_hashes.end()) {
      rec.targets = it->second;
    }
    rec.loss = last_loss;
    last_loss.reset();
    rec.digest = grads_digest(v);
    trace.step(std::move(rec));
    time.step_overhead_s = 0.0;
  }
}

}  // namespace trainsan::host
