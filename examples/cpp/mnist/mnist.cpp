// An MNIST-style convolutional classifier trained as the public LibTorch examples train it, on
// generated 28x28 digits (no download). The three lines marked "trainsan" are all TrainSan needs.
// `mnist --bug NAME` plants one of the bugs below; TRAINSAN_OPTIONS=policy=record,trace=run.jsonl
// records the findings instead of stopping at the first error.
#include <torch/torch.h>
#include <trainsan/trainsan.h>  // trainsan

#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
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
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

// Digits drawn as a bright 7x7 block whose position encodes the class, plus noise.
class Digits : public torch::data::datasets::Dataset<Digits> {
 public:
  explicit Digits(int64_t size, uint64_t seed) {
    torch::manual_seed(seed);
    targets_ = torch::randint(0, 10, {size}, torch::kLong);
    images_ = torch::rand({size, 1, 28, 28}) * 0.3;
    for (int64_t i = 0; i < size; ++i) {
      const int64_t c = targets_[i].item<int64_t>();
      const int64_t r = 2 + (c / 5) * 12, col = 2 + (c % 5) * 5;
      images_[i].narrow(1, r, 7).narrow(2, col, 5).add_(0.7);
    }
  }
  torch::data::Example<> get(size_t i) override { return {images_[i], targets_[i]}; }
  torch::optional<size_t> size() const override { return targets_.size(0); }

 private:
  torch::Tensor images_, targets_;
};

int main(int argc, char** argv) {
  std::string bug = argc > 2 && std::string(argv[1]) == "--bug" ? argv[2] : "";
  torch::manual_seed(1);
  Net model;
  auto train_loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      Digits(640, 7).map(torch::data::transforms::Stack<>()), /*batch_size=*/64);
  auto test_loader = torch::data::make_data_loader(
      Digits(128, 8).map(torch::data::transforms::Stack<>()), /*batch_size=*/128);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  auto san = trainsan::attach(model, optimizer);  // trainsan

  for (int epoch = 1; epoch <= 2; ++epoch) {
    if (bug != "eval_mode") model.train();  // bug: model.train() forgotten after the test pass
    size_t batch_idx = 0;
    for (auto& batch : *train_loader) {
      auto data = batch.data, targets = batch.target;
      if (bug == "label_range") targets = targets + 1;  // labels 1..10 for 10 classes
      if (bug == "nan_loss" && epoch == 2 && batch_idx == 3) data[0][0][0][0] = NAN;  // bad pixel
      if (bug != "stale_grad") optimizer.zero_grad();
      auto output = model.forward(data);
      auto loss = torch::nll_loss(output, targets);
      AT_ASSERT(!std::isnan(loss.item<float>()));  // aborts the program on a NaN loss
      loss.backward();
      optimizer.step();
      san.end_step(loss);  // trainsan
      if (batch_idx++ % 5 == 0) {
        std::printf("\rTrain Epoch: %d [%5zu] Loss: %.4f", epoch, batch_idx * 64,
                    loss.item<float>());
      }
    }
    model.eval();
    torch::NoGradGuard no_grad;
    double test_loss = 0;
    int64_t correct = 0;
    for (const auto& batch : *test_loader) {
      auto output = model.forward(batch.data);
      test_loss += torch::nll_loss(output, batch.target, {}, torch::Reduction::Sum).item<double>();
      correct += output.argmax(1).eq(batch.target).sum().item<int64_t>();
    }
    std::printf("\nTest set: Average loss: %.4f | Accuracy: %.3f\n", test_loss / 128,
                static_cast<double>(correct) / 128);
  }
}
