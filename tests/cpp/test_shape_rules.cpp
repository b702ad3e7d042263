// The shape rules of the op audit (host/audit/shape_rules.h), torch-free: broadcasting and the
// [N,1]-vs-[N] signature of Note [Op audit].
#include <gtest/gtest.h>

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
