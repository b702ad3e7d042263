// The replica family (host/checks/replicas.cpp) on synthetic comparisons: one finding per
// comparison and kind of tensor, the ranks named by their classes of equal values, the cause the
// pattern points to, and the schedule of fingerprints (desync_every).
#include <gtest/gtest.h>

#include <string>

#include "checks/check.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;
using Moment = ReplicaReport::Moment;

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

ReplicaReport four_ranks(Moment m) {
  ReplicaReport r;
  r.moment = m;
  r.step = 7;
  r.opt = 0;
  r.group = "the DDP process group";
  r.ranks = {0, 1, 2, 3};
  return r;
}

TEST(ReplicaCheck, SchedulesFingerprintsEveryNthStep) {
  FakeSink sink;
  Options o;
  o.desync_every = 3;
  ReplicaCheck c(sink, o);
  EXPECT_TRUE(c.fingerprint_due(0));
  EXPECT_FALSE(c.fingerprint_due(1));
  EXPECT_TRUE(c.fingerprint_due(6));
}

TEST(ReplicaCheck, NamesTheRankThatDiffersAndTheCause) {
  FakeSink sink;
  Options o;
  ReplicaCheck c(sink, o);
  ReplicaReport r = four_ranks(Moment::kAfterStep);
  r.mismatches = {{"fc.weight", "parameter", {0, 0, 1, 0}}, {"fc.bias", "parameter", {0, 0, 1, 0}}};
  r.grads_agree = true;
  c.on_report(r);
  ASSERT_EQ(sink.calls.size(), 1u);
  const auto& f = sink.calls[0];
  EXPECT_EQ(f.kind, Kind::rank_desync);
  EXPECT_EQ(f.step, 7);
  EXPECT_EQ(f.tensor, "fc.weight");
  EXPECT_EQ(f.severity, Severity::kError);
  EXPECT_TRUE(has(f.message, "2 parameters")) << f.message;
  EXPECT_TRUE(has(f.message, "fc.weight, fc.bias — rank 2 differs from ranks 0, 1, 3"))
      << f.message;
  EXPECT_TRUE(has(f.message, "The gradients agree")) << f.message;
  EXPECT_TRUE(has(f.message, "[ranks 0, 1, 2, 3]")) << f.message;
}

TEST(ReplicaCheck, GradientsAndWeightsAreSeparateFindings) {
  FakeSink sink;
  Options o;
  ReplicaCheck c(sink, o);
  ReplicaReport r = four_ranks(Moment::kAfterStep);
  r.mismatches = {{"fc.weight", "gradient", {0, 1, 0, 1}}, {"fc.weight", "parameter", {}}};
  c.on_report(r);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].tensor, "fc.weight.grad");
  EXPECT_TRUE(has(sink.calls[0].message, "already differ after the reduction"));
  EXPECT_TRUE(has(sink.calls[0].message, "ranks 1, 3 differ from ranks 0, 2"))
      << sink.calls[0].message;
  EXPECT_EQ(sink.calls[1].tensor, "fc.weight");
  EXPECT_TRUE(has(sink.calls[1].message, "Their gradients differ too"));
}

TEST(ReplicaCheck, ThreeClassesAreListed) {
  FakeSink sink;
  Options o;
  ReplicaCheck c(sink, o);
  ReplicaReport r = four_ranks(Moment::kBeforeFirstStep);
  r.step = 0;
  r.mismatches = {{"w", "parameter", {0, 0, 1, 2}}};
  c.on_report(r);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_TRUE(has(sink.calls[0].message, "start from different weights"));
  EXPECT_TRUE(has(sink.calls[0].message, "3 different values: {0, 1} {2} {3}"))
      << sink.calls[0].message;
  EXPECT_TRUE(has(sink.calls[0].message, "broadcast"));
}

TEST(ReplicaCheck, SkippedStepOutOfStepAndMissingRanks) {
  FakeSink sink;
  Options o;
  ReplicaCheck c(sink, o);
  ReplicaReport skip = four_ranks(Moment::kAfterStep);
  skip.skipped = {false, true, false, false};
  c.on_report(skip);
  ReplicaReport shift = four_ranks(Moment::kAfterStep);
  shift.forwards = {8, 9, 8, 8};
  shift.mismatches = {{"w", "parameter", {0, 1, 0, 0}}};
  c.on_report(shift);
  ReplicaReport gone = four_ranks(Moment::kMissing);
  gone.missing = {3};
  gone.waited_s = 600;
  gone.missing_detail = {""};
  c.on_report(gone);
  ASSERT_EQ(sink.calls.size(), 3u);
  EXPECT_TRUE(has(sink.calls[0].message, "rank 1 of the DDP process group"));
  EXPECT_TRUE(has(sink.calls[0].message, "skipped step 7 of optimizer 0"));
  EXPECT_TRUE(has(sink.calls[0].message, "while ranks 0, 2, 3 stepped"));
  EXPECT_TRUE(has(sink.calls[1].message, "out of step"));
  EXPECT_TRUE(has(sink.calls[1].message, "rank 0: 8, rank 1: 9, rank 2: 8, rank 3: 8"));
  EXPECT_TRUE(has(sink.calls[2].message, "rank 3 of the DDP process group"));
  EXPECT_TRUE(has(sink.calls[2].message, "within 600 s"));
}

TEST(ReplicaCheck, SwitchedOffSaysNothing) {
  FakeSink sink;
  sink.enabled[Kind::rank_desync] = false;
  Options o;
  ReplicaCheck c(sink, o);
  ReplicaReport r = four_ranks(Moment::kAfterStep);
  r.mismatches = {{"w", "parameter", {0, 1, 0, 0}}};
  c.on_report(r);
  EXPECT_TRUE(sink.calls.empty());
}

}  // namespace
}  // namespace trainsan::host
