// The checkpoint family (host/checks/checkpoint.cpp) on synthetic facts: one finding per kind of
// fault, the legitimate partial saves silent.
#include <gtest/gtest.h>

#include <string>

#include "checks/check.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

CheckpointFacts model_facts() {
  CheckpointFacts f;
  f.source = "ckpt.pt";
  f.have_model = true;
  f.model_found = true;
  f.model_key = "model";
  f.model_keys = 6;
  return f;
}

TEST(CheckpointCheck, CleanAndLegitimatePartsAreSilent) {
  CheckpointFacts f = model_facts();
  EXPECT_TRUE(judge_checkpoint(f).empty());
  f.missing_other = {"0.weight", "1.running_mean"};  // frozen and buffers only: an adapter save
  EXPECT_TRUE(judge_checkpoint(f).empty());
  f.have_optimizer_state = true;  // covers what the live optimizer has state for
  f.optimizer_params = 6;
  f.optimizer_with_state = 4;
  f.live_with_state = 4;
  EXPECT_TRUE(judge_checkpoint(f).empty());
  f.live_with_state = -1;  // nothing to compare with: partial coverage is not judged
  f.optimizer_with_state = 0;
  EXPECT_TRUE(judge_checkpoint(f).empty());
}

TEST(CheckpointCheck, EachFaultIsOneFinding) {
  CheckpointFacts f = model_facts();
  f.nonfinite = {{"model.0.weight", 1, 128}, {"model.0.bias", 2, 16}};
  f.missing_trainable = {"3.weight"};
  f.unexpected = {"extra.bias"};
  f.mismatched = {"0.weight: [32, 8] float32 in the checkpoint, [16, 8] float32 in the model"};
  f.have_optimizer_state = true;
  f.optimizer_params = 6;
  f.optimizer_with_state = 0;
  f.live_with_state = 6;
  f.state_mismatched = {"exp_avg of parameter 0 (0.weight): [2], the parameter [16, 8]"};
  const auto out = judge_checkpoint(f);
  ASSERT_EQ(out.size(), 5u);
  for (const auto& x : out) {
    EXPECT_EQ(x.kind, "bad_checkpoint");
    EXPECT_EQ(x.severity, "error");
    EXPECT_TRUE(has(x.message, "bad_checkpoint: ckpt.pt: ")) << x.message;
  }
  EXPECT_EQ(out[0].tensor, "model.0.weight");
  EXPECT_EQ(out[0].value, 3.0);
  EXPECT_TRUE(has(out[0].message, "model.0.weight (1 of 128), model.0.bias (2 of 16)"));
  EXPECT_EQ(out[1].tensor, "3.weight");
  EXPECT_TRUE(has(out[1].message, "(under 'model')"));
  EXPECT_EQ(out[2].tensor, "0.weight");
  EXPECT_TRUE(has(out[3].message,
                  "covers 0 parameter(s) of 6 while the optimizer holds state "
                  "for 6"));
  EXPECT_TRUE(has(out[4].message, "bound to parameters by position"));
}

TEST(CheckpointCheck, UnloadableOrForeignCheckpoints) {
  CheckpointFacts f;
  f.source = "code.pt";
  f.load_error = "Unsupported global: GLOBAL __main__.Foo";
  f.nonfinite = {{"x", 1, 1}};  // not looked at: nothing was loaded
  auto out = judge_checkpoint(f);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(has(out[0].message, "Unsupported global")) << out[0].message;
  CheckpointFacts g = model_facts();
  g.model_found = false;
  out = judge_checkpoint(g);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(has(out[0].message, "none of its 6 keys")) << out[0].message;
  g.model_found = true;
  g.ddp_prefix = true;
  g.missing_trainable = {"0.weight"};  // the prefix explains it: one finding
  out = judge_checkpoint(g);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(has(out[0].message, "'module.' prefix")) << out[0].message;
}

TEST(ResumeCheck, FirstStepRules) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kFirstStep;
  f.opt = 0;
  f.optimizer_type = "AdamW";
  f.stateful = true;
  f.progress = "epoch=5";
  c.on_resume(f, 0);  // fine-tuning from weights: no optimizer state in the checkpoint
  EXPECT_TRUE(sink.calls.empty());
  f.checkpoint_has_optimizer_state = true;
  f.optimizer_with_state = 4;  // restored (before the model, or before attach)
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty());
  f.optimizer_with_state = 0;
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::optimizer_reset);
  EXPECT_TRUE(has(sink.calls[0].message, "was not restored")) << sink.calls[0].message;
  f.optimizer_restored = true;  // restored, but with an empty state
  c.on_resume(f, 1);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[1].message, "restored with an empty state"));
  f.stateful = false;  // plain SGD has no state to lose
  f.optimizer_with_state = 0;
  c.on_resume(f, 2);
  EXPECT_EQ(sink.calls.size(), 2u);
  f.scheduler_epoch = 5;
  f.lr = 1e-4;
  c.on_resume(f, 3);
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_EQ(sink.calls[2].severity, Severity::kWarning);
  EXPECT_TRUE(has(sink.calls[2].message, "the learning rate is 0.0001")) << sink.calls[2].message;
}

TEST(ResumeCheck, LossyLoadsAreBadCheckpoints) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kModelLoad;
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty());
  f.prefix = "module.";
  f.prefix_keys = 4;
  f.dropped_frozen = {"0.weight"};
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].kind, Kind::bad_checkpoint);
  EXPECT_EQ(sink.calls[1].tensor, "0.weight");
}

}  // namespace
}  // namespace trainsan::host
