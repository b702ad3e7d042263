// The checkpoint family on synthetic facts (host/checks/checkpoint.cpp: one finding per kind of
// fault, the legitimate partial saves silent) and its gatherer on hand-built descriptions
// (host/checks/checkpoint_facts.cpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "checks/checks.h"
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

// --- the gatherer (host/checks/checkpoint_facts.cpp) ---

TensorDesc desc(const std::string& key, std::vector<int64_t> sizes,
                const std::string& dtype = "float32", int64_t nonfinite = 0) {
  TensorDesc t;
  t.key = key;
  t.numel = 1;
  for (const int64_t s : sizes) t.numel *= s;
  t.sizes = std::move(sizes);
  t.dtype = dtype;
  t.nonfinite = nonfinite;
  return t;
}

// Linear(8, 16), BatchNorm1d(16), ReLU, Linear(16, 2) as nn.Sequential names them.
ModelDesc mlp() {
  ModelDesc m;
  m.state = {desc("0.weight", {16, 8}),
             desc("0.bias", {16}),
             desc("1.weight", {16}),
             desc("1.bias", {16}),
             desc("1.running_mean", {16}),
             desc("1.running_var", {16}),
             desc("1.num_batches_tracked", {}, "int64"),
             desc("3.weight", {2, 16}),
             desc("3.bias", {2})};
  for (const TensorDesc& t : m.state) {
    if (t.key.find("running") == std::string::npos && t.key.find("num_") == std::string::npos) {
      m.trainable.push_back(t);
    }
  }
  return m;
}

// A checkpoint {"model": <state dict>} holding `entries`.
CheckpointDesc saved(const std::vector<TensorDesc>& entries, const std::string& path = "model") {
  CheckpointDesc d;
  d.source = "ckpt.pt";
  for (TensorDesc t : entries) {
    t.key = path.empty() ? t.key : path + "." + t.key;
    d.tensors.push_back(t);
  }
  d.state_dicts.push_back({path, entries});
  d.model = {mlp()};
  return d;
}

OptimizerDesc optimizer(const std::string& path, const std::vector<TensorDesc>& params,
                        const std::vector<std::vector<TensorDesc>>& state, int64_t step = -1) {
  OptimizerDesc o;
  o.path = path;
  for (size_t k = 0; k < state.size(); ++k) {
    OptimizerSlotDesc s;
    if (k < params.size()) s.param = params[k];
    s.has_state = !state[k].empty();
    s.step = s.has_state ? step : -1;
    s.state = state[k];
    o.slots.push_back(s);
  }
  return o;
}

std::vector<std::vector<TensorDesc>> adam_state(const std::vector<TensorDesc>& params) {
  std::vector<std::vector<TensorDesc>> out;
  for (const TensorDesc& p : params) {
    out.push_back({desc("step", {}), desc("exp_avg", p.sizes), desc("exp_avg_sq", p.sizes)});
  }
  return out;
}

TEST(GatherCheckpoint, TheModelsOwnStateIsClean) {
  const CheckpointFacts f = gather_checkpoint(saved(mlp().state));
  EXPECT_TRUE(f.have_model);
  EXPECT_TRUE(f.model_found);
  EXPECT_EQ(f.model_key, "model");
  EXPECT_EQ(f.model_keys, 9);
  EXPECT_TRUE(f.missing_trainable.empty() && f.missing_other.empty() && f.unexpected.empty());
  EXPECT_TRUE(f.mismatched.empty() && f.nonfinite.empty());
  EXPECT_FALSE(f.have_optimizer_state);
  EXPECT_TRUE(judge_checkpoint(f).empty());
}

TEST(GatherCheckpoint, NonfiniteTensorsByPath) {
  std::vector<TensorDesc> state = mlp().state;
  state[0].nonfinite = 1;
  state[7].nonfinite = 3;
  const CheckpointFacts f = gather_checkpoint(saved(state));
  ASSERT_EQ(f.nonfinite.size(), 2u);
  EXPECT_EQ(f.nonfinite[0].key, "model.0.weight");
  EXPECT_EQ(f.nonfinite[0].count, 1);
  EXPECT_EQ(f.nonfinite[0].numel, 128);
  EXPECT_EQ(f.nonfinite[1].key, "model.3.weight");
  CheckpointDesc d = saved(state);
  d.load_error = "Unsupported global";  // nothing was loaded: nothing else is looked at
  const CheckpointFacts g = gather_checkpoint(d);
  EXPECT_TRUE(g.nonfinite.empty());
  EXPECT_FALSE(g.have_model);
}

TEST(GatherCheckpoint, MissingUnexpectedAndMismatchedEntries) {
  std::vector<TensorDesc> state;
  for (const TensorDesc& t : mlp().state) {
    if (t.key == "3.weight" || t.key == "1.running_mean") continue;
    state.push_back(t);
  }
  state[0].sizes = {32, 8};    // 0.weight: another version of the model
  state[1].dtype = "float16";  // 0.bias
  state.push_back(desc("extra.bias", {2}));
  const CheckpointFacts f = gather_checkpoint(saved(state));
  EXPECT_EQ(f.missing_trainable, std::vector<std::string>{"3.weight"});
  EXPECT_EQ(f.missing_other, std::vector<std::string>{"1.running_mean"});
  EXPECT_EQ(f.unexpected, std::vector<std::string>{"extra.bias"});
  ASSERT_EQ(f.mismatched.size(), 2u);
  EXPECT_EQ(f.mismatched[0],
            "0.weight: [32, 8] float32 in the checkpoint, [16, 8] float32 in the model");
  EXPECT_EQ(f.mismatched[1], "0.bias: [16] float16 in the checkpoint, [16] float32 in the model");
  EXPECT_EQ(judge_checkpoint(f).size(), 2u);  // the keys, the shapes
}

TEST(GatherCheckpoint, FrozenEntriesMissingAreAnAdapterSave) {
  ModelDesc m = mlp();
  m.trainable.erase(m.trainable.begin(), m.trainable.begin() + 2);  // 0.* frozen
  std::vector<TensorDesc> state;
  for (const TensorDesc& t : m.state) {
    if (t.key.rfind("0.", 0) != 0) state.push_back(t);
  }
  CheckpointDesc d = saved(state, "");
  d.model = {m};
  const CheckpointFacts f = gather_checkpoint(d);
  EXPECT_TRUE(f.model_found);
  EXPECT_EQ(f.model_key, "");
  EXPECT_TRUE(f.missing_trainable.empty());
  EXPECT_EQ(f.missing_other.size(), 2u);
  EXPECT_TRUE(judge_checkpoint(f).empty());
}

TEST(GatherCheckpoint, ForeignStateAndDdpPrefix) {
  CheckpointDesc d = saved({desc("encoder.weight", {4, 4})});
  CheckpointFacts f = gather_checkpoint(d);
  EXPECT_TRUE(f.have_model);
  EXPECT_FALSE(f.model_found);
  std::vector<TensorDesc> prefixed = mlp().state;
  for (TensorDesc& t : prefixed) t.key = "module." + t.key;
  f = gather_checkpoint(saved(prefixed, ""));
  EXPECT_TRUE(f.model_found && f.ddp_prefix);
  ASSERT_EQ(judge_checkpoint(f).size(), 1u);
  // A wrapper (DDP) checked against its inner module's keys: the inner state dict is the model.
  CheckpointDesc w = saved(mlp().state, "");
  ModelDesc outer = mlp();
  for (TensorDesc& t : outer.state) t.key = "module." + t.key;
  for (TensorDesc& t : outer.trainable) t.key = "module." + t.key;
  w.model = {outer, mlp()};
  f = gather_checkpoint(w);
  EXPECT_TRUE(f.model_found);
  EXPECT_FALSE(f.ddp_prefix);
  EXPECT_TRUE(f.missing_trainable.empty() && f.unexpected.empty());
}

TEST(GatherCheckpoint, PartsOfTheModelWhileAttached) {
  std::vector<TensorDesc> head;
  for (const TensorDesc& t : mlp().state) {
    if (t.key.rfind("3.", 0) == 0) head.push_back(t);
  }
  CheckpointDesc d = saved(head);
  d.part_ok = true;  // 2 of 9 keys: a part, not judged as the model
  EXPECT_FALSE(gather_checkpoint(d).have_model);
  d.part_ok = false;  // checked as the model: it lacks the rest
  EXPECT_EQ(gather_checkpoint(d).missing_trainable.size(), 4u);
  CheckpointDesc other = saved({desc("x", {1})});
  other.part_ok = true;  // nothing of the model: something else saved
  EXPECT_FALSE(gather_checkpoint(other).have_model);
}

TEST(GatherCheckpoint, OptimizerStateAgainstTheLiveOptimizer) {
  const std::vector<TensorDesc> params = mlp().trainable;
  CheckpointDesc d = saved(mlp().state);
  // A fresh optimizer's state saved for the trained one.
  d.saved_optimizers = {optimizer("optimizer", {}, std::vector<std::vector<TensorDesc>>(6))};
  d.optimizers = {optimizer("", params, adam_state(params), 5)};
  CheckpointFacts f = gather_checkpoint(d);
  EXPECT_TRUE(f.have_optimizer_state);
  EXPECT_EQ(f.optimizer_params, 6);
  EXPECT_EQ(f.optimizer_with_state, 0);
  EXPECT_EQ(f.live_with_state, 6);
  EXPECT_EQ(f.optimizer_step_live, 5);
  EXPECT_EQ(f.optimizer_step_saved, -1);
  // The optimizer's own state, two steps behind: a stale snapshot.
  d.saved_optimizers = {optimizer("optimizer", {}, adam_state(params), 3)};
  f = gather_checkpoint(d);
  EXPECT_EQ(f.optimizer_with_state, 6);
  EXPECT_EQ(f.optimizer_step_saved, 3);
  EXPECT_TRUE(f.state_mismatched.empty());
  const auto out = judge_checkpoint(f);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(has(out[0].message, "from its step 3 while the optimizer is at step 5"));
}

TEST(GatherCheckpoint, OptimizerStateBoundByPosition) {
  std::vector<TensorDesc> params = mlp().trainable;
  std::vector<TensorDesc> reversed(params.rbegin(), params.rend());
  CheckpointDesc d = saved(mlp().state);
  // Saved from an optimizer over the parameters in reverse order, checked against the model.
  d.saved_optimizers = {optimizer("opt", {}, adam_state(reversed))};
  CheckpointFacts f = gather_checkpoint(d);
  ASSERT_FALSE(f.state_mismatched.empty());
  EXPECT_EQ(f.state_mismatched[0], "exp_avg of parameter 0 (0.weight): [2], the parameter [16, 8]");
  EXPECT_EQ(f.live_with_state, -1);  // no live optimizer: coverage and steps not compared
  // Against the optimizer that made it, the same state fits.
  d.optimizers = {optimizer("", reversed, adam_state(reversed))};
  EXPECT_TRUE(gather_checkpoint(d).state_mismatched.empty());
  // Factored state (Adafactor's row/column variances) is not per element.
  std::vector<std::vector<TensorDesc>> factored;
  for (const TensorDesc& p : params) factored.push_back({desc("row_var", {p.sizes[0]})});
  d.optimizers.clear();
  d.saved_optimizers = {optimizer("opt", {}, factored)};
  EXPECT_TRUE(gather_checkpoint(d).state_mismatched.empty());
  // Another parameter count.
  factored.pop_back();
  d.saved_optimizers = {optimizer("opt", {}, factored)};
  f = gather_checkpoint(d);
  EXPECT_EQ(f.state_mismatched,
            std::vector<std::string>{"opt holds 5 parameters, the optimizer it belongs to 6"});
  // Two saved states without live optimizers: nothing to bind them to.
  d.saved_optimizers = {optimizer("a", {}, adam_state(reversed)),
                        optimizer("b", {}, adam_state(reversed))};
  f = gather_checkpoint(d);
  EXPECT_TRUE(f.state_mismatched.empty());
  EXPECT_EQ(f.optimizer_params, 12);
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

ResumeFacts forgotten_optimizer() {
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kFirstStep;
  f.opt = 0;
  f.optimizer_type = "SGD";
  f.stateful = true;
  f.progress = "epoch=90";
  f.checkpoint_has_optimizer_state = true;
  f.trainable_params = 4;
  f.checkpoint_state_params = 4;
  return f;
}

TEST(ResumeCheck, FineTuneLeavesThePretrainingOptimizerUnloaded) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f = forgotten_optimizer();
  f.scheduler_epoch = 90;  // the pretraining's schedule too
  f.lr = 0.01;
  f.checkpoint_lr = 0.1;
  c.on_resume(f, 0);  // the same model, the same optimizer: forgotten
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_TRUE(has(sink.calls[0].message, "was not restored")) << sink.calls[0].message;
  EXPECT_EQ(sink.calls[1].severity, Severity::kWarning);  // the forgotten optimizer explains it
  sink.calls.clear();
  ResumeFacts head = f;  // model.fc = nn.Linear(512, 10) after the load
  head.params_not_loaded = 2;
  c.on_resume(head, 0);
  ResumeFacts other = f;  // an optimizer over the head only, or of another type
  other.checkpoint_optimizer_fits = false;
  other.checkpoint_state_params = -1;
  c.on_resume(other, 0);
  ResumeFacts frozen = f;  // the backbone frozen now, trained then
  frozen.trainable_params = 2;
  c.on_resume(frozen, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
  frozen.trainable_params = 4;  // frozen then and now: a resume
  frozen.checkpoint_state_params = 3;
  c.on_resume(frozen, 0);
  EXPECT_EQ(sink.calls.size(), 2u);
}

TEST(ResumeCheck, SchedulerNotRestoredIsAnErrorWhenTheRateJumped) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kFirstStep;
  f.opt = 0;
  f.optimizer_type = "AdamW";
  f.stateful = true;
  f.optimizer_restored = true;
  f.optimizer_with_state = 4;
  f.scheduler_epoch = 5;
  f.lr = 6e-4;
  f.checkpoint_lr = 6e-4;  // the optimizer's state restored the saved rate
  c.on_resume(f, 0);
  f.checkpoint_lr = 6e-4 * (1 + 1e-6);  // rounding
  c.on_resume(f, 0);
  f.checkpoint_lr = std::numeric_limits<double>::quiet_NaN();  // unknown
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 3u);
  for (const auto& call : sink.calls) EXPECT_EQ(call.severity, Severity::kWarning);
  f.lr = 1e-4;  // a scheduler built after optimizer.load_state_dict set its initial rate
  f.checkpoint_lr = 6e-4;
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 4u);
  EXPECT_EQ(sink.calls[3].severity, Severity::kError);
  EXPECT_TRUE(has(sink.calls[3].message,
                  "the learning rate jumped from 0.0006 when saved to "
                  "0.0001 at this step"))
      << sink.calls[3].message;
  f.scheduler_restored = true;
  c.on_resume(f, 0);
  EXPECT_EQ(sink.calls.size(), 4u);
}

MomentScale moment(const std::string& name, const std::string& shape, double state, double grad) {
  MomentScale m;
  m.name = name;
  m.shape = shape;
  m.moment = state;
  m.grad = grad;
  return m;
}

TEST(ResumeCheck, MomentsRestoredToOtherParametersAreFound) {
  testing::FakeSink sink;
  Options o;
  ResumeCheck c(sink, o);
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kFirstStep;
  f.opt = 0;
  f.optimizer_type = "AdamW";
  // Legitimate: within the bound, or off one way only (a layer whose gradient changed), or no
  // scale to compare (an unused parameter: zero state, zero gradient).
  f.moments = {moment("emb.weight", "[64, 64]", 1e-3, 2e-3),
               moment("out.weight", "[64, 64]", 2.0, 1.5), moment("a.weight", "[8]", 5.0, 0.01),
               moment("b.weight", "[8]", 0.0, 1.0), moment("c.weight", "[8]", 1.0, 0.0)};
  c.on_resume(f, 0);
  EXPECT_TRUE(sink.calls.empty()) << sink.calls[0].message;
  // Swapped: the embedding got the output layer's state and back.
  f.moments[0].moment = 2.0;
  f.moments[1].moment = 1e-3;
  c.on_resume(f, 0);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::optimizer_reset);
  EXPECT_EQ(sink.calls[0].tensor, "emb.weight");
  EXPECT_EQ(sink.calls[0].severity, Severity::kError);
  const std::string& m = sink.calls[0].message;
  EXPECT_TRUE(has(m, "emb.weight [64, 64] (state 1000x its gradient's scale)")) << m;
  EXPECT_TRUE(has(m, "out.weight [64, 64] (state 0.0006667x")) << m;
  EXPECT_TRUE(has(m, "restored by position after the parameter order changed")) << m;
  EXPECT_FALSE(has(m, "a.weight")) << m;
  // Off both ways, but in different shapes: no permutation could have done it.
  f.moments[1].shape = "[64, 32]";
  c.on_resume(f, 1);
  EXPECT_EQ(sink.calls.size(), 1u);
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
