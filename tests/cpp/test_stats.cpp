#include <gtest/gtest.h>
#include <torch/torch.h>

#include "trainsan/stats.h"

TEST(TensorStats, HandComputed) {
  auto t = torch::tensor({1.0f, -2.0f, 0.0f, std::numeric_limits<float>::quiet_NaN()});
  auto s = trainsan::tensor_stats({t});
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].numel, 4);
  EXPECT_EQ(s[0].nan, 1);
  EXPECT_EQ(s[0].zero, 1);
  EXPECT_EQ(*s[0].min, -2.0);
  EXPECT_EQ(*s[0].max, 1.0);
  EXPECT_EQ(s[0].sum, -1.0);
}
