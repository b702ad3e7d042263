// The op audits (broadcast, label_range, batch_mismatch, probs_as_logits) in a LibTorch training
// loop: the same RecordFunction observer that serves Python programs.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

// ---------------------------------------------------------------------------------------------
// probs_as_logits (Note [Probabilities as logits]): probabilities into a loss that applies
// softmax or sigmoid itself.

namespace {

constexpr int64_t kClasses = 5;

// `steps` training steps of a Linear(8, 5) classifier, the loss made by `loss_of(logits [32, 5],
// labels [32], step)`; returns the sanitizer's findings of probs_as_logits.
using ClassLoss = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, int)>;
std::vector<trainsan::Finding> probs_findings(int steps, const ClassLoss& loss_of,
                                              trainsan::Options o = record()) {
  torch::manual_seed(0);
  torch::nn::Linear net(8, kClasses);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  trainsan::Sanitizer san(net->named_parameters(), std::move(o));
  for (int i = 0; i < steps; ++i) {
    torch::manual_seed(300 + i);
    const torch::Tensor x = torch::randn({kBatch, 8});
    const torch::Tensor y = torch::randint(0, kClasses, {kBatch});
    opt.zero_grad();
    san.begin_step({x, y});
    torch::Tensor loss = loss_of(net->forward(x), y, i);
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
  san.close();
  return of_kind(san, "probs_as_logits");
}

std::string messages(const std::vector<trainsan::Finding>& fs) {
  std::string s;
  for (const auto& f : fs) s += "\n  " + f.message;
  return s;
}

}  // namespace

TEST(ProbsAsLogits, SoftmaxIntoCrossEntropyIsFoundAtStepZero) {
  const auto fs = probs_findings(3, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    return F::cross_entropy(torch::softmax(z, 1), y);
  });
  ASSERT_EQ(fs.size(), 1u) << messages(fs);
  const trainsan::Finding& f = fs[0];
  EXPECT_EQ(f.step, 0);
  EXPECT_EQ(f.count, 3);  // each audited step
  EXPECT_EQ(f.severity, "error");
  EXPECT_TRUE(op_named(f.tensor, "aten::cross_entropy_loss"));
  EXPECT_TRUE(contains(f.message, "the input [32, 5] of aten::cross_entropy_loss")) << f.message;
  EXPECT_TRUE(contains(f.message, "holds probabilities, not logits")) << f.message;
  EXPECT_TRUE(contains(f.message, "each of its 32 rows sums to 1 over the 5 classes of dim 1"))
      << f.message;
  EXPECT_TRUE(contains(f.message, "pass the logits, not softmax(logits)")) << f.message;
  ASSERT_TRUE(f.value.has_value());
  EXPECT_LE(*f.value, 1e-6);  // a float32 softmax's rows
}

TEST(ProbsAsLogits, SoftmaxIntoNllLossIsFound) {
  const auto fs = probs_findings(1, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    return F::nll_loss(torch::softmax(z, 1), y);  // the log forgotten
  });
  ASSERT_EQ(fs.size(), 1u) << messages(fs);
  EXPECT_TRUE(op_named(fs[0].tensor, "aten::nll_loss_nd") ||
              op_named(fs[0].tensor, "aten::nll_loss"))
      << fs[0].tensor;
  EXPECT_TRUE(contains(fs[0].message, "holds probabilities, not log-probabilities"))
      << fs[0].message;
  EXPECT_TRUE(contains(fs[0].message, "use log_softmax / nn.LogSoftmax before nll_loss"))
      << fs[0].message;
}

TEST(ProbsAsLogits, EachInputFormOfTheClassLosses) {
  // One sample's [C] input.
  auto fs = probs_findings(1, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    return F::cross_entropy(torch::softmax(z[0], 0), y[0]);
  });
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_TRUE(contains(fs[0].message, "each of its 1 row sums to 1 over the 5 classes of dim 0"))
      << fs[0].message;
  // [N, C, d]: 4 samples of 8 positions, softmax over the classes (dim 1).
  fs = probs_findings(1, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    const torch::Tensor ncd = z.reshape({4, 8, kClasses}).permute({0, 2, 1});
    return F::nll_loss(torch::softmax(ncd, 1), y.reshape({4, 8}));
  });
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_TRUE(contains(fs[0].message, "the input [4, 5, 8]")) << fs[0].message;
  EXPECT_TRUE(contains(fs[0].message, "each of its 32 rows")) << fs[0].message;
  // The same probabilities normalised over the wrong dim: its class rows do not sum to 1.
  fs = probs_findings(1, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    const torch::Tensor ncd = z.reshape({4, 8, kClasses}).permute({0, 2, 1});
    return F::nll_loss(torch::softmax(ncd, 2), y.reshape({4, 8}));
  });
  EXPECT_TRUE(fs.empty()) << messages(fs);
  // Half precision: rows off by up to 2.7e-4, within 4 * 2^-10.
  fs = probs_findings(1, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    return F::nll_loss(torch::softmax(z.to(torch::kHalf), 1), y);
  });
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_TRUE(contains(fs[0].message, "[32, 5]")) << fs[0].message;
}

TEST(ProbsAsLogits, NonFiniteAndEmptyInputsAreSilent) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const double bad : {nan, inf}) {
    const auto fs = probs_findings(1, [bad](const torch::Tensor& z, const torch::Tensor& y, int) {
      const torch::Tensor row = torch::zeros({kBatch, 1}).index_put_({3}, 1.0);  // row 3 only
      const torch::Tensor p =
          torch::where(row.to(torch::kBool), torch::full({}, bad), torch::softmax(z, 1));
      return F::cross_entropy(p, y);
    });
    EXPECT_TRUE(fs.empty()) << messages(fs);
  }
  const auto fs = probs_findings(1, [](const torch::Tensor& z, const torch::Tensor& y, int) {
    return F::cross_entropy(torch::softmax(z, 1).slice(0, 0, 0), y.slice(0, 0, 0)) +
           0.0 * z.sum();  // an empty batch: a NaN loss, but no evidence
  });
  EXPECT_TRUE(fs.empty()) << messages(fs);
}

TEST(ProbsAsLogits, TheTwinsOfTheClassLossesAreSilent) {
  const std::vector<std::pair<std::string, ClassLoss>> twins = {
      {"logits",
       [](const torch::Tensor& z, const torch::Tensor& y, int) { return F::cross_entropy(z, y); }},
      {"logits near 0 (an untrained model)", [](const torch::Tensor& z, const torch::Tensor& y,
                                                int) { return F::cross_entropy(1e-4 * z, y); }},
      {"log_softmax into cross_entropy",
       [](const torch::Tensor& z, const torch::Tensor& y, int) {
         return F::cross_entropy(torch::log_softmax(z, 1), y);
       }},
      {"log_softmax into nll_loss", [](const torch::Tensor& z, const torch::Tensor& y,
                                       int) { return F::nll_loss(torch::log_softmax(z, 1), y); }},
      {"label smoothing",
       [](const torch::Tensor& z, const torch::Tensor& y, int) {
         return F::cross_entropy(z, y, F::CrossEntropyFuncOptions().label_smoothing(0.1));
       }},
      {"soft targets",
       [](const torch::Tensor& z, const torch::Tensor&, int) {
         return F::cross_entropy(z, torch::softmax(torch::randn_like(z), 1));
       }},
      {"class weights",
       [](const torch::Tensor& z, const torch::Tensor& y, int) {
         return F::cross_entropy(
             z, y, F::CrossEntropyFuncOptions().weight(torch::linspace(0.5, 2.0, kClasses)));
       }},
      {"ignore_index rows",
       [](const torch::Tensor& z, const torch::Tensor& y, int) {
         const torch::Tensor t = y.clone().index_put_({torch::indexing::Slice(0, 8)}, -100);
         return F::cross_entropy(z, t);
       }},
      {"a ReLU head", [](const torch::Tensor& z, const torch::Tensor& y,
                         int) { return F::cross_entropy(torch::relu(z), y); }},
      {"a zero head", [](const torch::Tensor& z, const torch::Tensor& y,
                         int) { return F::cross_entropy(0.0 * z, y); }},
      {"softmax under no_grad, then the logits",
       [](const torch::Tensor& z, const torch::Tensor& y, int) {
         {
           const torch::NoGradGuard no_grad;  // an accuracy metric: not audited
           F::cross_entropy(torch::softmax(z, 1), y).item<float>();
         }
         return F::cross_entropy(z, y);
       }},
  };
  for (const auto& [what, loss_of] : twins) {
    const auto fs = probs_findings(3, loss_of);
    EXPECT_TRUE(fs.empty()) << what << messages(fs);
  }
}

namespace {

// `steps` steps of a Linear(8, 2) binary head, 32 x 2 = 64 outputs; `head` makes the BCE's input.
std::vector<trainsan::Finding> binary_findings(
    int steps, const std::function<torch::Tensor(const torch::Tensor&, int)>& head,
    bool with_logits = true, trainsan::Options o = record(), int64_t batch = kBatch) {
  torch::manual_seed(0);
  torch::nn::Linear net(8, 2);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  trainsan::Sanitizer san(net->named_parameters(), std::move(o));
  for (int i = 0; i < steps; ++i) {
    torch::manual_seed(500 + i);
    const torch::Tensor x = torch::randn({batch, 8});
    const torch::Tensor y = torch::randint(0, 2, {batch, 2}).to(torch::kFloat);
    opt.zero_grad();
    san.begin_step({x, y});
    const torch::Tensor in = head(net->forward(x), i);
    torch::Tensor loss =
        with_logits ? F::binary_cross_entropy_with_logits(in, y) : F::binary_cross_entropy(in, y);
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
  san.close();
  return of_kind(san, "probs_as_logits");
}

}  // namespace

TEST(ProbsAsLogits, SigmoidIntoBceWithLogitsOnThreeAuditedStepsInARow) {
  const auto sigmoid = [](const torch::Tensor& z, int) { return torch::sigmoid(z); };
  EXPECT_TRUE(binary_findings(2, sigmoid).empty());
  const auto fs = binary_findings(3, sigmoid);
  ASSERT_EQ(fs.size(), 1u) << messages(fs);
  EXPECT_EQ(fs[0].step, 2);
  EXPECT_TRUE(op_named(fs[0].tensor, "aten::binary_cross_entropy_with_logits"));
  EXPECT_TRUE(
      contains(fs[0].message, "the input [32, 2] of aten::binary_cross_entropy_with_logits"))
      << fs[0].message;
  EXPECT_TRUE(contains(fs[0].message, "64 values) on 3 audited steps in a row")) << fs[0].message;
  EXPECT_TRUE(contains(fs[0].message, "pass the logits to BCEWithLogitsLoss")) << fs[0].message;
  EXPECT_TRUE(contains(fs[0].message, "or use BCELoss on probabilities")) << fs[0].message;
  // A step of logits at the site breaks the run: steps 3, 4, 5 make the next one.
  const auto broken = binary_findings(
      6, [](const torch::Tensor& z, int i) { return i == 2 ? z : torch::sigmoid(z); });
  ASSERT_EQ(broken.size(), 1u) << messages(broken);
  EXPECT_EQ(broken[0].step, 5);
  // Steps that are not audited neither count nor break: audited 0, 1 and then 3 (every 3rd).
  trainsan::Options o = record();
  o.set("audit_first_steps", "2");
  o.set("audit_every", "3");
  const auto sampled = binary_findings(4, sigmoid, true, o);
  ASSERT_EQ(sampled.size(), 1u) << messages(sampled);
  EXPECT_EQ(sampled[0].step, 3);
  // Through ops that keep the values: a transpose and back.
  const auto viewed = binary_findings(
      3, [](const torch::Tensor& z, int) { return torch::sigmoid(z.t()).t().contiguous(); });
  EXPECT_EQ(viewed.size(), 1u) << messages(viewed);
  // 31 x 2 = 62 values: too few for a binary output.
  EXPECT_TRUE(binary_findings(4, sigmoid, true, record(), 31).empty());
  // Switched off.
  trainsan::Options off = record();
  off.checks["probs_as_logits"] = false;
  EXPECT_TRUE(binary_findings(4, sigmoid, true, off).empty());
}

TEST(ProbsAsLogits, TheTwinsOfTheBinaryLossAreSilent) {
  const std::vector<std::pair<std::string, std::function<torch::Tensor(const torch::Tensor&, int)>>>
      heads = {
          {"logits", [](const torch::Tensor& z, int) { return z; }},
          {"a ReLU head", [](const torch::Tensor& z, int) { return torch::relu(z); }},
          {"a ReLU head scaled into [0, 1]",
           [](const torch::Tensor& z, int) { return torch::relu(z).clamp_max(1.0); }},
          {"a zero-initialised head", [](const torch::Tensor& z, int) { return 0.0 * z; }},
          {"small values of one sign",
           [](const torch::Tensor& z, int) { return 1e-3 * torch::sigmoid(z); }},
          {"logits of one sign in [0, 1] (a fresh head over features of little spread)",
           [](const torch::Tensor& z, int) { return 0.4 + 0.05 * torch::tanh(z); }},
      };
  for (const auto& [what, head] : heads) {
    const auto fs = binary_findings(6, head);
    EXPECT_TRUE(fs.empty()) << what << messages(fs);
  }
  // The right pairing: probabilities into binary_cross_entropy.
  const auto fs = binary_findings(
      6, [](const torch::Tensor& z, int) { return torch::sigmoid(z); }, /*with_logits=*/false);
  EXPECT_TRUE(fs.empty()) << messages(fs);
}

TEST(ProbsAsLogits, GradientsAreTheSameWithAndWithoutTheAudit) {
  std::vector<torch::Tensor> grads[2];
  for (const bool watched : {false, true}) {
    torch::manual_seed(0);
    torch::nn::Linear net(8, kClasses);
    std::optional<trainsan::Sanitizer> san;
    if (watched) san.emplace(net->named_parameters(), record());
    for (int i = 0; i < 2; ++i) {
      torch::manual_seed(300 + i);
      const torch::Tensor x = torch::randn({kBatch, 8});
      const torch::Tensor y = torch::randint(0, kClasses, {kBatch});
      net->zero_grad();
      if (san) san->begin_step({x, y});
      const torch::Tensor z = net->forward(x);
      torch::Tensor loss =
          F::cross_entropy(torch::softmax(z, 1), y) +
          F::binary_cross_entropy_with_logits(torch::sigmoid(z), torch::ones_like(z));
      if (san) san->watch_loss(loss);
      loss.backward();
      if (san) san->end_step();
    }
    for (const auto& p : net->parameters()) grads[watched ? 1 : 0].push_back(p.grad().clone());
    if (san) {
      san->close();
      EXPECT_EQ(of_kind(*san, "probs_as_logits").size(), 1u);
    }
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t k = 0; k < grads[0].size(); ++k) EXPECT_TRUE(torch::equal(grads[0][k], grads[1][k]));
}
