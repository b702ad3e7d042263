// Independent oracles for the statistics tests (test_stats.cpp, test_stats_gpu.cpp): a float64
// reference built from ATen ops and compensated sums, and Note [Hash] (kernels/stats.cuh)
// re-implemented from its text. Nothing here includes the kernels' headers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "trainsan/stats.h"

namespace trainsan_test {

constexpr int64_t kChunk = int64_t{1} << 16;
constexpr double kSumRtol = 1e-12;

inline const std::vector<at::ScalarType>& all_dtypes() {
  static const std::vector<at::ScalarType> v = {at::kFloat, at::kHalf,  at::kBFloat16, at::kDouble,
                                                at::kChar,  at::kShort, at::kInt,      at::kLong,
                                                at::kByte,  at::kBool};
  return v;
}

inline bool is_float(at::ScalarType st) { return at::isFloatingType(st); }

// The oracles run many small ATen ops, which are far slower on a thread pool when the machine's
// cores are busy: run them on one thread, then restore the count.
struct OneThread {
  int saved = at::get_num_threads();
  OneThread() { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(saved); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;
};

// Smallest subnormal number of each floating dtype (2^-24, 2^-133, 2^-149, 2^-1074).
inline double smallest_subnormal(at::ScalarType st) {
  switch (st) {
    case at::kHalf:
      return std::ldexp(1.0, -24);
    case at::kBFloat16:
      return std::ldexp(1.0, -133);
    case at::kFloat:
      return std::ldexp(1.0, -149);
    default:
      return std::numeric_limits<double>::denorm_min();
  }
}

// Smallest normal number of each floating dtype.
inline double smallest_normal(at::ScalarType st) {
  switch (st) {
    case at::kHalf:
      return std::ldexp(1.0, -14);
    case at::kBFloat16:
    case at::kFloat:
      return std::ldexp(1.0, -126);
    default:
      return std::numeric_limits<double>::min();
  }
}

// --- Note [Hash], from its text --------------------------------------------------------------

inline uint64_t ref_mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

inline uint64_t ref_hash(const at::Tensor& t) {
  const at::Tensor x = t.contiguous().cpu();
  const int64_t n = x.numel();
  const int64_t es = x.element_size();
  const auto* p = static_cast<const unsigned char*>(x.const_data_ptr());
  uint64_t s = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t b = 0;  // zero-extended storage bits (little-endian)
    std::memcpy(&b, p + i * es, static_cast<size_t>(es));
    s += ref_mix64(b + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
  }
  return ref_mix64(s ^ static_cast<uint64_t>(n));
}

// --- Float64 reference -------------------------------------------------------------------------

struct Reference {
  int64_t numel = 0, nan = 0, posinf = 0, neginf = 0, zero = 0, subnormal = 0, fp16_overflow = 0;
  std::optional<double> min, max, absmax;
  double sum = 0, abs_sum = 0, l2 = 0;
  uint64_t hash = 0;
};

// Neumaier's compensated sum: far below the 1e-12 tolerance for the sizes used here.
inline double compensated_sum(const at::Tensor& d) {
  const at::Tensor c = d.contiguous();
  const double* p = c.const_data_ptr<double>();
  double s = 0.0, comp = 0.0;
  for (int64_t i = 0; i < c.numel(); ++i) {
    const double t = s + p[i];
    comp += std::fabs(s) >= std::fabs(p[i]) ? (s - t) + p[i] : (p[i] - t) + s;
    s = t;
  }
  return s + comp;
}

inline int64_t count(const at::Tensor& mask) { return mask.sum().item<int64_t>(); }

inline Reference reference(const at::Tensor& t) {
  const OneThread one_thread;
  Reference r;
  const at::Tensor x = t.detach().cpu().reshape(-1);
  const at::Tensor d = x.to(at::kDouble);
  r.numel = x.numel();
  at::Tensor fv = d;
  if (is_float(x.scalar_type())) {
    const at::Tensor finite = d.isfinite();
    r.nan = count(d.isnan());
    r.posinf = count(d == std::numeric_limits<double>::infinity());
    r.neginf = count(d == -std::numeric_limits<double>::infinity());
    r.subnormal = count((d != 0) & (d.abs() < smallest_normal(x.scalar_type())) & finite);
    fv = d.masked_select(finite);
  }
  r.zero = count(x == 0);
  if (is_float(x.scalar_type())) {
    r.fp16_overflow = count(fv.abs() > 65504.0);
  } else {
    const at::Tensor w = x.to(at::kLong);
    r.fp16_overflow = count((w > 65504) | (w < -65504));
  }
  if (fv.numel() > 0) {
    r.min = fv.min().item<double>();
    r.max = fv.max().item<double>();
    r.absmax = fv.abs().max().item<double>();
  }
  r.sum = compensated_sum(fv);
  r.abs_sum = compensated_sum(fv.abs());
  r.l2 = std::sqrt(compensated_sum(fv * fv));
  r.hash = ref_hash(x);
  return r;
}

// --- Comparisons -------------------------------------------------------------------------------

inline void expect_close(double got, double want, double scale, const std::string& what) {
  if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  EXPECT_LE(std::fabs(got - want), kSumRtol * scale) << what << ": " << got << " vs " << want;
}

inline void expect_opt_eq(const std::optional<double>& got, const std::optional<double>& want,
                          const std::string& what) {
  ASSERT_EQ(got.has_value(), want.has_value()) << what;
  if (want) {
    EXPECT_EQ(*got, *want) << what;
  }
}

// Counts, min/max/absmax and hash exactly; sum and l2 within the one tolerance.
inline void expect_matches(const trainsan::TensorStats& s, const Reference& r,
                           const std::string& what) {
  EXPECT_EQ(s.numel, r.numel) << what;
  EXPECT_EQ(s.nan, r.nan) << what;
  EXPECT_EQ(s.posinf, r.posinf) << what;
  EXPECT_EQ(s.neginf, r.neginf) << what;
  EXPECT_EQ(s.zero, r.zero) << what;
  EXPECT_EQ(s.subnormal, r.subnormal) << what;
  EXPECT_EQ(s.fp16_overflow, r.fp16_overflow) << what;
  expect_opt_eq(s.min, r.min, what + " min");
  expect_opt_eq(s.max, r.max, what + " max");
  expect_opt_eq(s.absmax, r.absmax, what + " absmax");
  expect_close(s.sum, r.sum, r.abs_sum, what + " sum");
  expect_close(s.l2, r.l2, r.l2, what + " l2");
  EXPECT_EQ(s.hash, r.hash) << what;
}

// Two results for the same logical tensor (another layout, another backend).
inline void expect_same(const trainsan::TensorStats& a, const trainsan::TensorStats& b,
                        double scale, const std::string& what) {
  EXPECT_EQ(a.numel, b.numel) << what;
  EXPECT_EQ(a.nan, b.nan) << what;
  EXPECT_EQ(a.posinf, b.posinf) << what;
  EXPECT_EQ(a.neginf, b.neginf) << what;
  EXPECT_EQ(a.zero, b.zero) << what;
  EXPECT_EQ(a.subnormal, b.subnormal) << what;
  EXPECT_EQ(a.fp16_overflow, b.fp16_overflow) << what;
  expect_opt_eq(a.min, b.min, what + " min");
  expect_opt_eq(a.max, b.max, what + " max");
  expect_opt_eq(a.absmax, b.absmax, what + " absmax");
  expect_close(a.sum, b.sum, scale, what + " sum");
  expect_close(a.l2, b.l2, b.l2, what + " l2");
  EXPECT_EQ(a.hash, b.hash) << what;
}

// Every field, floats by their bits.
inline bool bitwise_equal(const trainsan::TensorStats& a, const trainsan::TensorStats& b) {
  auto same = [](double x, double y) { return std::memcmp(&x, &y, sizeof(double)) == 0; };
  auto same_opt = [&](const std::optional<double>& x, const std::optional<double>& y) {
    return x.has_value() == y.has_value() && (!x || same(*x, *y));
  };
  return a.numel == b.numel && a.nan == b.nan && a.posinf == b.posinf && a.neginf == b.neginf &&
         a.zero == b.zero && a.subnormal == b.subnormal && a.fp16_overflow == b.fp16_overflow &&
         same_opt(a.min, b.min) && same_opt(a.max, b.max) && same_opt(a.absmax, b.absmax) &&
         same(a.sum, b.sum) && same(a.l2, b.l2) && a.hash == b.hash;
}

// --- Test data ---------------------------------------------------------------------------------

// First, last and chunk-boundary indices.
inline std::vector<int64_t> boundary_positions(int64_t n) {
  std::vector<int64_t> out;
  auto add = [&](int64_t p) {
    if (p >= 0 && p < n) out.push_back(p);
  };
  add(0);
  add(n - 1);
  for (int64_t k = 1; k <= n / kChunk; ++k) {
    add(k * kChunk - 1);
    add(k * kChunk);
    add(k * kChunk + 1);
  }
  return out;
}

// Seeded random data of dtype `st` with NaN/±Inf/±0/subnormal/fp16-overflow (floats) or
// 0/min/max/±65505 (integers) planted at the boundary positions and at a few random ones.
inline at::Tensor random_tensor(at::ScalarType st, int64_t n, uint64_t seed) {
  const OneThread one_thread;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x;
  std::vector<at::Scalar> specials;
  if (is_float(st)) {
    const at::Tensor scale = at::exp(at::empty({n}, at::kDouble).uniform_(-9.0, 9.0, gen));
    x = (at::randn({n}, gen, at::kDouble) * scale).to(st);
    const double tiny = smallest_normal(st);
    const double inf = std::numeric_limits<double>::infinity();
    const double min_sub = smallest_subnormal(st);
    for (double v : {std::nan(""), inf, -inf, 0.0, -0.0, min_sub, -(tiny - min_sub), tiny / 4, tiny,
                     65504.0, 1.0e5, -3.0e6}) {
      // fill_ refuses a finite value that overflows fp16; fp16 has no such element anyway.
      if (st != at::kHalf || !(std::fabs(v) > 65504.0 && std::isfinite(v))) {
        specials.emplace_back(v);
      }
    }
  } else if (st == at::kBool) {
    x = at::randint(0, 2, {n}, gen, at::kLong).to(at::kBool);
    specials = {at::Scalar(false), at::Scalar(true)};
  } else {
    int64_t lo = 0, hi = 255;
    switch (st) {
      case at::kChar:
        lo = -128, hi = 127;
        break;
      case at::kShort:
        lo = -32768, hi = 32767;
        break;
      case at::kInt:
        lo = std::numeric_limits<int32_t>::min(), hi = -(lo + 1);
        break;
      case at::kLong:
        lo = std::numeric_limits<int64_t>::min(), hi = -(lo + 1);
        break;
      default:
        break;
    }
    at::Tensor wide = at::randint(-70000, 70001, {n}, gen, at::kLong);
    if (st == at::kLong) wide = wide * 131071000003LL;  // values far beyond int32 and 2^53
    x = wide.clamp(lo, hi).to(st);
    for (int64_t v : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{65504}, int64_t{65505},
                      int64_t{-65505}, lo, hi}) {
      if (v >= lo && v <= hi) specials.emplace_back(v);
    }
  }
  if (n == 0) return x;
  std::vector<int64_t> pos = boundary_positions(n);
  const at::Tensor extra = at::randint(0, n, {std::max<int64_t>(n / 200, 1)}, gen, at::kLong);
  for (int64_t k = 0; k < extra.numel(); ++k) pos.push_back(extra[k].item<int64_t>());
  for (size_t k = 0; k < pos.size(); ++k) {
    x[pos[k]].fill_(specials[k % specials.size()]);
  }
  return x;
}

}  // namespace trainsan_test
