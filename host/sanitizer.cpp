// The sanitizer: gradient hooks (bookkeeping only), the fused pass at each optimizer step, the
// checks over its numbers, findings with de-duplication, and the C++ API.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <sstream>

#include "audit.h"
#include "nvtx.h"
#include "sanitizer_impl.h"
#include "stats.h"
#include "stats_internal.h"
#include "trace.h"

namespace trainsan {

namespace kn = kernels;
using Clock = std::chrono::steady_clock;

namespace {

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

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Post-hook on a parameter's AccumulateGrad node (the pattern of DDP's reducer): runs after the
// gradient has been accumulated into .grad, on the autograd engine's thread. Bookkeeping only.
struct AccumulatePostHook : torch::autograd::FunctionPostHook {
  AccumulatePostHook(std::weak_ptr<SanitizerImpl*> owner, size_t index)
      : owner_(std::move(owner)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (auto o = owner_.lock()) (*o)->on_grad_accumulated(index_);
    return outputs;
  }

 private:
  std::weak_ptr<SanitizerImpl*> owner_;
  size_t index_;
};

}  // namespace

std::string severity_of(const std::string& kind) {
  static const std::set<std::string> warnings = {"grad_explosion",  "grad_vanishing",
                                                 "update_ratio",    "eval_mode",
                                                 "duplicate_batch", "fp16_overflow"};
  return warnings.count(kind) ? "warning" : "error";
}

// ---------------------------------------------------------------------------------------------
// Options

bool Options::enabled(const std::string& kind) const {
  auto it = checks.find(kind);
  if (it != checks.end()) return it->second;
  return kind != "nonfinite_activation" && kind != "update_outside_step";
}

void Options::set(const std::string& name, const std::string& value) {
  auto as_double = [&]() {
    try {
      size_t pos = 0;
      const double v = std::stod(value, &pos);
      TORCH_CHECK_VALUE(pos == value.size(), "");
      return v;
    } catch (...) {
      TORCH_CHECK_VALUE(false, "trainsan option ", name, " expects a number, got '", value, "'");
    }
  };
  auto as_int = [&]() {
    const double v = as_double();
    TORCH_CHECK_VALUE(v == std::floor(v) && v >= 0, "trainsan option ", name,
                      " expects a non-negative integer, got '", value, "'");
    return static_cast<int64_t>(v);
  };
  auto as_bool = [&]() {
    TORCH_CHECK_VALUE(value == "1" || value == "0" || value == "true" || value == "false",
                      "trainsan option ", name, " expects a bool, got '", value, "'");
    return value == "1" || value == "true";
  };
  if (name == "policy") {
    TORCH_CHECK_VALUE(value == "raise" || value == "warn" || value == "record",
                      "trainsan: policy must be 'raise', 'warn' or 'record', got '", value, "'");
    policy = value;
  } else if (name == "trace") {
    trace = value;
  } else if (name == "trace_every") {
    trace_every = std::max<int64_t>(1, as_int());
  } else if (name == "trace_tensors") {
    TORCH_CHECK_VALUE(value == "all" || value == "topk" || value == "global",
                      "trainsan: trace_tensors must be 'all', 'topk' or 'global', got '", value,
                      "'");
    trace_tensors = value;
  } else if (name == "trace_topk") {
    trace_topk = as_int();
  } else if (name == "sync") {
    sync = as_bool();
  } else if (name == "fingerprints") {
    fingerprints = as_bool();
  } else if (name == "track_updates") {
    track_updates = as_bool();
  } else if (name == "grad_explosion_factor") {
    grad_explosion_factor = as_double();
  } else if (name == "grad_explosion_warmup") {
    grad_explosion_warmup = as_int();
  } else if (name == "grad_explosion_limit") {
    grad_explosion_limit = as_double();
  } else if (name == "grad_vanishing_ratio") {
    grad_vanishing_ratio = as_double();
  } else if (name == "grad_vanishing_steps") {
    grad_vanishing_steps = std::max<int64_t>(1, as_int());
  } else if (name == "missing_grad_patience") {
    missing_grad_patience = std::max<int64_t>(1, as_int());
  } else if (name == "update_ratio_low") {
    update_ratio_low = as_double();
  } else if (name == "update_ratio_high") {
    update_ratio_high = as_double();
  } else if (name == "update_ratio_steps") {
    update_ratio_steps = std::max<int64_t>(1, as_int());
  } else if (name == "max_accumulation") {
    max_accumulation = std::max<int64_t>(1, as_int());
  } else if (name == "fp16_overflow_fraction") {
    fp16_overflow_fraction = as_double();
  } else if (name == "audit_first_steps") {
    audit_first_steps = as_int();
  } else if (name == "audit_every") {
    audit_every = as_int();
  } else if (name.rfind("check.", 0) == 0) {
    checks[name.substr(6)] = as_bool();
  } else {
    TORCH_CHECK_VALUE(false, "trainsan: unknown option '", name,
                      "'; see the README's option table for the valid names");
  }
}

// ---------------------------------------------------------------------------------------------
// SanitizerImpl

SanitizerImpl::SanitizerImpl(std::vector<ParamInfo> ps, Options o, std::string header_json)
    : params(std::move(ps)), opts(std::move(o)) {
  grad.resize(params.size());
  audit = std::make_unique<OpAudit>(*this);
  for (const auto& p : params) have_optimizer = have_optimizer || p.opt >= 0;
  if (!opts.trace.empty()) {
    trace.open(opts.trace, std::ios::out | std::ios::trunc);
    TORCH_CHECK_VALUE(trace.is_open(), "trainsan: cannot open the trace file '", opts.trace,
                      "' for writing; check that its directory exists and is writable");
    write_trace_line(trace_header_json(opts, header_json, params.size()));
  }
  if (opts.track_updates) {
    snapshots.resize(params.size());
    const at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].param.requires_grad()) {
        snapshots[i] = params[i].param.detach().clone(at::MemoryFormat::Contiguous);
      }
    }
  }
  prev_param_l2.assign(params.size(), std::nan(""));
  if (opts.track_updates) {
    // Norms before the first step, for the first update ratio: one fused pass per device.
    std::map<std::pair<int, int>, std::vector<size_t>> groups;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Device d = params[i].param.device();
      groups[{static_cast<int>(d.type()), d.index()}].push_back(i);
    }
    for (const auto& [dev, idx] : groups) {
      std::vector<at::Tensor> ts;
      for (const size_t i : idx) ts.push_back(params[i].param.detach());
      try {
        const std::vector<TensorStats> st = unpack_stats(tensor_stats_packed(ts));
        for (size_t j = 0; j < idx.size(); ++j) {
          if (st[j].nonfinite() == 0) prev_param_l2[idx[j]] = st[j].l2;
        }
      } catch (const c10::Error&) {
        // unsupported dtype: the first ratio of these parameters stays unknown
      }
    }
  }
}

SanitizerImpl::~SanitizerImpl() {
  try {
    remove_hooks();
  } catch (...) {
  }
}

void SanitizerImpl::install_hooks() {
  if (!hook_keys.empty()) return;
  self_token = std::make_shared<SanitizerImpl*>(this);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i].param;
    if (!p.requires_grad() || !p.is_leaf()) {
      accumulators.emplace_back();
      hook_keys.push_back(0);
      continue;
    }
    // Holding the accumulator keeps it (and the hook) alive across graphs, as DDP does.
    auto acc = torch::autograd::impl::grad_accumulator(p);
    const uintptr_t key = acc->add_post_hook(std::make_unique<AccumulatePostHook>(self_token, i));
    accumulators.push_back(std::move(acc));
    hook_keys.push_back(key);
  }
}

void SanitizerImpl::remove_hooks() {
  for (size_t i = 0; i < accumulators.size(); ++i) {
    if (accumulators[i]) accumulators[i]->del_post_hook(hook_keys[i]);
  }
  accumulators.clear();
  hook_keys.clear();
  self_token.reset();  // a hook still running elsewhere sees the owner gone
}

void SanitizerImpl::on_grad_accumulated(size_t i) {
  audit->stop();  // backward has started: the op audit covers forward and loss only
  const at::Tensor& g = params[i].param.grad();
  if (!g.defined()) return;
  const std::lock_guard<std::mutex> lock(mu);
  GradState& s = grad[i];
  const c10::TensorImpl* impl = g.unsafeGetTensorImpl();
  const uint32_t ver = g._version();
  const bool onto_consumed = s.consumed.get() == impl && ver == s.consumed_version + 1;
  const bool onto_last = s.last.get() == impl && ver == s.last_version + 1;
  if (!in_step) {
    if (onto_consumed && have_optimizer) {
      s.stale = true;
    } else if (onto_last) {
      s.accumulated = true;
    } else if (s.produced_since_clear && !s.step_since_clear && have_optimizer &&
               params[i].opt >= 0) {
      // Cleared (zero_grad) although no step used the previous gradient. Once is legitimate:
      // another model's backward (GAN) leaves gradients here that this model's zero_grad
      // discards before its own backward. Twice in a row with no step of this parameter's
      // optimizer in between means its steps are missing.
      s.unused_clears += 1;
      if (s.unused_clears >= 2) s.skipped = true;
    }
    if (!onto_last && !onto_consumed) {
      s.step_since_clear = false;
    }
  }
  if (!onto_last && !onto_consumed) {
    // A fresh .grad: whatever was accumulated onto a consumed gradient before has been cleared
    // (zero_grad / set to None) without a step using it, so it can no longer be stale.
    s.stale = false;
    s.accumulated = false;
  }
  s.produced_since_clear = true;
  s.got_grad = true;
  grad_since_forward = true;
  s.last = WeakImpl(g);
  s.last_version = ver;
}

std::vector<Finding> SanitizerImpl::add(const std::string& kind, const std::string& tensor,
                                        const std::string& message, std::optional<double> value,
                                        int64_t at_step) {
  if (!opts.enabled(kind)) return {};
  const int64_t st = at_step >= 0 ? at_step : step;
  const std::string key = kind + '\x1f' + tensor;
  auto it = finding_index.find(key);
  if (it != finding_index.end()) {
    Finding& f = findings[it->second];
    f.count += 1;
    f.last_step = st;
    return {};
  }
  Finding f;
  f.kind = kind;
  f.step = st;
  f.last_step = st;
  f.severity = severity_of(kind);
  f.tensor = tensor;
  f.message = kind + " at step " + std::to_string(st) + ": " + message;
  f.value = value;
  finding_index[key] = findings.size();
  findings.push_back(f);
  write_trace_line(finding_json(f));
  return {f};
}

static void append(std::vector<Finding>& a, std::vector<Finding> b) {
  a.insert(a.end(), std::make_move_iterator(b.begin()), std::make_move_iterator(b.end()));
}

std::vector<Finding> SanitizerImpl::on_forward(bool grad_enabled, bool training,
                                               const std::vector<std::string>& eval_modules,
                                               const std::vector<at::Tensor>& inputs,
                                               bool fp16_autocast) {
  const auto t0 = Clock::now();
  TRAINSAN_NVTX_RANGE("trainsan/forward");
  std::vector<Finding> out;
  if (closed || in_step) return out;
  append(out, audit->take());
  if (!grad_enabled && training) {
    append(out, add("no_grad_leak", "",
                    "the model's forward ran with gradients disabled (torch.no_grad / "
                    "inference_mode) while the model is in train mode — parameters get no "
                    "gradient from this forward; if this is validation, call model.eval() first, "
                    "otherwise remove the no_grad context around the training forward",
                    std::nullopt));
  }
  if (grad_enabled) {
    current_eval_modules = eval_modules;
  }
  if (grad_enabled && training) {
    {
      const std::lock_guard<std::mutex> lock(mu);
      if (grad_since_forward) backwards_since_step += 1;
      grad_since_forward = false;
    }
    append(out, check_between_steps());
  }
  fp16_in_use = fp16_in_use || fp16_autocast;
  if (grad_enabled && training && input_hash_step != step && !inputs.empty()) {
    input_hash_step = step;
    std::vector<at::Tensor> ok;
    for (const auto& t : inputs) {
      if (t.defined() && t.layout() == at::kStrided && !t.is_meta() &&
          (t.device().is_cpu() || t.device().is_cuda()) && t.device() == inputs[0].device()) {
        ok.push_back(t.detach());
      }
    }
    if (!ok.empty()) {
      try {
        host::check_tensors(ok, "trainsan inputs");
        pending_inputs = host::start_host_copy(tensor_stats_packed(ok));
      } catch (const c10::Error&) {
        pending_inputs.reset();  // unsupported input dtypes: no duplicate-batch check
      }
    }
  }
  add_overhead(seconds_since(t0));
  if (grad_enabled && training) audit->begin_forward();  // last: TrainSan's own ops stay out
  return out;
}

std::vector<Finding> SanitizerImpl::check_between_steps() {
  // Gradients cleared without a step that used them are seen by the hooks of the next backward;
  // report them at the next training forward, since no optimizer step may ever come.
  std::vector<std::string> skipped;
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < params.size(); ++i) {
      if (grad[i].skipped) skipped.push_back(params[i].name);
      grad[i].skipped = false;
    }
  }
  std::vector<Finding> out;
  if (!skipped.empty()) {
    append(out, add("skipped_step", skipped.front(),
                    "gradients of " + std::to_string(skipped.size()) + " parameter(s) (e.g. " +
                        skipped.front() +
                        ") were produced by backward() and then cleared by zero_grad() without "
                        "any optimizer.step() using them — call optimizer.step() after backward()",
                    static_cast<double>(skipped.size())));
  }
  if (have_optimizer && backwards_since_step > opts.max_accumulation) {
    append(out, add("skipped_step", "",
                    std::to_string(backwards_since_step) +
                        " backward passes ran without an optimizer step (more than "
                        "max_accumulation=" +
                        std::to_string(opts.max_accumulation) +
                        ") — optimizer.step() is never called, or the accumulation condition "
                        "never holds",
                    static_cast<double>(backwards_since_step)));
  }
  return out;
}

std::vector<Finding> SanitizerImpl::on_loss(const at::Tensor& loss) {
  const auto t0 = Clock::now();
  std::vector<Finding> out;
  append(out, audit->take());
  TORCH_CHECK_TYPE(loss.defined(), "watch_loss: loss is an undefined tensor");
  host::check_tensors({loss}, "watch_loss");
  host::HostCopy copy = host::start_host_copy(tensor_stats_packed({loss.detach()}));
  if (!copy.event || opts.sync) {
    host::wait_host_copy(copy);
    append(out, check_loss(unpack_stats(copy.host)[0], step));
  } else {
    pending_losses.push_back(std::move(copy));
  }
  add_overhead(seconds_since(t0));
  return out;
}

std::vector<Finding> SanitizerImpl::on_step_begin(int64_t opt) {
  {
    const std::lock_guard<std::mutex> lock(mu);
    in_step = true;
  }
  std::vector<Finding> out;
  append(out, audit->take());
  if (!opts.enabled("update_outside_step") || snapshots.empty() || closed) return out;
  // Opt-in: one comparison per parameter against the snapshot of the previous step's end, and
  // one read of the flags (a device sync on GPU) — hence off by default.
  const auto t0 = Clock::now();
  std::vector<size_t> idx;
  std::vector<at::Tensor> flags;
  {
    const at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      if (opt >= 0 && params[i].opt != opt) continue;
      const at::Tensor& snap = snapshots[i];
      const at::Tensor& prm = params[i].param;
      if (!snap.defined() || snap.sizes() != prm.sizes() || snap.device() != prm.device() ||
          snap.scalar_type() != prm.scalar_type() || step == 0) {
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
    for (size_t k = 0; k < idx.size(); ++k) {
      if (!c[k]) continue;
      const std::string& n = params[idx[k]].name;
      append(out, add("update_outside_step", n,
                      n + " changed between the previous optimizer step and this one without a "
                          "step — a manual in-place update (.data, copy_, add_ under no_grad), a "
                          "load_state_dict, or another optimizer writing it",
                      std::nullopt));
    }
  }
  add_overhead(seconds_since(t0));
  return out;
}

void SanitizerImpl::on_amp_skip(int64_t opt) {
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < params.size(); ++i) {
      if (opt < 0 || params[i].opt == opt) {
        grad[i].step_since_clear = true;  // the scaler consumed the gradient, on purpose
        grad[i].unused_clears = 0;
        grad[i].got_grad = false;
      }
    }
    in_step = false;
  }
  amp_skips += 1;
  write_trace_line(amp_skip_json(step, opt));
}

std::vector<Finding> SanitizerImpl::on_step_end(int64_t opt, bool lr_zero,
                                                double extra_overhead_s) {
  add_overhead(extra_overhead_s);
  return run_pass(opt, lr_zero, /*manual=*/false);
}

std::vector<Finding> SanitizerImpl::on_manual_boundary(double extra_overhead_s) {
  add_overhead(extra_overhead_s);
  bool any = false;
  {
    const std::lock_guard<std::mutex> lock(mu);
    for (const auto& g : grad) any = any || g.produced_since_clear;
  }
  if (!any) return {};
  return run_pass(-1, /*lr_zero=*/false, /*manual=*/true);
}

std::vector<Finding> SanitizerImpl::run_pass(int64_t opt, bool lr_zero, bool manual) {
  const auto t0 = Clock::now();
  TRAINSAN_NVTX_RANGE("trainsan/step");
  std::vector<Finding> out;
  if (closed) return out;
  append(out, audit->step_end());
  auto p = std::make_unique<PendingPass>();
  // With several optimizers, each steps once per iteration: the step number is the count of
  // the stepping optimizer's steps, and `step` (iterations) the largest such count.
  int64_t& opt_count = opt_steps[manual ? -1 : opt];
  p->step = opt_count;
  opt_count += 1;
  p->opt = opt;
  p->lr_zero = lr_zero;
  p->manual = manual;
  p->eval_modules = current_eval_modules;
  {
    const std::lock_guard<std::mutex> lock(mu);
    in_step = false;
    backwards_since_step = 0;
    grad_since_forward = false;
    for (size_t i = 0; i < params.size(); ++i) {
      GradState& s = grad[i];
      // A step covers its optimizer's parameters and those in no optimizer
      // (param_not_in_optimizer).
      const bool orphan = params[i].opt < 0;
      if (!manual && opt >= 0 && params[i].opt != opt && !orphan) continue;
      p->indices.push_back(i);
      p->observed.push_back(s);
      // This step consumes the gradient as it is now.
      const at::Tensor& g = params[i].param.grad();
      p->grad_at_step.push_back(
          !g.defined()                                                                  ? 1
          : (s.last.get() == g.unsafeGetTensorImpl() && g._version() == s.last_version) ? 0
                                                                                        : 2);
      if (!manual && !orphan) {
        if (g.defined()) {
          s.consumed = WeakImpl(g);
          s.consumed_version = g._version();
        }
        s.step_since_clear = true;
        s.unused_clears = 0;
      }
      s.got_grad = false;
      s.stale = false;
      s.accumulated = false;
      if (manual) s.produced_since_clear = false;
    }
  }
  {
    TRAINSAN_NVTX_RANGE("trainsan/stats");
    // Rows: gradients then parameters, grouped by device; one pass per device.
    // Keyed by (device type, index): at::Device has no ordering.
    using DevKey = std::pair<int, int>;
    std::map<DevKey, std::vector<at::Tensor>> tensors, snaps;
    // Fingerprints (hash) cost about two thirds of the CPU pass's arithmetic and no check reads
    // them: computed on traced steps (for `trainsan diff`) or every step with `fingerprints`.
    p->hashed = opts.fingerprints || (trace.is_open() && p->step % opts.trace_every == 0);
    std::map<DevKey, std::vector<char>> no_hash;
    std::map<DevKey, std::vector<int64_t>> global_rows;
    const bool upd = opts.track_updates;
    p->with_update = upd;
    int64_t row = 0;
    auto push = [&](const at::Tensor& t, const at::Tensor& snap) {
      const DevKey d{static_cast<int>(t.device().type()), t.device().index()};
      tensors[d].push_back(t.detach());
      snaps[d].push_back(snap);
      no_hash[d].push_back(p->hashed ? 0 : 1);
      global_rows[d].push_back(row);
      return row++;
    };
    p->grad_row.assign(p->indices.size(), -1);
    p->param_row.assign(p->indices.size(), -1);
    for (size_t k = 0; k < p->indices.size(); ++k) {
      const at::Tensor& g = params[p->indices[k]].param.grad();
      bool untouched = true;
      if (manual && g.defined()) {
        // Manual loops clear gradients (zero_ / None) after their update and before the next
        // forward, where this pass runs: only a gradient as the backward left it is checked.
        const std::lock_guard<std::mutex> lock(mu);
        const GradState& s = grad[p->indices[k]];
        untouched = s.last.get() == g.unsafeGetTensorImpl() && s.last_version == g._version();
      }
      if (g.defined() && g.layout() == at::kStrided && untouched) {
        p->grad_row[k] = push(g, at::Tensor());
      }
    }
    for (size_t k = 0; k < p->indices.size(); ++k) {
      const size_t i = p->indices[k];
      const at::Tensor& prm = params[i].param;
      at::Tensor snap = upd && i < snapshots.size() ? snapshots[i] : at::Tensor();
      if (snap.defined() && (snap.device() != prm.device() || snap.numel() != prm.numel() ||
                             snap.scalar_type() != prm.scalar_type())) {
        snap = at::Tensor();  // the parameter was replaced; start a new snapshot below
        snapshots[i] = prm.detach().clone(at::MemoryFormat::Contiguous);
      }
      p->param_row[k] = push(prm, snap);
    }
    p->row_map.assign(static_cast<size_t>(row), {0, 0});
    for (auto& [dev, ts] : tensors) {
      const std::vector<at::Tensor>& sn = snaps[dev];
      const bool any_snap =
          std::any_of(sn.begin(), sn.end(), [](const at::Tensor& t) { return t.defined(); });
      const std::vector<char>* nh = &no_hash[dev];
      PackedStats packed = ts.front().is_cuda()
                               ? host::packed_cuda(ts, any_snap ? &sn : nullptr, nh)
                               : host::packed_cpu(ts, any_snap ? &sn : nullptr, nh);
      const size_t c = p->copies.size();
      p->copies.push_back(host::start_host_copy(packed));
      const auto& gr = global_rows[dev];
      for (size_t r = 0; r < gr.size(); ++r) {
        p->row_map[static_cast<size_t>(gr[r])] = {c, static_cast<int64_t>(r)};
      }
    }
  }
  p->inputs = std::move(pending_inputs);
  pending_inputs.reset();
  p->losses = std::move(pending_losses);
  pending_losses.clear();
  step = std::max(step, opt_count);
  current_eval_modules.clear();

  // Check: the previous pass (GPU, lagged by one step) or this one (CPU, or sync).
  bool device_pass = false;
  for (const auto& c : p->copies) device_pass = device_pass || c.event != nullptr;
  p->launch_overhead_s = seconds_since(t0);
  if (!device_pass || opts.sync) {
    if (pending) append(out, check_pass(*pending));
    pending.reset();
    append(out, check_pass(*p));
  } else {
    if (pending) append(out, check_pass(*pending));
    pending = std::move(p);
  }
  add_overhead(seconds_since(t0));
  return out;
}

std::vector<Finding> SanitizerImpl::close() {
  std::vector<Finding> out;
  if (closed) return out;
  append(out, audit->close());
  if (pending) append(out, check_pass(*pending));
  pending.reset();
  remove_hooks();
  closed = true;
  write_trace_line(summary_json(*this));
  if (trace.is_open()) trace.close();
  return out;
}

std::map<std::string, TensorStats> SanitizerImpl::last_stats() const { return last; }

void SanitizerImpl::write_trace_line(const std::string& json) {
  if (!trace.is_open()) return;
  trace << json << '\n';
  trace.flush();
}

// ---------------------------------------------------------------------------------------------
// C++ API

namespace {

void apply_policy(const Options& o, const std::vector<Finding>& fs) {
  for (const auto& f : fs) {
    if (o.policy == "raise" && f.severity == "error") throw TrainingBugError(f);
    if (o.policy != "record") std::cerr << "[trainsan] " << f.severity << ": " << f.message << '\n';
  }
}

std::vector<ParamInfo> to_params(const Sanitizer::NamedTensors& named) {
  std::vector<ParamInfo> out;
  for (const auto& [name, t] : named) {
    TORCH_CHECK_TYPE(t.defined(), "trainsan::Sanitizer: parameter '", name, "' is undefined");
    out.push_back({name, t, 0});
  }
  TORCH_CHECK_VALUE(!out.empty(),
                    "trainsan::Sanitizer: no parameters given; pass "
                    "model->named_parameters()");
  return out;
}

}  // namespace

Sanitizer::Sanitizer(const NamedTensors& named_parameters, Options options)
    : impl_(std::make_unique<SanitizerImpl>(to_params(named_parameters), std::move(options), "")) {
  impl_->install_hooks();
}

Sanitizer::~Sanitizer() {
  try {
    impl_->close();
  } catch (...) {
  }
}

void Sanitizer::begin_step(const std::vector<at::Tensor>& inputs) {
  apply_policy(impl_->opts, impl_->on_step_begin(-1));
  {
    const std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->in_step = false;  // C++: begin_step precedes the forward, not the optimizer step
  }
  apply_policy(impl_->opts, impl_->on_forward(at::GradMode::is_enabled(), true, {}, inputs, false));
}

void Sanitizer::watch_loss(const at::Tensor& loss) {
  apply_policy(impl_->opts, impl_->on_loss(loss));
}

void Sanitizer::end_step(bool lr_zero) {
  apply_policy(impl_->opts, impl_->on_step_end(0, lr_zero, 0.0));
}

void Sanitizer::close() { apply_policy(impl_->opts, impl_->close()); }

const std::vector<Finding>& Sanitizer::findings() const { return impl_->findings; }

std::map<std::string, TensorStats> Sanitizer::last_stats() const { return impl_->last_stats(); }

int64_t Sanitizer::step() const { return impl_->step; }

bool Sanitizer::hooks_installed() const { return impl_->hooks_installed(); }

}  // namespace trainsan
