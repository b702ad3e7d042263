// Fits a random cubic polynomial with a linear model over the features x, x^2, x^3, x^4, as the
// public LibTorch regression example does, on batches of 32 until the loss is below 1e-3. The
// three lines marked "trainsan" are all TrainSan needs; `regression --bug NAME` plants a bug.
#include <torch/torch.h>
#include <trainsan/trainsan.h>  // trainsan

#include <cstdio>
#include <string>

constexpr int64_t kDegree = 4;

// Builds features x, x^2, ..., x^kDegree for a column vector x.
torch::Tensor make_features(torch::Tensor x) {
  x = x.unsqueeze(1);
  std::vector<torch::Tensor> xs;
  for (int64_t i = 0; i < kDegree; ++i) xs.push_back(x.pow(i + 1));
  return torch::cat(xs, 1);
}

int main(int argc, char** argv) {
  std::string bug = argc > 2 && std::string(argv[1]) == "--bug" ? argv[2] : "";
  torch::manual_seed(0);
  auto W_target = torch::randn({kDegree, 1}) * 5;
  auto b_target = torch::randn({1}) * 5;
  auto f = [&](torch::Tensor x) { return x.mm(W_target) + b_target.item(); };

  auto fc = torch::nn::Linear(W_target.size(0), 1);
  torch::optim::SGD optim(fc->parameters(), 0.1);
  auto san = trainsan::attach(fc, optim);  // trainsan

  float loss = 0;
  int64_t batch_idx = 0;
  for (batch_idx = 1; batch_idx <= 2000; ++batch_idx) {
    auto x = make_features(torch::randn({32}));
    auto y = f(x);
    if (bug == "broadcast") y = y.squeeze(1);  // [32] targets against [32, 1] predictions
    optim.zero_grad();
    auto output = torch::smooth_l1_loss(fc(x), y);
    loss = output.item<float>();
    output.backward();
    if (bug != "skipped_step") optim.step();
    san.end_step(output);  // trainsan
    if (loss < 1e-3f) break;
  }
  std::printf("Loss: %.6f after %ld batches\n", loss, static_cast<long>(batch_idx));
}
