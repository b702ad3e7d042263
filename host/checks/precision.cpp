// Mixed precision: amp_scale_collapse, update_underflow, low_precision_loss, the fp16_overflow of
// module outputs, and the overflow provenance (Origins) the non-finite findings quote.
#include "checks/precision.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace trainsan::host {

// Note [Overflow provenance]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Where did the first NaN/Inf of a step come from? Anomaly mode answers for the backward at
// 1.5-3x the step; HF's DebugUnderflowOverflow for the forward with Python per module and a host
// read each. Here the module hooks are *armed* only on some steps (bindings/trainsan/precision.py):
// every provenance_every-th, and the provenance_rearm steps after one where a non-finite loss or
// gradient or a scaler skip was seen — a fault that repeats (an fp16 overflow at every step, a
// scale that keeps halving) is named within a few steps at the cost of a sampled one. On an armed
// step every module output gets one min/max reduction on its device (NaN propagates, ±Inf shows,
// and under fp16 autocast a float32 output beyond ±65504 shows too), and every output's gradient
// the same in the backward; the flags are read once, when the loss is watched (forward) and when
// the step begins (backward), and only the first non-finite tensor of each pass, in execution
// order, is reported here as facts (Provenance): where a forward hook fires after the module's
// children, the first flagged output is the innermost module where the value was born. The
// non-finite findings of that step (nonfinite_loss, nonfinite_grad) and amp_scale_collapse quote
// it; the cause, where fp16 is in use, is an fp16_overflow finding of its own (a parameter of
// that module beyond ±65504, or a float32 output beyond it that the next fp16 op turns into Inf),
// reported before the non-finite finding it causes.

bool Origins::armed(int64_t step) const {
  if (opts_.provenance_every > 0 && step % opts_.provenance_every == 0) return true;
  return step <= armed_until_;
}

void Origins::rearm(int64_t step) {
  armed_until_ = std::max(armed_until_, step + opts_.provenance_rearm);
}

void Origins::record(const Provenance& p) {
  for (Provenance& r : recent_) {
    if (r.step != p.step) continue;
    r.forward_checked = std::max(r.forward_checked, p.forward_checked);
    r.backward_checked = std::max(r.backward_checked, p.backward_checked);
    if (!r.forward && p.forward) r.forward = p.forward;
    if (!r.backward && p.backward) r.backward = p.backward;
    r.fp16_range.insert(r.fp16_range.end(), p.fp16_range.begin(), p.fp16_range.end());
    return;
  }
  recent_.push_back(p);
  while (recent_.size() > 8) recent_.pop_front();
}

const Provenance* Origins::at(int64_t step) const {
  for (const Provenance& r : recent_) {
    if (r.step == step) return &r;
  }
  return nullptr;
}

const Provenance* Origins::latest(int64_t step, int64_t window) const {
  for (auto it = recent_.rbegin(); it != recent_.rend(); ++it) {
    if (it->step <= step && it->step > step - window && (it->forward || it->backward)) {
      return &*it;
    }
  }
  return nullptr;
}

namespace {

std::string ordinal(int64_t n) {
  const int64_t t = n % 100;
  const char* suffix = (t >= 11 && t <= 13) ? "th"
                       : n % 10 == 1        ? "st"
                       : n % 10 == 2        ? "nd"
                       : n % 10 == 3        ? "rd"
                                            : "th";
  return std::to_string(n) + suffix;
}

std::string module_name(const std::string& m) { return m.empty() ? "the model" : m; }

std::string join_params(const std::vector<std::pair<std::string, int64_t>>& ps) {
  std::string out;
  for (size_t k = 0; k < ps.size() && k < 3; ++k) {
    if (k) out += ", ";
    out += ps[k].first + " (" + std::to_string(ps[k].second) + ")";
  }
  if (ps.size() > 3) out += " and " + std::to_string(ps.size() - 3) + " more";
  return out;
}

}  // namespace

std::string origin_text(const ModuleOrigin& o) {
  std::ostringstream os;
  if (o.input && o.module.empty()) {
    os << "the model's input (" << o.dtype << "): the batch itself holds it — look at the data "
       << "pipeline (a corrupt sample, a division by a zero statistic in the normalisation)";
    return os.str();
  }
  os << (o.backward ? "the gradient of the output of "
         : o.input  ? "the input of "
                    : "the output of ")
     << module_name(o.module);
  os << " (" << (o.type.empty() ? "" : o.type + ", ") << o.dtype;
  if (!o.autocast.empty()) os << " under " << o.autocast << " autocast";
  os << "; the " << ordinal(o.position) << " of " << o.checked
     << (o.backward ? " output gradients in backward order" : " tensors flagged in forward order")
     << ")";
  if (o.input) {
    const auto dot = o.module.rfind('.');
    const std::string parent = dot == std::string::npos ? "the model" : o.module.substr(0, dot);
    os << ", which no module output before it held: it was made by the forward code of " << parent
       << " itself, between its submodules (an operation written in forward(), not a module)";
    if (o.inf_only && o.dtype == "float16") {
      os << "; ±Inf only: an fp16 overflow (a value beyond ±65504) there";
    }
  } else if (!o.beyond_fp16.empty()) {
    os << ": its parameters hold values beyond ±65504 — " << join_params(o.beyond_fp16)
       << " — which become Inf when autocast casts them to float16";
  } else if (o.inf_only && o.dtype == "float16") {
    os << ", ±Inf only: an fp16 overflow (a value beyond ±65504) in "
       << (o.backward ? "the backward of the op that consumes this output" : "this module");
  } else if (o.inf_only) {
    os << ", ±Inf only: an overflow";
  } else if (o.backward) {
    os << ": the backward of the op that consumes this output made it (log/sqrt/pow/division "
          "at 0, or a NaN in its saved inputs)";
  }
  if (!o.inf_only && o.prior_absmax > 0.0 && !o.prior_where.empty()) {
    os << "; the largest value flagged before it was " << fmt(o.prior_absmax) << " at "
       << o.prior_where;
    if (o.autocast == "float16" && o.prior_absmax > 256.0) {
      os << " (products and sums of values that large overflow float16's ±65504, and an "
            "Inf then becomes NaN in softmax, Inf - Inf or 0 x Inf)";
    }
  }
  return os.str();
}

std::string Origins::describe(int64_t step) const {
  const Provenance* p = at(step);
  if (p == nullptr) return "";
  std::string out;
  if (p->forward) {
    out += " It first appeared in the forward at " + origin_text(*p->forward) + ".";
  } else if (p->forward_checked > 0) {
    out += " The forward's " + std::to_string(p->forward_checked) +
           " flagged tensors (module inputs and outputs) were all finite.";
  }
  // A forward origin explains the backward's non-finite gradients: only the forward's is said.
  if (p->backward && !p->forward) {
    out += " It first appeared in the backward at " + origin_text(*p->backward) + ".";
  }
  return out;
}

// --- amp_scale_collapse ---------------------------------------------------------------------

PrecisionCheck::Scaler& PrecisionCheck::scaler(int64_t opt) {
  for (Scaler& s : scalers_) {
    if (s.opt == opt) return s;
  }
  scalers_.push_back(Scaler{});
  scalers_.back().opt = opt;
  return scalers_.back();
}

void PrecisionCheck::on_scaler(const ScalerStep& e, int64_t step) {
  Scaler& s = scaler(e.opt);
  if (!std::isnan(e.scale)) {
    s.history.push_back({step, e.scale, e.skipped});
    while (s.history.size() > 12) s.history.pop_front();
  }
  if (e.skipped) {
    s.skips += 1;
    s.run += 1;
    origins_.rearm(step);
  } else {
    s.run = 0;
  }
  if (!e.skipped) s.stepped = true;
  if (e.skipped) backward_nan(s, step);
  if (!std::isnan(e.scale) && e.scale < 1.0) {
    collapse(s,
             "its scale fell to " + fmt(e.scale) +
                 " (below 1: the gradients hold Inf/NaN even without scaling)",
             e.scale, step);
    return;
  }
  if (!s.stepped) return;  // the scaler still looks for its scale (its first steps skip)
  s.window.push_back(e.skipped);
  while (static_cast<int64_t>(s.window.size()) > opts_.amp_skip_window) s.window.pop_front();
  if (!e.skipped) return;
  if (s.run >= opts_.amp_skip_run) {
    collapse(s, "it skipped the last " + std::to_string(s.run) + " steps in a row",
             static_cast<double>(s.run), step);
    return;
  }
  const auto in_window = std::count(s.window.begin(), s.window.end(), true);
  if (static_cast<int64_t>(s.window.size()) >= opts_.amp_skip_window &&
      static_cast<double>(in_window) >=
          opts_.amp_skip_fraction * static_cast<double>(s.window.size())) {
    collapse(s,
             "it skipped " + std::to_string(in_window) + " of the last " +
                 std::to_string(s.window.size()) + " steps",
             static_cast<double>(in_window), step);
  }
}

// Note [Backward NaN]
// ~~~~~~~~~~~~~~~~~~~
// A gradient scaler skips the steps whose gradients hold Inf/NaN and halves its scale: right for
// an fp16 overflow of the scaled gradients (warm-up from 65536, a spike), useless for a NaN the
// backward makes whatever the scale (the gradient of log or sqrt at 0 behind a torch.where, a
// norm of a zero vector): the scaler then skips every step, and amp_scale_collapse could speak
// only after some 17 halvings brought the scale below 1. The armed module hooks tell the two
// apart (Note [Overflow provenance]; a skip re-arms them, so the second skip in a row is armed):
// at the second consecutive skip, when the provenance of that step names a backward origin that
// holds NaN (not ±Inf only: an overflow is Inf where it happens), the forward was finite (no
// forward origin: the loss is not the cause), and no value flagged before it in the backward came
// near the fp16 range (prior_absmax below 2^14: an overflow turned into NaN by the op that made
// it, Inf - Inf, is not this), nonfinite_grad names that origin. Once per scaler. Warm-up skips
// (±Inf at first) and a one-off NaN (one skip) stay silent.
void PrecisionCheck::backward_nan(Scaler& s, int64_t step) {
  if (s.backward_nan || s.run < 2) return;
  const Provenance* p = origins_.at(step);
  if (p == nullptr || !p->backward || p->forward || p->backward->inf_only) return;
  if (p->backward->prior_absmax >= 16384.0) return;
  s.backward_nan = true;
  const ModuleOrigin& o = *p->backward;
  sink_.add(Kind::nonfinite_grad, o.module.empty() ? "<model>" : o.module,
            "the gradient scaler of optimizer " + std::to_string(s.opt) + " skipped " +
                std::to_string(s.run) +
                " steps in a row because the gradients hold NaN, and the NaN is made in the "
                "backward, not by an overflow of the scaled loss (the forward was finite; the "
                "first non-finite gradient holds NaN, not ±Inf): it appeared at " +
                origin_text(o) +
                " — lowering the scale will not remove it, so the scaler will skip every step; "
                "fix the op (a log/sqrt/division whose input reaches 0 behind a torch.where or "
                "mask still has a NaN gradient: clamp its input first)",
            static_cast<double>(s.run), step);
}

void PrecisionCheck::collapse(const Scaler& s, const std::string& why, double value, int64_t step) {
  std::ostringstream os;
  os << "the gradient scaler of optimizer " << s.opt << " keeps skipping steps: " << why << " ("
     << s.skips << " skipped in all)";
  if (!s.history.empty()) {
    os << "; its scale over its last steps:";
    for (const ScaleEntry& h : s.history) {
      // Scales are powers of two: whole ones in full.
      const bool whole = h.scale >= 1.0 && h.scale < 1e15 && h.scale == std::floor(h.scale);
      os << ' ' << (whole ? std::to_string(static_cast<int64_t>(h.scale)) : fmt(h.scale))
         << (h.skipped ? "*" : "");
    }
    os << " (* skipped)";
  }
  os << " — every step's gradients hold Inf/NaN whatever the scale, so the model does not train.";
  if (const Provenance* p = origins_.latest(step, 8); p != nullptr) {
    os << " At step " << p->step << ":" << origins_.describe(p->step);
  } else {
    os << " Likely causes: a tensor that overflows at every step (see fp16_overflow findings; "
          "set provenance_every=1 to flag every module output), or gradients never cleared (a "
          "missing zero_grad keeps an Inf in .grad: see stale_grad).";
  }
  os << " Fix the overflowing computation (run it in float32 or bfloat16, scale it down), or "
        "clear the gradients every step.";
  sink_.add(Kind::amp_scale_collapse, "", os.str(), value, step);
}

// --- provenance and fp16 range --------------------------------------------------------------

void PrecisionCheck::on_provenance(const Provenance& p) {
  origins_.record(p);
  for (const auto& o : {p.forward, p.backward}) {
    if (!o) continue;
    for (const auto& [name, count] : o->beyond_fp16) {
      sink_.add(Kind::fp16_overflow, name,
                name + " holds " + std::to_string(count) +
                    " values beyond ±65504, which become Inf when " + module_name(o->module) +
                    " runs under float16 autocast — the first non-finite output of this step is "
                    "that module's; keep it in float32 (torch.autocast(..., enabled=False)), use "
                    "bfloat16, or constrain the weights",
                static_cast<double>(count), p.step);
    }
  }
  for (const RangeOverflow& r : p.fp16_range) {
    sink_.add(Kind::fp16_overflow, r.module,
              "the output of " + module_name(r.module) + " (" +
                  (r.type.empty() ? "" : r.type + ", ") + r.dtype + ") reaches " + fmt(r.absmax) +
                  ", beyond ±65504, under float16 autocast: the next op that autocast runs in "
                  "float16 turns it into Inf — normalise or scale it, or keep that op in float32 "
                  "(torch.autocast(..., enabled=False)) or use bfloat16",
              r.absmax, p.step);
  }
}

// --- low_precision_loss ---------------------------------------------------------------------

void PrecisionCheck::on_loss(const LossView& v) {
  if (v.dtype != "float16" && v.dtype != "bfloat16") return;
  sink_.add(Kind::low_precision_loss, "",
            "the loss is a " + v.dtype +
                " tensor: it was reduced (its mean or sum over the batch) into half precision, "
                "which keeps " +
                (v.dtype == "bfloat16" ? std::string("about 3 significant digits")
                                       : std::string("about 3 significant digits and ±65504")) +
                " — compute the loss in float32 (e.g. loss_fn(output.float(), target)); "
                "autocast does so for the loss functions it lists",
            std::nullopt, v.step);
}

// --- update_underflow -----------------------------------------------------------------------

namespace {

std::string dtype_of_eps(double eps) {
  if (eps == std::ldexp(1.0, -7)) return "bfloat16";
  if (eps == std::ldexp(1.0, -10)) return "float16";
  if (eps == std::ldexp(1.0, -23)) return "float32";
  if (eps == std::ldexp(1.0, -52)) return "float64";
  return "low-precision";
}

}  // namespace

// Note [Rounded-away updates]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A weight w keeps its bits when |Δw| < ulp(w)/2: in bfloat16 that is |Δw| < ~|w|/256, so a
// small learning rate trains nothing in pure bf16 where fp32 master weights would (a LayerNorm
// gain of 1.0 in bf16 under Adam at lr 1e-3 never moves). The pass gives, per tensor, the
// elements the step changed (UpdateStats::changed) and the gradient's exact zeros; elements with
// a nonzero gradient minus changed elements is a lower bound of the updates that were rounded
// away (an element with a zero gradient that moved — weight decay, momentum — only lowers the
// bound: never a false alarm). Per tensor of the stepping optimizer (learning rate not 0, finite
// gradient and weights), on the steps whose update statistics were measured (the overhead budget
// samples them): the warning after update_underflow_steps such steps in a row at or above
// update_underflow_fraction. float16/bfloat16 weights only: in float32 an update rounds away only
// when it is negligible anyway (update_ratio's low band speaks for a learning rate far too low);
// and not a tensor whose gradient RMS is below 1e-3 of the step's largest (a bias before a
// normalisation layer: its gradient cancels, and what rounds away never mattered). A step that
// changed nothing at all is this rule too where the step-level skipped_step does not judge it
// (updates predicted below 4 ulp: Note [Unchanged tensors]).
void PrecisionCheck::on_step(const StepView& v) {
  if (v.partial || v.manual || v.lr_zero) return;
  const auto judged = [&](const ParamView& p) {
    return p.opt == v.opt && p.trainable && p.update && p.grad && p.lr != 0.0 &&
           p.grad->nonfinite() == 0 && p.param.nonfinite() == 0 &&
           p.eps >= std::ldexp(1.0, -10) &&  // float16, bfloat16
           p.grad->numel > p.grad->zero;
  };
  // The gradient scale of the step: tensors whose gradient is negligible against it (a bias
  // before a normalisation, whose gradient cancels) lose nothing that matters by rounding.
  double top_rms = 0.0;
  for (const ParamView& p : v.params) {
    if (!judged(p)) continue;
    const auto nz = static_cast<double>(p.grad->numel - p.grad->zero);
    top_rms = std::max(top_rms, p.grad->l2 / std::sqrt(nz));
  }
  for (const ParamView& p : v.params) {
    if (!judged(p)) continue;
    if (underflow_steps_.size() <= p.index) underflow_steps_.resize(p.index + 1, 0);
    int64_t& run = underflow_steps_[p.index];
    const int64_t nz = p.grad->numel - p.grad->zero;
    if (p.grad->l2 / std::sqrt(static_cast<double>(nz)) < 1e-3 * top_rms) {
      run = 0;
      continue;
    }
    // Note [Update statistics without a snapshot]: from a sample, only a gradient dense enough
    // that the sample holds >= 64 of its nonzero elements (the run is neither advanced nor reset).
    if (p.update->sampled && nz < 64 * p.update->stride) continue;
    const int64_t lost = std::max<int64_t>(0, nz - p.update->changed);
    const double frac = static_cast<double>(lost) / static_cast<double>(nz);
    if (frac < opts_.update_underflow_fraction) {
      run = 0;
      continue;
    }
    run += 1;
    if (run < opts_.update_underflow_steps) continue;
    std::ostringstream os;
    os << p.name << " (" << dtype_of_eps(p.eps) << "): the step left " << lost << " of its " << nz
       << " elements with a nonzero gradient unchanged (" << fmt(100.0 * frac) << "%), " << run
       << " measured steps in a row — their updates are smaller than half the spacing between "
          "neighbouring "
       << dtype_of_eps(p.eps) << " values at their magnitude (largest |w|: "
       << fmt(p.param.absmax ? *p.param.absmax : p.param.l2)
       << ") and round away, so it does not train. Keep float32 master weights (autocast with "
          "float32 parameters, or an optimizer that holds float32 copies), use stochastic "
          "rounding or Kahan-compensated updates, or raise the learning rate";
    sink_.add(Kind::update_underflow, p.name, os.str(), frac, v.step);
  }
}

}  // namespace trainsan::host
