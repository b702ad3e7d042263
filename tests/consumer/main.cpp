// A small LibTorch training loop under trainsan::Sanitizer, built against the installed package
// (tests/consumer/CMakeLists.txt). A clean run has no error finding; the same loop without
// zero_grad has stale_grad; a torch::save of the model with a NaN weight is a bad_checkpoint
// (trainsan::check_checkpoint). Exit status 0 when all hold.
#include <torch/torch.h>
#include <trainsan/trainsan.h>
#include <trainsan/version.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Trains a fresh model for a few steps; `zero_grad` false plants the bug. Returns the findings.
std::vector<trainsan::Finding> train(bool zero_grad) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  trainsan::Options opts;
  opts.policy = "record";  // collect the findings instead of throwing TrainingBugError
  trainsan::Sanitizer san(net.named_parameters(), opts);
  for (int step = 0; step < 4; ++step) {
    auto x = torch::randn({32, 8});
    auto y = torch::randint(0, 3, {32});
    if (zero_grad) opt.zero_grad();
    san.begin_step({x});
    auto loss = torch::nn::functional::cross_entropy(net.forward(x), y);
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
  san.close();
  return san.findings();
}

// A model saved with a NaN weight, checked against itself: one bad_checkpoint finding.
bool nan_checkpoint_found() {
  auto net = std::make_shared<Net>();
  {
    torch::NoGradGuard no_grad;
    net->fc1->weight[0][0] = NAN;
  }
  char path[] = "/tmp/trainsan_consumer_XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) return false;
  ::close(fd);
  torch::save(net, path);
  const auto out = trainsan::check_checkpoint(std::string(path), net.get());
  std::remove(path);
  return out.size() == 1 && out[0].kind == "bad_checkpoint";
}

}  // namespace

int main() {
  std::cout << "trainsan " << TRAINSAN_VERSION << ", torch " << TORCH_VERSION << "\n";
  for (const auto& f : train(/*zero_grad=*/true)) {
    if (f.severity == "error") {
      std::cerr << "FAIL: clean loop: " << f.kind << ": " << f.message << "\n";
      return 1;
    }
  }
  if (!nan_checkpoint_found()) {
    std::cerr << "FAIL: no bad_checkpoint for a save with a NaN weight\n";
    return 1;
  }
  for (const auto& f : train(/*zero_grad=*/false)) {
    if (f.kind == "stale_grad") {
      std::cout << "found " << f.kind << " at step " << f.step << " (" << f.tensor
                << "), and the NaN checkpoint\n";
      return 0;
    }
  }
  std::cerr << "FAIL: no stale_grad for a loop without zero_grad\n";
  return 1;
}
