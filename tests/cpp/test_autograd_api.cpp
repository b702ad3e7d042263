// The LibTorch API of bad_custom_grad (trainsan::check_custom_grad, Sanitizer::check_custom_grad)
// and nondeterminism (Sanitizer::rerun) on torch::autograd::Function subclasses and a small
// training loop: correct code is silent and trains bit for bit as without the checks; planted
// bugs are found and located.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "trainsan/trainsan.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// --- custom Functions ---------------------------------------------------------------------------

template <int Factor>
struct ScaledExp : torch::autograd::Function<ScaledExp<Factor>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    at::Tensor y = x.exp();
    ctx->save_for_backward({y});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {Factor * g[0] * ctx->get_saved_variables()[0]};
  }
};
using MyExp = ScaledExp<1>;
using DoubledExp = ScaledExp<2>;  // bug: off by a factor 2

template <int WeightSign>
struct Linear : torch::autograd::Function<Linear<WeightSign>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b) {
    ctx->save_for_backward({x, w});
    return x.matmul(w.t()) + b;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    return {g[0].matmul(w), WeightSign * g[0].t().matmul(x), g[0].sum(0)};
  }
};
using MyLinear = Linear<1>;
using NegatedWeightLinear = Linear<-1>;  // bug: the weight gradient's sign

// Computes in float32 whatever its inputs: a lower-precision Function (looser tolerance).
struct Float32Sin : torch::autograd::Function<Float32Sin> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return x.to(at::kFloat).sin();
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    return {(g[0] * x.to(at::kFloat).cos()).to(x.scalar_type())};
  }
};

// A custom dropout: stochastic, with a correct backward for its own mask.
struct MyDropout : torch::autograd::Function<MyDropout> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x) {
    const at::Tensor mask = (at::rand_like(x) > 0.5).to(x.scalar_type()) * 2;
    ctx->save_for_backward({mask});
    return x * mask;
  }
  static variable_list backward(AutogradContext* ctx, variable_list g) {
    return {g[0] * ctx->get_saved_variables()[0]};
  }
};

template <typename F>
trainsan::TensorFunction unary() {
  return [](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{F::apply(x[0])}; };
}

template <typename F>
trainsan::TensorFunction ternary() {
  return [](const std::vector<at::Tensor>& x) {
    return std::vector<at::Tensor>{F::apply(x[0], x[1], x[2])};
  };
}

std::vector<at::Tensor> linear_inputs(bool x_requires_grad = true) {
  torch::manual_seed(3);
  return {torch::randn({4, 3}).requires_grad_(x_requires_grad),
          torch::randn({6, 3}).requires_grad_(), torch::randn({6}).requires_grad_()};
}

TEST(CheckCustomGrad, CorrectBackwardsAreSilent) {
  torch::manual_seed(0);
  EXPECT_TRUE(
      trainsan::check_custom_grad("MyExp", unary<MyExp>(), {torch::randn({5, 3}).requires_grad_()})
          .empty());
  EXPECT_TRUE(
      trainsan::check_custom_grad("MyLinear", ternary<MyLinear>(), linear_inputs()).empty());
  EXPECT_TRUE(trainsan::check_custom_grad("Float32Sin", unary<Float32Sin>(),
                                          {torch::randn({7}, at::kDouble).requires_grad_()})
                  .empty());
  EXPECT_TRUE(trainsan::check_custom_grad("MyDropout", unary<MyDropout>(),
                                          {torch::randn({9}).requires_grad_()})
                  .empty());
}

TEST(CheckCustomGrad, AFactorOffIsFoundWithItsRatio) {
  torch::manual_seed(0);
  const auto fs = trainsan::check_custom_grad("DoubledExp", unary<DoubledExp>(),
                                              {torch::randn({5, 3}).requires_grad_()});
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].kind, "bad_custom_grad");
  EXPECT_EQ(fs[0].severity, "error");
  EXPECT_EQ(fs[0].tensor, "DoubledExp:input 0");
  ASSERT_TRUE(fs[0].value.has_value());
  EXPECT_NEAR(*fs[0].value, 2.0, 2e-3);
  EXPECT_NE(fs[0].message.find("(2x)"), std::string::npos) << fs[0].message;
}

TEST(CheckCustomGrad, AFlippedSignIsFoundOnItsInputOnly) {
  const auto fs = trainsan::check_custom_grad("NegatedWeightLinear", ternary<NegatedWeightLinear>(),
                                              linear_inputs());
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].tensor, "NegatedWeightLinear:input 1");
  EXPECT_NE(fs[0].message.find("(the opposite sign)"), std::string::npos) << fs[0].message;
}

TEST(MeasureCustomGrad, OneResultPerDifferentiableInputAndNothingTouched) {
  const std::vector<at::Tensor> in = linear_inputs(/*x_requires_grad=*/false);
  std::vector<at::Tensor> before;
  for (const auto& t : in) before.push_back(t.detach().clone());
  torch::manual_seed(42);
  const auto results = trainsan::measure_custom_grad("MyLinear", ternary<MyLinear>(), in);
  const at::Tensor after = torch::rand({3});  // the caller's random stream is kept
  torch::manual_seed(42);
  EXPECT_TRUE(torch::equal(after, torch::rand({3})));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].input_index, 1);
  EXPECT_EQ(results[1].input_index, 2);
  for (const auto& r : results) {
    EXPECT_EQ(r.function, "MyLinear");
    EXPECT_FALSE(r.low_precision);
    EXPECT_NEAR(r.analytic, r.central, 1e-6 * std::abs(r.central) + 1e-9);
    EXPECT_GT(r.unit, 0.0);
  }
  for (size_t k = 0; k < in.size(); ++k) {
    EXPECT_TRUE(torch::equal(in[k], before[k]));
    EXPECT_FALSE(in[k].grad().defined());
  }
  // Float32 outputs: measured in lower precision.
  const auto low = trainsan::measure_custom_grad("Float32Sin", unary<Float32Sin>(),
                                                 {torch::randn({7}).requires_grad_()});
  ASSERT_EQ(low.size(), 1u);
  EXPECT_TRUE(low[0].low_precision);
}

TEST(MeasureCustomGrad, NothingToMeasure) {
  // No input requires grad; a function that throws on the copies; an empty function.
  EXPECT_TRUE(trainsan::measure_custom_grad("MyExp", unary<MyExp>(), {torch::randn({3})}).empty());
  const trainsan::TensorFunction throws = [](const std::vector<at::Tensor>& x) {
    TORCH_CHECK(x[0].scalar_type() == at::kFloat, "float32 only");
    return std::vector<at::Tensor>{x[0]};
  };
  EXPECT_TRUE(
      trainsan::measure_custom_grad("F", throws, {torch::randn({3}).requires_grad_()}).empty());
  EXPECT_THROW(trainsan::measure_custom_grad("F", {}, {torch::randn({3}).requires_grad_()}),
               c10::ValueError);
}

TEST(SanitizerCheckCustomGrad, AtItsFirstCallThenOnSampledStepsThroughThePolicy) {
  auto run = [](int64_t every, int steps) {
    torch::manual_seed(0);
    at::Tensor w = torch::randn({4}).requires_grad_();
    trainsan::Options o;
    o.policy = "record";
    o.gradcheck_every = every;
    trainsan::Sanitizer san({{"w", w}}, o);
    torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.01));
    for (int i = 0; i < steps; ++i) {
      const at::Tensor x = torch::randn({4});
      opt.zero_grad();
      san.begin_step({x});
      san.check_custom_grad("DoubledExp", unary<DoubledExp>(), {w * x});
      DoubledExp::apply(w * x).sum().backward();
      opt.step();
      san.end_step();
    }
    san.close();
    std::vector<trainsan::Finding> out;
    for (const auto& f : san.findings()) {
      if (f.kind == "bad_custom_grad") out.push_back(f);
    }
    return out;
  };
  const auto once = run(0, 3);  // its first call only
  ASSERT_EQ(once.size(), 1u);
  EXPECT_EQ(once[0].step, 0);
  EXPECT_EQ(once[0].count, 1);
  const auto fs = run(4, 5);  // steps 0 and 4
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].tensor, "DoubledExp:input 0");
  EXPECT_EQ(fs[0].step, 0);
  EXPECT_EQ(fs[0].count, 2);
  EXPECT_EQ(fs[0].last_step, 4);
}

// A straight-through round and a gradient reversal: deliberate surrogates (Note [Surrogate
// gradients]), silent; a ReLU whose backward doubles is found on its positive side.
struct RoundSTE : public torch::autograd::Function<RoundSTE> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.round();
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*,
                                               torch::autograd::tensor_list g) {
    return {g[0]};
  }
};

struct GradReverse : public torch::autograd::Function<GradReverse> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.view_as(x);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*,
                                               torch::autograd::tensor_list g) {
    return {-0.5 * g[0]};
  }
};

struct DoubledReLU : public torch::autograd::Function<DoubledReLU> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    ctx->save_for_backward({x});
    return x.clamp_min(0);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list g) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    return {2 * g[0] * (x > 0).to(g[0].scalar_type())};
  }
};

TEST(CheckCustomGrad, SurrogateGradientsAreSilentAndAReluSlipIsFound) {
  torch::manual_seed(0);
  const at::Tensor x = (3 * torch::randn({6, 5})).requires_grad_();
  EXPECT_TRUE(trainsan::check_custom_grad("RoundSTE", unary<RoundSTE>(), {x}).empty());
  EXPECT_TRUE(trainsan::check_custom_grad("GradReverse", unary<GradReverse>(), {x}).empty());
  const auto fs = trainsan::check_custom_grad("DoubledReLU", unary<DoubledReLU>(), {x});
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_NE(fs[0].message.find("(2x)"), std::string::npos) << fs[0].message;
}

// --- Sanitizer::rerun ---------------------------------------------------------------------------

using Mid = std::function<at::Tensor(const at::Tensor&)>;

// Linear → Dropout → mid → ReLU → BatchNorm → Linear; records each layer's output by name.
struct Model : torch::nn::Module {
  Model(Mid m, std::string type) : mid(std::move(m)), mid_type(std::move(type)) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    drop = register_module("drop", torch::nn::Dropout(0.3));
    bn = register_module("bn", torch::nn::BatchNorm1d(12));
    fc2 = register_module("fc2", torch::nn::Linear(12, 2));
  }
  at::Tensor forward(const at::Tensor& x, trainsan::RerunRecord& rec) {
    at::Tensor h = fc1(x);
    rec.add("fc1", {h}, "Linear");
    h = drop(h);
    rec.add("drop", {h}, "Dropout");
    h = mid(h);
    rec.add("mid", {h}, mid_type);
    h = bn(torch::relu(h));
    rec.add("bn", {h}, "BatchNorm1d");
    h = fc2(h);
    rec.add("fc2", {h}, "Linear");
    return h;
  }
  Mid mid;
  std::string mid_type;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};

at::Generator& own_generator() {  // a generator the run never re-seeds
  static at::Generator g = at::make_generator<at::CPUGeneratorImpl>(123);
  return g;
}

struct NoisyGrad : torch::autograd::Function<NoisyGrad> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static variable_list backward(AutogradContext*, variable_list g) {
    return {g[0] + at::randn(g[0].sizes(), own_generator()) * 1e-6};
  }
};

struct RerunRun {
  std::vector<trainsan::Finding> findings;
  std::vector<at::Tensor> state;  // parameters, then buffers, after training
  int calls = 0;                  // of the step function
};

// Four SGD steps; with `check`, under a sanitizer that re-runs every `every`-th step.
// `state`: tensors the forward updates besides the model's buffers (in Setup::buffers too).
RerunRun train(const Mid& mid, const std::string& type, bool check = true, int64_t every = 2,
               const std::vector<at::Tensor>& state = {}) {
  torch::manual_seed(0);
  Model m(mid, type);
  torch::optim::SGD opt(m.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  trainsan::Options o;
  o.policy = "record";
  o.rerun_every = every;
  std::vector<trainsan::Parameter> ps;
  for (const auto& kv : m.named_parameters()) ps.push_back({kv.key(), kv.value(), 0});
  trainsan::Setup setup;
  for (const auto& b : m.buffers()) setup.buffers.push_back(b);
  setup.buffers.insert(setup.buffers.end(), state.begin(), state.end());
  std::optional<trainsan::Sanitizer> san;
  if (check) san.emplace(ps, o, setup);
  RerunRun out;
  torch::manual_seed(1);
  for (int i = 0; i < 4; ++i) {
    const at::Tensor x = torch::randn({16, 6}, at::make_generator<at::CPUGeneratorImpl>(i));
    opt.zero_grad();
    if (san) san->begin_step({x});
    trainsan::RerunRecord own;
    const at::Tensor loss = m.forward(x, own).pow(2).mean();
    own.add("loss", {loss});
    loss.backward();
    if (san) {
      san->watch_loss(loss);
      san->rerun(
          [&] {
            trainsan::RerunRecord r;
            const at::Tensor l = m.forward(x, r).pow(2).mean();
            r.add("loss", {l});
            l.backward();
            out.calls += 1;
            return r;
          },
          own);
    }
    opt.step();
    if (san) san->end_step();
  }
  if (san) {
    san->close();
    out.findings = san->findings();
  }
  for (const auto& p : m.parameters()) out.state.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.state.push_back(b.detach().clone());
  for (const auto& t : state) out.state.push_back(t.detach().clone());
  return out;
}

std::vector<trainsan::Finding> of_kind(const RerunRun& r, const std::string& kind) {
  std::vector<trainsan::Finding> out;
  for (const auto& f : r.findings) {
    if (f.kind == kind) out.push_back(f);
  }
  return out;
}

const Mid kIdentity = [](const at::Tensor& h) { return h; };

TEST(Rerun, DeterministicStepIsSilentAndTrainsUnchanged) {
  const RerunRun with = train(kIdentity, "Identity");
  const RerunRun without = train(kIdentity, "Identity", /*check=*/false);
  const RerunRun off = train(kIdentity, "Identity", true, /*every=*/0);
  EXPECT_EQ(with.calls, 4);  // steps 0 and 2, twice each
  EXPECT_EQ(off.calls, 0);   // not due: the step function is not called
  EXPECT_TRUE(of_kind(with, "nondeterminism").empty());
  // The gradients, the RNG and the buffers were put back: training is bit for bit the same,
  // and the other checks saw the same steps (the re-runs' backwards are not theirs).
  ASSERT_EQ(with.state.size(), without.state.size());
  for (size_t k = 0; k < with.state.size(); ++k) {
    EXPECT_TRUE(torch::equal(with.state[k], without.state[k])) << k;
  }
  ASSERT_EQ(with.findings.size(), off.findings.size());
  for (size_t k = 0; k < with.findings.size(); ++k) {
    EXPECT_EQ(with.findings[k].kind, off.findings[k].kind);
    EXPECT_EQ(with.findings[k].tensor, off.findings[k].tensor);
  }
}

TEST(Rerun, ACounterKeptInABufferIsModelStateNotNondeterminism) {
  // Each re-run starts from the buffer's value at begin_step() and leaves it as it found it.
  auto counted = [](const at::Tensor& calls) {
    return [calls](const at::Tensor& h) {
      calls.add_(1);
      return h + 1e-3 * calls;
    };
  };
  const at::Tensor a = torch::zeros({}), b = torch::zeros({});
  const RerunRun with = train(counted(a), "BufferCounter", true, 2, {a});
  const RerunRun without = train(counted(b), "BufferCounter", false, 2, {b});
  EXPECT_EQ(with.calls, 4);
  EXPECT_TRUE(of_kind(with, "nondeterminism").empty());
  EXPECT_EQ(a.item<float>(), 4.0f);  // the step's own calls only
  ASSERT_EQ(with.state.size(), without.state.size());
  for (size_t k = 0; k < with.state.size(); ++k) {
    EXPECT_TRUE(torch::equal(with.state[k], without.state[k])) << k;
  }
}

TEST(Rerun, UnseededGeneratorIsLocatedInTheForward) {
  const RerunRun r =
      train([](const at::Tensor& h) { return h + at::randn(h.sizes(), own_generator()) * 1e-3; },
            "Unseeded");
  const auto fs = of_kind(r, "nondeterminism");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].step, 0);
  EXPECT_EQ(fs[0].tensor, "mid");
  EXPECT_NE(fs[0].message.find("forward twice on the same batch"), std::string::npos);
  EXPECT_NE(fs[0].message.find("(Unseeded)"), std::string::npos) << fs[0].message;
}

TEST(Rerun, CounterChangingAtEveryCallIsLocated) {
  const RerunRun r =
      train([calls = 0](const at::Tensor& h) mutable { return h + 1e-3 * ++calls; }, "Counter");
  const auto fs = of_kind(r, "nondeterminism");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].tensor, "mid");
  EXPECT_NE(fs[0].message.find("state the module changes at every call"), std::string::npos);
}

TEST(Rerun, NondeterministicBackwardIsLocated) {
  const RerunRun r = train([](const at::Tensor& h) { return NoisyGrad::apply(h); }, "Noisy");
  const auto fs = of_kind(r, "nondeterminism");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_NE(fs[0].message.find("backward twice from the same output gradient"), std::string::npos);
  EXPECT_EQ(fs[0].tensor, "fc1.bias");  // the first parameter its noise reaches
}

TEST(Rerun, StateSetByTheStepsOwnCallIsBetweenCalls) {
  auto centre = std::make_shared<at::Tensor>();
  const RerunRun r = train(
      [centre](const at::Tensor& h) {
        if (!centre->defined()) {
          *centre = h.detach().mean();
          return h;
        }
        return h - *centre;
      },
      "LazyCentre");
  const auto fs = of_kind(r, "nondeterminism");
  ASSERT_EQ(fs.size(), 1u);
  EXPECT_EQ(fs[0].tensor, "mid");
  EXPECT_NE(fs[0].message.find("agree with each other but not with the step's own forward"),
            std::string::npos);
  EXPECT_NE(fs[0].message.find("(LazyCentre)"), std::string::npos);
}

TEST(Rerun, TheRandomStreamIsLeftAsFound) {
  at::Tensor w = torch::randn({3}).requires_grad_();
  trainsan::Options o;
  o.policy = "record";
  o.rerun_every = 1;
  trainsan::Sanitizer san({{"w", w}}, o);
  san.begin_step();
  (w * torch::rand({3})).sum().backward();
  auto state = [] {
    at::Generator g = at::detail::getDefaultCPUGenerator();
    const std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  };
  const at::Tensor before = state();
  int calls = 0;
  san.rerun([&] {
    (w * torch::rand({3})).sum().backward();
    torch::rand({100});  // draws more than the step did
    calls += 1;
    return trainsan::RerunRecord{};
  });
  EXPECT_EQ(calls, 2);
  EXPECT_TRUE(torch::equal(state(), before));
  EXPECT_TRUE(san.findings().empty());
  san.close();
}

TEST(Rerun, StepFunctionErrorsLeaveTheStepAsItWas) {
  at::Tensor w = torch::randn({3}).requires_grad_();
  trainsan::Options o;
  o.policy = "record";
  o.rerun_every = 1;
  trainsan::Sanitizer san({{"w", w}}, o);
  san.begin_step();
  (w * 2).sum().backward();
  const at::Tensor grad = w.grad();
  const at::Tensor values = grad.clone();
  EXPECT_THROW(san.rerun({}), c10::ValueError);
  EXPECT_THROW(san.rerun([&]() -> trainsan::RerunRecord {
    (w * 3).sum().backward();
    throw std::runtime_error("the user's step failed");
  }),
               std::runtime_error);
  EXPECT_TRUE(w.grad().is_same(grad));
  EXPECT_TRUE(torch::equal(w.grad(), values));
  san.close();
}

// The driver with the caller's start state and run (Note [One re-run driver]), as the Python
// package calls it: two runs, each between start() and restore(), the records' own fingerprints
// and gradients compared, restore() called on an exception too; nothing when no re-run is due.
TEST(Rerun, StepRerunDriverRunsTwiceBetweenStartAndRestore) {
  at::Tensor w = torch::randn({3}).requires_grad_();
  trainsan::Options o;
  o.policy = "record";
  o.rerun_every = 2;
  trainsan::Sanitizer san({{"w", w}}, o);
  std::vector<std::string> calls;
  int runs = 0;
  bool noisy_grad = false;
  const trainsan::StepRerun how{[&] { calls.push_back("start"); },
                                [&] { calls.push_back("restore"); },
                                [&] {
                                  calls.push_back("run");
                                  runs += 1;
                                  trainsan::RerunRecord r;
                                  r.add_hashes("fc", {7, 8}, "Linear");
                                  const at::Tensor g = torch::ones({3});
                                  r.grads.emplace_back("w", noisy_grad ? g * runs : g);
                                  return r;
                                }};
  trainsan::RerunRecord own;
  own.add_hashes("fc", {7, 8}, "Linear");
  san.begin_step();
  san.rerun(how, own);  // step 0: due, the runs agree with each other and with the step's own
  EXPECT_EQ(calls,
            (std::vector<std::string>{"start", "run", "restore", "start", "run", "restore"}));
  EXPECT_TRUE(san.findings().empty());
  san.end_step();
  calls.clear();
  san.begin_step();
  san.rerun(how, own);  // step 1: not due
  EXPECT_TRUE(calls.empty());
  san.end_step();
  san.begin_step();
  noisy_grad = true;
  san.rerun(how, std::nullopt);  // step 2: the gradients differ
  ASSERT_EQ(san.findings().size(), 1u);
  EXPECT_EQ(san.findings()[0].kind, "nondeterminism");
  EXPECT_EQ(san.findings()[0].tensor, "w");
  EXPECT_NE(san.findings()[0].message.find("backward twice"), std::string::npos);
  san.end_step();
  san.begin_step();
  san.end_step();
  san.begin_step();
  calls.clear();
  const trainsan::StepRerun failing{how.start, how.restore, [&]() -> trainsan::RerunRecord {
                                      calls.push_back("run");
                                      throw std::runtime_error("the run failed");
                                    }};
  EXPECT_THROW(san.rerun(failing, std::nullopt), std::runtime_error);  // step 4
  EXPECT_EQ(calls, (std::vector<std::string>{"start", "run", "restore"}));
  san.close();
}

// --- Sanitizer::recompute (Note [Recompute checks]) -----------------------------------------

// A region with dropout, called for its forward and again for its "recompute", the RNG state
// put back before the recompute or not; the findings of one check.
std::vector<trainsan::Finding> recompute_region(bool preserve_rng) {
  torch::manual_seed(0);
  at::Tensor w = torch::randn({8, 8}).requires_grad_();
  trainsan::Options o;
  o.policy = "record";
  trainsan::Sanitizer san({{"w", w}}, o);
  san.begin_step();
  EXPECT_TRUE(san.recompute_due());  // the first step (recompute_every=100)
  const at::Tensor x = torch::randn({4, 8});
  auto region = [&] { return torch::dropout(torch::matmul(x, w), 0.5, /*train=*/true); };
  at::Generator g = at::detail::getDefaultCPUGenerator();
  at::Tensor start;
  {
    const std::lock_guard<std::mutex> lock(g.mutex());
    start = g.get_state();
  }
  trainsan::RecomputeRecord fwd{"block", "", {}, trainsan::rng_fingerprints({x})};
  fwd.hashes = trainsan::output_fingerprints({region()});
  if (preserve_rng) {
    const std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(start);
  }
  trainsan::RecomputeRecord again{"block", "", {}, trainsan::rng_fingerprints({x})};
  again.hashes = trainsan::output_fingerprints({region()});
  san.recompute(fwd, again);
  std::vector<trainsan::Finding> out = san.findings();
  san.close();
  return out;
}

TEST(Recompute, DropoutRecomputedWithoutItsRngStateIsNamed) {
  const std::vector<trainsan::Finding> f = recompute_region(false);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0].kind, "nondeterminism");
  EXPECT_EQ(f[0].tensor, "block");
  EXPECT_NE(f[0].message.find("RNG is not preserved"), std::string::npos) << f[0].message;
}

TEST(Recompute, DropoutRecomputedFromItsRngStateIsSilent) {
  EXPECT_TRUE(recompute_region(true).empty());
}

}  // namespace
