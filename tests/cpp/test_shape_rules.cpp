// The shape rules of the op audit (host/audit/shape_rules.h), torch-free: broadcasting and the
// [N,1]-vs-[N] signature of Note [Op audit]; the value rules of target_leak and probs_as_logits.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "audit/shape_rules.h"

namespace {

using trainsan::host::audit::broadcast_shape;
using trainsan::host::audit::dim_at;
using trainsan::host::audit::implicit_cross_broadcast;
using trainsan::host::audit::numel_of;
using trainsan::host::audit::Operand;
using trainsan::host::audit::operands_str;
using trainsan::host::audit::Shape;
using trainsan::host::audit::shape_str;

Operand op(Shape shape, bool grad = true, std::string role = "") {
  return Operand{std::move(role), std::move(shape), grad};
}

// The elementwise rule as the observer applies it: broadcast first, then the signature.
bool fires(const std::vector<Operand>& ops) {
  const std::optional<Shape> out = broadcast_shape(ops);
  return out.has_value() && implicit_cross_broadcast(ops, *out);
}

TEST(ShapeRules, NumelAndText) {
  EXPECT_EQ(numel_of({}), 1);
  EXPECT_EQ(numel_of({3, 0, 2}), 0);
  EXPECT_EQ(numel_of({32, 1}), 32);
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({32, 1}), "[32, 1]");
  EXPECT_EQ(operands_str({op({32, 1}, true, "input"), op({32}, false, "target")}),
            "input [32, 1] and target [32]");
  EXPECT_EQ(operands_str({op({2}), op({3, 1}), op({1})}), "[2], [3, 1] and [1]");
}

TEST(ShapeRules, BroadcastShape) {
  EXPECT_EQ(broadcast_shape({op({32, 1}), op({32})}), (Shape{32, 32}));
  EXPECT_EQ(broadcast_shape({op({4, 1, 3}), op({5, 1}), op({})}), (Shape{4, 5, 3}));
  EXPECT_EQ(broadcast_shape({op({8, 16}), op({16})}), (Shape{8, 16}));
  EXPECT_EQ(broadcast_shape({op({0, 1}), op({3})}), (Shape{0, 3}));
  EXPECT_EQ(broadcast_shape({}), Shape{});
}

TEST(ShapeRules, NotBroadcastableGivesNothing) {
  EXPECT_FALSE(broadcast_shape({op({3}), op({4})}).has_value());
  EXPECT_FALSE(broadcast_shape({op({2, 3}), op({3, 3})}).has_value());
  EXPECT_FALSE(fires({op({5, 1, 3}), op({4})}));
}

TEST(ShapeRules, DimAtIsRightAligned) {
  const Operand o = op({5, 1});
  EXPECT_EQ(dim_at(o, 0, 3), 1);  // no such dim: 1
  EXPECT_EQ(dim_at(o, 1, 3), 5);
  EXPECT_EQ(dim_at(o, 2, 3), 1);
}

TEST(ShapeRules, PredictionN1AgainstTargetNFires) {
  EXPECT_TRUE(fires({op({32, 1}), op({32}, /*grad=*/false)}));
  EXPECT_TRUE(fires({op({32}, /*grad=*/false), op({32, 1})}));  // either order
  EXPECT_TRUE(fires({op({4, 32, 1}), op({32})}));               // with a leading batch dim
}

TEST(ShapeRules, BiasAddDoesNotFire) {
  EXPECT_FALSE(fires({op({32, 16}), op({16})}));  // no growth
  EXPECT_FALSE(fires({op({32, 16}), op({})}));    // scalar
}

TEST(ShapeRules, EqualRanksDoNotFire) {
  // a[:, None] - b[None]: the pairwise term written out on both sides.
  EXPECT_FALSE(fires({op({32, 1}), op({1, 32})}));
}

TEST(ShapeRules, NoGradDoesNotFire) {
  // t[:, None] * freqs: an encoding built from constants.
  EXPECT_FALSE(fires({op({32, 1}, false), op({32}, false)}));
}

TEST(ShapeRules, PairwiseAgainstAnotherSetDoesNotFire) {
  // x[:, None] - centroids with N != K: [N, 1, D] against [K, D].
  EXPECT_FALSE(fires({op({32, 1, 8}), op({10, 8})}));
  EXPECT_FALSE(fires({op({32, 1}), op({10})}));
  EXPECT_TRUE(fires({op({10, 1}), op({10})}));  // N == K is the signature
}

TEST(ShapeRules, SingleOperandNeverFires) {
  EXPECT_FALSE(implicit_cross_broadcast({op({32, 1})}, {32, 1}));
}

TEST(ShapeRules, MoreThanSixteenDims) {
  Shape a(17, 1);
  a[15] = 6;  // [..., 6, 1]
  const Shape b{6};
  const std::optional<Shape> out = broadcast_shape({op(a), op(b)});
  ASSERT_TRUE(out.has_value());
  ASSERT_EQ(out->size(), 17u);
  EXPECT_EQ((*out)[15], 6);
  EXPECT_EQ((*out)[16], 6);
  EXPECT_TRUE(implicit_cross_broadcast({op(a), op(b)}, *out));
  Shape c(20, 1);
  c[19] = 4;
  EXPECT_FALSE(fires({op(c), op({4})}));  // a bias over 20 dims: no growth
  c[0] = 3;
  EXPECT_TRUE(fires({op(c), op({3, 1})}));  // [3, 1, ..., 4] meets [3, 1]: across dims 0 and 18
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// target_leak's value rules (Note [Target leak] in audit/leaks.cpp), on hand-written tables.

namespace {

using trainsan::host::audit::kLeakRowsInteger;
using trainsan::host::audit::kLeakRowsReal;
using trainsan::host::audit::last_valid_positions;
using trainsan::host::audit::leaked_column;
using trainsan::host::audit::match_sequence;

TEST(TargetLeak, UnshiftedTargetsEqualTheSequence) {
  // 2 rows of 4 tokens; the target is the sequence itself.
  const std::vector<int64_t> ids = {5, 7, 9, 2, 3, 3, 8, 1};
  const auto m = match_sequence(ids.data(), ids.data(), 2, 4, std::nullopt);
  EXPECT_TRUE(m.equal);
  EXPECT_FALSE(m.shifted);  // 5 7 9 2 read shifted: 7 != 5
  EXPECT_TRUE(m.varies);
  EXPECT_EQ(m.valid, 8);
}

TEST(TargetLeak, ShiftedTargetsAreTheDecodersInput) {
  // ids = [BOS=0, a, b, c]; the target is the next token: [a, b, c, EOS=1].
  const std::vector<int64_t> seq = {0, 5, 7, 9, 0, 3, 8, 4};
  const std::vector<int64_t> tgt = {5, 7, 9, 1, 3, 8, 4, 1};
  const auto m = match_sequence(tgt.data(), seq.data(), 2, 4, std::nullopt);
  EXPECT_FALSE(m.equal);
  EXPECT_TRUE(m.shifted);  // seq[t + 1] == tgt[t] for t < 3 in both rows
  // One position off breaks it.
  std::vector<int64_t> off = seq;
  off[6] = 2;
  EXPECT_FALSE(match_sequence(tgt.data(), off.data(), 2, 4, std::nullopt).shifted);
}

TEST(TargetLeak, IgnoredPositionsAreLeftOut) {
  // A masked LM: labels -100 where unmasked; the masked position holds [MASK]=99 in the input.
  const std::vector<int64_t> input = {5, 99, 9, 2};
  const std::vector<int64_t> labels = {-100, 7, -100, -100};
  const auto mlm = match_sequence(labels.data(), input.data(), 1, 4, int64_t{-100});
  EXPECT_EQ(mlm.valid, 1);
  EXPECT_FALSE(mlm.equal);
  // The masking forgotten (the input keeps the token): equal at the one valid position.
  const std::vector<int64_t> kept = {5, 7, 9, 2};
  const auto leak = match_sequence(labels.data(), kept.data(), 1, 4, int64_t{-100});
  EXPECT_TRUE(leak.equal);
  EXPECT_FALSE(leak.varies);  // one value: the caller asks for more positions than this
  // Every position ignored: nothing is equal.
  const std::vector<int64_t> none = {-100, -100};
  EXPECT_FALSE(match_sequence(none.data(), none.data(), 1, 2, int64_t{-100}).equal);
}

TEST(TargetLeak, LastValidPositionPerRow) {
  const std::vector<int64_t> tgt = {4, 5, -1, -1, 6, 7, 8, 9, -1, -1, -1, -1};
  EXPECT_EQ(last_valid_positions(tgt.data(), 3, 4, int64_t{-1}), (std::vector<int64_t>{1, 3, -1}));
  EXPECT_EQ(last_valid_positions(tgt.data(), 3, 4, std::nullopt), (std::vector<int64_t>{3, 3, 3}));
}

// A [rows, 3] table: column 0 noise, column 1 the target, column 2 a constant.
std::vector<double> table_with(const std::vector<double>& y) {
  std::vector<double> t;
  for (size_t r = 0; r < y.size(); ++r) {
    t.push_back(0.25 * static_cast<double>(r) - 1.0);
    t.push_back(y[r]);
    t.push_back(1.0);
  }
  return t;
}

TEST(TargetLeak, RealTargetColumnFromEightRows) {
  std::vector<double> y;
  for (int64_t r = 0; r < kLeakRowsReal; ++r) y.push_back(0.5 + 1.25 * static_cast<double>(r));
  const auto t = table_with(y);
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsReal, 3, y.data()), std::optional<int64_t>(1));
  // One row fewer is not enough evidence.
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsReal - 1, 3, y.data()), std::nullopt);
  // One row differing by the last bit: no column is the target.
  std::vector<double> near = y;
  near[3] = std::nextafter(near[3], 100.0);
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsReal, 3, near.data()), std::nullopt);
}

TEST(TargetLeak, ClassIndexColumnNeedsThirtyTwoRows) {
  std::vector<double> y;
  for (int64_t r = 0; r < kLeakRowsInteger; ++r) y.push_back(static_cast<double>(r % 3));
  const auto t = table_with(y);
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsInteger, 3, y.data()), std::optional<int64_t>(1));
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsInteger - 1, 3, y.data()), std::nullopt);
}

TEST(TargetLeak, ConstantTargetIsNoEvidence) {
  // A GAN's real labels (all 1) against a table with a column of ones.
  const std::vector<double> y(kLeakRowsInteger, 1.0);
  const auto t = table_with(y);
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsInteger, 3, y.data()), std::nullopt);
}

TEST(TargetLeak, OneHotPairOfATwoValuedLabelIsConditioning) {
  // [noise, onehot_0, onehot_1]: onehot_1 equals the 0/1 label, onehot_0 is its complement.
  std::vector<double> y, t;
  for (int64_t r = 0; r < kLeakRowsInteger; ++r) {
    y.push_back(static_cast<double>((r * 7) % 2));
    t.push_back(0.1 * static_cast<double>(r));
    t.push_back(1.0 - y.back());
    t.push_back(y.back());
  }
  EXPECT_EQ(leaked_column(t.data(), kLeakRowsInteger, 3, y.data()), std::nullopt);
  // Without the complement column, the 0/1 column is the label left among the features.
  std::vector<double> two;
  for (int64_t r = 0; r < kLeakRowsInteger; ++r) {
    two.push_back(t[static_cast<size_t>(3 * r)]);
    two.push_back(y[static_cast<size_t>(r)]);
  }
  EXPECT_EQ(leaked_column(two.data(), kLeakRowsInteger, 2, y.data()), std::optional<int64_t>(1));
  // A single column is no table.
  EXPECT_EQ(leaked_column(y.data(), kLeakRowsInteger, 1, y.data()), std::nullopt);
}

// ---------------------------------------------------------------------------------------------
// probs_as_logits (Note [Probabilities as logits]): the layout, the tolerance, the two rules.

using trainsan::host::audit::class_layout;
using trainsan::host::audit::ClassLayout;
using trainsan::host::audit::kRowSumTolerance;
using trainsan::host::audit::kSigmoidMinElements;
using trainsan::host::audit::looks_like_sigmoid;
using trainsan::host::audit::ProbSummary;
using trainsan::host::audit::Producer;
using trainsan::host::audit::producer_of;
using trainsan::host::audit::row_sum_tolerance;
using trainsan::host::audit::rows_are_probabilities;

ProbSummary summary(int64_t numel, double lo, double hi, double max_dev, int64_t zeros = 0) {
  ProbSummary s;
  s.numel = numel;
  s.lo = lo;
  s.hi = hi;
  s.max_dev = max_dev;
  s.zeros = zeros;
  return s;
}

const double kFloat32Eps = std::ldexp(1.0, -23);
const double kHalfEps = std::ldexp(1.0, -10);
const double kBFloat16Eps = std::ldexp(1.0, -7);

TEST(ProbsAsLogits, ClassLayoutOfEachInputForm) {
  const ClassLayout nc = *class_layout({64, 10});  // [N, C]
  EXPECT_EQ(nc.dim, 1);
  EXPECT_EQ(nc.classes, 10);
  EXPECT_EQ(nc.rows, 64);
  const ClassLayout c = *class_layout({10});  // one sample's [C]
  EXPECT_EQ(c.dim, 0);
  EXPECT_EQ(c.classes, 10);
  EXPECT_EQ(c.rows, 1);
  const ClassLayout ncd = *class_layout({2, 3, 4, 5});  // [N, C, H, W]: 2 * 4 * 5 rows
  EXPECT_EQ(ncd.dim, 1);
  EXPECT_EQ(ncd.classes, 3);
  EXPECT_EQ(ncd.rows, 40);
  EXPECT_EQ(class_layout({0, 10})->rows, 0);   // an empty batch
  EXPECT_EQ(class_layout({8, 0})->rows, 0);    // no classes
  EXPECT_FALSE(class_layout({}).has_value());  // 0-d
}

TEST(ProbsAsLogits, ToleranceByDtype) {
  EXPECT_EQ(row_sum_tolerance(kFloat32Eps), kRowSumTolerance);  // 4 eps = 4.8e-7 < 1e-3
  EXPECT_EQ(row_sum_tolerance(std::ldexp(1.0, -52)), kRowSumTolerance);
  EXPECT_EQ(row_sum_tolerance(kHalfEps), 0.00390625);   // 4 * 2^-10
  EXPECT_EQ(row_sum_tolerance(kBFloat16Eps), 0.03125);  // 4 * 2^-7
}

TEST(ProbsAsLogits, RowsSummingToOneAtTheToleranceEdge) {
  const ClassLayout l = *class_layout({2, 2});
  const double tol = row_sum_tolerance(kFloat32Eps);
  // Rows [0.25, 0.75] and [0.5, 0.5005]: sums 1 and 1.0005, max |sum-1| = 5e-4.
  EXPECT_TRUE(rows_are_probabilities(summary(4, 0.25, 0.75, 5e-4), l, tol));
  EXPECT_TRUE(rows_are_probabilities(summary(4, 0.25, 0.75, 1e-3), l, tol));  // at the edge
  EXPECT_FALSE(rows_are_probabilities(summary(4, 0.25, 0.75, std::nextafter(1e-3, 1.0)), l, tol));
  // [0.5, 0.5011] sums to 1.0011: beyond float32's tolerance, within float16's.
  EXPECT_FALSE(rows_are_probabilities(summary(4, 0.25, 0.75, 1.1e-3), l, tol));
  EXPECT_TRUE(
      rows_are_probabilities(summary(4, 0.25, 0.75, 1.1e-3), l, row_sum_tolerance(kHalfEps)));
  EXPECT_TRUE(
      rows_are_probabilities(summary(4, 0.25, 0.75, 0.00390625), l, row_sum_tolerance(kHalfEps)));
  EXPECT_FALSE(
      rows_are_probabilities(summary(4, 0.25, 0.75, 0.004), l, row_sum_tolerance(kHalfEps)));
  // bfloat16: a row off by 2.3e-3 (measured on softmax over 10 classes) is within 3.1e-2.
  EXPECT_TRUE(
      rows_are_probabilities(summary(4, 0.0, 1.0, 2.3e-3), l, row_sum_tolerance(kBFloat16Eps)));
}

TEST(ProbsAsLogits, EveryValueMustBeFiniteAndInTheUnitInterval) {
  const ClassLayout l = *class_layout({8, 10});
  const double tol = kRowSumTolerance;
  EXPECT_TRUE(rows_are_probabilities(summary(80, 0.0, 1.0, 0.0), l, tol));  // one-hot rows
  EXPECT_FALSE(rows_are_probabilities(summary(80, -1e-7, 0.9, 0.0), l, tol));
  EXPECT_FALSE(rows_are_probabilities(summary(80, 0.0, std::nextafter(1.0, 2.0), 0.0), l, tol));
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  // A NaN row makes min, max and its sum NaN; an Inf makes the max Inf.
  EXPECT_FALSE(rows_are_probabilities(summary(80, nan, nan, nan), l, tol));
  EXPECT_FALSE(rows_are_probabilities(summary(80, 0.0, 0.9, nan), l, tol));
  EXPECT_FALSE(rows_are_probabilities(summary(80, 0.0, inf, inf), l, tol));
  // Log-probabilities in [0, 1] are all 0: each row sums to 0.
  EXPECT_FALSE(rows_are_probabilities(summary(80, 0.0, 0.0, 1.0), l, tol));
}

TEST(ProbsAsLogits, OneRowIsEnoughButNotOneClassOrNoRow) {
  // A [C] input of one sample: softmax [0.2, 0.3, 0.5].
  EXPECT_TRUE(rows_are_probabilities(summary(3, 0.2, 0.5, 0.0), *class_layout({3}), 1e-3));
  EXPECT_TRUE(rows_are_probabilities(summary(3, 0.2, 0.5, 0.0), *class_layout({1, 3}), 1e-3));
  // An [N, C, d] input: rows are the N * d positions.
  EXPECT_TRUE(rows_are_probabilities(summary(24, 0.1, 0.8, 2e-7), *class_layout({2, 3, 4}), 1e-3));
  // One class: every row is [1.0] after a softmax, and also a constant logit.
  EXPECT_FALSE(rows_are_probabilities(summary(8, 1.0, 1.0, 0.0), *class_layout({8, 1}), 1e-3));
  EXPECT_FALSE(rows_are_probabilities(summary(0, 0.0, 0.0, 0.0), *class_layout({0, 10}), 1e-3));
}

TEST(ProbsAsLogits, ProducerByAutogradNodeName) {
  EXPECT_EQ(producer_of("SigmoidBackward0"), Producer::kSigmoid);  // sigmoid, expit
  EXPECT_EQ(producer_of("HardsigmoidBackward0"), Producer::kSigmoid);
  for (const char* same : {"ViewBackward0", "SqueezeBackward1", "UnsqueezeBackward0", "TBackward0",
                           "SliceBackward0", "SelectBackward0", "ToCopyBackward0", "IndexBackward0",
                           "ExpandBackward0", "PermuteBackward0"}) {
    EXPECT_EQ(producer_of(same), Producer::kSameValues) << same;
  }
  for (const char* other :
       {"AddmmBackward0", "ReluBackward0", "MulBackward0", "SoftmaxBackward0", "Sigmoid",
        "SigmoidBackwardX", "Backward0", "", "LogSigmoidBackward0"}) {
    EXPECT_EQ(producer_of(other), Producer::kOther) << other;
  }
}

TEST(ProbsAsLogits, SigmoidOutputsAtEachEdge) {
  const int64_t n = kSigmoidMinElements;
  EXPECT_TRUE(looks_like_sigmoid(summary(n, 0.31, 0.77, 0.0)));
  EXPECT_FALSE(looks_like_sigmoid(summary(n - 1, 0.31, 0.77, 0.0)));  // too few values
  EXPECT_TRUE(looks_like_sigmoid(summary(n, 0.0, 0.1, 0.0, n / 4)));  // the largest exactly 0.1
  EXPECT_FALSE(looks_like_sigmoid(summary(n, 0.0, std::nextafter(0.1, 0.0), 0.0)));
  EXPECT_FALSE(looks_like_sigmoid(summary(n, 0.0, 0.9, 0.0, n / 4 + 1)));  // a ReLU's zeros
  EXPECT_TRUE(looks_like_sigmoid(summary(n, 1e-30, 1.0, 0.0)));            // saturated at 1.0
  EXPECT_FALSE(looks_like_sigmoid(summary(n, 0.0, std::nextafter(1.0, 2.0), 0.0)));
  EXPECT_FALSE(looks_like_sigmoid(summary(n, -1e-9, 0.8, 0.0)));   // logits of both signs
  EXPECT_FALSE(looks_like_sigmoid(summary(n, 0.0, 0.0, 0.0, n)));  // a zero-initialised head
  EXPECT_FALSE(looks_like_sigmoid(summary(n, 1e-4, 3e-3, 0.0)));   // small, of one sign
  EXPECT_FALSE(looks_like_sigmoid(summary(n, std::nan(""), std::nan(""), 0.0)));
  EXPECT_FALSE(looks_like_sigmoid(summary(n, 0.2, std::numeric_limits<double>::infinity(), 0.0)));
  EXPECT_FALSE(looks_like_sigmoid(summary(0, 0.0, 0.0, 0.0)));
}

}  // namespace
