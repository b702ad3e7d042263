// Every finding kind a LibTorch program can reach, reached from C++: each scenario plants one bug
// in a small loop attached with trainsan::attach (or calls the C++ API the kind's kinds.def row
// names) and must find its kind; at the end, the kinds reached are every kind whose `needs` is not
// `python`. rank_desync needs two processes: tests/cpp/test_replicas_pg.cpp reaches it.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "trainsan/trainsan.h"

namespace {

// `spare`: a branch the forward never runs (missing_grad); `idle`: a parameter whose gradient
// is always zero (grad_vanishing).
struct Net : torch::nn::Module {
  explicit Net(bool spare_branch = false, bool idle_param = false) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    drop = register_module("drop", torch::nn::Dropout(0.1));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
    if (spare_branch) spare = register_module("spare", torch::nn::Linear(8, 3));
    if (idle_param) idle = register_parameter("idle", torch::ones({3}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc2(drop(torch::relu(fc1(x))));
    return idle.defined() ? y + 0.0 * idle : y;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::Tensor idle;
};

trainsan::Options record() {
  trainsan::Options o;
  o.policy = "record";
  return o;
}

std::set<std::string> kinds_of(const trainsan::Sanitizer& san) {
  std::set<std::string> out;
  for (const auto& f : san.findings()) out.insert(f.kind);
  return out;
}

torch::Tensor batch(int i) {
  torch::manual_seed(1000 + i);
  return torch::randn({32, 8});
}

torch::Tensor labels(int i) {
  torch::manual_seed(2000 + i);
  return torch::randint(0, 3, {32});
}

// One iteration as the examples write it; `loss_of` makes the loss from the output.
using LossOf = std::function<torch::Tensor(const torch::Tensor& out, int i)>;
torch::Tensor iteration(Net& net, torch::optim::Optimizer& opt, trainsan::Sanitizer& san, int i,
                        const LossOf& loss_of, bool zero = true, bool step = true,
                        const torch::Tensor& x = {}) {
  if (zero) opt.zero_grad();
  auto loss = loss_of(net.forward(x.defined() ? x : batch(i)), i);
  loss.backward();
  if (step) opt.step();
  san.end_step(loss);
  return loss;
}

const LossOf kCrossEntropy = [](const torch::Tensor& out, int i) {
  return torch::nn::functional::cross_entropy(out, labels(i));
};

// Trains `steps` iterations of `net` under a fresh sanitizer; `body` may replace an iteration.
std::set<std::string> run(
    int steps, trainsan::Options o,
    const std::function<void(Net&, torch::optim::Optimizer&, trainsan::Sanitizer&, int)>& body,
    bool spare = false, double lr = 0.05, bool idle = false) {
  torch::manual_seed(0);
  Net net(spare, idle);
  torch::optim::SGD opt(net.parameters(), lr);
  auto san = trainsan::attach(net, opt, o);
  for (int i = 0; i < steps; ++i) body(net, opt, san, i);
  san.close();
  return kinds_of(san);
}

// A custom Function whose backward is off by a factor 2.
struct DoubledExp : torch::autograd::Function<DoubledExp> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor y = x.exp();
    ctx->save_for_backward({y});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    return {2 * g[0] * ctx->get_saved_variables()[0]};
  }
};

// Note [Foreign backwards]: a loss made by the model from before a copy trains that one while the
// optimizer steps the copy; end_step(loss) walks the loss's graph. Its twin uses the copy.
TEST(LibTorchKinds, ALossOfTheModelBeforeACopyIsMissingGrad) {
  for (const bool bug : {true, false}) {
    torch::manual_seed(0);
    Net old_net;
    Net net;  // the model the optimizer steps
    torch::optim::SGD opt(net.parameters(), 0.05);
    auto san = trainsan::attach(net, opt, record());
    for (int i = 0; i < 5; ++i) {
      opt.zero_grad();
      auto loss = kCrossEntropy((bug ? old_net : net).forward(batch(i)), i);
      loss.backward();
      opt.step();
      san.end_step(loss);
    }
    san.close();
    std::vector<trainsan::Finding> foreign;
    for (const auto& f : san.findings()) {
      if (f.kind == "missing_grad" && f.tensor.empty()) foreign.push_back(f);
    }
    if (!bug) {
      EXPECT_TRUE(san.findings().empty()) << san.findings()[0].message;
      continue;
    }
    ASSERT_EQ(foreign.size(), 1u) << kinds_of(san).size();
    EXPECT_EQ(foreign[0].step, 2);
    EXPECT_EQ(foreign[0].message.rfind(
                  "missing_grad at step 2: none of the 4 trainable parameters optimizer 0 steps "
                  "got a gradient, for 3 steps, while the backward since its previous step "
                  "reached 4 requires-grad tensors (195 elements) outside this model — ",
                  0),
              0u)
        << foreign[0].message;
  }
}

// Sanitizer::loss_reaches: the graph walk alone, hand-built cases: a loss of the attached model
// (1, also mixed with another model's), of another model (0, also with ours detached), a tensor
// with no graph (-1), and after close (-1).
TEST(LibTorchKinds, LossReachesSaysWhoseGraphALossIs) {
  torch::manual_seed(0);
  Net net;
  Net other;
  torch::optim::SGD opt(net.parameters(), 0.05);
  auto san = trainsan::attach(net, opt, record());
  const auto x = batch(0);
  EXPECT_EQ(san.loss_reaches(net.forward(x).sum()), 1);
  EXPECT_EQ(san.loss_reaches(other.forward(x).sum()), 0);
  EXPECT_EQ(san.loss_reaches((other.forward(x) * net.forward(x).detach()).sum()), 0);
  EXPECT_EQ(san.loss_reaches((other.forward(x) * net.forward(x)).sum()), 1);  // and another's
  EXPECT_EQ(san.loss_reaches(torch::ones({1})), -1);
  {
    torch::NoGradGuard no_grad;
    EXPECT_EQ(san.loss_reaches(net.forward(x).sum()), -1);
  }
  san.close();
  EXPECT_EQ(san.loss_reaches(net.forward(x).sum()), -1);
}
// trainsan::walk_loss_graph (the walk of loss_reaches and of the Python package's Note [Loss
// roots]) with several targets: which are reached, the leaves it passed, when it stops.
TEST(LibTorchKinds, LossWalkTellsWhichTargetsAGraphReaches) {
  torch::manual_seed(0);
  Net a;
  Net b;
  Net c;
  auto impls = [](Net& n) {
    std::vector<const void*> out;
    for (const auto& p : n.parameters()) out.push_back(p.unsafeGetTensorImpl());
    std::sort(out.begin(), out.end(), std::less<const void*>());
    return out;
  };
  const auto ta = impls(a), tb = impls(b), tc = impls(c);
  const auto x = batch(0);
  const at::Tensor loss = (a.forward(x) * b.forward(x)).sum();
  trainsan::LossWalk w = trainsan::walk_loss_graph(loss, {&ta, &tb, &tc}, /*keep_leaves=*/true);
  EXPECT_EQ(w.reaches, (std::vector<bool>{true, true, false}));
  EXPECT_TRUE(w.complete);  // c is never reached: walked to its end
  EXPECT_FALSE(w.out_of_budget);
  const int64_t n = static_cast<int64_t>(a.parameters().size() + b.parameters().size());
  EXPECT_EQ(w.leaf_count, n);
  EXPECT_EQ(static_cast<int64_t>(w.leaves.size()), n);
  // Every target reached: it stops there, not walked to its end.
  w = trainsan::walk_loss_graph(loss, {&ta}, /*keep_leaves=*/false);
  EXPECT_EQ(w.reaches, std::vector<bool>{true});
  EXPECT_TRUE(w.leaves.empty());
  // Out of budget: neither complete nor a verdict.
  w = trainsan::walk_loss_graph(loss, {&tc}, /*keep_leaves=*/false, /*limit=*/2);
  EXPECT_EQ(w.reaches, std::vector<bool>{false});
  EXPECT_FALSE(w.complete);
  EXPECT_TRUE(w.out_of_budget);
  // No graph: nothing reached, not complete.
  w = trainsan::walk_loss_graph(torch::ones({1}), {&ta}, /*keep_leaves=*/true);
  EXPECT_EQ(w.reaches, std::vector<bool>{false});
  EXPECT_FALSE(w.complete);
}

TEST(LibTorchKinds, EveryKindButPythonOnlyIsReached) {
  std::set<std::string> reached = {"rank_desync"};  // tests/cpp/test_replicas_pg.cpp
  auto expect = [&](const std::string& kind, const std::set<std::string>& found) {
    EXPECT_TRUE(found.count(kind)) << kind << " not found; found:" << [&] {
      std::string s;
      for (const auto& k : found) s += " " + k;
      return s;
    }();
    if (found.count(kind)) reached.insert(kind);
  };
  const auto plain = [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
    iteration(n, o, s, i, kCrossEntropy);
  };
  const auto clean = run(4, record(), plain);
  EXPECT_TRUE(clean.empty()) << *clean.begin();

  // NaN in the loss, then in the gradients, then (after SGD) in the parameters.
  const auto nan =
      run(2, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
        iteration(n, o, s, i, [](const torch::Tensor& out, int j) {
          auto l = kCrossEntropy(out, j);
          return j == 1 ? l * std::numeric_limits<float>::quiet_NaN() : l;
        });
      });
  for (const char* k : {"nonfinite_loss", "nonfinite_grad", "nonfinite_param"}) expect(k, nan);

  // A gradient 1e6 times its running level after the warm-up.
  expect("grad_explosion",
         run(10, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, [](const torch::Tensor& out, int j) {
             return kCrossEntropy(out, j) * (j == 8 ? 1e6 : 1.0);
           });
         }));
  expect("missing_grad", run(5, record(), plain, /*spare=*/true));
  expect("grad_vanishing", run(5, record(), plain, false, 0.05, /*idle=*/true));
  expect("stale_grad",
         run(3, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, kCrossEntropy, /*zero=*/false);
         }));
  expect("skipped_step",
         run(3, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, kCrossEntropy, true, /*step=*/false);
         }));
  {  // accumulation_steps=4 declared, the loop steps every 3 micro-batches (end_step(losses))
    trainsan::Options o = record();
    o.accumulation_steps = 4;
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), 0.05);
    auto san = trainsan::attach(net, opt, o);
    for (int w = 0; w < 4; ++w) {
      opt.zero_grad();
      std::vector<torch::Tensor> losses;
      for (int m = 0; m < 3; ++m) {
        losses.push_back(kCrossEntropy(net.forward(batch(3 * w + m)), 3 * w + m) / 4);
        losses.back().backward();
      }
      opt.step();
      san.end_step(losses);
    }
    san.close();
    expect("accumulation_mismatch", kinds_of(san));
    EXPECT_EQ(san.coverage().window_backwards, 3);
    trainsan::Options kept = record();
    kept.accumulation_steps = 4;
    const auto four =
        run(3, kept, [](Net& n, torch::optim::Optimizer& opt, trainsan::Sanitizer& s, int i) {
          opt.zero_grad();
          std::vector<torch::Tensor> losses;
          for (int m = 0; m < 4; ++m) {
            losses.push_back(kCrossEntropy(n.forward(batch(4 * i + m)), 4 * i + m) / 4);
            losses.back().backward();
          }
          opt.step();
          s.end_step(losses);
        });
    EXPECT_TRUE(four.empty()) << *four.begin();
  }
  {  // fc2 in no optimizer
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.fc1->parameters(), 0.05);
    auto san = trainsan::attach(net, opt, record());
    for (int i = 0; i < 3; ++i) iteration(net, opt, san, i, kCrossEntropy);
    san.close();
    expect("param_not_in_optimizer", kinds_of(san));
  }
  {  // a weight changed between steps (opt-in)
    trainsan::Options o = record();
    o.checks["update_outside_step"] = true;
    expect("update_outside_step",
           run(3, o, [](Net& n, torch::optim::Optimizer& opt, trainsan::Sanitizer& s, int i) {
             if (i == 2) {
               torch::NoGradGuard no_grad;
               n.fc1->weight.add_(0.5);
             }
             iteration(n, opt, s, i, kCrossEntropy);
           }));
  }
  // A learning rate far too high: the update as large as the weights, step after step.
  expect("update_ratio", run(5, record(), plain, false, /*lr=*/50.0));
  {  // the features made under NoGradGuard: the body never trains
    torch::manual_seed(0);
    Net body;
    auto head = torch::nn::Linear(3, 3);
    torch::optim::SGD b_opt(body.parameters(), 0.05), h_opt(head->parameters(), 0.05);
    auto san = trainsan::attach({{"body", body, b_opt}, {"head", *head, h_opt}}, record());
    for (int i = 0; i < 3; ++i) {
      b_opt.zero_grad();
      h_opt.zero_grad();
      torch::Tensor f;
      {
        torch::NoGradGuard no_grad;
        f = body.forward(batch(i));
      }
      auto loss = kCrossEntropy(head->forward(f), i);
      loss.backward();
      b_opt.step();
      h_opt.step();
      san.end_step(loss);
    }
    san.close();
    expect("no_grad_leak", kinds_of(san));
  }
  expect("eval_mode",
         run(3, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           n.drop->eval();
           iteration(n, o, s, i, kCrossEntropy);
         }));
  expect("broadcast",
         run(2, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, [](const torch::Tensor& out, int) {
             return torch::mse_loss(out.narrow(1, 0, 1), torch::randn({32}));  // [32,1] vs [32]
           });
         }));
  // Out-of-range labels and a target batch of another size: recorded before the op fails.
  for (const auto& [kind, target] : std::vector<std::pair<std::string, torch::Tensor>>{
           {"label_range", torch::full({32}, 3, torch::kLong)},
           {"batch_mismatch", torch::zeros({16}, torch::kLong)}}) {
    expect(kind,
           run(1, record(),
               [t = target](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
                 try {
                   iteration(n, o, s, i, [&](const torch::Tensor& out, int) {
                     return torch::nll_loss(torch::log_softmax(out, 1), t);
                   });
                 } catch (const c10::Error&) {
                   // torch's own error follows the finding
                 }
               }));
  }
  // 300 classes whose labels were stored as uint8 (wrapped), given with the batch: label_dtype.
  expect("label_dtype",
         run(1, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           torch::manual_seed(3000 + i);
           const torch::Tensor y8 = torch::randint(0, 300, {32}).to(torch::kByte);
           const torch::Tensor x = batch(i);
           s.begin_step({x, y8});
           iteration(
               n, o, s, i,
               [&](const torch::Tensor& out, int) {
                 return torch::nn::functional::cross_entropy(out.repeat({1, 100}),
                                                             y8.to(torch::kLong));
               },
               true, true, x);
         }));
  // The label column left among the features: column 3 of the input is the class index.
  expect("target_leak",
         run(1, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           torch::Tensor x = batch(i);
           x.select(1, 3).copy_(labels(i).to(torch::kFloat));
           iteration(n, o, s, i, kCrossEntropy, true, true, x);
         }));
  // The model's softmax output given to cross_entropy, which applies log_softmax itself.
  expect("probs_as_logits",
         run(1, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, [](const torch::Tensor& out, int j) {
             return kCrossEntropy(torch::softmax(out, 1), j);
           });
         }));
  // New batches, then the same one again: the data stopped advancing.
  expect("duplicate_batch",
         run(4, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, kCrossEntropy, true, true, batch(i < 2 ? i : 2));
         }));
  {  // a parameter beyond ±65504 while the forward runs under fp16 autocast
    const bool was = at::autocast::is_autocast_enabled(at::kCPU);
    const auto dtype = at::autocast::get_autocast_dtype(at::kCPU);
    expect("fp16_overflow",
           run(
               2, record(),
               [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
                 {
                   torch::NoGradGuard no_grad;
                   n.idle.fill_(1e5);
                 }
                 at::autocast::set_autocast_enabled(at::kCPU, true);
                 at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
                 iteration(n, o, s, i, [](const torch::Tensor& out, int j) {
                   return kCrossEntropy(out.to(torch::kFloat), j);
                 });
                 at::autocast::set_autocast_enabled(at::kCPU, false);
               },
               false, 0.05, /*idle=*/true));
    at::autocast::set_autocast_enabled(at::kCPU, was);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
  // A hand-written loss scaler that keeps skipping after its first taken step.
  expect("amp_scale_collapse",
         run(8, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           o.zero_grad();
           auto loss = kCrossEntropy(n.forward(batch(i)), i);
           loss.backward();
           if (i == 0) {
             o.step();
             s.scaler_step({0, false, 65536.0});
           } else {
             s.scaler_step({0, true, 65536.0 / (1 << i)});
           }
           s.end_step(loss);
         }));
  {  // bfloat16 weights with a learning rate whose updates round away; the loss in bfloat16
    torch::manual_seed(0);
    Net net;
    net.to(torch::kBFloat16);
    torch::optim::SGD opt(net.parameters(), 1e-6);
    auto san = trainsan::attach(net, opt, record());
    for (int i = 0; i < 5; ++i) {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(net.forward(batch(i).to(torch::kBFloat16)),
                                                       labels(i));
      loss.backward();
      opt.step();
      san.end_step(loss);
    }
    san.close();
    expect("update_underflow", kinds_of(san));
    expect("low_precision_loss", kinds_of(san));
  }
  expect("loss_spike",
         run(16, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, [](const torch::Tensor& out, int j) {
             return kCrossEntropy(out, j) * (j == 14 ? 1e4 : 1.0);
           });
         }));
  {  // every target ignore_index: the mean over none is NaN (0/0) with zero gradients
    const auto empty =
        run(3, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
          iteration(n, o, s, i, [](const torch::Tensor& out, int) {
            return torch::nn::functional::cross_entropy(
                out, torch::full({out.size(0)}, -100, torch::kLong),
                torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100));
          });
        });
    expect("empty_loss", empty);
    EXPECT_FALSE(empty.count("nonfinite_loss"));
  }
  expect("trivial_loss",
         run(4, record(), [](Net& n, torch::optim::Optimizer& o, trainsan::Sanitizer& s, int i) {
           iteration(n, o, s, i, [](const torch::Tensor& out, int) { return out.sum() * 0.0; });
         }));
  {  // opt-in: a module output with a NaN, given by the program
    trainsan::Options o = record();
    o.checks["nonfinite_activation"] = true;
    expect("nonfinite_activation",
           run(1, o, [](Net& n, torch::optim::Optimizer& opt, trainsan::Sanitizer& s, int i) {
             auto h = n.fc1->forward(batch(i)) * std::numeric_limits<float>::quiet_NaN();
             s.module_output({"fc1", "Linear"}, {h});
             iteration(n, opt, s, i, kCrossEntropy);
           }));
  }
  {  // a custom autograd Function whose backward is off by a factor 2
    std::set<std::string> found;
    for (const auto& f :
         trainsan::check_custom_grad("DoubledExp",
                                     [](const std::vector<at::Tensor>& x) {
                                       return std::vector<at::Tensor>{DoubledExp::apply(x[0])};
                                     },
                                     {torch::randn({4, 3}, torch::kDouble).requires_grad_()})) {
      found.insert(f.kind);
    }
    expect("bad_custom_grad", found);
  }
  {  // a step whose forward draws from a generator nobody seeded: re-runs differ
    trainsan::Options o = record();
    o.rerun_every = 1;
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), 0.05);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
    auto noisy = [&](const torch::Tensor& x) {
      return net.forward(x + torch::rand(x.sizes(), gen) * 1e-3);
    };
    auto san = trainsan::attach(net, opt, o);
    for (int i = 0; i < 2; ++i) {
      opt.zero_grad();
      const auto x = batch(i);
      auto loss = kCrossEntropy(noisy(x), i);
      loss.backward();
      san.rerun([&] {
        trainsan::RerunRecord r;
        auto l = kCrossEntropy(noisy(x), i);
        l.backward();
        return r.add("loss", {l});
      });
      opt.step();
      san.end_step(loss);
    }
    san.close();
    expect("nondeterminism", kinds_of(san));
  }
  {  // a GAN-style resume: the model and one optimizer restored, the other one forgotten
    const std::string dir = ::testing::TempDir();
    auto train = [&](Net& net, torch::optim::Adam& a, torch::optim::Adam& b, int steps) {
      for (int i = 0; i < steps; ++i) {
        a.zero_grad();
        b.zero_grad();
        auto loss = kCrossEntropy(net.forward(batch(i)), i);
        loss.backward();
        a.step();
        b.step();
      }
    };
    torch::manual_seed(0);
    Net first;
    torch::optim::Adam a1(first.fc1->parameters(), 1e-3), b1(first.fc2->parameters(), 1e-3);
    train(first, a1, b1, 2);
    torch::save(a1, dir + "trainsan_a.pt");
    torch::serialize::OutputArchive archive;
    first.save(archive);
    archive.save_to(dir + "trainsan_model.pt");
    Net second;
    torch::optim::Adam a2(second.fc1->parameters(), 1e-3), b2(second.fc2->parameters(), 1e-3);
    auto san = trainsan::attach(second, {&a2, &b2}, record());
    trainsan::load(san, second, dir + "trainsan_model.pt");
    trainsan::load(san, a2, dir + "trainsan_a.pt");  // b2 forgotten
    for (int i = 0; i < 2; ++i) {
      a2.zero_grad();
      b2.zero_grad();
      auto loss = kCrossEntropy(second.forward(batch(i)), i);
      loss.backward();
      a2.step();
      b2.step();
      san.end_step(loss);
    }
    san.close();
    const auto fs = san.findings();
    bool second_optimizer = false;
    for (const auto& f : fs) {
      if (f.kind == "optimizer_reset") {
        second_optimizer = f.message.find("optimizer 1") != std::string::npos;
      }
    }
    EXPECT_TRUE(second_optimizer);
    expect("optimizer_reset", kinds_of(san));
    std::remove((dir + "trainsan_a.pt").c_str());
    std::remove((dir + "trainsan_model.pt").c_str());
  }

  {  // a checkpoint written with a NaN in a weight, checked against the model
    const std::string path = ::testing::TempDir() + "trainsan_kinds_ckpt.pt";
    torch::manual_seed(0);
    Net net;
    {
      torch::NoGradGuard no_grad;
      net.fc1->weight.index_put_({0, 0}, std::numeric_limits<float>::quiet_NaN());
    }
    torch::serialize::OutputArchive archive;
    net.save(archive);
    archive.save_to(path);
    std::set<std::string> found;
    for (const auto& f : trainsan::check_checkpoint(path, &net)) found.insert(f.kind);
    expect("bad_checkpoint", found);
    std::remove(path.c_str());
  }

  std::set<std::string> missing;
  for (const trainsan::KindInfo& k : trainsan::kinds()) {
    if (std::string(k.needs) != "python" && reached.count(k.name) == 0) missing.insert(k.name);
  }
  std::string list;
  for (const auto& k : missing) list += " " + k;
  EXPECT_TRUE(missing.empty()) << "kinds no LibTorch scenario reached:" << list;
}

// target_leak's token form (Note [Target leak]): a LibTorch LM trained on its own input ids. The
// audit must see the embedding lookup: a trainsan::Sanitizer given begin_step() starts it before
// the forward; through trainsan::attach the forward is seen at its first op on a parameter (the
// lookup itself; begin_step() only arms that watch), whose output the audit cannot hold, so
// nothing is said. Shifted targets are silent.
struct TokenLM : torch::nn::Module {
  TokenLM() {
    emb = register_module("emb", torch::nn::Embedding(50, 16));
    rnn = register_module("rnn", torch::nn::GRU(torch::nn::GRUOptions(16, 16).batch_first(true)));
    head = register_module("head", torch::nn::Linear(16, 50));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(std::get<0>(rnn(emb(ids)))); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::GRU rnn{nullptr};
  torch::nn::Linear head{nullptr};
};

std::set<std::string> token_lm(bool attach, int64_t shift) {
  torch::manual_seed(0);
  TokenLM lm;
  torch::optim::Adam opt(lm.parameters(), 1e-3);
  auto san = attach ? trainsan::attach(lm, opt, record())
                    : trainsan::Sanitizer(lm.named_parameters(), record());
  const torch::Tensor data = torch::randint(0, 50, {1024});
  for (int i = 0; i < 2; ++i) {
    const int64_t at = 40 * i;
    const torch::Tensor x = data.slice(0, at, at + 8 * 16).view({8, 16});
    const torch::Tensor y = data.slice(0, at + shift, at + shift + 8 * 16).view({8, 16});
    san.begin_step({x});
    opt.zero_grad();
    const torch::Tensor logits = lm.forward(x);
    const torch::Tensor loss =
        torch::nn::functional::cross_entropy(logits.view({-1, 50}), y.reshape({-1}));
    loss.backward();
    opt.step();
    san.end_step(loss);
  }
  san.close();
  return kinds_of(san);
}

TEST(LibTorchKinds, TargetLeakOfTokensWhereTheLookupIsSeen) {
  EXPECT_EQ(token_lm(/*attach=*/false, 0), std::set<std::string>{"target_leak"});
  EXPECT_TRUE(token_lm(/*attach=*/false, 1).empty());
  EXPECT_TRUE(token_lm(/*attach=*/true, 0).empty());  // see above
}

// Re-run attribution (Options::rerun_on_error; Note [Re-run attribution]): a NaN the batch
// carries reproduces when the step is re-run (and writes a poison_batch record); a NaN a flaky
// forward made once does not; off, nothing changes.
TEST(Attribution, LibTorchLoopSaysWhetherTheStepReproduces) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const char* mode : {"batch", "transient", "off", "raise"}) {
    SCOPED_TRACE(mode);
    const std::string m = mode;
    const std::string trace = ::testing::TempDir() + "trainsan_attribution.jsonl";
    trainsan::Options o = record();
    o.rerun_on_error = m == "off" ? 0 : 3;
    o.trace = trace;
    if (m == "raise") o.policy = "raise";
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), 0.05);
    auto san = trainsan::attach(net, opt, o);
    int calls = 0;
    torch::Tensor x;
    int i = 0;
    auto forward = [&](const torch::Tensor& in) {
      calls += 1;
      auto out = net.forward(in);
      return m == "transient" && calls == 3 ? out * nan : out;  // step 2's own forward only
    };
    int reruns = 0;
    san.set_rerun_step([&] {
      reruns += 1;
      auto l = kCrossEntropy(forward(x), i);
      l.backward();
      return trainsan::RerunRecord().add("loss", {l});
    });
    std::optional<trainsan::Finding> raised;
    try {
      for (i = 0; i < 4; ++i) {
        opt.zero_grad();
        x = batch(i);
        if (m != "transient" && i == 2) x[0][0] = nan;
        auto loss = kCrossEntropy(forward(x), i);
        san.watch_loss(loss);  // before the backward: judged at the step's own parameters
        loss.backward();
        opt.step();
        san.end_step(loss);
      }
    } catch (const trainsan::TrainingBugError& e) {
      raised = e.finding;
    }
    san.close();
    std::optional<trainsan::Finding> f;
    for (const auto& g : san.findings()) {
      if (g.kind == "nonfinite_loss") f = g;
    }
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->step, 2);
    std::ifstream in(trace);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (m == "off") {
      EXPECT_FALSE(f->reproduces.has_value());
      EXPECT_EQ(f->message.find("re-run"), std::string::npos) << f->message;
      EXPECT_EQ(reruns, 0);
      EXPECT_EQ(text.find("rerun_attribution"), std::string::npos);
      continue;
    }
    EXPECT_EQ(reruns, 1);  // once: the repeats and the nonfinite_grad of step 2 are not re-run
    ASSERT_TRUE(f->reproduces.has_value()) << f->message;
    EXPECT_EQ(*f->reproduces, m != "transient") << f->message;
    EXPECT_NE(f->message.find(m == "transient" ? "does not reproduce" : "reproduces (a data"),
              std::string::npos)
        << f->message;
    EXPECT_EQ(text.find("\"type\":\"poison_batch\"") != std::string::npos, m != "transient");
    if (m == "raise") {
      ASSERT_TRUE(raised.has_value());
      EXPECT_EQ(raised->kind, "nonfinite_loss");
      EXPECT_TRUE(raised->reproduces.value_or(false)) << raised->message;
    }
    std::remove(trace.c_str());
  }
}

}  // namespace
