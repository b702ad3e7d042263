// The checkpoint check from LibTorch (trainsan/checkpoint.h): a torch::nn module saved with
// torch::save, read back and judged against the module; NaN, a missing key and another shape
// planted in the saves are found, a clean save gives none.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>

#include "trainsan/trainsan.h"

namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t hidden = 8, bool head = true)
      : fc1(register_module("fc1", torch::nn::Linear(4, hidden))),
        bn(register_module("bn", torch::nn::BatchNorm1d(hidden))) {
    if (head) fc2 = register_module("fc2", torch::nn::Linear(hidden, 2));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(Net);

// Files in a fresh directory of their own. (Not std::filesystem: libtorch.so exports some of its
// symbols, built for another ABI, and the test would call those.)
class CheckpointApi : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    char dir[] = "/tmp/trainsan_ckpt_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    for (const std::string& f : made_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string path(const std::string& name) {
    made_.push_back(dir_ + "/" + name);
    return made_.back();
  }
  std::string dir_;
  std::vector<std::string> made_;
};

TEST_F(CheckpointApi, CleanSaveHasNoFindings) {
  Net net;
  torch::save(net, path("net.pt"));
  const trainsan::NamedTensors entries = trainsan::read_archive(path("net.pt"));
  ASSERT_EQ(entries.size(), 9u);  // fc1: 2, bn: 2 and 3 buffers, fc2: 2
  EXPECT_TRUE(trainsan::check_checkpoint(path("net.pt"), net.get()).empty());
  EXPECT_TRUE(trainsan::check_checkpoint(path("net.pt")).empty());  // no model: NaN/Inf only
  const trainsan::CheckpointFacts f = trainsan::checkpoint_facts({path("net.pt"),
                                                                  "",
                                                                  entries,
                                                                  {{"", entries}},
                                                                  {},
                                                                  {trainsan::model_tensors(*net)},
                                                                  {},
                                                                  false});
  EXPECT_TRUE(f.model_found);
  EXPECT_EQ(f.model_keys, 9);
}

TEST_F(CheckpointApi, NanInTheSavedWeightsIsFound) {
  Net net;
  {
    torch::NoGradGuard no_grad;
    net->fc1->weight[1][2] = std::numeric_limits<float>::quiet_NaN();
    net->fc2->bias[0] = std::numeric_limits<float>::infinity();
  }
  torch::save(net, path("nan.pt"));
  const auto out = trainsan::check_checkpoint(path("nan.pt"), net.get());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].kind, "bad_checkpoint");
  EXPECT_EQ(out[0].severity, "error");
  EXPECT_EQ(out[0].tensor, "fc1.weight");
  EXPECT_EQ(out[0].value, 2.0);
  EXPECT_TRUE(has(out[0].message,
                  "holds NaN/±Inf values in 2 tensor(s): fc1.weight (1 of 32), "
                  "fc2.bias (1 of 2)"))
      << out[0].message;
}

TEST_F(CheckpointApi, MissingKeysAndOtherShapesAreFound) {
  Net headless(8, /*head=*/false);
  torch::save(headless, path("headless.pt"));
  Net net;
  auto out = trainsan::check_checkpoint(path("headless.pt"), net.get());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].tensor, "fc2.weight");
  EXPECT_TRUE(has(out[0].message, "lacks 2 trainable parameter(s) (fc2.weight, fc2.bias)"))
      << out[0].message;

  Net wide(16);
  torch::save(wide, path("wide.pt"));
  out = trainsan::check_checkpoint(path("wide.pt"), net.get());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].tensor, "fc1.weight");
  EXPECT_TRUE(has(out[0].message,
                  "fc1.weight: [16, 4] float32 in the checkpoint, [8, 4] float32 in the model"))
      << out[0].message;
  EXPECT_EQ(out[0].value, 7.0);  // every tensor of width 16 but fc2.bias

  // A frozen layer missing: a save of the trainable part, not a fault.
  net->fc1->weight.set_requires_grad(false);
  net->fc1->bias.set_requires_grad(false);
  const trainsan::NamedTensors part = {{"bn.weight", torch::ones({8})},
                                       {"bn.bias", torch::zeros({8})},
                                       {"bn.running_mean", torch::zeros({8})},
                                       {"bn.running_var", torch::ones({8})},
                                       {"bn.num_batches_tracked", torch::zeros({}, torch::kLong)},
                                       {"fc2.weight", torch::zeros({2, 8})},
                                       {"fc2.bias", torch::zeros({2})}};
  EXPECT_TRUE(trainsan::check_checkpoint(part, net.get(), "adapter").empty());
}

TEST_F(CheckpointApi, OptimizerStateAgainstTheModel) {
  Net net;
  const trainsan::ModelTensors m = trainsan::model_tensors(*net);
  trainsan::CheckpointContents c;
  c.source = "ckpt";
  c.tensors = m.state;
  c.state_dicts = {{"model", m.state}};
  c.model = {m};
  trainsan::OptimizerTensors saved;
  saved.path = "optimizer";
  for (auto it = m.trainable.rbegin(); it != m.trainable.rend(); ++it) {  // reversed order
    saved.state.push_back(
        {{"step", torch::tensor(3.0)}, {"exp_avg", torch::zeros_like(it->second)}});
  }
  c.saved_optimizers = {saved};
  const auto out = trainsan::check_checkpoint(c);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(has(out[0].message, "exp_avg of parameter 0 (fc1.weight): [2], the parameter [8, 4]"))
      << out[0].message;
  const trainsan::OptimizerDesc d = trainsan::describe_optimizer(saved);
  ASSERT_EQ(d.slots.size(), 6u);
  EXPECT_EQ(d.slots[0].step, 3);
  EXPECT_TRUE(d.slots[0].has_state);
}

TEST_F(CheckpointApi, ThroughASanitizerThePolicyAnswers) {
  Net net;
  {
    torch::NoGradGuard no_grad;
    net->fc2->weight[0][0] = std::numeric_limits<float>::quiet_NaN();
  }
  torch::save(net, path("nan.pt"));
  trainsan::Options record;
  record.policy = "record";
  trainsan::Sanitizer san(net->named_parameters(), record);
  san.check_checkpoint(path("nan.pt"), net.get());
  const auto found = san.findings();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].kind, "bad_checkpoint");
  EXPECT_TRUE(has(found[0].message, "nan.pt: holds NaN/±Inf values in 1 tensor(s): fc2.weight"))
      << found[0].message;
  san.close();
  trainsan::Sanitizer strict(net->named_parameters());  // policy "raise"
  EXPECT_THROW(strict.check_checkpoint(trainsan::read_archive(path("nan.pt")), net.get(), "ckpt"),
               trainsan::TrainingBugError);
  strict.close();
}

TEST_F(CheckpointApi, UnreadableFilesAreClearErrors) {
  try {
    trainsan::check_checkpoint(path("missing.pt"));
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_TRUE(has(e.what(), "no such file")) << e.what();
  }
  std::ofstream(path("junk.pt")) << "not an archive";
  try {
    trainsan::check_checkpoint(path("junk.pt"));
    FAIL() << "no error";
  } catch (const c10::ValueError& e) {
    EXPECT_TRUE(has(e.what(), "cannot be read as a torch::save archive")) << e.what();
  }
}

}  // namespace
