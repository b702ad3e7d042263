// trainsan::attach, the one-line C++ front door (Note [C++ attach] in host/attach.cpp): names,
// optimizers, groups and mode modules found from the model; the forward seen at its first op on a
// parameter (grad mode there, not at a begin_step); steps seen from the version counters.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "forward_watch.h"
#include "mnist_loop.h"
#include "trainsan/trainsan.h"

namespace {

using trainsan_testing::Mnist;
using trainsan_testing::MnistNet;

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    drop = register_module("drop", torch::nn::Dropout(0.1));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};

trainsan::Options record() {
  trainsan::Options o;
  o.policy = "record";
  return o;
}

std::string dump(const trainsan::Sanitizer& san) {
  std::string out;
  for (const auto& f : san.findings())
    out += f.kind + " @" + std::to_string(f.step) + ": " + f.message + "\n";
  return out;
}

std::set<std::string> kinds(const trainsan::Sanitizer& san) {
  std::set<std::string> out;
  for (const auto& f : san.findings()) out.insert(f.kind);
  return out;
}

// zero_grad, forward and backward of batch i; the loss.
torch::Tensor backward(Net& net, torch::optim::Optimizer& opt, int i) {
  torch::manual_seed(100 + i);
  auto x = torch::randn({32, 8});
  auto y = torch::randint(0, 3, {32});
  opt.zero_grad();
  auto loss = torch::nn::functional::cross_entropy(net.forward(x), y);
  loss.backward();
  return loss;
}

torch::Tensor step(Net& net, torch::optim::Optimizer& opt, int i) {
  auto loss = backward(net, opt, i);
  opt.step();
  return loss;
}

TEST(Attach, CleanLoopIsSilentAndCovered) {
  torch::manual_seed(0);
  Net net;
  torch::optim::Adam opt(net.parameters(), torch::optim::AdamOptions(1e-3));
  auto san = trainsan::attach(net, opt, record());
  for (int i = 0; i < 6; ++i) san.end_step(step(net, opt, i));
  const trainsan::Coverage c = san.coverage();
  san.close();
  EXPECT_TRUE(san.findings().empty()) << san.findings()[0].message;
  EXPECT_EQ(c.steps_checked, 6);
  EXPECT_EQ(c.training_forwards, 6);
  EXPECT_EQ(c.losses_checked, 6);
  EXPECT_EQ(c.inputs_fingerprinted, 6);
  // A C++ program gathers no checkpoint, re-run or replica facts here: coverage says so.
  std::set<std::string> unchecked;
  for (const auto& [kind, why] : c.unchecked) unchecked.insert(kind);
  EXPECT_TRUE(unchecked.count("bad_checkpoint"));
  EXPECT_TRUE(unchecked.count("inplace_before_backward"));
  EXPECT_FALSE(unchecked.count("nonfinite_grad"));
  EXPECT_FALSE(unchecked.count("duplicate_batch"));
  EXPECT_FALSE(unchecked.count("broadcast"));
  EXPECT_FALSE(unchecked.count("eval_mode"));
  const auto stats = san.last_stats();
  EXPECT_TRUE(stats.count("fc1.weight.grad"));
}

TEST(Attach, ForwardUnderNoGradGuardIsFoundAtTheForward) {
  // begin_step is outside the guard in the long form; here nothing but the forward itself says.
  torch::manual_seed(0);
  Net net;
  auto head = torch::nn::Linear(3, 3);
  torch::optim::SGD opt(net.parameters(), 0.1);
  torch::optim::SGD head_opt(head->parameters(), 0.1);
  auto san = trainsan::attach({{"net", net, opt}, {"head", *head, head_opt}}, record());
  for (int i = 0; i < 4; ++i) {
    auto x = torch::randn({16, 8});
    opt.zero_grad();
    head_opt.zero_grad();
    torch::Tensor features;
    {
      torch::NoGradGuard no_grad;
      features = net.forward(x);
    }
    auto loss = head->forward(features).pow(2).mean();
    loss.backward();
    opt.step();
    head_opt.step();
    san.end_step(loss);
  }
  san.close();
  const auto fs = san.findings();
  const auto it = std::find_if(fs.begin(), fs.end(), [](const trainsan::Finding& f) {
    return f.kind == "no_grad_leak" && f.severity == "error";
  });
  ASSERT_NE(it, fs.end()) << (fs.empty() ? "no finding" : fs[0].kind);
  EXPECT_NE(it->message.find("net."), std::string::npos) << it->message;
}

TEST(Attach, PartialOptimizerIsNotASkippedStep) {
  // The short constructor put every parameter in optimizer 0; attach reads the optimizer: fc1 is
  // trained, fc2 is in no optimizer (param_not_in_optimizer, not skipped_step).
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.fc1->parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  for (int i = 0; i < 4; ++i) san.end_step(step(net, opt, i));
  san.close();
  const auto k = kinds(san);
  EXPECT_TRUE(k.count("param_not_in_optimizer")) << dump(san);
  EXPECT_FALSE(k.count("skipped_step")) << dump(san);
}

TEST(Attach, EvalModeIsReadAtTheForward) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  net.drop->eval();  // left in eval mode
  for (int i = 0; i < 3; ++i) san.end_step(step(net, opt, i));
  san.close();
  const auto fs = san.findings();
  const auto it = std::find_if(fs.begin(), fs.end(),
                               [](const trainsan::Finding& f) { return f.kind == "eval_mode"; });
  ASSERT_NE(it, fs.end()) << dump(san) << san.coverage().training_forwards;
  EXPECT_EQ(it->tensor, "drop");
}

TEST(Attach, ScalerSkipIsNotASkippedStep) {
  // A hand-written loss scaler found Inf in the gradients and skipped optimizer.step(): it says
  // so with scaler_step before end_step (docs/cpp.md, "Loss scalers").
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  for (int i = 0; i < 6; ++i) {
    auto loss = backward(net, opt, i);
    if (i == 2) {
      san.scaler_step({0, /*skipped=*/true, 65536.0});
    } else {
      opt.step();
      san.scaler_step({0, /*skipped=*/false, 65536.0});
    }
    san.end_step(loss);
  }
  san.close();
  const auto k = kinds(san);
  EXPECT_FALSE(k.count("skipped_step")) << dump(san);
  EXPECT_FALSE(k.count("stale_grad")) << dump(san);
}

TEST(Attach, ForgottenStepIsFound) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  for (int i = 0; i < 4; ++i) {
    auto x = torch::randn({32, 8});
    opt.zero_grad();
    auto loss = net.forward(x).pow(2).mean();
    loss.backward();
    san.end_step(loss);  // optimizer.step() forgotten
  }
  san.close();
  EXPECT_TRUE(kinds(san).count("skipped_step"));
}

TEST(Attach, RaiseCompletesTheTraceBeforeThrowing) {
  const std::string path = ::testing::TempDir() + "trainsan_attach_raise.jsonl";
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  trainsan::Options o;
  o.trace = path;
  auto san = trainsan::attach(net, opt, o);
  bool raised = false;
  try {
    for (int i = 0; i < 4; ++i) {
      auto x = torch::randn({32, 8});
      auto loss = net.forward(x).pow(2).mean();  // no zero_grad: stale_grad
      loss.backward();
      opt.step();
      san.end_step(loss);
    }
  } catch (const trainsan::TrainingBugError& e) {
    raised = true;
  }
  EXPECT_TRUE(raised) << dump(san);
  std::ifstream in(path);
  std::string line, all;
  while (std::getline(in, line)) all += line + "\n";
  EXPECT_NE(all.find("\"type\":\"summary\""), std::string::npos);
  EXPECT_NE(all.find("\"torch\":"), std::string::npos);
  EXPECT_NE(all.find("\"seed\":"), std::string::npos);
  EXPECT_NE(all.find("\"argv\":"), std::string::npos);
}

TEST(Attach, OptionsFromTheEnvironment) {
  ::setenv("TRAINSAN_OPTIONS", "policy=record,check.stale_grad=false", 1);
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt);  // policy raise in code, record from the environment
  ::unsetenv("TRAINSAN_OPTIONS");
  for (int i = 0; i < 3; ++i) {
    auto loss = net.forward(torch::randn({8, 8})).pow(2).mean();
    loss.backward();
    opt.step();
    EXPECT_NO_THROW(san.end_step(loss));
  }
  EXPECT_FALSE(kinds(san).count("stale_grad"));
  ::setenv("TRAINSAN_OPTIONS", "policy", 1);
  EXPECT_THROW(trainsan::attach(net, opt), c10::Error);
  ::unsetenv("TRAINSAN_OPTIONS");
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::string line, all;
  while (std::getline(in, line)) all += line + "\n";
  return all;
}

TEST(Attach, ExamplesMnistEveryTrainingForwardIsSeen) {
  torch::manual_seed(0);
  MnistNet net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  Mnist mnist;
  auto san = trainsan::attach(net, opt, record());
  for (int epoch = 1; epoch <= 3; ++epoch) {
    mnist.train(net, *mnist.train_loader, opt, san);
    mnist.test(net, *mnist.test_loader);
  }
  // One op callback, armed for the next forward (Note [Watch removal]: one removed inside a
  // CPU backward comes back after it; it must not pile up, one more each step); none after close.
  EXPECT_EQ(at::get_record_function_tls_().sorted_tls_callbacks_.size(), 1u);
  const trainsan::Coverage c = san.coverage();
  san.close();
  EXPECT_EQ(at::get_record_function_tls_().sorted_tls_callbacks_.size(), 0u);
  EXPECT_EQ(dump(san), "");
  EXPECT_EQ(c.steps_checked, 18);
  EXPECT_EQ(c.training_forwards, 18);
  EXPECT_EQ(c.losses_checked, 18);
  EXPECT_EQ(c.inputs_fingerprinted, 18);
}

TEST(Attach, ExamplesMnistEvalModeIsFoundAtTheStepItBegins) {
  // model.train() forgotten after the test pass: the first step of epoch 2 (step 6) trains in
  // eval mode, and is the step reported (the watch saw that forward, past the test pass).
  torch::manual_seed(0);
  MnistNet net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  Mnist mnist;
  auto san = trainsan::attach(net, opt, record());
  for (int epoch = 1; epoch <= 2; ++epoch) {
    mnist.train(net, *mnist.train_loader, opt, san, /*forget_train=*/epoch > 1);
    mnist.test(net, *mnist.test_loader);
  }
  san.close();
  const auto fs = san.findings();
  const auto it = std::find_if(fs.begin(), fs.end(),
                               [](const trainsan::Finding& f) { return f.kind == "eval_mode"; });
  ASSERT_NE(it, fs.end()) << dump(san);
  EXPECT_EQ(it->step, 6) << dump(san);
}

// The program asserts on its loss before the backward, as pytorch/examples' MNIST does, and
// aborts (here: the c10::Error is caught where an uncaught one would end the program): the NaN
// loss is in the trace before, and under "raise" printed too. The step is the NaN batch's.
void nan_loss_run(const std::string& policy, bool* asserted, std::string* trace, std::string* err) {
  const std::string path = ::testing::TempDir() + "trainsan_attach_nan_" + policy + ".jsonl";
  std::remove(path.c_str());
  torch::manual_seed(0);
  MnistNet net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  Mnist mnist;
  mnist.nan_batch = 3;
  trainsan::Options o;
  o.policy = policy;
  o.trace = path;
  auto san = trainsan::attach(net, opt, o);
  *asserted = false;
  ::testing::internal::CaptureStderr();
  try {
    mnist.train(net, *mnist.train_loader, opt, san);
  } catch (const trainsan::TrainingBugError&) {
    // not before the program's own assert
  } catch (const c10::Error& e) {
    *asserted = std::string(e.what()).find("isnan") != std::string::npos;
  }
  *err = ::testing::internal::GetCapturedStderr();
  *trace = read_file(path);  // as the aborted program leaves it: san is not closed yet
}

TEST(Attach, NanLossReadBeforeTheBackwardIsInTheTraceBeforeTheProgramAborts) {
  bool asserted = false;
  std::string trace, err;
  nan_loss_run("record", &asserted, &trace, &err);
  EXPECT_TRUE(asserted);
  EXPECT_NE(trace.find("nonfinite_loss at step 3"), std::string::npos);
  EXPECT_EQ(err.find("nonfinite_loss"), std::string::npos) << err;  // record: only the trace
  nan_loss_run("raise", &asserted, &trace, &err);
  EXPECT_TRUE(asserted);  // the program's assert comes first: nothing can raise before it
  EXPECT_NE(trace.find("nonfinite_loss at step 3"), std::string::npos);
  EXPECT_NE(err.find("nonfinite_loss at step 3"), std::string::npos) << err;
}

TEST(Attach, FiniteLossAndProbeNanReadBeforeTheBackwardAreSilent) {
  // A finite loss the program reads before its backward, and a probe model's NaN scalar (its
  // graph reaches none of the model's parameters) read there: no nonfinite_loss, and each step's
  // loss checked once (at end_step).
  torch::manual_seed(0);
  Net net;
  auto probe = torch::nn::Linear(8, 1);
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  for (int i = 0; i < 12; ++i) {
    auto x = torch::randn({16, 8});
    opt.zero_grad();
    auto loss = net.forward(x).pow(2).mean();
    EXPECT_TRUE(std::isfinite(loss.item<float>()));
    auto probe_loss = probe->forward(x * NAN).mean();
    EXPECT_TRUE(std::isnan(probe_loss.item<float>()));
    probe_loss.backward();
    loss.backward();
    opt.step();
    san.end_step(loss);
  }
  const trainsan::Coverage c = san.coverage();
  san.close();
  EXPECT_EQ(dump(san), "");
  EXPECT_EQ(c.losses_checked, 12);
  EXPECT_EQ(c.training_forwards, 12);
}

// A program that checks its loss only after the backward (or not at all) and aborts there: the
// NaN loss is taken at the backward's root (Tensor::backward() seeds it with ones_like) and is in
// the trace before the abort. A probe model's backward before it does not end the watch.
TEST(Attach, NanLossIsTakenAtItsBackward) {
  const std::string path = ::testing::TempDir() + "trainsan_attach_nan_backward.jsonl";
  std::remove(path.c_str());
  torch::manual_seed(0);
  Net net;
  auto probe = torch::nn::Linear(8, 1);
  torch::optim::SGD opt(net.parameters(), 0.1);
  trainsan::Options o = record();
  o.trace = path;
  auto san = trainsan::attach(net, opt, o);
  bool aborted = false;
  try {
    for (int i = 0; i < 8; ++i) {
      auto x = torch::randn({16, 8});
      if (i == 5) x[0][0] = NAN;
      opt.zero_grad();
      auto loss = net.forward(x).pow(2).mean();
      probe->forward(x.abs()).mean().backward();  // a probe's backward first
      loss.backward();
      TORCH_CHECK(i != 5, "the program's own abort, without reading the loss");
      opt.step();
      san.end_step(loss);
    }
  } catch (const c10::Error&) {
    aborted = true;
  }
  EXPECT_TRUE(aborted);
  EXPECT_NE(read_file(path).find("nonfinite_loss at step 5"), std::string::npos) << read_file(path);
  san.close();
  EXPECT_EQ(dump(san).find("nonfinite_loss @5"), 0u) << dump(san);
}

TEST(Attach, NanLossReadAfterTheBackwardIsSeenOnceAndCleanStepsAreCheckedOnce) {
  // `loss.backward(); AT_ASSERT(!isnan(loss.item()))`: the NaN is reported once (at the
  // backward, on the CPU), not again at the read; the clean steps' losses once each, at end_step.
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  int checked_before = -1;
  for (int i = 0; i < 8; ++i) {
    auto x = torch::randn({16, 8});
    if (i == 6) x[0][0] = INFINITY;
    opt.zero_grad();
    auto loss = net.forward(x).pow(2).mean();
    loss.backward();
    if (i == 6) {
      checked_before = static_cast<int>(san.coverage().losses_checked);
      EXPECT_FALSE(std::isfinite(loss.item<float>()));
    }
    opt.step();
    san.end_step(loss);
  }
  const trainsan::Coverage c = san.coverage();
  san.close();
  EXPECT_EQ(checked_before, 7);  // steps 0-5 at their end_step, step 6 at its backward
  EXPECT_EQ(c.losses_checked, 8);
  int nonfinite = 0;
  for (const auto& f : san.findings()) nonfinite += f.kind == "nonfinite_loss" ? 1 : 0;
  EXPECT_EQ(nonfinite, 1) << dump(san);
}

TEST(Attach, ScaledLossBackwardIsNotTheLossStream) {
  // A hand-written loss scaler: (loss * scale).backward() with a scale that doubles every few
  // steps, end_step(loss) with the loss itself. The root of the backward is the scaled loss: not
  // taken into the loss stream (no loss_spike from the scale), each loss checked once.
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.01);
  auto san = trainsan::attach(net, opt, record());
  double scale = 1024.0;
  for (int i = 0; i < 30; ++i) {
    if (i % 4 == 3) scale *= 2.0;
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net.forward(torch::randn({32, 8})),
                                                     torch::randint(0, 3, {32}));
    (loss * scale).backward();
    for (auto& p : net.parameters()) p.mutable_grad().div_(scale);
    opt.step();
    san.end_step(loss);
  }
  const trainsan::Coverage c = san.coverage();
  san.close();
  EXPECT_EQ(dump(san), "");
  EXPECT_EQ(c.losses_checked, 30);
}

TEST(Attach, WatchTimeIncludesTheDispatcherPrice) {
  // Note [Watch price]: the price per op is measured (a sane figure: under 50 us on any machine
  // that runs this suite), and a watch's time is at least that price times the ops it saw.
  const double price = trainsan::host::ForwardWatch::price_per_op();
  EXPECT_GE(price, 0.0);
  EXPECT_LT(price, 50e-6);
  auto w = torch::randn({4, 3}, torch::requires_grad());
  trainsan::host::ForwardWatch watch({w}, {0}, [](std::vector<at::Tensor>, int64_t) {});
  watch.arm();
  auto x = torch::randn({2, 4});
  for (int k = 0; k < 10; ++k) x = x * 1.5;  // no forward: ops the watch looks at
  (void)x.matmul(w);
  const int64_t ops = watch.ops_seen();
  EXPECT_GE(ops, 11);
  EXPECT_GE(watch.take_seconds(), static_cast<double>(ops) * price * 0.999);
}

TEST(Attach, ClearErrors) {
  Net net;
  auto other = torch::nn::Linear(2, 2);
  torch::optim::SGD foreign(other->parameters(), 0.1);
  try {
    auto san = trainsan::attach(net, foreign);
    FAIL() << "an optimizer over another model's parameters was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a parameter of the model"), std::string::npos);
  }
}

TEST(Attach, HooksRemovedAtClose) {
  Net net;
  torch::optim::SGD opt(net.parameters(), 0.1);
  auto san = trainsan::attach(net, opt, record());
  EXPECT_TRUE(san.hooks_installed());
  auto moved = std::move(san);
  EXPECT_TRUE(moved.hooks_installed());
  moved.close();
  EXPECT_FALSE(moved.hooks_installed());
  // After close, training goes on untouched and nothing is observed.
  auto loss = net.forward(torch::randn({4, 8})).sum();
  loss.backward();
  opt.step();
  moved.end_step(loss);
  EXPECT_EQ(moved.coverage().training_forwards, 0);
}

}  // namespace
