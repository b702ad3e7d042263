// The op audits (broadcast, label_range, batch_mismatch) in a LibTorch training loop: the same
// RecordFunction observer that serves Python programs.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "audit.h"
#include "trainsan/trainsan.h"

namespace {

namespace F = torch::nn::functional;

struct Regressor : torch::nn::Module {
  Regressor() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

constexpr int64_t kBatch = 32;

trainsan::Options record() {
  trainsan::Options o;
  o.policy = "record";
  return o;
}

// One training step per call of `loss_of(prediction [32, 1], target [32])`.
void train(
    Regressor& net, torch::optim::Optimizer& opt, trainsan::Sanitizer& san, int steps,
    const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>& loss_of) {
  for (int i = 0; i < steps; ++i) {
    torch::manual_seed(100 + i);
    const torch::Tensor x = torch::randn({kBatch, 8});
    const torch::Tensor y = torch::randn({kBatch});
    opt.zero_grad();
    san.begin_step({x, y});
    torch::Tensor loss = loss_of(net.forward(x), y);
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
}

std::vector<trainsan::Finding> of_kind(const trainsan::Sanitizer& san, const std::string& kind) {
  std::vector<trainsan::Finding> out;
  for (const auto& f : san.findings()) {
    if (f.kind == kind) out.push_back(f);
  }
  return out;
}

// A finding's name for an op of this program: the op, and where the program has debug
// information the program's own line (this file's), never TrainSan's or an inlined header's.
::testing::AssertionResult op_named(const std::string& name, const std::string& op) {
  if (name == op || (name.rfind(op + " (test_audit.cpp:", 0) == 0 && name.back() == ')')) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "'" << name << "' is not '" << op << "' or '" << op << " (test_audit.cpp:N)'";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST(Audit, HandWrittenLossBroadcastIsFoundAtStepZero) {
  torch::manual_seed(0);
  Regressor net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  trainsan::Sanitizer san(net.named_parameters(), record());
  train(net, opt, san, 3, [](const torch::Tensor& p, const torch::Tensor& y) {
    return (p - y).pow(2).mean();  // [32, 1] - [32] -> [32, 32]
  });
  san.close();
  const auto fs = of_kind(san, "broadcast");
  ASSERT_EQ(fs.size(), 1u);
  const trainsan::Finding& f = fs[0];
  EXPECT_EQ(f.step, 0);
  EXPECT_EQ(f.severity, "error");
  EXPECT_TRUE(op_named(f.tensor, "aten::sub"));
  EXPECT_EQ(f.count, 3);  // every step of the first audit_first_steps is audited
  EXPECT_TRUE(contains(f.message, "[32, 1] and [32] into [32, 32]")) << f.message;
  ASSERT_TRUE(f.value.has_value());
  EXPECT_DOUBLE_EQ(*f.value, 32.0);
  EXPECT_EQ(san.findings().size(), 1u) << san.findings().back().message;
}

TEST(Audit, PolicyRaiseThrowsAtTheStepEnd) {
  torch::manual_seed(0);
  Regressor net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  trainsan::Sanitizer san(net.named_parameters());
  try {
    train(net, opt, san, 2, [](const torch::Tensor& p, const torch::Tensor& y) {
      return F::l1_loss(p, y);  // the functional broadcasts with broadcast_tensors first
    });
    FAIL() << "expected trainsan::TrainingBugError";
  } catch (const trainsan::TrainingBugError& e) {
    EXPECT_EQ(e.finding.kind, "broadcast");
    EXPECT_EQ(e.finding.step, 0);
    EXPECT_TRUE(op_named(e.finding.tensor, "aten::l1_loss"));
    EXPECT_TRUE(contains(e.finding.message, "input [32, 1] and target [32]")) << e.what();
  }
}

TEST(Audit, BatchMismatchOfALossIsFound) {
  torch::manual_seed(0);
  Regressor net;
  torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-3));
  trainsan::Sanitizer san(net.named_parameters(), record());
  train(net, opt, san, 2, [](const torch::Tensor& p, const torch::Tensor& y) {
    return F::mse_loss(p, y.slice(0, 0, 1).unsqueeze(1));  // target [1, 1]: one sample
  });
  san.close();
  const auto fs = of_kind(san, "batch_mismatch");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_TRUE(op_named(fs[0].tensor, "aten::mse_loss"));
  EXPECT_TRUE(contains(fs[0].message, "batch size 32 [32, 1] and target of batch size 1 [1, 1]"))
      << fs[0].message;
  EXPECT_TRUE(of_kind(san, "broadcast").empty());  // [32, 1] vs [1, 1] does not grow
}

TEST(Audit, LabelRangeIsRecordedBeforeTheOpFails) {
  torch::manual_seed(0);
  torch::nn::Linear net(8, 4);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  trainsan::Sanitizer san(net->named_parameters(), record());
  const torch::Tensor x = torch::randn({16, 8});
  const torch::Tensor y = torch::randint(1, 5, {16});  // 1-based labels, 4 classes
  san.begin_step({x, y});
  // On a CPU the op rejects the target itself; the audit has looked at it before.
  EXPECT_THROW(F::cross_entropy(net->forward(x), y), c10::Error);
  san.close();
  const auto fs = of_kind(san, "label_range");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_TRUE(op_named(fs[0].tensor, "aten::cross_entropy_loss"));
  EXPECT_TRUE(contains(fs[0].message, "outside [0, 4)")) << fs[0].message;
  EXPECT_TRUE(contains(fs[0].message, "1-based")) << fs[0].message;
}

TEST(Audit, IntentionalBroadcastsAndNoGradCodeStaySilent) {
  torch::manual_seed(0);
  Regressor net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  trainsan::Sanitizer san(net.named_parameters(), record());
  const torch::Tensor centres = torch::randn({5, 1}, torch::requires_grad());
  train(net, opt, san, 3, [&](const torch::Tensor& p, const torch::Tensor& y) {
    // bias-like add, explicit pairwise term, pairwise against another set, a constant encoding
    const torch::Tensor scaled = p * torch::ones({1}) + torch::zeros({1});
    const torch::Tensor pair = scaled.unsqueeze(1) - scaled.unsqueeze(0);  // [32,1,1]-[1,32,1]
    const torch::Tensor to_centres = scaled.unsqueeze(1) - centres;        // [32,1,1]-[5,1]
    const torch::Tensor enc = torch::arange(8).unsqueeze(1) * torch::rand({4});  // [8,1]*[4]
    {
      const torch::NoGradGuard no_grad;  // a bug under no_grad is validation code: not audited
      (p.detach() - y).abs().mean().item<float>();
    }
    return F::mse_loss(p.squeeze(1), y) + 1e-3 * (pair.mean() + to_centres.mean()) +
           0.0 * enc.sum();
  });
  san.close();
  for (const auto& f : san.findings()) ADD_FAILURE() << f.message;
}

TEST(Audit, SamplingFollowsTheOptions) {
  torch::manual_seed(0);
  Regressor net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  trainsan::Options o = record();
  o.set("audit_first_steps", "2");
  o.set("audit_every", "3");
  trainsan::Sanitizer san(net.named_parameters(), o);
  train(net, opt, san, 8, [](const torch::Tensor& p, const torch::Tensor& y) {
    return (y * p).mean();  // a per-sample weight [32] times a per-sample term [32, 1]
  });
  san.close();
  const auto fs = of_kind(san, "broadcast");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_TRUE(op_named(fs[0].tensor, "aten::mul"));
  EXPECT_EQ(fs[0].count, 4);  // steps 0, 1 (first two), 3 and 6 (every third)
  EXPECT_EQ(fs[0].last_step, 6);

  trainsan::Options off = record();
  off.checks["broadcast"] = false;
  trainsan::Sanitizer quiet(net.named_parameters(), off);
  train(net, opt, quiet, 2,
        [](const torch::Tensor& p, const torch::Tensor& y) { return (y * p).mean(); });
  quiet.close();
  EXPECT_TRUE(quiet.findings().empty());
}

TEST(Audit, ObserverIsOnOnlyWhileAuditingAndRemovedOnClose) {
  torch::manual_seed(0);
  Regressor net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01));
  EXPECT_FALSE(trainsan::audit_observer_registered());
  {
    trainsan::Sanitizer san(net.named_parameters(), record());
    const torch::Tensor x = torch::randn({kBatch, 8});
    const torch::Tensor y = torch::randn({kBatch, 1});
    san.begin_step({x, y});  // a sampled step: the observer is on from here...
    EXPECT_TRUE(trainsan::audit_observer_registered());
    EXPECT_TRUE(at::hasGlobalCallbacks());
    const torch::Tensor loss = F::mse_loss(net.forward(x), y);
    EXPECT_TRUE(at::hasGlobalCallbacks());
    loss.backward();  // ...to the first gradient hook
    EXPECT_FALSE(at::hasGlobalCallbacks());
    opt.step();
    san.end_step();
    EXPECT_FALSE(at::hasGlobalCallbacks());  // registered, but disabled between audits
    EXPECT_TRUE(trainsan::audit_observer_registered());
    san.close();
    EXPECT_FALSE(trainsan::audit_observer_registered());
    EXPECT_TRUE(san.findings().empty());
  }
  // A sanitizer destroyed without close() releases it too.
  {
    trainsan::Sanitizer san(net.named_parameters(), record());
    train(net, opt, san, 1, [](const torch::Tensor& p, const torch::Tensor& y) {
      return F::mse_loss(p.squeeze(1), y);
    });
    EXPECT_TRUE(trainsan::audit_observer_registered());
  }
  EXPECT_FALSE(trainsan::audit_observer_registered());
}
