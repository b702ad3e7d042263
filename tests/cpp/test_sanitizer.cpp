// A LibTorch training loop through the C++ API of the sanitizer.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

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

// Five steps of batches 0, 1, 2 and then 2 again (the data stops advancing: duplicate_batch),
// never calling zero_grad (stale_grad).
void train_without_zero_grad_repeating(Net& net, torch::optim::Optimizer& opt,
                                       trainsan::Sanitizer& san) {
  for (int i = 0; i < 5; ++i) {
    const Batch b = batch(std::min(i, 2));
    san.begin_step({b.x, b.y});
    auto loss = torch::nn::functional::cross_entropy(net.forward(b.x), b.y);
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

// A hand-written loss scaler (docs/cpp.md, "Loss scalers"): iterations 8 and 12 plant a loss x
// 1e30 whose gradients overflow; the scaler reports the skip before end_step and does not step.
// Those losses are not loss_spike (Note [Loss stream]), whether given to watch_loss before the
// report or to end_step(loss) after it; a x 1e4 loss at iteration 16 that the scaler lets
// through is one.
TEST(Sanitizer, LossesOfStepsTheScalerSkippedAreNotSpikes) {
  for (const bool at_end : {false, true}) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(1e-3));
    trainsan::Sanitizer san(net.named_parameters(), record());
    for (int i = 0; i < 20; ++i) {
      const Batch b = batch(i);
      opt.zero_grad();
      san.begin_step({b.x, b.y});
      auto loss = torch::nn::functional::cross_entropy(net.forward(b.x), b.y);
      const bool skip = i == 8 || i == 12;
      if (skip) loss = loss * 1e30;
      if (i == 16) loss = loss * 1e4;
      if (!at_end) san.watch_loss(loss);
      loss.backward();
      if (skip) {
        san.scaler_step({0, /*skipped=*/true, 1.0});
      } else {
        opt.step();
        san.scaler_step({0, /*skipped=*/false, 1.0});
      }
      if (at_end) {
        san.end_step(loss);
      } else {
        san.end_step();
      }
    }
    san.close();
    std::vector<trainsan::Finding> spikes;
    for (const auto& f : san.findings()) {
      if (f.kind == "loss_spike") spikes.push_back(f);
    }
    ASSERT_EQ(spikes.size(), 1u) << at_end;
    EXPECT_GT(spikes[0].value.value_or(0.0), 1e3) << spikes[0].message;
    EXPECT_LT(spikes[0].value.value_or(0.0), 1e6) << spikes[0].message;
  }
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

// --- issue 7: opt-in and mode checks from LibTorch, the tables, the policy's one answer ---------

namespace {

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::vector<trainsan::Finding> of_kind(const std::vector<trainsan::Finding>& fs,
                                       const std::string& kind) {
  std::vector<trainsan::Finding> out;
  for (const auto& f : fs) {
    if (f.kind == kind) out.push_back(f);
  }
  return out;
}

// The parameters of `net`, all in optimizer 0 (the three-argument constructor's form).
std::vector<trainsan::Parameter> params_of(Net& net) {
  std::vector<trainsan::Parameter> ps;
  for (const auto& item : net.named_parameters()) ps.push_back({item.key(), item.value(), 0});
  return ps;
}

// `steps` clean steps; `during_forward` runs after begin_step and the forward, before the loss.
template <typename F>
void train_with(Net& net, torch::optim::Optimizer& opt, trainsan::Sanitizer& san, int steps,
                F during_forward) {
  for (int i = 0; i < steps; ++i) {
    const Batch b = batch(i);
    opt.zero_grad();
    san.begin_step({b.x, b.y});
    auto out = net.forward(b.x);
    during_forward();
    auto loss = torch::nn::functional::cross_entropy(out, b.y);
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
}

std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "<no c10::ValueError>";
}

}  // namespace

TEST(Sanitizer, NonfiniteActivationFromLibTorchIsCountedAndTraced) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  const std::string path = ::testing::TempDir() + "trainsan_cpp_activation.jsonl";
  trainsan::Options o = record();
  o.trace = path;
  o.checks["nonfinite_activation"] = true;
  trainsan::Sanitizer san(net.named_parameters(), o);
  torch::Tensor bad = torch::zeros({2, 3});
  bad[0][1] = std::numeric_limits<float>::quiet_NaN();
  train_with(net, opt, san, 3, [&] { san.module_output({"fc1", "Linear"}, {bad}); });
  san.close();

  const auto act = of_kind(san.findings(), "nonfinite_activation");
  ASSERT_EQ(act.size(), 1u);
  EXPECT_EQ(act[0].count, 3);
  EXPECT_EQ(act[0].step, 0);
  EXPECT_EQ(act[0].last_step, 2);
  EXPECT_EQ(act[0].tensor, "fc1");
  EXPECT_EQ(act[0].severity, "error");
  ASSERT_TRUE(act[0].value.has_value());
  EXPECT_EQ(*act[0].value, 1.0);
  EXPECT_EQ(act[0].message.rfind("nonfinite_activation at step 0: the output of fc1 (Linear) "
                                 "holds 1 NaN and 0 ±Inf values",
                                 0),
            0u)
      << act[0].message;
  EXPECT_EQ(san.findings().size(), 1u);  // nothing else is wrong with this loop

  const auto lines = read_lines(path);
  ASSERT_GE(lines.size(), 2u);
  int traced = 0;
  for (const auto& l : lines) {
    if (contains(l, "\"type\":\"finding\"") && contains(l, "\"kind\":\"nonfinite_activation\"")) {
      ++traced;
      EXPECT_TRUE(contains(l, "\"tensor\":\"fc1\"")) << l;
    }
  }
  EXPECT_EQ(traced, 1);
  const std::string& summary = lines.back();
  ASSERT_TRUE(contains(summary, "\"type\":\"summary\"")) << summary;
  const size_t at = summary.find("\"findings\":{");
  ASSERT_NE(at, std::string::npos) << summary;
  const std::string counts = summary.substr(at, summary.find('}', at) - at);
  EXPECT_TRUE(contains(counts, "\"nonfinite_activation\":3")) << summary;
}

TEST(Sanitizer, NonfiniteActivationIsOptIn) {
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  trainsan::Sanitizer san(net.named_parameters(), record());
  const torch::Tensor bad = torch::full({4}, std::numeric_limits<float>::infinity());
  train_with(net, opt, san, 2, [&] { san.module_output({"fc1", "Linear"}, {bad}); });
  san.close();
  EXPECT_TRUE(san.findings().empty());
}

TEST(Sanitizer, EvalModeFromLibTorch) {
  for (const bool in_eval : {true, false}) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
    trainsan::Setup setup;
    setup.mode_modules = {{"drop", "Dropout"}};
    trainsan::Sanitizer san(params_of(net), record(), setup);
    for (int i = 0; i < 2; ++i) {
      const Batch b = batch(i);
      opt.zero_grad();
      san.begin_step({b.x, b.y}, {in_eval});
      auto loss = torch::nn::functional::cross_entropy(net.forward(b.x), b.y);
      san.watch_loss(loss);
      loss.backward();
      opt.step();
      san.end_step();
    }
    san.close();
    const auto em = of_kind(san.findings(), "eval_mode");
    if (!in_eval) {
      EXPECT_TRUE(san.findings().empty());
      continue;
    }
    ASSERT_EQ(em.size(), 1u);
    EXPECT_EQ(em[0].tensor, "drop");
    EXPECT_EQ(em[0].severity, "warning");
    EXPECT_EQ(em[0].step, 0);
    EXPECT_EQ(em[0].count, 2);
    EXPECT_TRUE(contains(em[0].message, "'drop' (Dropout)")) << em[0].message;
    EXPECT_EQ(san.findings().size(), 1u);
  }
}

TEST(Sanitizer, Fp16OverflowFromLibTorchUnderCpuAutocast) {
  for (const bool autocast : {true, false}) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
    std::vector<trainsan::Parameter> ps = params_of(net);
    // Not trainable and not in the forward: it stays at 70000 (> 65504, fp16's largest).
    ps.push_back({"scale", torch::full({4}, 70000.0f), 0});
    trainsan::Sanitizer san(std::move(ps), record(), trainsan::Setup{});
    const bool was_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    const at::ScalarType was_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    for (int i = 0; i < 2; ++i) {
      const Batch b = batch(i);
      opt.zero_grad();
      torch::Tensor loss;
      at::autocast::set_autocast_enabled(at::kCPU, autocast);
      at::autocast::set_autocast_dtype(at::kCPU, at::kHalf);
      try {
        san.begin_step({b.x, b.y});
        loss = torch::nn::functional::cross_entropy(net.forward(b.x).to(at::kFloat), b.y);
      } catch (...) {
        at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
        at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
        throw;
      }
      at::autocast::set_autocast_enabled(at::kCPU, was_enabled);
      at::autocast::set_autocast_dtype(at::kCPU, was_dtype);
      at::autocast::clear_cache();
      san.watch_loss(loss);
      loss.backward();
      opt.step();
      san.end_step();
    }
    san.close();
    const auto ov = of_kind(san.findings(), "fp16_overflow");
    if (!autocast) {
      EXPECT_TRUE(ov.empty()) << ov.front().message;
      continue;
    }
    ASSERT_EQ(ov.size(), 1u);
    EXPECT_EQ(ov[0].tensor, "scale");
    EXPECT_EQ(ov[0].severity, "warning");
    EXPECT_EQ(ov[0].step, 0);
    ASSERT_TRUE(ov[0].value.has_value());
    EXPECT_EQ(*ov[0].value, 4.0);
    EXPECT_TRUE(contains(ov[0].message, "scale holds 4 values beyond ±65504")) << ov[0].message;
  }
}

// Issue 39: a complex parameter trained with Adam under "record" (the step used to dereference an
// empty optional: "unknown dtype code <garbage>"), and a float8 one left out and named.
TEST(Sanitizer, ComplexParametersTrainAndUnreadDtypesAreNamed) {
  torch::manual_seed(0);
  torch::Tensor w = torch::randn({8, 3}, torch::kComplexFloat).mul_(0.3).requires_grad_();
  torch::Tensor frozen = torch::zeros({4}).to(torch::kFloat8_e4m3fn);
  std::vector<trainsan::Parameter> ps;
  ps.push_back({"w", w, /*optimizer=*/0});
  ps.push_back({"frozen", frozen, /*optimizer=*/-1});
  trainsan::Sanitizer san(std::move(ps), record(), trainsan::Setup{});
  torch::optim::Adam opt({w}, torch::optim::AdamOptions(1e-2));
  for (int i = 0; i < 12; ++i) {
    const Batch b = batch(i);
    opt.zero_grad();
    san.begin_step({b.x, b.y});
    auto loss =
        torch::nn::functional::cross_entropy(b.x.to(torch::kComplexFloat).matmul(w).abs(), b.y);
    san.watch_loss(loss);
    loss.backward();
    opt.step();
    san.end_step();
  }
  san.close();
  for (const auto& f : san.findings()) EXPECT_NE(f.severity, "error") << f.message;
  const trainsan::Coverage c = san.coverage();
  EXPECT_EQ(c.steps_checked, 12);
  ASSERT_EQ(c.unread.size(), 1u);
  EXPECT_EQ(c.unread[0], "frozen (float8_e4m3fn)");
}

// Note [Faults]: an exception out of an event (here a bad index given to local_shards) is the
// run's under "raise"; under "record" it is told once, kept in coverage().fault, later events
// return at once, and close() still closes (the hooks are removed).
TEST(Sanitizer, AnErrorInAnEventUnderRecordIsToldAndTheLoopGoesOn) {
  torch::manual_seed(0);
  for (const bool strict : {true, false}) {
    Net net;
    torch::optim::SGD opt(net.parameters(), 0.1);
    trainsan::Options o;
    o.policy = strict ? "raise" : "record";
    trainsan::Sanitizer san(net.named_parameters(), o);
    train(net, opt, san, 2);
    const torch::Tensor t = torch::zeros({1});
    if (strict) {
      EXPECT_THROW(san.local_shards({99}, {t}, {t}), c10::ValueError);
      san.close();
      continue;
    }
    EXPECT_NO_THROW(san.local_shards({99}, {t}, {t}));
    const std::string fault = san.coverage().fault;
    EXPECT_NE(fault.find("internal error in local_shards at step 2"), std::string::npos) << fault;
    EXPECT_NO_THROW(train(net, opt, san, 3));  // the loop goes on; nothing more is checked
    EXPECT_EQ(san.coverage().steps_checked, 2);
    EXPECT_TRUE(san.hooks_installed());
    EXPECT_NO_THROW(san.close());
    EXPECT_FALSE(san.hooks_installed());
  }
}

TEST(Sanitizer, UnknownOrUnimplementedCheckIsAnError) {
  torch::manual_seed(0);
  Net net;
  for (const std::string kind : {"nondeterministic", "stale_gard"}) {
    trainsan::Options o;
    o.checks[kind] = kind == "nondeterministic";  // off or on: an unknown name is an error
    EXPECT_THROW(trainsan::Sanitizer(net.named_parameters(), o), c10::ValueError) << kind;
    const std::string msg = error_text([&] { trainsan::Sanitizer s(net.named_parameters(), o); });
    EXPECT_TRUE(contains(msg, "'" + kind + "'")) << msg;
  }
}

// Every numeric option of options.def, at each side of its range: the bound itself where the
// range holds it, the nearest value beyond it refused with a message naming option, range and
// value (set by name, and a field set directly is refused by validate()). NaN is always refused.
TEST(Sanitizer, EveryOptionIsCheckedAgainstItsRange) {
  int numeric = 0;
  for (const trainsan::OptionInfo& info : trainsan::option_table()) {
    const std::string type = info.type;
    if (type != "int" && type != "float") continue;
    ++numeric;
    const std::string range = info.choices;
    ASSERT_GE(range.size(), 5u) << info.name;
    const size_t comma = range.find(',');
    const double lo = std::stod(range.substr(1, comma - 1));
    const double hi = std::stod(range.substr(comma + 1, range.size() - comma - 2));
    const bool lo_open = range.front() == '(', hi_open = range.back() == ')';
    auto text = [&](double v) {
      std::ostringstream os;
      os.precision(17);
      os << v;
      return os.str();
    };
    auto refused = [&](double v) {
      trainsan::Options o;
      const std::string msg = error_text([&] { o.set(info.name, text(v)); });
      EXPECT_TRUE(contains(msg, info.name) && contains(msg, range))
          << info.name << "=" << v << ": " << msg;
    };
    auto accepted = [&](double v) {
      trainsan::Options o;
      EXPECT_NO_THROW(o.set(info.name, text(v))) << info.name << "=" << v;
    };
    const double step = type == "int" ? 1.0 : 1e-9 * std::max(1.0, std::abs(lo));
    if (std::isfinite(lo)) {
      if (lo_open) {
        refused(lo);
        accepted(type == "int" ? lo + 1 : lo + step);
      } else {
        accepted(lo);
        refused(lo - step);
      }
    }
    if (std::isfinite(hi)) {
      const double hstep = type == "int" ? 1.0 : 1e-9 * std::max(1.0, std::abs(hi));
      if (hi_open) {
        refused(hi);
        if (!(std::isfinite(lo) && hi - hstep <= lo)) accepted(hi - hstep);
      } else {
        accepted(hi);
        refused(hi + hstep);
      }
    } else if (!hi_open) {
      accepted(hi);  // "inf]": infinity allowed
    } else {
      refused(hi);  // "inf)": infinity refused
    }
    if (type == "float") refused(std::nan(""));
  }
  EXPECT_GT(numeric, 30);
  // A field set directly is refused when the sanitizer validates its options.
  trainsan::Options direct;
  direct.loss_spike_factor = -5;
  const std::string msg = error_text([&] { direct.validate(); });
  EXPECT_TRUE(contains(msg, "loss_spike_factor") && contains(msg, "(0, inf)")) << msg;
  trainsan::Options band;
  band.update_ratio_low = 2;
  band.update_ratio_high = 1;
  EXPECT_TRUE(contains(error_text([&] { band.validate(); }), "update_ratio_low"));
}

TEST(Sanitizer, OptionsParseClampAndSerialise) {
  trainsan::Options o;
  EXPECT_THROW(o.set("check.x", "maybe"), c10::ValueError);
  EXPECT_THROW(o.set("check.stale_grad", "maybe"), c10::ValueError);
  o.set("check.stale_grad", "false");
  EXPECT_FALSE(o.enabled("stale_grad"));
  EXPECT_TRUE(o.enabled("grad_explosion"));
  EXPECT_FALSE(o.enabled("nonfinite_activation"));
  const std::string below = error_text([&] { o.set("trace_every", "0"); });
  EXPECT_TRUE(contains(below, "trace_every") && contains(below, "[1, inf)") &&
              contains(below, "got 0"))
      << below;
  EXPECT_EQ(o.trace_every, 1);  // unchanged by the refused value
  o.set("trace_every", "7");
  EXPECT_EQ(o.trace_every, 7);
  EXPECT_THROW(o.set("trace_every", "-1"), c10::ValueError);
  EXPECT_THROW(o.set("trace_every", "1.5"), c10::ValueError);
  const std::string msg = error_text([&] { o.set("policy", "loud"); });
  EXPECT_TRUE(contains(msg, "policy")) << msg;
  EXPECT_TRUE(contains(msg, "loud")) << msg;
  EXPECT_EQ(o.policy, "raise");  // unchanged by the rejected value
  o.set("sync", "true");
  EXPECT_TRUE(o.sync);

  const std::string json = o.to_json();
  ASSERT_FALSE(trainsan::option_table().empty());
  for (const trainsan::OptionInfo& info : trainsan::option_table()) {
    EXPECT_TRUE(contains(json, std::string("\"") + info.name + "\":")) << info.name;
  }
  EXPECT_TRUE(contains(json, "\"trace_every\":7")) << json;
  EXPECT_TRUE(contains(json, "\"sync\":true")) << json;
  EXPECT_TRUE(contains(json, "\"grad_explosion_factor\":50")) << json;
  const size_t at = json.find("\"checks\":{");
  ASSERT_NE(at, std::string::npos) << json;
  const std::string checks = json.substr(at);
  for (const trainsan::KindInfo& k : trainsan::kinds()) {
    EXPECT_TRUE(contains(checks, std::string("\"") + k.name + "\":")) << k.name;
  }
  EXPECT_TRUE(contains(checks, "\"stale_grad\":false")) << checks;
  EXPECT_TRUE(contains(checks, "\"nonfinite_activation\":false")) << checks;
  EXPECT_TRUE(contains(checks, "\"grad_explosion\":true")) << checks;
}

// Note [Mode rules] from LibTorch: a backbone run under no_grad in train mode, while a head
// trains, gets no gradient at its optimizer's step (an error); with a Dropout registered, the
// train-mode no_grad forward is also a warning at the forward. With grad enabled: nothing.
TEST(Sanitizer, NoGradLeakFromLibTorch) {
  for (const bool leak : {true, false}) {
    torch::manual_seed(0);
    Net backbone;
    auto head = torch::nn::Linear(3, 3);
    torch::optim::SGD opt_b(backbone.parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt_h(head->parameters(), torch::optim::SGDOptions(0.1));
    trainsan::Setup setup;
    setup.mode_modules = {{"drop", "Dropout"}};
    std::vector<trainsan::Parameter> ps;
    for (auto& p : backbone.named_parameters()) ps.push_back({p.key(), p.value(), 0});
    trainsan::Sanitizer san(std::move(ps), record(), setup);
    for (int i = 0; i < 3; ++i) {
      const Batch b = batch(i);
      opt_b.zero_grad();
      opt_h.zero_grad();
      torch::Tensor f;
      {
        const torch::NoGradGuard no_grad;
        if (!leak) at::GradMode::set_enabled(true);
        san.forward({true, {b.x}, {false}});
        f = backbone.forward(b.x);
      }
      auto loss = torch::nn::functional::cross_entropy(head->forward(f), b.y);
      loss.backward();
      opt_b.step();
      opt_h.step();
      san.end_step();
    }
    san.close();
    const auto ngl = of_kind(san.findings(), "no_grad_leak");
    if (!leak) {
      EXPECT_TRUE(ngl.empty());
      continue;
    }
    ASSERT_EQ(ngl.size(), 2u);
    EXPECT_EQ(ngl[0].tensor, "drop");
    EXPECT_EQ(ngl[0].severity, "warning");
    EXPECT_EQ(ngl[1].tensor, "");
    EXPECT_EQ(ngl[1].severity, "error");
    EXPECT_EQ(ngl[1].step, 0);
    EXPECT_EQ(ngl[1].count, 3);
    EXPECT_TRUE(contains(ngl[1].message, "none of its 4 trainable parameter(s)")) << ngl[1].message;
  }
}

TEST(Sanitizer, PolicyAnswersThroughTheReportCallback) {
  using trainsan::Action;
  const std::map<std::string, std::set<std::tuple<std::string, std::string, Action>>> expected = {
      {"raise",
       {{"stale_grad", "error", Action::kRaise}, {"duplicate_batch", "warning", Action::kWarn}}},
      {"warn",
       {{"stale_grad", "error", Action::kWarn}, {"duplicate_batch", "warning", Action::kWarn}}},
      {"record",
       {{"stale_grad", "error", Action::kNone}, {"duplicate_batch", "warning", Action::kNone}}},
  };
  for (const auto& [policy, want] : expected) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
    trainsan::Options o;
    o.policy = policy;
    std::vector<std::tuple<std::string, std::string, Action>> got;
    trainsan::Setup setup;
    setup.report = [&](const trainsan::Finding& f, Action a) {
      got.emplace_back(f.kind, f.severity, a);
    };
    trainsan::Sanitizer san(params_of(net), o, setup);
    // Batches 0, 1, 2 and then 2 again (the data stops advancing: duplicate_batch) and no
    // zero_grad (stale_grad): nothing throws, even under "raise", because the callback takes the
    // answers.
    EXPECT_NO_THROW({
      train_without_zero_grad_repeating(net, opt, san);
      san.close();
    }) << policy;
    const std::set<std::tuple<std::string, std::string, Action>> distinct(got.begin(), got.end());
    EXPECT_EQ(distinct, want) << policy;
    // Reported once per finding (stale_grad: once per parameter), repeats only counted.
    EXPECT_EQ(got.size(), san.findings().size()) << policy;
    EXPECT_EQ(of_kind(san.findings(), "stale_grad").size(), 4u) << policy;
  }
}

// Note [Own time]: TrainSan's own time takes each per-step entry whole, once. A report callback
// that takes 20 ms per finding runs inside the entries (report()): all of it is own time (a clock
// of sections alone missed it), and counted once (end_step nests step_end: counted twice, the own
// time would exceed the loop's wall time).
TEST(Sanitizer, OwnTimeTakesEachEntryWholeAndOnce) {
  using Clock = std::chrono::steady_clock;
  torch::manual_seed(0);
  Net net;
  torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.1));
  int reports = 0;
  trainsan::Setup setup;
  setup.report = [&](const trainsan::Finding&, trainsan::Action) {
    ++reports;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  trainsan::Sanitizer san(params_of(net), record(), setup);
  const double own0 = san.overhead_seconds();
  const auto t0 = Clock::now();
  train_without_zero_grad_repeating(net, opt, san);
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double own = san.overhead_seconds() - own0;
  ASSERT_GE(reports, 2);
  EXPECT_GE(own, 0.020 * reports) << reports << " reports";
  EXPECT_LE(own, wall);
}

// A tensor the step left unchanged (Note [Unchanged tensors]), from LibTorch: named per tensor;
// its group's learning rate of 0 (step_end's group_lr) silences it.
TEST(Sanitizer, TensorTheStepLeftUnchangedFromLibTorch) {
  for (const double bias_lr : {0.1, 0.0}) {
    torch::manual_seed(0);
    Net net;
    std::vector<trainsan::Parameter> params;
    for (auto& p : net.named_parameters()) {
      const bool bias = p.key() == "fc2.bias";
      params.push_back({p.key(), p.value(), 0, bias ? 1 : 0});
    }
    trainsan::Sanitizer san(std::move(params), record(), trainsan::Setup{});
    for (int i = 0; i < 3; ++i) {
      const Batch b = batch(i);
      for (auto& p : net.parameters()) p.mutable_grad() = torch::Tensor();
      san.begin_step({b.x});
      torch::nn::functional::cross_entropy(net.forward(b.x), b.y).backward();
      {
        torch::NoGradGuard no_grad;  // a hand-written step that forgets fc2.bias
        for (auto& p : net.named_parameters()) {
          if (p.key() != "fc2.bias") p.value().sub_(p.value().grad() * 0.1);
        }
      }
      san.step_end(0, false, {0.1, bias_lr});
    }
    std::vector<std::string> named;
    for (const auto& f : san.findings()) {
      if (f.kind == "skipped_step") named.push_back(f.tensor);
    }
    if (bias_lr > 0) {
      EXPECT_EQ(named, std::vector<std::string>{"fc2.bias"});
    } else {
      EXPECT_TRUE(named.empty());
    }
  }
}

// Note [Gradients read at the step's beginning]: the step's gradient rows are read at step_begin
// and used at step_end where the gradient is the same tensor at the same version. A NaN written
// into fc1.weight's gradient after the update, at step 1: in place (its version moves) or as a
// new tensor, the step end reads it again (nonfinite_grad at step 1); through .data() (no version
// move) the step's rows are those read at its begin (none); and without a write, no finding.
TEST(Sanitizer, GradientsReadAtTheStepsBeginAndAgainWhereTheStepWroteThem) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::string write : {"none", "in place", "new tensor", "hidden"}) {
    torch::manual_seed(0);
    Net net;
    trainsan::Sanitizer san(params_of(net), record(), trainsan::Setup{});
    for (int i = 0; i < 3; ++i) {
      const Batch b = batch(i);
      for (auto& p : net.parameters()) p.mutable_grad() = torch::Tensor();
      san.begin_step({b.x});
      torch::nn::functional::cross_entropy(net.forward(b.x), b.y).backward();
      san.step_begin(0);
      {
        torch::NoGradGuard no_grad;
        for (auto& p : net.parameters()) p.sub_(p.grad() * 0.1);
      }
      torch::Tensor g = net.fc1->weight.mutable_grad();
      if (i == 1 && write == "in place") g.view(-1)[0].fill_(nan);
      if (i == 1 && write == "new tensor") {
        net.fc1->weight.mutable_grad() = g.clone();
        net.fc1->weight.mutable_grad().view(-1)[0].fill_(nan);
      }
      if (i == 1 && write == "hidden") g.data().view(-1)[0].fill_(nan);
      san.step_end(0, false, {0.1});
    }
    san.close();
    std::vector<int64_t> at;
    for (const auto& f : san.findings()) {
      if (f.kind == "nonfinite_grad") at.push_back(f.step);
    }
    const bool reread = write == "in place" || write == "new tensor";
    EXPECT_EQ(at, reread ? std::vector<int64_t>{1} : std::vector<int64_t>{}) << write;
  }
}

// Attached inside a step (step_in_flight): the closure's remaining forwards and backwards are
// part of it, and the step it ends is not judged.
TEST(Sanitizer, StepInFlightAtAttach) {
  torch::manual_seed(0);
  Net net;
  trainsan::Options o = record();
  o.max_accumulation = 1;
  trainsan::Sanitizer san(net.named_parameters(), o);
  san.step_in_flight(0);
  for (int i = 0; i < 4; ++i) {  // closure evaluations: zero, forward, backward
    const Batch b = batch(i);
    for (auto& p : net.parameters()) p.mutable_grad() = torch::Tensor();
    san.forward({true, {b.x}, {}});
    torch::nn::functional::cross_entropy(net.forward(b.x), b.y).backward();
  }
  san.step_end(0, false);  // no parameter changed: a partial step is not judged
  EXPECT_TRUE(san.findings().empty()) << san.findings().front().message;
  EXPECT_EQ(san.step(), 1);
}

TEST(Kinds, TableIsConsistent) {
  const auto& ks = trainsan::kinds();
  ASSERT_EQ(ks.size(), 35u);  // the implemented kinds (docs/kinds.md)
  std::set<std::string> names;
  for (size_t i = 0; i < ks.size(); ++i) {
    const trainsan::KindInfo& k = ks[i];
    EXPECT_TRUE(names.insert(k.name).second) << "duplicate " << k.name;
    EXPECT_EQ(static_cast<size_t>(k.kind), i) << k.name;
    const auto back = trainsan::kind_from_name(k.name);
    ASSERT_TRUE(back.has_value()) << k.name;
    EXPECT_EQ(*back, k.kind);
    EXPECT_STREQ(trainsan::name_of(k.kind), k.name);
    EXPECT_NE(std::string(k.family), "");
    EXPECT_NE(std::string(k.rule), "");
  }
  EXPECT_EQ(trainsan::severity_of(trainsan::Kind::grad_explosion), trainsan::Severity::kWarning);
  EXPECT_EQ(trainsan::severity_of(trainsan::Kind::stale_grad), trainsan::Severity::kError);
  EXPECT_STREQ(trainsan::severity_name(trainsan::Severity::kWarning), "warning");
  EXPECT_FALSE(trainsan::info(trainsan::Kind::nonfinite_activation).default_on);
  EXPECT_FALSE(trainsan::info(trainsan::Kind::update_outside_step).default_on);
  EXPECT_TRUE(trainsan::info(trainsan::Kind::eval_mode).default_on);
  int off = 0;
  for (const auto& k : ks) off += k.default_on ? 0 : 1;
  EXPECT_EQ(off, 2);
  for (const char* missing : {"stale_gard", "", "nondeterministic"}) {
    EXPECT_FALSE(trainsan::kind_from_name(missing).has_value()) << missing;
  }
}

// Gradient accumulation through begin_step / watch_loss per micro-batch and end_step per step
// (Note [Accumulation windows]): the declared window kept is silent, a window never reached is
// accumulation_mismatch; the windows are in coverage().
TEST(Sanitizer, AccumulationWindowsFromLibTorch) {
  for (const int every : {2, 1}) {
    torch::manual_seed(0);
    Net net;
    torch::optim::SGD opt(net.parameters(), 0.05);
    trainsan::Options o = record();
    o.accumulation_steps = 2;
    trainsan::Sanitizer san(net.named_parameters(), o);
    for (int i = 0; i < 8; ++i) {
      const Batch b = batch(i);
      san.begin_step({b.x});
      auto loss = torch::nn::functional::cross_entropy(net.forward(b.x), b.y) / 2;
      san.watch_loss(loss);
      loss.backward();
      if ((i + 1) % every == 0) {
        opt.step();
        san.end_step();
        opt.zero_grad();
      }
    }
    san.close();
    const trainsan::Coverage c = san.coverage();
    EXPECT_EQ(c.window_declared, 2);
    EXPECT_EQ(c.window_backwards, every);
    EXPECT_EQ(c.windows, 8 / every);
    EXPECT_EQ(c.window_samples, 32 * every);
    bool found = false;
    for (const auto& f : san.findings()) found = found || f.kind == "accumulation_mismatch";
    EXPECT_EQ(found, every == 1) << every;
  }
}
