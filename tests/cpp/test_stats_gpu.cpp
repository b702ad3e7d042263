#include <gtest/gtest.h>
#include <torch/torch.h>

#include "trainsan/stats.h"

TEST(TensorStatsGpu, MatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
  auto t = torch::randn({100000});
  auto c = trainsan::tensor_stats({t});
  auto g = trainsan::tensor_stats({t.cuda()});
  EXPECT_EQ(c[0].hash, g[0].hash);
}
