// The C++ API of the statistics pass on CPU: trainsan::tensor_stats, tensor_stats_packed and
// unpack_stats against hand-computed values, the float64 reference and Note [Hash] re-implemented
// in stats_reference.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "stats.cuh"
#include "stats_internal.h"
#include "stats_reference.h"
#include "trainsan/stats.h"

namespace {

using trainsan::TensorStats;
using trainsan_test::all_dtypes;
using trainsan_test::bitwise_equal;
using trainsan_test::expect_matches;
using trainsan_test::expect_same;
using trainsan_test::kChunk;
using trainsan_test::random_tensor;
using trainsan_test::ref_hash;
using trainsan_test::reference;

constexpr double kInf = std::numeric_limits<double>::infinity();
const double kNaN = std::nan("");

std::string name(at::ScalarType st) { return c10::toString(st); }

TensorStats one(const at::Tensor& t) {
  const auto s = trainsan::tensor_stats({t});
  EXPECT_EQ(s.size(), 1u);
  return s.at(0);
}

// --- Hand-computed ---------------------------------------------------------------------------

TEST(TensorStats, HandComputedFloat32) {
  const at::Tensor t =
      at::tensor({1.0, -2.0, 0.0, kNaN, kInf, -kInf, -0.0, 1e-40, 7.0e4, 65504.0}, at::kFloat);
  const TensorStats s = one(t);
  EXPECT_EQ(s.numel, 10);
  EXPECT_EQ(s.nan, 1);
  EXPECT_EQ(s.posinf, 1);
  EXPECT_EQ(s.neginf, 1);
  EXPECT_EQ(s.nonfinite(), 3);
  EXPECT_EQ(s.zero, 2);
  EXPECT_EQ(s.subnormal, 1);      // 1e-40 is a float32 subnormal
  EXPECT_EQ(s.fp16_overflow, 1);  // 7e4; 65504 itself fits fp16
  EXPECT_EQ(s.min, -2.0);
  EXPECT_EQ(s.max, 7.0e4);
  EXPECT_EQ(s.absmax, 7.0e4);
  EXPECT_EQ(s.sum, 1.0 - 2.0 + 7.0e4 + 65504.0);
  EXPECT_EQ(s.l2, std::sqrt(1.0 + 4.0 + 4.9e9 + 65504.0 * 65504.0));
  EXPECT_EQ(s.hash, ref_hash(t));
}

TEST(TensorStats, HandComputedIntegers) {
  const TensorStats s = one(at::tensor({3, -70000, 0, 65504, 65505, -65505}, at::kInt));
  EXPECT_EQ(s.numel, 6);
  EXPECT_EQ(s.zero, 1);
  EXPECT_EQ(s.fp16_overflow, 3);
  EXPECT_EQ(s.nan + s.posinf + s.neginf + s.subnormal, 0);
  EXPECT_EQ(s.min, -70000.0);
  EXPECT_EQ(s.max, 65505.0);
  EXPECT_EQ(s.absmax, 70000.0);
  EXPECT_EQ(s.sum, 3.0 - 70000.0 + 65504.0);
  EXPECT_EQ(s.l2, std::sqrt(9.0 + 4.9e9 + 65504.0 * 65504.0 + 2 * 65505.0 * 65505.0));

  const TensorStats b = one(at::tensor({1, 0, 1, 1}, at::kInt).to(at::kBool));
  EXPECT_EQ(b.zero, 1);
  EXPECT_EQ(b.min, 0.0);
  EXPECT_EQ(b.max, 1.0);
  EXPECT_EQ(b.sum, 3.0);
  EXPECT_EQ(b.l2, std::sqrt(3.0));
}

TEST(TensorStats, GoldenHashes) {
  // Values of Note [Hash] computed independently by tests/python/stats_reference.py (numpy).
  EXPECT_EQ(one(at::arange(10, at::kInt)).hash, 0x23dcb38094e6e53bull);
  EXPECT_EQ(one(at::tensor({1, 0, 1}, at::kInt).to(at::kBool)).hash, 0x812d6626126a48eull);
  EXPECT_EQ(one(at::empty({0})).hash, 0x0ull);
  at::Tensor f = at::tensor({1.0f, -0.0f, 0.0f, 2.5f});
  f.view(at::kInt)[2].fill_(0x7fc00001);  // a NaN with a payload
  EXPECT_EQ(one(f).hash, 0x300e624ed5ce2adeull);
}

TEST(TensorStats, SubnormalIsPerOwnDtype) {
  // 1e-5 is normal in float32 but below fp16's smallest normal 2^-14.
  const at::Tensor x = at::tensor(
      {1e-5, std::ldexp(1.0, -14), std::ldexp(1.0, -24), -std::ldexp(1.0, -15)}, at::kFloat);
  const auto s = trainsan::tensor_stats({x, x.to(at::kHalf)});
  EXPECT_EQ(s[0].subnormal, 0);
  EXPECT_EQ(s[1].subnormal, 3);
  const at::Tensor b =
      at::tensor({std::ldexp(1.0, -126), std::ldexp(1.0, -127), std::ldexp(1.0, -133)})
          .to(at::kBFloat16);
  const at::Tensor d = at::tensor({std::ldexp(1.0, -1022), std::ldexp(1.0, -1023), 5e-324});
  const auto sb = trainsan::tensor_stats({b, d.to(at::kDouble)});
  EXPECT_EQ(sb[0].subnormal, 2);
  EXPECT_EQ(sb[1].subnormal, 2);
  EXPECT_EQ(sb[1].min, 5e-324);
  // Subnormals are finite values: they enter min/max/sum exactly (not flushed to zero).
  const double h = std::ldexp(1.0, -24);  // fp16's smallest subnormal
  const at::Tensor sub16 = at::tensor({h, 3 * h, -h}).to(at::kHalf);
  const TensorStats s16 = one(sub16);
  EXPECT_EQ(s16.subnormal, 3);
  EXPECT_EQ(s16.min, -h);
  EXPECT_EQ(s16.max, 3 * h);
  EXPECT_EQ(s16.sum, 3 * h);
  EXPECT_EQ(sb[0].min, std::ldexp(1.0, -133));
}

TEST(TensorStats, NoFiniteElement) {
  for (const auto st : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
    const TensorStats s = one(at::tensor({kNaN, kInf, -kInf}, at::kDouble).to(st));
    EXPECT_EQ(s.nan, 1) << name(st);
    EXPECT_FALSE(s.min.has_value()) << name(st);
    EXPECT_FALSE(s.max.has_value()) << name(st);
    EXPECT_FALSE(s.absmax.has_value()) << name(st);
    EXPECT_EQ(s.sum, 0.0) << name(st);
    EXPECT_EQ(s.l2, 0.0) << name(st);
  }
}

TEST(TensorStats, EmptyAndZeroDim) {
  for (const auto st : all_dtypes()) {
    for (const auto& shape : std::vector<std::vector<int64_t>>{{0}, {3, 0, 2}}) {
      const at::Tensor t = at::empty(shape, at::TensorOptions().dtype(st));
      const TensorStats s = one(t);
      EXPECT_EQ(s.numel, 0) << name(st);
      EXPECT_EQ(s.zero + s.nan + s.fp16_overflow, 0) << name(st);
      EXPECT_FALSE(s.min.has_value()) << name(st);
      EXPECT_EQ(s.sum, 0.0) << name(st);
      EXPECT_EQ(s.l2, 0.0) << name(st);
      EXPECT_EQ(s.hash, ref_hash(t)) << name(st);
    }
    const at::Tensor scalar = at::scalar_tensor(1, at::TensorOptions().dtype(st));  // 0-d
    const auto s = trainsan::tensor_stats({scalar, scalar.reshape({1, 1, 1})});
    expect_matches(s[0], reference(scalar), "0-d " + name(st));
    EXPECT_TRUE(bitwise_equal(s[0], s[1])) << name(st);
  }
  EXPECT_TRUE(trainsan::tensor_stats({}).empty());
}

TEST(TensorStats, SignedZeroHashesDiffer) {
  const auto s = trainsan::tensor_stats({at::tensor({0.0}), at::tensor({-0.0})});
  EXPECT_EQ(s[0].zero, 1);
  EXPECT_EQ(s[1].zero, 1);
  EXPECT_NE(s[0].hash, s[1].hash);
}

// --- Float64 reference -------------------------------------------------------------------------

TEST(TensorStats, ReferenceEveryDtype) {
  std::vector<at::Tensor> ts;
  for (const auto st : all_dtypes()) {
    for (const int64_t n : {int64_t{1}, int64_t{17}, kChunk - 1, kChunk + 1, 3 * kChunk + 17}) {
      ts.push_back(random_tensor(st, n, static_cast<uint64_t>(n) * 31 + ts.size()));
    }
  }
  const auto stats = trainsan::tensor_stats(ts);
  ASSERT_EQ(stats.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    expect_matches(stats[i], reference(ts[i]),
                   "tensors[" + std::to_string(i) + "] " + name(ts[i].scalar_type()));
  }
  // Planted specials reach every class somewhere.
  EXPECT_GT(stats[4].nan * stats[4].posinf * stats[4].neginf * stats[4].subnormal, 0);
}

// Note [Lean rows]: the every-step tier's rows are the full rows' counts, sum, l2 and absmax with
// the same bits (the same per-lane order of the sums), and nothing else.
// Every dtype at sizes around the chunk boundaries (empty included), and per dtype a transposed
// view and a strided slice; `seed` varies the values.
std::vector<at::Tensor> sizes_and_views(uint64_t seed) {
  std::vector<at::Tensor> ts;
  for (const auto st : all_dtypes()) {
    for (const int64_t n :
         {int64_t{0}, int64_t{1}, int64_t{17}, kChunk - 1, kChunk + 1, 3 * kChunk + 17}) {
      ts.push_back(random_tensor(st, n, static_cast<uint64_t>(n) * seed + ts.size()));
    }
    const at::Tensor m = random_tensor(st, 300 * 70, seed * 14 + ts.size()).reshape({300, 70});
    ts.push_back(m.t());                 // transposed view
    ts.push_back(m.slice(1, 3, 60, 2));  // strided slice
  }
  return ts;
}

// Note [Dtypes the pass reads]: a complex tensor is read as its real view (the same figures, bit
// for bit, as the view_as_real tensor); a dtype the pass does not read is a c10::TypeError naming
// it, never a descriptor with an undefined dtype code (issue 39: the code read an empty optional).
TEST(TensorStats, ComplexIsReadAsItsPartsAndOtherDtypesAreRefused) {
  at::manual_seed(3);
  at::Tensor z = at::randn({33, 7}, at::kComplexFloat);
  at::view_as_real(z).index_put_({5, 2, 0}, std::numeric_limits<float>::quiet_NaN());
  const auto got = trainsan::tensor_stats({z, z.to(at::kComplexDouble)});
  const auto want =
      trainsan::tensor_stats({at::view_as_real(z), at::view_as_real(z).to(at::kDouble)});
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(got[k].numel, 2 * z.numel());
    EXPECT_EQ(got[k].nan, 1);
    EXPECT_EQ(got[k].hash, want[k].hash);
    EXPECT_EQ(got[k].l2, want[k].l2);
    EXPECT_EQ(got[k].absmax, want[k].absmax);
  }
  for (const auto st :
       {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kUInt16, at::kUInt32, at::kUInt64}) {
    const at::Tensor t = at::zeros({4}, at::kFloat).to(st);
    try {
      trainsan::tensor_stats({at::zeros({2}), t});
      ADD_FAILURE() << "no error for " << st;
    } catch (const c10::TypeError& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("tensors[1]"), std::string::npos) << msg;
      EXPECT_NE(msg.find("not supported"), std::string::npos) << msg;
    }
  }
}

TEST(TensorStats, GradientStatsAreTheLeanColumns) {
  std::vector<at::Tensor> ts = sizes_and_views(7);
  // Blocks with no special value (the ordinary path), with zeros, and all-special tensors.
  ts.push_back(at::randn({5 * 1024 + 3}));
  ts.push_back(at::randn({4096}) * (at::rand({4096}) > 0.5));
  ts.push_back(at::full({2048}, kNaN));
  ts.push_back(at::full({2048}, -kInf, at::kHalf));
  const auto full = trainsan::tensor_stats(ts);
  const auto lean = trainsan::unpack_stats(trainsan::gradient_stats_packed(ts));
  ASSERT_EQ(lean.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "] " + name(ts[i].scalar_type());
    EXPECT_EQ(lean[i].numel, full[i].numel) << what;
    EXPECT_EQ(lean[i].nan, full[i].nan) << what;
    EXPECT_EQ(lean[i].posinf, full[i].posinf) << what;
    EXPECT_EQ(lean[i].neginf, full[i].neginf) << what;
    EXPECT_EQ(lean[i].zero, full[i].zero) << what;
    EXPECT_EQ(lean[i].subnormal, full[i].subnormal) << what;
    EXPECT_EQ(lean[i].fp16_overflow, full[i].fp16_overflow) << what;
    if (ts[i].is_contiguous() || !ts[i].is_non_overlapping_and_dense()) {
      EXPECT_EQ(lean[i].l2, full[i].l2) << what;    // bitwise: the same additions, same order
      EXPECT_EQ(lean[i].sum, full[i].sum) << what;  // bitwise, as l2
    } else {                                        // a transpose: read in memory order
      EXPECT_NEAR(lean[i].l2, full[i].l2, 1e-12 * std::max(1.0, full[i].l2)) << what;
      EXPECT_NEAR(lean[i].sum, full[i].sum, 1e-12 * std::max(1.0, std::fabs(full[i].l2))) << what;
    }
    EXPECT_EQ(lean[i].absmax.has_value(), full[i].absmax.has_value()) << what;
    if (lean[i].absmax && full[i].absmax) {
      EXPECT_EQ(*lean[i].absmax, *full[i].absmax) << what;
    }
    EXPECT_FALSE(lean[i].min.has_value()) << what;
    EXPECT_FALSE(lean[i].max.has_value()) << what;
    EXPECT_EQ(lean[i].hash, 0u) << what;
    // And against the float64 reference, independently of the full pass.
    const auto ref = reference(ts[i]);
    EXPECT_EQ(lean[i].nan + lean[i].posinf + lean[i].neginf, ref.nan + ref.posinf + ref.neginf)
        << what;
    EXPECT_NEAR(lean[i].l2, ref.l2, 1e-12 * std::max(1.0, ref.l2)) << what;
  }
  EXPECT_TRUE(trainsan::unpack_stats(trainsan::gradient_stats_packed({})).empty());
}

// Note [Lean rows]'s kModeHash: the fingerprint with the same bits as the full row's and as the
// independent reference's, numel, and nothing else; views are hashed in logical order.
TEST(TensorStats, FingerprintStatsAreTheHashOnly) {
  std::vector<at::Tensor> ts = sizes_and_views(13);
  ts.push_back(at::full({2048}, kNaN));
  ts.push_back(at::randint(0, 50000, {64, 33}, at::kLong));  // token ids
  const auto full = trainsan::tensor_stats(ts);
  const auto fp = trainsan::unpack_stats(trainsan::fingerprint_stats_packed(ts));
  ASSERT_EQ(fp.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    const std::string what = "tensors[" + std::to_string(i) + "] " + name(ts[i].scalar_type());
    EXPECT_EQ(fp[i].numel, ts[i].numel()) << what;
    EXPECT_EQ(fp[i].hash, full[i].hash) << what;
    EXPECT_EQ(fp[i].hash, reference(ts[i]).hash) << what;
    EXPECT_EQ(fp[i].nan + fp[i].posinf + fp[i].neginf + fp[i].zero + fp[i].subnormal, 0) << what;
    EXPECT_FALSE(fp[i].min.has_value()) << what;
    EXPECT_FALSE(fp[i].absmax.has_value()) << what;
    EXPECT_TRUE(std::isnan(fp[i].sum) && std::isnan(fp[i].l2)) << what;
  }
  // A moved element changes the fingerprint (the index enters every term).
  const at::Tensor a = at::arange(1000, at::kFloat);
  const at::Tensor b = a.flip(0).contiguous();
  const auto ab = trainsan::unpack_stats(trainsan::fingerprint_stats_packed({a, b}));
  EXPECT_NE(ab[0].hash, ab[1].hash);
  EXPECT_TRUE(trainsan::unpack_stats(trainsan::fingerprint_stats_packed({})).empty());
}

TEST(TensorStats, ManySmallTensors) {
  std::vector<at::Tensor> ts;
  for (int i = 0; i < 3000; ++i) {
    const auto st = all_dtypes()[i % all_dtypes().size()];
    at::Tensor t = random_tensor(st, 2 * (i % 23) + 1, static_cast<uint64_t>(i));
    if (i % 3 == 1) t = t.slice(0, 0, t.numel(), 2);  // strided
    ts.push_back(t);
  }
  const auto stats = trainsan::tensor_stats(ts);
  for (size_t i = 0; i < ts.size(); ++i) {
    expect_matches(stats[i], reference(ts[i]), "tensors[" + std::to_string(i) + "]");
  }
}

// --- Views ---------------------------------------------------------------------------------------

TEST(TensorStats, ViewsMatchReferenceAndContiguousCopy) {
  for (const auto st :
       {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble, at::kShort, at::kLong, at::kBool}) {
    const at::Tensor b = random_tensor(st, 150 * 517, 5).reshape({150, 517});
    const at::Tensor h = random_tensor(st, 1 << 18, 6);
    const std::vector<std::pair<std::string, at::Tensor>> views = {
        {"transpose", b.t()},
        {"step_slice", b.slice(0, 0, 150, 3).slice(1, 1, 517, 2)},
        {"column", b.select(1, 7)},
        {"misaligned", b.reshape({-1}).slice(0, 3, -5)},
        {"permute_4d", b.reshape({6, 25, 11, 47}).permute({2, 0, 3, 1})},
        {"six_dims", b.reshape({2, 3, 5, 5, 11, 47}).permute({5, 3, 1, 4, 2, 0})},
        {"nine_dims", h.reshape({4, 4, 4, 4, 4, 4, 4, 4, 4}).permute({8, 7, 6, 5, 4, 3, 2, 1, 0})},
        {"expand_rows", b.slice(0, 0, 1).expand({150, 517})},
        {"expand_middle", b.slice(1, 0, 40).unsqueeze(1).expand({150, 3, 40})},
        {"expand_scalar", b[7][9].expand({2 * kChunk + 1})},
    };
    for (const auto& [what, v] : views) {
      const auto s = trainsan::tensor_stats({v, v.contiguous()});
      const auto ref = reference(v);
      expect_matches(s[0], ref, what + " " + name(st));
      expect_same(s[0], s[1], ref.abs_sum, what + " " + name(st) + " vs contiguous");
    }
  }
}

TEST(TensorStats, NegativeView) {
  // A lazily negated view (the Python op's dispatcher resolves these before the kernel runs; the
  // C++ API sees them as they are).
  for (const auto st : {at::kFloat, at::kHalf, at::kLong}) {
    const at::Tensor x = random_tensor(st, 3000, 12).reshape({30, 100}).t();
    const at::Tensor v = at::_neg_view(x);
    ASSERT_TRUE(v.is_neg());
    expect_matches(one(v), reference(v.resolve_neg()), "neg view " + name(st));
  }
}

TEST(TensorStats, TensorsAutogradTracksAreReadAsTheirData) {
  // The pass reads a tracked tensor (a loss, a view of a parameter) without detaching it first;
  // the copies it makes of a negated or many-dimensional view are of an alias. Same rows as the
  // detached tensors', and the tensors' graphs are as they were.
  const at::Tensor leaf = random_tensor(at::kFloat, 4 * 4 * 4 * 4 * 4 * 4 * 4 * 4 * 4, 21)
                              .reshape({4, 4, 4, 4, 4, 4, 4, 4, 4})
                              .requires_grad_(true);
  const at::Tensor loss = (leaf * leaf).mean();
  const at::Tensor permuted = leaf.permute({8, 7, 6, 5, 4, 3, 2, 1, 0});
  const at::Tensor negated = at::_neg_view(leaf.reshape({64, -1}).t());
  ASSERT_TRUE(loss.requires_grad() && negated.is_neg() && negated.requires_grad());
  const std::vector<at::Tensor> tracked{loss, permuted, negated};
  std::vector<at::Tensor> detached;
  for (const at::Tensor& t : tracked) detached.push_back(t.detach());
  const auto a = trainsan::tensor_stats(tracked);
  const auto b = trainsan::tensor_stats(detached);
  for (size_t i = 0; i < tracked.size(); ++i) {
    expect_same(a[i], b[i], reference(detached[i]).abs_sum, "tracked[" + std::to_string(i) + "]");
  }
  expect_matches(a[2], reference(negated.detach().resolve_neg()), "negated view");
  loss.backward();
  EXPECT_TRUE(at::allclose(leaf.grad(), 2 * leaf.detach() / leaf.numel(), 1e-5, 1e-8,
                           /*equal_nan=*/true));
}

TEST(TensorStats, HashIndependentOfLayoutChangesWithContent) {
  const at::Tensor x = random_tensor(at::kFloat, 60 * 70, 9).reshape({60, 70});
  const at::Tensor col_major = x.t().contiguous().t();
  ASSERT_FALSE(col_major.is_contiguous());
  at::Tensor swapped = x.clone();
  swapped[0][0].copy_(x[59][69]);
  swapped[59][69].copy_(x[0][0]);
  at::Tensor flipped = x.clone();
  flipped.view(at::kInt)[30][31].bitwise_xor_(1);
  const auto s = trainsan::tensor_stats({x, col_major, x.reshape({-1}), swapped, flipped});
  EXPECT_EQ(s[0].hash, s[1].hash);
  EXPECT_EQ(s[0].hash, s[2].hash);
  EXPECT_NE(s[0].hash, s[3].hash);
  EXPECT_NE(s[0].hash, s[4].hash);
  EXPECT_EQ(s[0].hash, ref_hash(x));
  EXPECT_EQ(s[3].hash, ref_hash(swapped));
  EXPECT_EQ(s[4].hash, ref_hash(flipped));
}

// --- Determinism ---------------------------------------------------------------------------------

TEST(TensorStats, BitwiseEqualAcrossRunsAndThreadCounts) {
  std::vector<at::Tensor> ts;
  for (const auto st : all_dtypes()) ts.push_back(random_tensor(st, 5 * kChunk + 99, 40));
  ts.push_back(random_tensor(at::kFloat, 1 << 18, 41).reshape({64, 64, 64}).permute({2, 0, 1}));
  const int saved = at::get_num_threads();
  std::vector<std::vector<TensorStats>> runs;
  for (const int threads : {1, 2, 3, 2}) {
    at::set_num_threads(threads);
    runs.push_back(trainsan::tensor_stats(ts));
  }
  at::set_num_threads(saved);
  EXPECT_EQ(at::get_num_threads(), saved);
  for (size_t r = 1; r < runs.size(); ++r) {
    for (size_t i = 0; i < ts.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(runs[0][i], runs[r][i])) << "run " << r << " tensors[" << i << "]";
    }
  }
}

// --- Packed form ---------------------------------------------------------------------------------

TEST(TensorStats, PackedRoundTrip) {
  const std::vector<at::Tensor> ts = {random_tensor(at::kFloat, 1000, 1), at::tensor({kNaN, kInf}),
                                      at::empty({0}, at::kLong), random_tensor(at::kByte, 77, 2)};
  const trainsan::PackedStats p = trainsan::tensor_stats_packed(ts);
  ASSERT_EQ(p.ints.sizes(), at::IntArrayRef({4, 8}));
  ASSERT_EQ(p.floats.sizes(), at::IntArrayRef({4, 5}));
  EXPECT_EQ(p.ints.scalar_type(), at::kLong);
  EXPECT_EQ(p.floats.scalar_type(), at::kDouble);
  EXPECT_TRUE(p.ints.device().is_cpu());
  EXPECT_TRUE(std::isnan(p.floats[1][0].item<double>()));  // no finite element: NaN, packed
  const auto unpacked = trainsan::unpack_stats(p);
  const auto direct = trainsan::tensor_stats(ts);
  ASSERT_EQ(unpacked.size(), direct.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(unpacked[i], direct[i])) << i;
    EXPECT_EQ(static_cast<uint64_t>(p.ints[i][7].item<int64_t>()), direct[i].hash);
  }
  const trainsan::PackedStats empty = trainsan::tensor_stats_packed({});
  EXPECT_EQ(empty.ints.sizes(), at::IntArrayRef({0, 8}));
  EXPECT_TRUE(trainsan::unpack_stats(empty).empty());
  EXPECT_THROW(trainsan::unpack_stats({at::zeros({2, 3}, at::kLong), at::zeros({2, 5})}),
               c10::ValueError);
}

TEST(TensorStats, PackedBuffersHeldAreNeverReused) {
  // Note [Reused host rows]: a pass may reuse the buffers of an earlier pass of the same shape
  // only once nobody holds them (neither the tensors nor a view of their storage).
  const at::Tensor x = random_tensor(at::kFloat, 500, 31);
  const at::Tensor y = random_tensor(at::kFloat, 500, 32);
  const at::Tensor x_ints = trainsan::tensor_stats_packed({x}).ints.clone();
  const at::Tensor y_ints = trainsan::tensor_stats_packed({y}).ints.clone();
  ASSERT_FALSE(at::equal(x_ints, y_ints));
  trainsan::PackedStats held = trainsan::tensor_stats_packed({x});
  const trainsan::PackedStats other = trainsan::tensor_stats_packed({y});
  EXPECT_TRUE(at::equal(held.ints, x_ints));  // the second pass did not write the first's rows
  EXPECT_TRUE(at::equal(other.ints, y_ints));
  EXPECT_NE(held.ints.data_ptr(), other.ints.data_ptr());
  const at::Tensor alias = held.ints.detach();  // shares the storage, not the tensor
  held = trainsan::PackedStats{};
  std::vector<trainsan::PackedStats> kept;  // each held: every pass needs a buffer of its own
  for (int i = 0; i < 12; ++i) {
    kept.push_back(trainsan::tensor_stats_packed({y}));
    EXPECT_TRUE(at::equal(kept.back().ints, y_ints)) << "pass " << i;
  }
  EXPECT_TRUE(at::equal(alias, x_ints));
  // A buffer handed out, reshaped in place by its holder and dropped is not written as rows.
  kept.clear();
  {
    trainsan::PackedStats odd = trainsan::tensor_stats_packed({x});
    odd.ints.as_strided_(odd.ints.sizes(), {odd.ints.size(1), 0});  // same shape, not dense
  }
  std::vector<trainsan::PackedStats> dense;  // each held: every pass takes another buffer
  for (int i = 0; i < 12; ++i) {
    dense.push_back(trainsan::tensor_stats_packed({x}));
    EXPECT_TRUE(dense.back().ints.is_contiguous() && at::equal(dense.back().ints, x_ints))
        << "pass " << i;
  }
  dense.clear();
  // Rows nobody holds any more: the same results as new buffers would give, pass after pass.
  for (int i = 0; i < 12; ++i) {
    EXPECT_TRUE(at::equal(trainsan::tensor_stats_packed({i % 2 == 0 ? x : y}).ints,
                          i % 2 == 0 ? x_ints : y_ints))
        << "pass " << i;
  }
}

TEST(TensorStats, ToString) {
  const std::string s = one(at::tensor({kNaN, 1.0})).to_string();
  EXPECT_NE(s.find("nan=1"), std::string::npos) << s;
  EXPECT_NE(s.find("min=1"), std::string::npos) << s;
  EXPECT_NE(one(at::tensor({kNaN})).to_string().find("min=None"), std::string::npos);
}

// --- Errors: the element is named, never a crash
// --------------------------------------------------

template <typename Exc>
void expect_error_naming(const std::vector<at::Tensor>& ts, const std::string& element) {
  for (int packed = 0; packed < 2; ++packed) {
    try {
      if (packed) {
        trainsan::tensor_stats_packed(ts);
      } else {
        trainsan::tensor_stats(ts);
      }
      ADD_FAILURE() << "no exception for " << element;
    } catch (const Exc& e) {
      EXPECT_NE(std::string(e.what()).find(element), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "wrong exception type for " << element << ": " << e.what();
    }
  }
}

TEST(TensorStats, BadInputNamesTheElement) {
  const at::Tensor ok = at::ones({3});
  const at::Tensor dense = at::randn({4, 4});
  expect_error_naming<c10::ValueError>({ok, at::Tensor()}, "tensors[1]");
  expect_error_naming<c10::ValueError>({ok, ok, dense.to_sparse()}, "tensors[2]");
  expect_error_naming<c10::ValueError>({ok, dense.to_sparse_csr()}, "tensors[1]");
  expect_error_naming<c10::ValueError>({at::quantize_per_tensor(dense, 0.1, 0, at::kQInt8), ok},
                                       "tensors[0]");
  expect_error_naming<c10::ValueError>({ok, at::empty({3}, at::device(at::kMeta))}, "tensors[1]");
  // (complex tensors are read as their parts: ComplexIsReadAsItsPartsAndOtherDtypesAreRefused)
  for (const auto st :
       {at::kUInt16, at::kUInt32, at::kUInt64, at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    expect_error_naming<c10::TypeError>({ok, ok.to(at::kInt), at::zeros({2}, st)}, "tensors[2]");
  }
}

}  // namespace

// --- Note [Update sample] ----------------------------------------------------------------------

namespace {

// The logical indices a tensor's sample holds.
std::vector<int64_t> sample_indices(int64_t n) {
  const int64_t stride = trainsan::host::update_sample_stride(n);
  std::vector<int64_t> idx;
  for (int64_t j = 0; j < trainsan::kernels::num_samples_of(n, stride); ++j) {
    idx.push_back(stride <= 1 ? j : trainsan::kernels::sample_index(j, stride, n));
  }
  return idx;
}

at::Tensor bits_of(const at::Tensor& t) {
  switch (t.element_size()) {
    case 2:
      return t.view(at::kShort).to(at::kLong);
    case 4:
      return t.view(at::kInt).to(at::kLong);
    default:
      return t.view(at::kLong);
  }
}

}  // namespace

// The strata: one element each, inside its stratum, at offsets that vary (never a plain stride),
// at most kUpdateSampleCap of them; small tensors whole.
TEST(UpdateSample, OneElementPerStratumAtHashedOffsets) {
  for (const int64_t n : {int64_t{1}, int64_t{4096}, int64_t{4097}, int64_t{70001},
                          int64_t{3} << 20, (int64_t{1} << 31) + 5}) {
    const int64_t stride = trainsan::host::update_sample_stride(n);
    const int64_t m = trainsan::kernels::num_samples_of(n, stride);
    EXPECT_LE(m, trainsan::host::kUpdateSampleCap) << n;
    if (n <= trainsan::host::kUpdateSampleCap) {
      EXPECT_EQ(stride, 1) << n;
      continue;
    }
    std::set<int64_t> offsets;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t i = trainsan::kernels::sample_index(j, stride, n);
      ASSERT_GE(i, j * stride) << n << " " << j;
      ASSERT_LT(i, std::min(n, (j + 1) * stride)) << n << " " << j;
      offsets.insert(i - j * stride);
    }
    EXPECT_GT(offsets.size(), std::min<size_t>(static_cast<size_t>(stride), 64) / 2) << n;
  }
}

// The pass against a sample equals a float64 reference over the sampled elements (bits changed,
// ||d|| and max |d| over elements finite in both), for every floating dtype, contiguous and
// strided tensors, one and many chunks, NaN/Inf/subnormals included; and leaves the sample
// holding the current values. make_update_snapshot gathers the same elements.
TEST(UpdateSample, PassMatchesReferenceOverTheSampledElements) {
  uint64_t seed = 11;
  for (const at::ScalarType st : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    for (const int64_t n : {int64_t{4000}, int64_t{5000}, int64_t{3} * kChunk + 17}) {
      for (const bool strided : {false, true}) {
        const std::string what = name(st) + " n=" + std::to_string(n) + (strided ? " T" : "");
        at::Tensor before = random_tensor(st, n, seed++);
        at::Tensor after = before.clone();
        // Change about a third of the elements (some to NaN/Inf, which random_tensor seeds).
        const at::Tensor other = random_tensor(st, n, seed++);
        const at::Tensor mask = at::arange(n) % 3 == 0;
        after = at::where(mask, other, after);
        if (strided) {  // the same logical values, read through a transposed view
          const int64_t rows = n % 2 == 0 ? 2 : 1;
          before = before.reshape({n / rows, rows}).t().contiguous().t();
          after = after.reshape({n / rows, rows}).t().contiguous().t();
        }
        at::Tensor snap =
            trainsan::host::make_update_snapshot(before, /*exact=*/false).reshape({-1});
        const std::vector<int64_t> idx = sample_indices(n);
        const at::Tensor index = at::tensor(idx, at::kLong);
        ASSERT_EQ(snap.numel(), static_cast<int64_t>(idx.size())) << what;
        ASSERT_TRUE(at::equal(bits_of(snap), bits_of(before.reshape({-1}).index_select(0, index))))
            << what;
        // Reference over the sampled elements.
        const at::Tensor a = after.reshape({-1}).index_select(0, index);
        const at::Tensor b = snap.clone();
        const int64_t changed = at::ne(bits_of(a), bits_of(b)).sum().item<int64_t>();
        const at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble);
        const at::Tensor both = at::isfinite(ad) & at::isfinite(bd);
        const at::Tensor d = at::where(both, ad - bd, at::zeros_like(ad));
        const double l2 = d.pow(2).sum().sqrt().item<double>();
        const double mx = d.abs().max().item<double>();

        const std::vector<at::Tensor> snaps{snap};
        const trainsan::PackedStats p = trainsan::host::packed_cpu({after}, &snaps);
        namespace kn = trainsan::kernels;
        EXPECT_EQ(p.ints[0][kn::kColChanged].item<int64_t>(), changed) << what;
        EXPECT_NEAR(p.floats[0][kn::kColUpdateL2].item<double>(), l2, 1e-12 * (1.0 + l2)) << what;
        EXPECT_EQ(p.floats[0][kn::kColUpdateMax].item<double>(), mx) << what;
        EXPECT_TRUE(at::equal(bits_of(snap), bits_of(a))) << what << ": sample not rewritten";
        // The tensor's own statistics are those of a pass without a snapshot.
        const trainsan::PackedStats plain = trainsan::host::packed_cpu({after});
        for (int c = 0; c < kn::kIntFields; ++c) {
          EXPECT_EQ(p.ints[0][c].item<int64_t>(), plain.ints[0][c].item<int64_t>()) << what << c;
        }
        // The exact form: the same figures over every element.
        at::Tensor full = trainsan::host::make_update_snapshot(before, /*exact=*/true);
        ASSERT_EQ(full.numel(), n);
      }
    }
  }
}
