// The determinism family (host/checks/determinism.cpp) on synthetic fingerprints: where
// compare_reruns locates the first difference of two re-runs and the step's own forward, the
// re-run schedule, and the wording of each place.
#include <gtest/gtest.h>

#include <string>

#include "checks/checks.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;
using W = RerunFacts::Where;

// A run of a small model: its root, two layers and the loss, then three gradients in backward
// order. `salt` changes every fingerprint, as a run that differs everywhere would.
RerunFingerprints run(uint64_t salt = 0) {
  RerunFingerprints r;
  r.outputs = {{"0", "Linear", {11 + salt}},
               {"1", "Dropout", {12 + salt}},
               {"", "Sequential", {13 + salt, 14 + salt}},
               {"loss", "", {15 + salt}}};
  r.grads = {{"1.bias", 21 + salt}, {"1.weight", 22 + salt}, {"0.bias", 23 + salt}};
  return r;
}

RerunFingerprints outputs_only(RerunFingerprints r) {
  r.grads.clear();
  return r;
}

TEST(CompareReruns, IdenticalRunsAgree) {
  EXPECT_FALSE(compare_reruns(outputs_only(run()), run(), run()).has_value());
  EXPECT_FALSE(compare_reruns({}, run(), run()).has_value());  // step not recorded
  EXPECT_FALSE(compare_reruns({}, {}, {}).has_value());
}

TEST(CompareReruns, FirstDifferingOutputInExecutionOrder) {
  RerunFingerprints b = run();
  b.outputs[1].hashes[0] = 99;
  b.outputs[3].hashes[0] = 99;
  b.grads[0].second = 99;  // the forward is reported before the backward
  const auto f = compare_reruns(outputs_only(run()), run(), b);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kForward);
  EXPECT_EQ(f->tensor, "1");
  EXPECT_EQ(f->type, "Dropout");
  EXPECT_EQ(f->position, 2);
  EXPECT_EQ(f->checked, 4);
}

TEST(CompareReruns, TheModelItselfAndItsSecondOutputAreNamed) {
  RerunFingerprints b = run();
  b.outputs[2].hashes[1] = 99;  // the model's second floating output
  const auto f = compare_reruns({}, run(), b);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kForward);
  EXPECT_EQ(f->tensor, "(model)");
  EXPECT_EQ(f->type, "Sequential");
  EXPECT_EQ(f->position, 3);
  // One more output in one run: compared as a whole list, so not the same list.
  b = run();
  b.outputs[2].hashes.push_back(14);
  EXPECT_EQ(compare_reruns({}, run(), b)->tensor, "(model)");
}

TEST(CompareReruns, OutputListsOfDifferentLengthsAreNotComparedPlaceByPlace) {
  RerunFingerprints b = run();
  b.outputs.push_back({"extra", "Linear", {1}});
  b.outputs[0].hashes[0] = 99;
  EXPECT_FALSE(compare_reruns({}, run(), b).has_value());
}

TEST(CompareReruns, BackwardDifferenceInBackwardOrder) {
  RerunFingerprints b = run();
  b.grads[2].second = 99;
  b.grads[1].second = 98;
  const auto f = compare_reruns(outputs_only(run()), run(), b);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kBackward);
  EXPECT_EQ(f->tensor, "1.weight");
  EXPECT_EQ(f->type, "");
  EXPECT_EQ(f->position, 2);
  EXPECT_EQ(f->checked, 3);
}

TEST(CompareReruns, GradientsAreMatchedByName) {
  RerunFingerprints b = run();
  std::swap(b.grads[0], b.grads[2]);  // another order, the same bits per parameter
  EXPECT_FALSE(compare_reruns({}, run(), b).has_value());
  b.grads.pop_back();  // "1.bias" has no gradient in the second run
  const auto f = compare_reruns({}, run(), b);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kBackward);
  EXPECT_EQ(f->tensor, "1.bias");
  EXPECT_EQ(f->position, 1);
  // A gradient only the second run has is not compared.
  b = run();
  b.grads.emplace_back("new", 1);
  EXPECT_FALSE(compare_reruns({}, run(), b).has_value());
}

TEST(CompareReruns, RerunsThatAgreeButNotWithTheStepAreBetweenCalls) {
  RerunFingerprints step = outputs_only(run());
  step.outputs[1].hashes[0] = 99;
  step.outputs[1].type = "LazyCentre";
  const auto f = compare_reruns(step, run(5), run(5));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kBetweenCalls);
  EXPECT_EQ(f->tensor, "0");  // run(5) differs from the step everywhere: the first output
  EXPECT_EQ(f->position, 1);
  EXPECT_EQ(f->checked, 4);
  const auto g = compare_reruns(step, run(), run());
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->tensor, "1");
  EXPECT_EQ(g->type, "LazyCentre");  // the step's own record names the type
  EXPECT_EQ(g->position, 2);
}

TEST(CompareReruns, BetweenCallsNeedsTheSameLengthAndName) {
  RerunFingerprints step = outputs_only(run(5));
  step.outputs.pop_back();
  EXPECT_FALSE(compare_reruns(step, run(), run()).has_value());
  step = outputs_only(run(5));
  for (auto& o : step.outputs) o.name += "x";  // other modules: not compared
  EXPECT_FALSE(compare_reruns(step, run(), run()).has_value());
}

TEST(DeterminismCheck, RerunIsOffByDefaultAndEveryNth) {
  FakeSink sink;
  Options o;
  DeterminismCheck c(sink, o);
  EXPECT_FALSE(c.rerun_due(0));
  o.rerun_every = 3;
  EXPECT_TRUE(c.rerun_due(0));
  EXPECT_FALSE(c.rerun_due(2));
  EXPECT_TRUE(c.rerun_due(6));
}

TEST(DeterminismCheck, EachPlaceIsWorded) {
  FakeSink sink;
  Options o;
  DeterminismCheck c(sink, o);
  c.on_rerun({W::kForward, "2", "Unseeded", 3, 7}, 4);
  c.on_rerun({W::kBackward, "0.bias", "", 2, 4}, 4);
  c.on_rerun({W::kBetweenCalls, "(model)", "", 1, 7}, 4);
  ASSERT_EQ(sink.calls.size(), 3u);
  for (const auto& r : sink.calls) {
    EXPECT_EQ(r.kind, Kind::nondeterminism);
    EXPECT_EQ(r.step, 4);
  }
  EXPECT_EQ(sink.calls[0].tensor, "2");
  EXPECT_NE(sink.calls[0].message.find("re-running step 4's forward twice on the same batch"),
            std::string::npos);
  EXPECT_NE(sink.calls[0].message.find("first at the output of 2 (Unseeded) (the 3-th of 7"),
            std::string::npos)
      << sink.calls[0].message;
  EXPECT_NE(sink.calls[1].message.find("backward twice from the same output gradient"),
            std::string::npos);
  EXPECT_NE(sink.calls[1].message.find("first for 0.bias (the 2-th of 4 compared)"),
            std::string::npos);
  EXPECT_NE(sink.calls[2].message.find("agree with each other but not with the step's own"),
            std::string::npos);
  EXPECT_NE(sink.calls[2].message.find("output of (model) (the 1-th"), std::string::npos);
}

// Note [Recompute checks]: a checkpointed region's forward and its recompute in the backward.
RecomputeRecord region_call(std::vector<uint64_t> hashes, std::vector<uint64_t> rng) {
  return {"layers.3", "Block", std::move(hashes), std::move(rng)};
}

TEST(CompareRecompute, AgreeingCallsAreSilentWhateverTheRng) {
  EXPECT_FALSE(compare_recompute(region_call({1, 2}, {7}), region_call({1, 2}, {7})).has_value());
  // A region without random ops need not preserve the RNG: the same outputs are silent.
  EXPECT_FALSE(compare_recompute(region_call({1, 2}, {7}), region_call({1, 2}, {8})).has_value());
  EXPECT_FALSE(compare_recompute(region_call({}, {7}), region_call({}, {8})).has_value());
  // Another number of outputs is another computation, not a difference of bits at one place.
  EXPECT_FALSE(compare_recompute(region_call({1, 2}, {7}), region_call({1}, {8})).has_value());
}

TEST(CompareRecompute, OtherBitsFromOtherRngIsTheRngNotPreserved) {
  const auto f = compare_recompute(region_call({1, 2, 3}, {7, 9}), region_call({1, 5, 6}, {8, 9}));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kRecomputeRng);
  EXPECT_EQ(f->tensor, "layers.3");
  EXPECT_EQ(f->type, "Block");
  EXPECT_EQ(f->position, 2);
  EXPECT_EQ(f->checked, 3);
}

TEST(CompareRecompute, OtherBitsFromTheSameRngIsStateOrKernels) {
  const auto f = compare_recompute(region_call({1, 2}, {7}), region_call({4, 2}, {7}));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->where, W::kRecomputeState);
  EXPECT_EQ(f->position, 1);
  const auto none = compare_recompute({"", "", {1}, {}}, {"", "", {2}, {}});
  ASSERT_TRUE(none.has_value());
  EXPECT_EQ(none->where, W::kRecomputeState);  // neither recorded the RNG
  EXPECT_EQ(none->tensor, "(region)");
}

TEST(DeterminismCheck, RecomputeSchedule) {
  FakeSink sink;
  Options o;
  DeterminismCheck c(sink, o);
  EXPECT_TRUE(c.recompute_due(0));  // the default: the first step, then every 100th
  EXPECT_FALSE(c.recompute_due(1));
  EXPECT_TRUE(c.recompute_due(100));
  o.recompute_every = 0;
  EXPECT_FALSE(c.recompute_due(0));
  o.recompute_every = 1;
  EXPECT_TRUE(c.recompute_due(3));
  // Attached mid-run: the first step asked about is checked at once.
  Options late;
  DeterminismCheck d(sink, late);
  EXPECT_TRUE(d.recompute_due(37));
  EXPECT_TRUE(d.recompute_due(37));
  EXPECT_FALSE(d.recompute_due(38));
  EXPECT_TRUE(d.recompute_due(200));
}

TEST(DeterminismCheck, RecomputeIsWordedWithItsCause) {
  FakeSink sink;
  Options o;
  DeterminismCheck c(sink, o);
  c.on_rerun({W::kRecomputeRng, "layers.3", "Block", 2, 3}, 0);
  c.on_rerun({W::kRecomputeState, "layers.1", "Block", 1, 1}, 5);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].kind, Kind::nondeterminism);
  EXPECT_EQ(sink.calls[0].tensor, "layers.3");
  const std::string& m0 = sink.calls[0].message;
  EXPECT_NE(m0.find("activation-checkpointed region layers.3 (Block), recomputed in step 0's "
                    "backward, gave other bits than its forward, first at its output 2 of 3"),
            std::string::npos)
      << m0;
  EXPECT_NE(m0.find("RNG is not preserved"), std::string::npos) << m0;
  EXPECT_NE(m0.find("preserve_rng_state=False"), std::string::npos) << m0;
  const std::string& m1 = sink.calls[1].message;
  EXPECT_EQ(sink.calls[1].step, 5);
  EXPECT_NE(m1.find("from the same RNG state"), std::string::npos) << m1;
  EXPECT_EQ(m1.find("RNG is not preserved"), std::string::npos) << m1;
}

}  // namespace
}  // namespace trainsan::host
