// The one-line C++ attach (trainsan::attach, Note [C++ attach]) against the long form
// (trainsan::Sanitizer with begin_step / watch_loss / end_step) and no sanitizer, on the loops of
// pytorch/examples' LibTorch MNIST (tests/cpp/mnist_loop.h): two epochs of 30 batches of 64 with a
// test pass of large batches after each, on one intra-op thread. Read the ratios of one run against
// BM_Mnist/plain; the counter own_ms is the sanitizer's overhead_seconds() per run (what it counts
// of its own time). bench/README.md, bench/RESULTS.md.
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <memory>

#include "mnist_loop.h"
#include "trainsan/trainsan.h"

namespace {

using trainsan_testing::Mnist;
using trainsan_testing::MnistNet;

enum Form : int64_t { kPlain = 0, kLongForm = 1, kAttach = 2 };

void BM_Mnist(benchmark::State& state) {
  const auto form = static_cast<Form>(state.range(0));
  torch::set_num_threads(1);
  Mnist mnist(30 * 64);
  double own = 0;
  for (auto _ : state) {
    state.PauseTiming();
    torch::manual_seed(0);
    MnistNet net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
    trainsan::Options o;
    o.policy = "record";
    std::unique_ptr<trainsan::Sanitizer> san;
    if (form == kLongForm) san = std::make_unique<trainsan::Sanitizer>(net.named_parameters(), o);
    if (form == kAttach) san = std::make_unique<trainsan::Sanitizer>(trainsan::attach(net, opt, o));
    state.ResumeTiming();
    for (int epoch = 0; epoch < 2; ++epoch) {
      net.train();
      for (auto& batch : *mnist.train_loader) {
        opt.zero_grad();
        if (form == kLongForm) san->begin_step({batch.data});
        auto loss = torch::nll_loss(net.forward(batch.data), batch.target);
        if (form == kLongForm) san->watch_loss(loss);
        loss.backward();
        opt.step();
        if (form == kLongForm) san->end_step();
        if (form == kAttach) san->end_step(loss);
      }
      mnist.test(net, *mnist.test_loader);
    }
    state.PauseTiming();
    if (san) own += san->overhead_seconds();
    san.reset();
    state.ResumeTiming();
  }
  state.counters["own_ms"] =
      benchmark::Counter(own * 1e3 / static_cast<double>(state.iterations()));
  state.SetLabel(form == kPlain ? "plain" : form == kLongForm ? "long form" : "one-line attach");
}
BENCHMARK(BM_Mnist)->Arg(kPlain)->Arg(kLongForm)->Arg(kAttach)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
