// The CUDA backend through the C++ API: equal to the CPU backend (counts, min/max/absmax and hash
// exactly, sum and l2 within relative 1e-12) and to the float64 reference, bitwise equal run to
// run. Skipped where no CUDA device is visible.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

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
using trainsan_test::reference;

class TensorStatsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible";
    ASSERT_TRUE(trainsan::cuda_compiled()) << "a GPU is visible but TrainSan has no CUDA kernels";
  }
};

// One CUDA pass over `gpu` against one CPU pass over `cpu` (the same logical tensors) and the
// float64 reference.
void expect_gpu_equals_cpu(const std::vector<at::Tensor>& cpu, const std::vector<at::Tensor>& gpu,
                           const std::string& what) {
  ASSERT_EQ(cpu.size(), gpu.size());
  const auto g = trainsan::tensor_stats(gpu);
  const auto c = trainsan::tensor_stats(cpu);
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_TRUE(gpu[i].is_cuda());
    const std::string w =
        what + " tensors[" + std::to_string(i) + "] " + c10::toString(cpu[i].scalar_type());
    const auto ref = reference(cpu[i]);
    expect_same(g[i], c[i], ref.abs_sum, w);
    expect_matches(g[i], ref, w);
  }
}

std::vector<at::Tensor> to_cuda(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.cuda());
  return out;
}

TEST_F(TensorStatsGpu, EqualsCpuEveryDtypeAndSize) {
  std::vector<at::Tensor> ts;
  for (const auto st : all_dtypes()) {
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{17}, int64_t{1023},
                            kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 17}) {
      ts.push_back(random_tensor(st, n, static_cast<uint64_t>(ts.size()) + 11));
    }
  }
  expect_gpu_equals_cpu(ts, to_cuda(ts), "sizes");
}

TEST_F(TensorStatsGpu, Views) {
  for (const auto st : all_dtypes()) {
    const at::Tensor b = random_tensor(st, 150 * 517, 5).reshape({150, 517});
    const at::Tensor h = random_tensor(st, 1 << 18, 6);
    auto views = [](const at::Tensor& b, const at::Tensor& h) {
      return std::vector<at::Tensor>{
          b.t(),
          b.slice(0, 0, 150, 3).slice(1, 1, 517, 2),
          b.select(1, 7),
          b.reshape({-1}).slice(0, 1, -5),  // misaligned start
          b.reshape({-1}).slice(0, 3),
          b.reshape({6, 25, 11, 47}).permute({2, 0, 3, 1}),
          b.reshape({2, 3, 5, 5, 11, 47}).permute({5, 3, 1, 4, 2, 0}),
          h.reshape({4, 4, 4, 4, 4, 4, 4, 4, 4}).permute({8, 7, 6, 5, 4, 3, 2, 1, 0}),
          b.slice(0, 0, 1).expand({150, 517}),
          b.slice(1, 0, 40).unsqueeze(1).expand({150, 3, 40}),
          b[7][9].expand({2 * kChunk + 1}),
      };
    };
    expect_gpu_equals_cpu(views(b, h), views(b.cuda(), h.cuda()), c10::toString(st));
  }
}

TEST_F(TensorStatsGpu, ManyTensorsOneCall) {
  std::vector<at::Tensor> ts;
  for (int i = 0; i < 5000; ++i) {
    ts.push_back(random_tensor(all_dtypes()[i % all_dtypes().size()], i % 41, i));
  }
  for (const auto st : all_dtypes()) ts.push_back(random_tensor(st, 2 * kChunk + 5, 3));
  expect_gpu_equals_cpu(ts, to_cuda(ts), "many");
}

TEST_F(TensorStatsGpu, MixedDevices) {
  const at::Tensor a = random_tensor(at::kFloat, 1000, 1);
  const at::Tensor b = random_tensor(at::kHalf, 3000, 2);
  const auto mixed = trainsan::tensor_stats({a, b.cuda(), a.cuda(), b});
  const auto cpu = trainsan::tensor_stats({a, b});
  const auto gpu = trainsan::tensor_stats({b.cuda(), a.cuda()});
  EXPECT_TRUE(bitwise_equal(mixed[0], cpu[0]));
  EXPECT_TRUE(bitwise_equal(mixed[3], cpu[1]));
  EXPECT_TRUE(bitwise_equal(mixed[1], gpu[0]));
  EXPECT_TRUE(bitwise_equal(mixed[2], gpu[1]));
  // The packed (asynchronous) form takes one device per call and names the odd one out.
  try {
    trainsan::tensor_stats_packed({a.cuda(), a});
    ADD_FAILURE() << "no exception for a mixed list";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("tensors[1]"), std::string::npos) << e.what();
  }
}

TEST_F(TensorStatsGpu, PackedStaysOnDevice) {
  const std::vector<at::Tensor> ts = {random_tensor(at::kFloat, 5000, 1).cuda(),
                                      at::empty({0}, at::device(at::kCUDA))};
  const trainsan::PackedStats p = trainsan::tensor_stats_packed(ts);
  EXPECT_TRUE(p.ints.is_cuda());
  EXPECT_TRUE(p.floats.is_cuda());
  EXPECT_EQ(p.ints.sizes(), at::IntArrayRef({2, 8}));
  const auto unpacked = trainsan::unpack_stats(p);
  const auto direct = trainsan::tensor_stats(ts);
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(bitwise_equal(unpacked[i], direct[i])) << i;
}

TEST_F(TensorStatsGpu, RunTwiceBitwiseEqual) {
  std::vector<at::Tensor> ts;
  for (const auto st : all_dtypes()) ts.push_back(random_tensor(st, 7 * kChunk + 3, 9).cuda());
  const auto first = trainsan::tensor_stats(ts);
  for (int run = 0; run < 3; ++run) {
    const auto again = trainsan::tensor_stats(ts);
    for (size_t i = 0; i < ts.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(first[i], again[i])) << "run " << run << " tensors[" << i << "]";
    }
  }
}

}  // namespace
