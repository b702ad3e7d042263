// A LibTorch training loop through the C++ API of the sanitizer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <string>

#include "trainsan/trainsan.h"

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Batch {
  torch::Tensor x, y;
};

Batch batch(int i) {
  torch::manual_seed(100 + i);
  return {torch::randn({32, 8}), torch::randint(0, 3, {32})};
}

trainsan::Options record() {
  trainsan::Options o;
  o.policy = "record";
  return o;
}

// Runs `steps` steps; `zero` false forgets zero_grad, `nan_at` plants a NaN loss at that step.
void train(Net& net, torch::optim::Optimizer& opt, trainsan::Sanitizer& san, int steps,
           bool zero = true, int nan_at = -1) {
  for (int i = 0; i < steps; ++i) {
    const Batch b = batch(i);
    if (zero) opt.zero_grad();
    san.begin_step({b.x, b.y});
    auto loss = torch::nn::functional::cross_entropy(net.forward(b.x), b.y);
    if (i == nan_at) loss = loss * std::numeric_limits<float>::quiet_NaN();
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
}

}  // namespace

TEST(Sanitizer, CleanLibTorchLoopHasNoFindings) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::string path = ::testing::TempDir() + "trainsan_cpp_trace.jsonl";
  trainsan::Options o;
  o.trace = path;
  trainsan::Sanitizer san(net.named_parameters(), o);
  train(net, opt, san, 6);
  san.close();
  EXPECT_TRUE(san.findings().empty());
  EXPECT_EQ(san.step(), 6);
  const auto st = san.last_stats();
  ASSERT_TRUE(st.count("fc1.weight.grad"));
  EXPECT_EQ(st.at("fc1.weight").numel, 128);
  EXPECT_GT(st.at("fc1.weight.update").l2, 0.0);
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  std::string first, last;
  while (std::getline(in, line)) {
    if (lines == 0) first = line;
    last = line;
    ++lines;
  }
  EXPECT_EQ(lines, 1 + 6 + 1);  // header, one record per step, summary
  EXPECT_NE(first.find("\"type\":\"header\""), std::string::npos);
  EXPECT_NE(last.find("\"type\":\"summary\""), std::string::npos);
}

TEST(Sanitizer, MissingZeroGradRaisesAtStepOne) {
  torch::manual_seed(0);
  Net net;
  torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-2));
  trainsan::Sanitizer san(net.named_parameters());  // policy "raise"
  try {
    train(net, opt, san, 4, /*zero=*/false);
    FAIL() << "expected trainsan::TrainingBugError";
  } catch (const trainsan::TrainingBugError& e) {
    EXPECT_EQ(e.finding.kind, "stale_grad");
    EXPECT_EQ(e.finding.step, 1);
    EXPECT_EQ(e.finding.severity, "error");
    EXPECT_NE(std::string(e.what()).find("zero_grad"), std::string::npos);
  }
}

TEST(Sanitizer, NanLossAndGradientsAreFoundAtTheirStep) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  trainsan::Sanitizer san(net.named_parameters(), record());
  train(net, opt, san, 5, true, /*nan_at=*/2);
  san.close();
  std::set<std::string> kinds;
  for (const auto& f : san.findings()) {
    kinds.insert(f.kind);
    EXPECT_EQ(f.step, 2) << f.message;
  }
  EXPECT_TRUE(kinds.count("nonfinite_loss"));
  EXPECT_TRUE(kinds.count("nonfinite_grad"));
  EXPECT_TRUE(kinds.count("nonfinite_param"));
}

TEST(Sanitizer, HooksAreRemovedOnClose) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  auto san = std::make_unique<trainsan::Sanitizer>(net.named_parameters(), record());
  EXPECT_TRUE(san->hooks_installed());
  san->close();
  EXPECT_FALSE(san->hooks_installed());
  train(net, opt, *san, 3, /*zero=*/false);  // unseen after close; nothing crashes
  EXPECT_TRUE(san->findings().empty());
  san.reset();
  // Training continues normally once the sanitizer is gone.
  const Batch b = batch(0);
  opt.zero_grad();
  torch::nn::functional::cross_entropy(net.forward(b.x), b.y).backward();
  opt.step();
}

TEST(Sanitizer, BadInputIsAClearError) {
  EXPECT_THROW(trainsan::Sanitizer(trainsan::Sanitizer::NamedTensors{}), c10::ValueError);
  trainsan::Options o;
  EXPECT_THROW(o.set("policy", "explode"), c10::ValueError);
  EXPECT_THROW(o.set("no_such_option", "1"), c10::ValueError);
  EXPECT_THROW(o.set("grad_explosion_factor", "big"), c10::ValueError);
  o.set("grad_explosion_factor", "20");
  EXPECT_EQ(o.grad_explosion_factor, 20.0);
}
