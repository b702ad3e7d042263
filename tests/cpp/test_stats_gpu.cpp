// The CUDA backend through the C++ API: equal to the CPU backend (counts, min/max/absmax and hash
// exactly, sum and l2 within relative 1e-12) and to the float64 reference, bitwise equal run to
// run; the single-launch pass in every PassMode (Note [Lean rows]) and with update statistics
// against the CPU backend's packed rows, and captured into a CUDA graph; the device-side stop
// (Note [Device stop]), whose stopping path runs in a child process (it ends the CUDA context).
// Skipped where no CUDA device is visible.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "stats.h"
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

// --- The single launch against the CPU backend, packed rows, every mode -----------------------

namespace kn = trainsan::kernels;
using trainsan::PackedStats;

// A list with NaN/±Inf/subnormals (random_tensor), empty tensors, tensors of one and of several
// chunks, a tensor of more chunks than threads in a block (the combining block's threads loop),
// strided views, and more empty tensors than threads in the grid.
std::vector<at::Tensor> mixed_list() {
  std::vector<at::Tensor> ts;
  uint64_t seed = 100;
  for (const auto st : all_dtypes()) {
    for (const int64_t n :
         {int64_t{0}, int64_t{1}, int64_t{17}, kChunk - 1, kChunk + 1, 3 * kChunk + 17}) {
      ts.push_back(random_tensor(st, n, seed++));
    }
    ts.push_back(random_tensor(st, 300 * 517, seed++).reshape({300, 517}).t());
  }
  ts.push_back(random_tensor(at::kBFloat16, 260 * kChunk + 5, seed++));
  for (int i = 0; i < 300; ++i) ts.push_back(at::empty({0}, at::kFloat));
  for (int i = 0; i < 40; ++i) ts.push_back(random_tensor(at::kFloat, (i * 7919) % 3000, seed++));
  return ts;
}

std::vector<char> modes_of(size_t n, int pattern) {
  std::vector<char> m(n);
  for (size_t i = 0; i < n; ++i) {
    m[i] = static_cast<char>(pattern < 4 ? pattern : static_cast<int>(i % 4));
  }
  return m;
}

double finite_abs_sum(const at::Tensor& t) {
  const at::Tensor d = t.detach().cpu().reshape(-1).to(at::kDouble);
  return at::where(d.isfinite(), d.abs(), at::zeros_like(d)).sum().item<double>();
}

bool same_double(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof a) == 0;
}

// Packed rows of the GPU against those of the CPU: every int column exactly; min, max, absmax and
// update_max exactly (NaN where the CPU has NaN); sum, l2 and update_l2 within relative 1e-12.
void expect_packed_equal(const PackedStats& gpu, const PackedStats& cpu,
                         const std::vector<double>& scale, const std::string& what) {
  const at::Tensor gi = gpu.ints.cpu(), gf = gpu.floats.cpu();
  ASSERT_EQ(gi.sizes(), cpu.ints.sizes()) << what;
  ASSERT_EQ(gf.sizes(), cpu.floats.sizes()) << what;
  const int64_t rows = gi.size(0), ni = gi.size(1), nf = gf.size(1);
  const int64_t* a = gi.const_data_ptr<int64_t>();
  const int64_t* b = cpu.ints.const_data_ptr<int64_t>();
  const double* x = gf.const_data_ptr<double>();
  const double* y = cpu.floats.const_data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    const std::string w = what + " row " + std::to_string(r);
    for (int64_t c = 0; c < ni; ++c) {
      EXPECT_EQ(a[r * ni + c], b[r * ni + c]) << w << " " << kn::kIntColNames[c];
    }
    for (int64_t c = 0; c < nf; ++c) {
      const double g = x[r * nf + c], h = y[r * nf + c];
      const bool rounded = c == kn::kColSum || c == kn::kColL2 || c == kn::kColUpdateL2;
      if (rounded && !std::isnan(h)) {
        const double tol = 1e-12 * (c == kn::kColSum ? scale[r] : std::fabs(h));
        EXPECT_LE(std::fabs(g - h), tol)
            << w << " " << kn::kFloatColNames[c] << ": " << g << " vs " << h;
      } else {
        EXPECT_TRUE(same_double(g, h))
            << w << " " << kn::kFloatColNames[c] << ": " << g << " vs " << h;
      }
    }
  }
}

TEST_F(TensorStatsGpu, SingleLaunchEqualsCpuEveryMode) {
  const std::vector<at::Tensor> cpu = mixed_list();
  const std::vector<at::Tensor> gpu = to_cuda(cpu);
  std::vector<double> scale;
  for (const auto& t : cpu) scale.push_back(finite_abs_sum(t));
  // kModeHash: a full row on CUDA, packed as the CPU's hash row (Note [Lean rows]).
  const char* names[] = {"full", "no hash", "lean", "hash only", "mixed modes"};
  for (int pattern = 0; pattern < 5; ++pattern) {
    const std::vector<char> modes = modes_of(cpu.size(), pattern);
    expect_packed_equal(trainsan::host::packed_cuda(gpu, nullptr, &modes),
                        trainsan::host::packed_cpu(cpu, nullptr, &modes), scale, names[pattern]);
  }
}

// Note [Lean rows]: a lean row has the full row's counts, and its l2 and absmax bit for bit (same
// order of accumulation); min, max and sum are NaN and the hash 0.
TEST_F(TensorStatsGpu, LeanRowsAreFullRowsLessTheRest) {
  const std::vector<at::Tensor> gpu = to_cuda(mixed_list());
  const std::vector<char> full = modes_of(gpu.size(), kn::kModeFull);
  const std::vector<char> lean = modes_of(gpu.size(), kn::kModeLean);
  const PackedStats f = trainsan::host::packed_cuda(gpu, nullptr, &full);
  const PackedStats l = trainsan::host::packed_cuda(gpu, nullptr, &lean);
  const at::Tensor fi = f.ints.cpu(), li = l.ints.cpu(), ff = f.floats.cpu(), lf = l.floats.cpu();
  for (int64_t r = 0; r < fi.size(0); ++r) {
    const std::string w = "row " + std::to_string(r);
    for (int c = 0; c < kn::kColHash; ++c) {
      EXPECT_EQ(li[r][c].item<int64_t>(), fi[r][c].item<int64_t>()) << w << " " << c;
    }
    EXPECT_EQ(li[r][kn::kColHash].item<int64_t>(), 0) << w;
    for (const int c : {kn::kColMin, kn::kColMax, kn::kColSum}) {
      EXPECT_TRUE(std::isnan(lf[r][c].item<double>())) << w << " " << kn::kFloatColNames[c];
    }
    for (const int c : {kn::kColAbsmax, kn::kColL2}) {
      EXPECT_TRUE(same_double(lf[r][c].item<double>(), ff[r][c].item<double>()))
          << w << " " << kn::kFloatColNames[c];
    }
  }
}

TEST_F(TensorStatsGpu, SingleLaunchWithUpdateEqualsCpu) {
  const std::vector<at::Tensor> cpu = mixed_list();
  std::vector<at::Tensor> snap_cpu, snap_gpu;
  std::vector<double> scale;
  for (size_t i = 0; i < cpu.size(); ++i) {
    scale.push_back(finite_abs_sum(cpu[i]));
    if (i % 4 == 3 || cpu[i].numel() == 0) {
      snap_cpu.emplace_back();  // no snapshot: update columns 0
      snap_gpu.emplace_back();
      continue;
    }
    const at::Tensor prev = random_tensor(cpu[i].scalar_type(), cpu[i].numel(), 7000 + i);
    snap_cpu.push_back(prev.clone());
    snap_gpu.push_back(prev.cuda());
  }
  const std::vector<char> modes = modes_of(cpu.size(), 4);
  expect_packed_equal(trainsan::host::packed_cuda(to_cuda(cpu), &snap_gpu, &modes),
                      trainsan::host::packed_cpu(cpu, &snap_cpu, &modes), scale, "update");
  // Both backends rewrote the snapshots with the current values.
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (!snap_cpu[i].defined()) continue;
    const at::Tensor g = snap_gpu[i].cpu();
    ASSERT_EQ(std::memcmp(g.const_data_ptr(), snap_cpu[i].const_data_ptr(), g.nbytes()), 0) << i;
  }
}

// Note [Update sample]: the CUDA pass against samples gives the CPU pass's bits, and rewrites
// the samples alike (many chunks, a stride that spans chunks, strided tensors).
TEST_F(TensorStatsGpu, SampledUpdateEqualsCpu) {
  std::vector<at::Tensor> cpu, snap_cpu, snap_gpu;
  std::vector<double> scale;
  uint64_t seed = 900;
  for (const int64_t n : {int64_t{4097}, int64_t{5} * kChunk + 3, int64_t{1} << 22}) {
    for (const at::ScalarType st : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
      const at::Tensor before = random_tensor(st, n, seed++);
      at::Tensor after = at::where(at::arange(n) % 2 == 0, random_tensor(st, n, seed++), before);
      if (n % 2 == 0) after = after.reshape({2, n / 2}).t().contiguous().t();
      cpu.push_back(after);
      scale.push_back(finite_abs_sum(after));
      snap_cpu.push_back(trainsan::host::make_update_snapshot(before, false));
      snap_gpu.push_back(trainsan::host::make_update_snapshot(before.cuda(), false));
      ASSERT_LT(snap_cpu.back().numel(), n);
    }
  }
  const std::vector<char> modes(cpu.size(), static_cast<char>(kn::kModeFull));
  expect_packed_equal(trainsan::host::packed_cuda(to_cuda(cpu), &snap_gpu, &modes),
                      trainsan::host::packed_cpu(cpu, &snap_cpu, &modes), scale, "sampled");
  for (size_t i = 0; i < cpu.size(); ++i) {
    const at::Tensor g = snap_gpu[i].cpu();
    ASSERT_EQ(std::memcmp(g.const_data_ptr(), snap_cpu[i].const_data_ptr(), g.nbytes()), 0) << i;
  }
}

// The ticket counters are reset by every launch: passes of several sizes on one stream (the
// buffer regrows once past its first 1024 counters), then on a stream of the pool, all give the
// bits of the first pass.
TEST_F(TensorStatsGpu, RepeatedLaunchesBitwiseEqual) {
  const std::vector<at::Tensor> small = to_cuda(mixed_list());
  std::vector<at::Tensor> big = small;
  for (int i = 0; i < 1500; ++i) big.push_back(random_tensor(at::kHalf, i % 300, i).cuda());
  const std::vector<char> modes_small = modes_of(small.size(), 4);
  const std::vector<char> modes_big = modes_of(big.size(), 4);
  const auto run = [&](const std::vector<at::Tensor>& ts, const std::vector<char>& m) {
    const PackedStats p = trainsan::host::packed_cuda(ts, nullptr, &m);
    return std::make_pair(p.ints.cpu(), p.floats.cpu());
  };
  const auto bits_equal = [](const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() &&
           std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0;
  };
  const auto first_small = run(small, modes_small);
  const auto first_big = run(big, modes_big);
  for (int k = 0; k < 4; ++k) {
    const auto again = k % 2 == 0 ? run(small, modes_small) : run(big, modes_big);
    const auto& want = k % 2 == 0 ? first_small : first_big;
    EXPECT_TRUE(bits_equal(again.first, want.first)) << "ints, run " << k;
    EXPECT_TRUE(bits_equal(again.second, want.second)) << "floats, run " << k;
  }
  // Back to back without a read in between, then read: still the same bits.
  std::vector<PackedStats> queued;
  for (int k = 0; k < 5; ++k) {
    queued.push_back(trainsan::host::packed_cuda(small, nullptr, &modes_small));
  }
  for (const auto& p : queued) {
    EXPECT_TRUE(bits_equal(p.ints.cpu(), first_small.first));
    EXPECT_TRUE(bits_equal(p.floats.cpu(), first_small.second));
  }
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    for (int k = 0; k < 2; ++k) {
      const auto again = run(small, modes_small);
      EXPECT_TRUE(bits_equal(again.first, first_small.first)) << "side stream, run " << k;
      EXPECT_TRUE(bits_equal(again.second, first_small.second)) << "side stream, run " << k;
    }
  }
  // Only empty tensors (no chunk at all): one launch still writes their rows.
  const std::vector<at::Tensor> empties(700, at::empty({0}, at::device(at::kCUDA)));
  const auto e = trainsan::tensor_stats(empties);
  for (const auto& s : e) EXPECT_EQ(s.numel, 0);
}

// The pass captured into a CUDA graph (the ticket counters are then a buffer of the graph,
// zeroed by a memset node, host/stats_cuda.cpp): every replay recomputes the rows, with the bits
// of an uncaptured pass over the same values.
TEST_F(TensorStatsGpu, CapturedInCudaGraph) {
  std::vector<at::Tensor> ts = to_cuda(mixed_list());
  const std::vector<char> modes = modes_of(ts.size(), 4);
  const auto uncaptured = [&] {
    const PackedStats p = trainsan::host::packed_cuda(ts, nullptr, &modes);
    return std::make_pair(p.ints.cpu(), p.floats.cpu());
  };
  const auto bits_equal = [](const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() &&
           std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0;
  };
  const auto want = uncaptured();  // also the warm-up before capture
  torch::cuda::synchronize();
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  at::cuda::CUDAGraph graph;
  PackedStats captured;
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    graph.capture_begin();
    captured = trainsan::host::packed_cuda(ts, nullptr, &modes);
    graph.capture_end();
  }
  for (int k = 0; k < 3; ++k) {
    graph.replay();
    torch::cuda::synchronize();
    EXPECT_TRUE(bits_equal(captured.ints.cpu(), want.first)) << "replay " << k;
    EXPECT_TRUE(bits_equal(captured.floats.cpu(), want.second)) << "replay " << k;
  }
  // New values in place: the replay sees them.
  ts[3].copy_(random_tensor(ts[3].scalar_type(), ts[3].numel(), 999).reshape(ts[3].sizes()));
  ts[5].fill_(1);
  const auto changed = uncaptured();
  graph.replay();
  torch::cuda::synchronize();
  EXPECT_TRUE(bits_equal(captured.ints.cpu(), changed.first));
  EXPECT_TRUE(bits_equal(captured.floats.cpu(), changed.second));
  EXPECT_FALSE(bits_equal(changed.first, want.first));
}

// --- Device stop ------------------------------------------------------------------------------

TEST_F(TensorStatsGpu, StopIfNonfiniteIgnoresFiniteRows) {
  at::Tensor p = random_tensor(at::kFloat, 5000, 1);
  p = at::where(p.isfinite(), p, at::zeros_like(p));
  const std::vector<at::Tensor> ts = {p.cuda(), at::ones({3, kChunk + 1}, at::device(at::kCUDA)),
                                      at::empty({0}, at::device(at::kCUDA))};
  const PackedStats packed = trainsan::tensor_stats_packed(ts);
  trainsan::host::stop_if_nonfinite(packed);
  trainsan::host::stop_if_nonfinite({packed.ints.narrow(0, 1, 2), packed.floats.narrow(0, 1, 2)});
  std::vector<at::Tensor> snaps = {at::zeros({5000}, at::device(at::kCUDA)), at::Tensor(),
                                   at::Tensor()};
  const PackedStats update = trainsan::host::packed_cuda(ts, &snaps);  // kIntFieldsUpdate rows
  trainsan::host::stop_if_nonfinite(update);
  // CPU rows, even non-finite ones: a no-op.
  trainsan::host::stop_if_nonfinite(
      trainsan::tensor_stats_packed({at::full({4}, std::nan(""), at::kFloat)}));
  torch::cuda::synchronize();  // throws if the context was stopped
  EXPECT_EQ(trainsan::tensor_stats({ts[1]})[0].numel, 3 * (kChunk + 1));
}

constexpr const char* kStopChildEnv = "TRAINSAN_DEVICE_STOP_CHILD";

// Run by DeviceStopStopsTheContext in a child process (skipped otherwise): a good step, then a
// step whose gradient has a NaN and a +Inf; the stop must end the context before the "optimizer
// step" after it runs. Exit status 42: the synchronisation after the stop raised, as it must.
TEST_F(TensorStatsGpu, DeviceStopChild) {
  if (std::getenv(kStopChildEnv) == nullptr) {
    GTEST_SKIP() << "run in a child process by DeviceStopStopsTheContext";
  }
  const auto cuda = at::device(at::kCUDA);
  at::Tensor param = at::zeros({1000}, cuda);
  const at::Tensor good = at::ones({1000}, cuda);
  trainsan::host::stop_if_nonfinite(trainsan::tensor_stats_packed({good}));
  param.add_(good);
  torch::cuda::synchronize();
  std::fprintf(stderr, "child: good step applied, param sum %g\n", param.sum().item<double>());
  at::Tensor bad = at::ones({1000});
  bad[3].fill_(NAN);
  bad[7].fill_(INFINITY);
  bad = bad.cuda();
  try {  // a launch after the trap may raise already
    trainsan::host::stop_if_nonfinite(trainsan::tensor_stats_packed({good, bad}));
    param.add_(bad);  // the optimizer step: must never run
    torch::cuda::synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: the stop raised: %s\n", e.what());
    std::fflush(nullptr);
    std::_Exit(42);
  }
  std::fprintf(stderr, "child: no error after the stop; param sum %g\n",
               param.sum().item<double>());
  std::fflush(nullptr);
  std::_Exit(43);
}

TEST_F(TensorStatsGpu, DeviceStopStopsTheContext) {
  if (std::getenv(kStopChildEnv) != nullptr) GTEST_SKIP() << "in the child";
  char exe[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  ASSERT_GT(len, 0);
  char log_path[] = "/tmp/trainsan_device_stop_XXXXXX";
  const int fd = mkstemp(log_path);
  ASSERT_GE(fd, 0);
  close(fd);
  const std::string cmd = std::string(kStopChildEnv) + "=1 '" + exe +
                          "' --gtest_filter=TensorStatsGpu.DeviceStopChild > '" + log_path +
                          "' 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(log_path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string log = ss.str();
  std::remove(log_path);
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status << "\n" << log;
  EXPECT_EQ(WEXITSTATUS(status), 42) << log;
  EXPECT_NE(log.find("child: good step applied, param sum 1000"), std::string::npos) << log;
  EXPECT_NE(log.find("trainsan: device_stop: 2 non-finite gradient elements (1 NaN, 1 +Inf, "
                     "0 -Inf); the optimizer step was not applied"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("no error after the stop"), std::string::npos) << log;
}

}  // namespace
