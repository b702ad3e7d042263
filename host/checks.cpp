// The checks over one step's numbers (the fused pass's results plus the hooks' observations).
// Each check's rule, default threshold and reason are in the README ("Checks and their options").
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

#include "nvtx.h"
#include "sanitizer_impl.h"
#include "stats.h"
#include "trace.h"

namespace trainsan {

namespace kn = kernels;

namespace {

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(4);
  os << v;
  return os.str();
}

struct Update {
  int64_t changed = 0;
  double l2 = 0.0;
  double max = 0.0;
};

struct Row {
  TensorStats stats;
  std::optional<Update> update;
};

std::vector<Row> unpack_rows(const PendingPass& p) {
  std::vector<std::vector<Row>> per_copy;
  for (const auto& c : p.copies) {
    host::wait_host_copy(c);
    const std::vector<TensorStats> st = unpack_stats(c.host);
    std::vector<Row> rows(st.size());
    const bool upd = c.host.ints.size(1) == kn::kIntFieldsUpdate;
    const int64_t* ip = c.host.ints.const_data_ptr<int64_t>();
    const double* fp = c.host.floats.const_data_ptr<double>();
    for (size_t r = 0; r < st.size(); ++r) {
      rows[r].stats = st[r];
      if (!p.hashed) rows[r].stats.hash = 0;
      if (upd) {
        Update u;
        u.changed = ip[r * kn::kIntFieldsUpdate + kn::kIntFields];
        u.l2 = fp[r * kn::kFloatFieldsUpdate + kn::kFloatFields];
        u.max = fp[r * kn::kFloatFieldsUpdate + kn::kFloatFields + 1];
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

std::string nonfinite_text(const TensorStats& s) {
  std::ostringstream os;
  os << s.nan << " NaN, " << s.posinf << " +Inf and " << s.neginf << " -Inf values of " << s.numel;
  return os.str();
}

}  // namespace

std::vector<Finding> SanitizerImpl::check_loss(const TensorStats& s, int64_t at_step) {
  if (s.nonfinite() == 0) return {};
  return add("nonfinite_loss", "",
             "the loss holds " + nonfinite_text(s) +
                 " — check the model outputs and the loss inputs (log of 0, division by 0, too "
                 "large a learning rate in the previous step)",
             static_cast<double>(s.nonfinite()), at_step);
}

std::vector<Finding> SanitizerImpl::check_pass(PendingPass& p) {
  TRAINSAN_NVTX_RANGE("trainsan/checks");
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Finding> out;
  auto emit = [&](const std::string& kind, const std::string& tensor, const std::string& msg,
                  std::optional<double> value) {
    auto fs = add(kind, tensor, msg, value, p.step);
    out.insert(out.end(), fs.begin(), fs.end());
  };
  const std::vector<Row> rows = unpack_rows(p);
  const size_t n = p.indices.size();
  auto name = [&](size_t k) { return params[p.indices[k]].name; };

  // --- losses and inputs queued during the step ---
  for (const auto& lc : p.losses) {
    host::wait_host_copy(lc);
    const auto fs = check_loss(unpack_stats(lc.host)[0], p.step);
    out.insert(out.end(), fs.begin(), fs.end());
  }
  if (p.inputs) {
    host::wait_host_copy(*p.inputs);
    uint64_t h = 0x84222325cbf29ce4ull;
    for (const auto& s : unpack_stats(p.inputs->host)) h = (h ^ s.hash) * 0x100000001b3ull;
    if (last_input_hash && *last_input_hash == h) {
      emit("duplicate_batch", "",
           "the training forward received exactly the same inputs (bit for bit) as at the "
           "previous step — the data loader or the batch variable is not advancing (e.g. `x, y = "
           "next(iter(loader))` inside the loop, or a batch reused by mistake)",
           std::nullopt);
    }
    last_input_hash = h;
  }

  // --- hook observations of this step ---
  int64_t with_grad = 0;
  for (size_t k = 0; k < n; ++k) with_grad += p.observed[k].got_grad ? 1 : 0;
  for (size_t k = 0; k < n; ++k) {
    const GradState& o = p.observed[k];
    const size_t i = p.indices[k];
    GradState& live = grad[i];
    const bool trainable = params[i].param.requires_grad();
    if (o.stale || (p.manual && o.accumulated && manual_prev_changed)) {
      emit("stale_grad", name(k),
           name(k) + " still holds the gradient of step " + std::to_string(p.step - 1) +
               " — optimizer.zero_grad() was not called after optimizer.step() (for gradient "
               "accumulation, zero after the step)",
           std::nullopt);
    }
    if (have_optimizer && params[i].opt < 0 && o.got_grad) {
      emit("param_not_in_optimizer", name(k),
           name(k) +
               " receives gradients but is in no optimizer's param_groups, so it never trains — "
               "build the optimizer from model.parameters() after the model is complete (or "
               "add_param_group), or set requires_grad=False if it is meant to be frozen",
           std::nullopt);
    }
    const bool counted = p.manual ? trainable : (params[i].opt >= 0 && trainable);
    if (counted && !p.observed[k].got_grad && with_grad > 0) {
      live.steps_without_grad += 1;
      if (live.steps_without_grad >= opts.missing_grad_patience) {
        emit("missing_grad", name(k),
             name(k) + " got no gradient for " + std::to_string(live.steps_without_grad) +
                 " steps while other parameters did — its output does not reach the loss "
                 "(a .detach(), torch.no_grad(), .data, or an unused branch in forward())",
             static_cast<double>(live.steps_without_grad));
      }
    } else if (o.got_grad) {
      live.steps_without_grad = 0;
    }
  }

  // --- numeric checks on the pass results ---
  double grad_sq = 0.0, param_sq = 0.0, upd_sq = 0.0;
  double pre_sq = 0.0;  // ‖θ‖² before the step, over the parameters with an update
  bool pre_known = true;
  int64_t changed = 0;
  bool any_update = false;
  bool any_nonfinite_grad = false;
  size_t top_grad = 0;
  double top_grad_l2 = -1.0;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = p.indices[k];
    const Row& pr = rows[static_cast<size_t>(p.param_row[k])];
    if (p.grad_row[k] >= 0) {
      const TensorStats& g = rows[static_cast<size_t>(p.grad_row[k])].stats;
      if (g.nonfinite() > 0) {
        any_nonfinite_grad = true;
        emit("nonfinite_grad", name(k),
             name(k) + ".grad holds " + nonfinite_text(g) +
                 " — look for log/sqrt/division of zero or negative values, too large a learning "
                 "rate, or fp16 overflow in the forward; torch.autograd.set_detect_anomaly(True) "
                 "names the op",
             static_cast<double>(g.nonfinite()));
      } else {
        grad_sq += g.l2 * g.l2;
        if (g.l2 > top_grad_l2) {
          top_grad_l2 = g.l2;
          top_grad = k;
        }
      }
      GradState& live = grad[i];
      const bool vanished =
          g.nonfinite() == 0 && (g.l2 == 0.0 || g.l2 <= opts.grad_vanishing_ratio * pr.stats.l2);
      live.vanishing_steps = vanished ? live.vanishing_steps + 1 : 0;
      if (vanished && live.vanishing_steps >= opts.grad_vanishing_steps && !p.lr_zero) {
        emit("grad_vanishing", name(k),
             name(k) + ".grad has been " +
                 (g.l2 == 0.0 ? "exactly zero" : "negligible (" + fmt(g.l2) + ")") + " for " +
                 std::to_string(live.vanishing_steps) +
                 " steps — dead activations (ReLU), saturated sigmoid/tanh, a multiplication by "
                 "zero, or a loss that does not depend on this layer",
             g.l2);
      }
    }
    if (pr.stats.nonfinite() > 0) {
      emit("nonfinite_param", name(k),
           name(k) + " holds " + nonfinite_text(pr.stats) +
               " after the step — a non-finite gradient or learning rate reached the weights; "
               "check the gradients at this step and the optimizer's state",
           static_cast<double>(pr.stats.nonfinite()));
    } else {
      param_sq += pr.stats.l2 * pr.stats.l2;
    }
    if (pr.update) {
      any_update = true;
      upd_sq += pr.update->l2 * pr.update->l2;
      changed += pr.update->changed;
      const double pre = i < prev_param_l2.size() ? prev_param_l2[i] : std::nan("");
      if (std::isfinite(pre)) {
        pre_sq += pre * pre;
      } else {
        pre_known = false;
      }
    }
    if (i < prev_param_l2.size()) {
      prev_param_l2[i] = pr.stats.nonfinite() == 0 ? pr.stats.l2 : std::nan("");
    }
    if (fp16_in_use && pr.stats.fp16_overflow > 0) {
      emit("fp16_overflow", name(k),
           name(k) + " holds " + std::to_string(pr.stats.fp16_overflow) +
               " values beyond ±65504, which become Inf when cast to fp16 under autocast — "
               "use bfloat16, rescale, or keep this computation in float32",
           static_cast<double>(pr.stats.fp16_overflow));
    }
  }
  const double grad_norm = std::sqrt(grad_sq);
  // grad_explosion: against an exponential moving average of past finite global norms.
  if (!any_nonfinite_grad && grad_sq > 0.0) {
    // Per optimizer: with several, each covers its own parameters.
    double& grad_norm_ema = grad_norm_ema_of[p.opt];
    int64_t& grad_norm_steps = grad_norm_steps_of[p.opt];
    const bool warm = grad_norm_steps >= opts.grad_explosion_warmup && grad_norm_ema > 0.0;
    const bool jump = warm && grad_norm > opts.grad_explosion_factor * grad_norm_ema;
    const bool over = opts.grad_explosion_limit > 0.0 && grad_norm > opts.grad_explosion_limit;
    if (jump || over) {
      emit("grad_explosion", "",
           "the global gradient norm is " + fmt(grad_norm) +
               (jump ? ", " + fmt(grad_norm / grad_norm_ema) + "x its running average " +
                           fmt(grad_norm_ema)
                     : ", above the limit " + fmt(opts.grad_explosion_limit)) +
               " (largest: " + name(top_grad) +
               ") — lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), or "
               "look for an unnormalised loss or input at this step",
           grad_norm);
    } else {
      grad_norm_ema = grad_norm_steps == 0 ? grad_norm : 0.9 * grad_norm_ema + 0.1 * grad_norm;
      grad_norm_steps += 1;
    }
  }
  const double param_norm = std::sqrt(param_sq);
  const double upd_norm = std::sqrt(upd_sq);
  // The update ratio is against the parameters *before* the step (cs231n's update/weight
  // ratio): against ‖θ_after‖ it could never exceed ~1 once updates dominate the weights
  // (‖Δθ‖ <= ‖θ_after‖ + ‖θ_before‖), so update_ratio_high = 1 would be out of reach. Falls back
  // to the norm after the step where the norm before is unknown.
  const double pre_norm = std::sqrt(pre_sq);
  const double ratio_denom = pre_known && pre_norm > 0.0 ? pre_norm : param_norm;
  const double ratio = ratio_denom > 0.0 ? upd_norm / ratio_denom : 0.0;
  if (p.manual) manual_prev_changed = changed > 0;
  // skipped_step, cleared before the step: every gradient produced since the previous step of
  // this optimizer was gone at the step — set to None, or zeroed in place after backward()
  // (zero_grad() between backward() and step()). Clearing only some (selective freezing) is fine.
  if (!p.manual && p.grad_at_step.size() == n) {
    int64_t produced = 0, cleared = 0;
    for (size_t k = 0; k < n; ++k) {
      if (!p.observed[k].got_grad || params[p.indices[k]].opt < 0) continue;
      produced += 1;
      const bool zeroed = p.grad_at_step[k] == 2 && p.grad_row[k] >= 0 &&
                          rows[static_cast<size_t>(p.grad_row[k])].stats.zero ==
                              rows[static_cast<size_t>(p.grad_row[k])].stats.numel;
      cleared += (p.grad_at_step[k] == 1 || zeroed) ? 1 : 0;
    }
    if (produced > 0 && cleared == produced) {
      emit("skipped_step", "",
           "optimizer.step() ran after the gradients of all " + std::to_string(produced) +
               " parameter(s) that got one since the previous step had been cleared — "
               "zero_grad() is called between backward() and step(); call it before backward() "
               "(or after step())",
           static_cast<double>(produced));
    }
  }
  if (any_update && !p.manual && !p.lr_zero && grad_sq > 0.0 && changed == 0) {
    emit("skipped_step", "",
         "optimizer.step() ran but changed no parameter although the gradients are nonzero — "
         "the optimizer holds other tensors than the model's parameters (built before the model "
         "was replaced or moved?), or its learning rate underflows",
         0.0);
  }
  if (any_update && !p.lr_zero && ratio_denom > 0.0 && grad_sq > 0.0) {
    const bool outside = ratio < opts.update_ratio_low || ratio > opts.update_ratio_high;
    int64_t& out_steps = update_ratio_out[p.opt];
    out_steps = outside ? out_steps + 1 : 0;
    // One step beyond 10x the upper bound is enough: adaptive optimizers (Adam) with an absurd
    // learning rate inflate the weights in one step, after which the ratio falls back under 1.
    const bool extreme = ratio > 10.0 * opts.update_ratio_high;
    if (outside && (out_steps >= opts.update_ratio_steps || extreme)) {
      emit("update_ratio", "",
           "the update ratio ||Δθ||/||θ|| (θ before the step) has been " + fmt(ratio) +
               " (outside [" + fmt(opts.update_ratio_low) + ", " + fmt(opts.update_ratio_high) +
               "]) for " + std::to_string(out_steps) + " step(s) — the learning rate is far too " +
               (ratio > opts.update_ratio_high ? "high" : "low") +
               " for these weights (typical ratios are 1e-4..1e-2)",
           ratio);
    }
  }
  if (!p.eval_modules.empty() && !p.manual) {
    // Entries are "name:Type" (Python) or "name".
    const std::string& first = p.eval_modules.front();
    const size_t colon = first.rfind(':');
    const std::string mod = first.substr(0, colon);
    const std::string type = colon == std::string::npos ? "" : " (" + first.substr(colon + 1) + ")";
    const std::string others =
        p.eval_modules.size() > 1
            ? " and " + std::to_string(p.eval_modules.size() - 1) + " other module(s)"
            : std::string();
    emit("eval_mode", mod,
         "module '" + mod + "'" + type + others +
             " ran in eval mode during a training step — Dropout/BatchNorm behave as at "
             "inference and BatchNorm statistics stop updating; call model.train() after "
             "validation",
         static_cast<double>(p.eval_modules.size()));
  }

  // --- last_stats and the trace ---
  last.clear();
  std::vector<std::pair<double, size_t>> order;
  for (size_t k = 0; k < n; ++k) {
    const Row& pr = rows[static_cast<size_t>(p.param_row[k])];
    last[name(k)] = pr.stats;
    double key = pr.stats.l2;
    if (p.grad_row[k] >= 0) {
      const TensorStats& g = rows[static_cast<size_t>(p.grad_row[k])].stats;
      last[name(k) + ".grad"] = g;
      key = g.nonfinite() > 0 ? INFINITY : g.l2;
    }
    if (pr.update) {
      TensorStats u;
      u.numel = pr.stats.numel;
      u.l2 = pr.update->l2;
      u.absmax = pr.update->max;
      u.zero = pr.stats.numel - pr.update->changed;
      last[name(k) + ".update"] = u;
    }
    order.emplace_back(key, k);
  }
  const double check_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  add_overhead(check_s);
  if (trace.is_open() && p.step % opts.trace_every == 0) {
    std::ostringstream g;
    g << "\"grad_norm\":" << json_number(grad_norm) << ",\"param_norm\":" << json_number(param_norm)
      << ",\"update_norm\":" << json_number(upd_norm) << ",\"update_ratio\":" << json_number(ratio)
      << ",\"changed\":" << changed
      << ",\"nonfinite_grad\":" << (any_nonfinite_grad ? "true" : "false");
    std::ostringstream t;
    if (opts.trace_tensors != "global") {
      if (opts.trace_tensors == "topk") {
        std::stable_sort(order.begin(), order.end(),
                         [](const auto& a, const auto& b) { return a.first > b.first; });
        if (order.size() > static_cast<size_t>(opts.trace_topk)) order.resize(opts.trace_topk);
      }
      bool first = true;
      for (const auto& [key, k] : order) {
        const Row& pr = rows[static_cast<size_t>(p.param_row[k])];
        t << (first ? "" : ",") << json_escape(name(k)) << ":{\"param\":" << stats_json(pr.stats);
        if (p.grad_row[k] >= 0) {
          t << ",\"grad\":" << stats_json(rows[static_cast<size_t>(p.grad_row[k])].stats);
        }
        if (pr.update) {
          t << ",\"update\":{\"l2\":" << json_number(pr.update->l2)
            << ",\"max\":" << json_number(pr.update->max) << ",\"changed\":" << pr.update->changed
            << "}";
        }
        t << "}";
        first = false;
      }
    }
    write_trace_line(step_json(*this, p, g.str(), t.str(), step_overhead_s));
    step_overhead_s = 0.0;
  }
  return out;
}

}  // namespace trainsan
