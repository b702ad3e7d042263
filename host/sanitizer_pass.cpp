// The step pass: one fused statistics pass per device over the stepping optimizer's gradients,
// parameters and snapshot, queued for read-back (Note [Lagged checks]); when it lands, the
// StepView that every check family reads, last_stats() and the trace's step record.
// Which steps get update statistics, the snapshots and the per-parameter figures kept between
// passes are UpdateStatistics' (update_stats.cpp).
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
  bool unwritten = false;        // Note [Manual-mode steps]
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
  p->unwritten = manual && manual_unwritten();
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
    // Note [Overhead budget], Note [Version trigger]: update statistics on this step or the next.
    const UpdatePlan up = updates.plan(p->step, opt, manual, lr_zero, p->partial);
    with_snapshot = up.with_snapshot;
    p->with_snapshot = with_snapshot;
    // Note [Every-step tier]: the parameters are read with the update statistics (the step that
    // writes the snapshot and the step that reads it), on traced and replica steps.
    p->with_params = up.read_params || p->hashed || p->replica;
    p->report_update = up.report_update;
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
      const at::Tensor snap = with_snapshot ? updates.snapshot_for(i, prm) : at::Tensor();
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
    updates.budget.observe(std::chrono::duration<double>(now - last_step_end).count(),
                           time.overhead_s - overhead_at_last_step_end, p->with_params);
  }
  last_step_end = now;
  overhead_at_last_step_end = time.overhead_s;
  coverage.update_period = updates.budget.period();
  for (Feed* f : feeds) f->after_step(manual ? -1 : opt, /*skipped=*/false);
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

void SanitizerImpl::check_pass(const Pass& p, const std::vector<HostCopy>& copies) {
  TRAINSAN_NVTX_RANGE("trainsan/checks");
  const auto t0 = Clock::now();
  const std::vector<Row> rows = unpack_rows(p, copies);
  StepView v;
  v.step = p.step;
  v.opt = p.opt;
  v.lr_zero = p.lr_zero;
  v.manual = p.manual;
  v.unwritten = p.unwritten;
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
    if (p.param_row[k] >= 0) {
      const Row& pr = rows[static_cast<size_t>(p.param_row[k])];
      updates.fill(pv, i, &pr.stats, pr.update, p.with_snapshot);
    } else {
      updates.fill(pv, i, nullptr, std::nullopt, p.with_snapshot);
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
