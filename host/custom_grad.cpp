// bad_custom_grad's measurement (custom_grad.h): a custom autograd function's backward against
// central differences along one random direction per input, in float64 (Note [Directional
// gradcheck], host/checks/autograd.cpp, which judges the figures). The Python package runs this
// same measurement on a Python Function (measure_custom_grad_or_throw through _trainsan_hot, Note
// [One orchestration] in bindings/csrc/hot.cpp).
#include "trainsan/custom_grad.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <cmath>
#include <limits>

#include "checks/autograd.h"
#include "feeds/custom_grad_feed.h"
#include "rng_state.h"

namespace trainsan {

namespace {

// zlib's crc32 (the Python package seeds from zlib.crc32 of the same name).
uint32_t crc32(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (const unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

double machine_eps(at::ScalarType t) {
  double eps = 0.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "trainsan machine_eps", [&] {
    eps = static_cast<double>(std::numeric_limits<scalar_t>::epsilon());
  });
  return eps;
}

double value(const at::Tensor& t) { return t.item<double>(); }

std::vector<at::Tensor> kept(const std::vector<at::Tensor>& outs, const std::vector<size_t>& keep) {
  std::vector<at::Tensor> out;
  for (const size_t j : keep) {
    TORCH_CHECK(j < outs.size(), "the function returned fewer outputs than before");
    out.push_back(outs[j]);
  }
  return out;
}

// The audit's pause for this thread, for the length of a scope (Note [Compiled regions]).
struct AuditPause {
  AuditPause() { Sanitizer::pause_audit(true); }
  ~AuditPause() { Sanitizer::pause_audit(false); }
  AuditPause(const AuditPause&) = delete;
  AuditPause& operator=(const AuditPause&) = delete;
};

// The caller's RNG state, put back on every way out.
struct RestoreRng {
  explicit RestoreRng(host::RngState s) : saved(std::move(s)) {}
  ~RestoreRng() {
    try {
      saved.restore();
    } catch (...) {  // a destructor: nothing else to do with it
    }
  }
  RestoreRng(const RestoreRng&) = delete;
  RestoreRng& operator=(const RestoreRng&) = delete;
  host::RngState saved;
};

}  // namespace

double directional_eps(const at::Tensor& x, bool low_precision) {
  const double xmax = x.numel() > 0 ? value(x.abs().max()) : 0.0;
  return (low_precision ? 1e-3 : 1e-6) * (1.0 + xmax);
}

std::vector<at::Tensor> surrogate_masks(const at::Tensor& x_plus, const at::Tensor& x_minus,
                                        const std::vector<at::Tensor>& yp,
                                        const std::vector<at::Tensor>& ym) {
  TORCH_CHECK_VALUE(yp.size() == ym.size(), "surrogate_masks: yp and ym differ in length (",
                    yp.size(), ", ", ym.size(), ")");
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (size_t o = 0; o < yp.size(); ++o) {
    const bool identity = yp[o].sizes() == x_plus.sizes() && ym[o].sizes() == x_minus.sizes() &&
                          yp[o].scalar_type() == x_plus.scalar_type() && at::equal(yp[o], x_plus) &&
                          at::equal(ym[o], x_minus);
    out.push_back(identity ? at::ones_like(yp[o], at::TensorOptions().dtype(at::kBool))
                           : at::eq(yp[o], ym[o]));
  }
  return out;
}

CustomGradResult directional_figures(const std::vector<at::Tensor>& u, const at::Tensor& v,
                                     const std::vector<at::Tensor>& y0,
                                     const std::vector<at::Tensor>& yp,
                                     const std::vector<at::Tensor>& ym, const at::Tensor& grad,
                                     double eps, const std::vector<at::Tensor>& u_surrogate,
                                     const at::Tensor& grad_surrogate) {
  TORCH_CHECK_VALUE(u.size() == y0.size() && yp.size() == y0.size() && ym.size() == y0.size(),
                    "directional_figures: u, y0, yp and ym differ in length (", u.size(), ", ",
                    y0.size(), ", ", yp.size(), ", ", ym.size(), ")");
  const at::NoGradGuard no_grad;
  CustomGradResult r;
  // The order of the operations is the Python measurement's (the same float64 results).
  double u_norm2 = 0.0;
  for (size_t o = 0; o < u.size(); ++o) {
    const double n = value(u[o].to(at::kDouble).norm());
    u_norm2 += n * n;
    r.low_precision = r.low_precision || y0[o].scalar_type() != at::kDouble;
  }
  for (size_t o = 0; o < u.size(); ++o) {
    const at::Tensor u64 = u[o].to(at::kDouble);
    const at::Tensor p64 = yp[o].to(at::kDouble);
    const at::Tensor m64 = ym[o].to(at::kDouble);
    const at::Tensor c64 = y0[o].to(at::kDouble);
    r.central += value((u64 * (p64 - m64)).sum()) / (2 * eps);
    const double un = value(u64.norm());
    r.curvature += un * value((p64 - 2 * c64 + m64).norm()) / (2 * eps);
    r.scale += un * value((p64 - m64).norm()) / (2 * eps);
    r.noise += un * value(c64.norm()) * machine_eps(y0[o].scalar_type()) / eps;
  }
  r.analytic = grad.defined() ? value((grad.to(at::kDouble) * v).sum()) : 0.0;
  r.unit = std::pow(u_norm2, 0.5) * value(v.norm());  // pow, as Python's ** 0.5
  if (!u_surrogate.empty()) {
    TORCH_CHECK_VALUE(u_surrogate.size() == y0.size(),
                      "directional_figures: u_surrogate and y0 differ in length (",
                      u_surrogate.size(), ", ", y0.size(), ")");
    double w_norm2 = 0.0;
    for (size_t o = 0; o < u_surrogate.size(); ++o) {
      const at::Tensor w64 = u_surrogate[o].to(at::kDouble);
      const double n = value(w64.norm());
      w_norm2 += n * n;
      r.surrogate_central +=
          value((w64 * (yp[o].to(at::kDouble) - ym[o].to(at::kDouble))).sum()) / (2 * eps);
    }
    r.surrogate_analytic =
        grad_surrogate.defined() ? value((grad_surrogate.to(at::kDouble) * v).sum()) : 0.0;
    r.surrogate_unit = std::pow(w_norm2, 0.5) * value(v.norm());
  }
  return r;
}

namespace {

// measure_custom_grad; `rethrow`: an exception of an evaluation propagates instead of meaning "not
// checked" (measure_custom_grad_or_throw).
std::vector<CustomGradResult> measure(const std::string& name, const TensorFunction& fn,
                                      const std::vector<at::Tensor>& inputs, bool rethrow) {
  TORCH_CHECK_VALUE(static_cast<bool>(fn), "measure_custom_grad(", name, "): fn is empty");
  std::vector<size_t> diff;  // the differentiable inputs
  for (size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor& t = inputs[k];
    if (t.defined() && t.requires_grad() && t.is_floating_point()) diff.push_back(k);
  }
  if (diff.empty()) return {};
  std::vector<at::Tensor> base;  // float64 copies of the floating inputs, clones of the others
  {
    const at::NoGradGuard no_grad;
    for (const at::Tensor& t : inputs) {
      if (!t.defined()) {
        base.emplace_back();
        continue;
      }
      if (t.is_complex() || t.layout() != at::kStrided) return {};
      const at::Tensor d = t.detach();
      base.push_back(d.is_floating_point() ? d.to(at::kDouble, false, /*copy=*/true) : d.clone());
    }
  }
  const uint64_t seed = crc32(name) & 0x7FFFFFFFu;
  const std::vector<c10::DeviceIndex> devices = host::cuda_devices(base);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const RestoreRng restore(host::RngState::capture(devices));
  host::RngState::seed(seed, devices);
  const host::RngState start = host::RngState::capture(devices);
  // One random draw for every evaluation: the same generator states each time.
  auto run = [&](const std::vector<at::Tensor>& xs, bool grad) {
    start.restore();
    const at::AutoGradMode mode(grad);
    return fn(xs);
  };
  std::vector<CustomGradResult> results;
  try {
    std::vector<at::Tensor> leaves, xs = base;
    for (const size_t k : diff) {
      leaves.push_back(base[k].clone().requires_grad_());
      xs[k] = leaves.back().clone();  // the function sees a non-leaf, as in training
    }
    const std::vector<at::Tensor> outs = run(xs, true);
    std::vector<size_t> keep;
    for (size_t j = 0; j < outs.size(); ++j) {
      if (outs[j].defined() && outs[j].requires_grad() && outs[j].is_floating_point()) {
        keep.push_back(j);
      }
    }
    if (keep.empty()) return {};
    const std::vector<at::Tensor> douts = kept(outs, keep);
    std::vector<at::Tensor> us;
    for (const at::Tensor& o : douts) {
      us.push_back(
          at::randn(o.sizes(), gen, at::TensorOptions().dtype(o.scalar_type())).to(o.device()));
    }
    // The graph is kept for the backwards of the judged and surrogate parts (below).
    const std::vector<at::Tensor> grads =
        torch::autograd::grad(douts, leaves, us, /*retain_graph=*/true,
                              /*create_graph=*/false, /*allow_unused=*/true);
    const at::NoGradGuard no_grad;
    const std::vector<at::Tensor> y0 = kept(run(base, false), keep);
    for (size_t j = 0; j < y0.size(); ++j) {
      if (!y0[j].defined() || y0[j].sizes() != douts[j].sizes() ||
          !at::equal(y0[j], douts[j].detach())) {
        return {};  // not deterministic under one seed: nothing to compare
      }
      us[j] = us[j].to(y0[j].scalar_type());
    }
    bool low = false;
    for (const at::Tensor& y : y0) low = low || y.scalar_type() != at::kDouble;
    for (size_t i = 0; i < diff.size(); ++i) {
      const size_t k = diff[i];
      const at::Tensor& x = base[k];
      const at::Tensor v =
          at::randn(x.sizes(), gen, at::TensorOptions().dtype(at::kDouble)).to(x.device());
      const double eps = directional_eps(x, low);
      std::vector<at::Tensor> plus = base, minus = base;
      plus[k] = x + eps * v;
      minus[k] = x - eps * v;
      const std::vector<at::Tensor> yp = kept(run(plus, false), keep);
      const std::vector<at::Tensor> ym = kept(run(minus, false), keep);
      // Note [Surrogate gradients]: the flat and identity elements are judged apart.
      const std::vector<at::Tensor> masks = surrogate_masks(plus[k], minus[k], yp, ym);
      bool any = false;
      for (const at::Tensor& m : masks) any = any || m.any().item<bool>();
      CustomGradResult r;
      if (!any) {
        r = directional_figures(us, v, y0, yp, ym, grads[i], eps);
      } else {
        std::vector<at::Tensor> judged, surrogate;
        for (size_t j = 0; j < us.size(); ++j) {
          judged.push_back(us[j].masked_fill(masks[j], 0));
          surrogate.push_back(us[j].masked_fill(masks[j].logical_not(), 0));
        }
        const auto one = [&](const std::vector<at::Tensor>& w) {
          return torch::autograd::grad(douts, {leaves[i]}, w, /*retain_graph=*/true,
                                       /*create_graph=*/false, /*allow_unused=*/true)[0];
        };
        r = directional_figures(judged, v, y0, yp, ym, one(judged), eps, surrogate, one(surrogate));
      }
      r.function = name;
      r.input_index = static_cast<int64_t>(k);
      results.push_back(std::move(r));
    }
  } catch (const std::exception&) {
    if (rethrow) throw;
    return {};  // a function that cannot run in float64 or on copies: not checked
  }
  return results;
}

}  // namespace

std::vector<CustomGradResult> measure_custom_grad(const std::string& name, const TensorFunction& fn,
                                                  const std::vector<at::Tensor>& inputs) {
  return measure(name, fn, inputs, /*rethrow=*/false);
}

std::vector<CustomGradResult> measure_custom_grad_or_throw(const std::string& name,
                                                           const TensorFunction& fn,
                                                           const std::vector<at::Tensor>& inputs) {
  return measure(name, fn, inputs, /*rethrow=*/true);
}

std::vector<Finding> check_custom_grad(const std::string& name, const TensorFunction& fn,
                                       const std::vector<at::Tensor>& inputs) {
  std::vector<CustomGradResult> results;
  {
    const AuditPause pause;
    results = measure_custom_grad(name, fn, inputs);
  }
  return host::judge_custom_grad(results);
}

void host::CustomGradFeed::check(const std::string& name, const TensorFunction& fn,
                                 const std::vector<at::Tensor>& inputs) {
  checked_.insert(name);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<CustomGradResult> results;
  {
    const AuditPause pause;
    results = measure_custom_grad(name, fn, inputs);
  }
  ctx_.time.add_overhead(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  ctx_.events_seen.insert("bad_custom_grad");
  ctx_.checks.autograd.on_custom_grads(results, ctx_.step);
}

}  // namespace trainsan
