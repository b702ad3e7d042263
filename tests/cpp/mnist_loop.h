// The loops of pytorch/examples' LibTorch MNIST, shared by tests/cpp/test_attach.cpp and
// bench/bench_attach.cpp: a map-style dataset with Normalize and Stack, a sequential loader of 64,
// `AT_ASSERT(!std::isnan(loss.item()))` before the backward, and a test pass of large batches
// under torch::NoGradGuard after each epoch.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "trainsan/trainsan.h"

namespace trainsan_testing {

class Digits : public torch::data::datasets::Dataset<Digits> {
 public:
  // Images of side x side pixels (12, or 28 as MNIST's), class 0-2 a bright band.
  Digits(int64_t size, uint64_t seed, int64_t side = 12) {
    torch::manual_seed(seed);
    targets_ = torch::randint(0, 3, {size}, torch::kLong);
    images_ = torch::rand({size, 1, side, side}) * 0.3;
    const int64_t band = side / 3;
    for (int64_t i = 0; i < size; ++i) {
      images_[i].narrow(1, band * targets_[i].item<int64_t>(), band).add_(0.7);
    }
  }
  torch::data::Example<> get(size_t i) override { return {images_[i], targets_[i]}; }
  torch::optional<size_t> size() const override { return targets_.size(0); }

 private:
  torch::Tensor images_, targets_;
};

struct MnistNet : torch::nn::Module {
  MnistNet() : conv1(torch::nn::Conv2dOptions(1, 4, /*kernel_size=*/5)), fc1(64, 16), fc2(16, 3) {
    register_module("conv1", conv1);
    register_module("conv1_drop", conv1_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1_drop->forward(conv1->forward(x)), 2));
    x = x.view({-1, 64});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*training=*/is_training());
    return torch::log_softmax(fc2->forward(x), /*dim=*/1);
  }
  torch::nn::Conv2d conv1;
  torch::nn::Dropout2d conv1_drop;
  torch::nn::Linear fc1, fc2;
};

// pytorch/examples' cpp/mnist Net as it is (28 x 28 inputs, 10 classes);
// examples/cpp/mnist/mnist.cpp writes the same network out again on purpose: it is a one-file
// program for users to copy.
struct ExamplesNet : torch::nn::Module {
  ExamplesNet()
      : conv1(torch::nn::Conv2dOptions(1, 10, 5)), conv2(10, 20, 5), fc1(320, 50), fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*training=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1, fc2;
};

struct Mnist {
  explicit Mnist(int64_t train_size = 6 * 64, int64_t side = 12, int64_t test_size = 2000)
      : train_loader(torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
            Digits(train_size, 7, side)
                .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                .map(torch::data::transforms::Stack<>()),
            64)),
        test_loader(
            torch::data::make_data_loader(Digits(test_size, 8, side)
                                              .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                                              .map(torch::data::transforms::Stack<>()),
                                          1000)) {}

  template <typename Loader>
  void train(MnistNet& model, Loader& loader, torch::optim::Optimizer& optimizer,
             trainsan::Sanitizer& san, bool forget_train = false) {
    if (!forget_train) model.train();
    size_t batch_idx = 0;
    for (auto& batch : loader) {
      auto data = batch.data.to(torch::kCPU), targets = batch.target.to(torch::kCPU);
      optimizer.zero_grad();
      if (static_cast<int64_t>(batch_idx) == nan_batch) data[0][0][0][0] = NAN;  // bad sample
      auto output = model.forward(data);
      auto loss = torch::nll_loss(output, targets);
      AT_ASSERT(!std::isnan(loss.template item<float>()));
      loss.backward();
      optimizer.step();
      san.end_step(loss);
      if (batch_idx++ % 10 == 0) losses.push_back(loss.template item<float>());
    }
  }

  template <typename Net, typename Loader>
  void test(Net& model, Loader& loader) {
    torch::NoGradGuard no_grad;
    model.eval();
    for (const auto& batch : loader) {
      auto output = model.forward(batch.data);
      correct += output.argmax(1).eq(batch.target).sum().template item<int64_t>();
    }
  }

  decltype(torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      Digits(1, 0)
          .map(torch::data::transforms::Normalize<>(0.5, 0.3))
          .map(torch::data::transforms::Stack<>()),
      64)) train_loader;
  decltype(torch::data::make_data_loader(Digits(1, 0)
                                             .map(torch::data::transforms::Normalize<>(0.5, 0.3))
                                             .map(torch::data::transforms::Stack<>()),
                                         1000)) test_loader;
  std::vector<float> losses;
  int64_t correct = 0;
  int64_t nan_batch = -1;  // of each epoch: an input that makes the loss NaN
};

}  // namespace trainsan_testing
