// The one-line C++ attach (trainsan::attach, Note [C++ attach]) against the long form
// (trainsan::Sanitizer with begin_step / watch_loss / end_step) and no sanitizer, on the loops of
// pytorch/examples' LibTorch MNIST (tests/cpp/mnist_loop.h): two epochs of 30 batches of 64 with a
// test pass of large batches after each, on one intra-op thread; on the tests' small images and
// model, and on the example's own sizes. Read the ratios of one run against
// BM_Mnist/plain; the counter own_ms is the sanitizer's overhead_seconds() per run (what it counts
// of its own time). Two probes bound what any op-callback watch can cost: the plain loop with an
// empty thread-local RecordFunction callback on all the time, without and with the op's inputs
// (the dispatcher's per-op price, whatever the callback does). bench/README.md, bench/RESULTS.md.
#include <ATen/record_function.h>
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <memory>

#include "mnist_loop.h"
#include "trainsan/trainsan.h"

namespace {

using trainsan_testing::ExamplesNet;
using trainsan_testing::Mnist;
using trainsan_testing::MnistNet;

enum Form : int64_t {
  kPlain = 0,
  kLongForm = 1,
  kAttach = 2,
  kEmptyCallback = 3,        // the plain loop under an empty op callback
  kEmptyCallbackInputs = 4,  // the same, asking for the ops' inputs
};

std::unique_ptr<at::ObserverContext> empty_callback(const at::RecordFunction& fn) {
  benchmark::DoNotOptimize(fn.inputs().size());
  return nullptr;
}

// Two epochs of 30 batches of 64 and a test pass after each, in form `form`, over `mnist`.
template <typename Net>
void run_mnist(benchmark::State& state, Mnist& mnist) {
  const auto form = static_cast<Form>(state.range(0));
  torch::set_num_threads(1);
  double own = 0;
  for (auto _ : state) {
    state.PauseTiming();
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
    trainsan::Options o;
    o.policy = "record";
    std::unique_ptr<trainsan::Sanitizer> san;
    if (form == kLongForm) san = std::make_unique<trainsan::Sanitizer>(net.named_parameters(), o);
    if (form == kAttach) san = std::make_unique<trainsan::Sanitizer>(trainsan::attach(net, opt, o));
    at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
    if (form == kEmptyCallback || form == kEmptyCallbackInputs) {
      handle = at::addThreadLocalCallback(
          at::RecordFunctionCallback(&empty_callback)
              .needsInputs(form == kEmptyCallbackInputs)
              .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
    }
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
    if (handle != at::INVALID_CALLBACK_HANDLE) at::removeCallback(handle);
    if (san) own += san->overhead_seconds();
    san.reset();
    state.ResumeTiming();
  }
  state.counters["own_ms"] =
      benchmark::Counter(own * 1e3 / static_cast<double>(state.iterations()));
  const char* labels[] = {"plain", "long form", "one-line attach", "empty op callback",
                          "empty op callback with inputs"};
  state.SetLabel(labels[form]);
}

// The small loop of the tests (12 x 12 images, a 4-channel convolution): per-op prices loom large.
void BM_Mnist(benchmark::State& state) {
  Mnist mnist(30 * 64);
  run_mnist<MnistNet>(state, mnist);
}
BENCHMARK(BM_Mnist)->DenseRange(kPlain, kEmptyCallbackInputs)->Unit(benchmark::kMillisecond);

// pytorch/examples' MNIST as it is (28 x 28 images, its Net), its test set a sixth of its training
// set as MNIST's (10000 against 60000): what the issue measured.
void BM_MnistExamples(benchmark::State& state) {
  Mnist mnist(30 * 64, /*side=*/28, /*test_size=*/320);
  run_mnist<ExamplesNet>(state, mnist);
}
BENCHMARK(BM_MnistExamples)
    ->DenseRange(kPlain, kEmptyCallbackInputs)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
