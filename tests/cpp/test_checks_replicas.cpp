// The replica family (host/checks/replicas.cpp) on synthetic comparisons: one finding per
// comparison and kind of tensor, the ranks named by their classes of equal values, the cause the
// pattern points to, and the schedule of fingerprints (desync_every).
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "checks/checks.h"
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

// --- the payload's verdict (judge_replica_payload, Note [Replica payload]) ----------------------

using R = ReplicaRow;
using Outcome = ReplicaVerdict::Outcome;

// One rank's row: `members` parameters with weight, gradient and state, `buffers` buffers.
std::vector<int64_t> row(size_t members, size_t buffers = 0) {
  std::vector<int64_t> r(R::kHeader + R::kSlot * members + R::kBufferSlot * buffers, 0);
  r[R::kDigest] = 77;
  r[R::kCount] = r[R::kStep] = r[R::kForwards] = 3;
  for (size_t j = 0; j < members; ++j) {
    for (int64_t k = 0; k < 3; ++k) {
      r[R::kHeader + R::kSlot * j + 2 * k] = 1;
      r[R::kHeader + R::kSlot * j + 2 * k + 1] = 100 * (k + 1) + static_cast<int64_t>(j);
    }
  }
  for (size_t j = 0; j < buffers; ++j) {
    r[R::kHeader + R::kSlot * members + R::kBufferSlot * j] = 1;
    r[R::kHeader + R::kSlot * members + R::kBufferSlot * j + 1] = 400 + static_cast<int64_t>(j);
  }
  return r;
}

int64_t field(size_t member, int64_t k) { return R::kHeader + R::kSlot * member + k; }

// What the all-reduce of the rows and their complements gives: the maximum and the minimum.
ReplicaVerdict judge(const std::vector<std::vector<int64_t>>& rows,
                     const std::vector<std::string>& members,
                     const std::vector<std::string>& buffers = {},
                     const std::vector<std::pair<std::string, std::string>>& known = {}) {
  std::vector<int64_t> hi = rows[0], lo = rows[0];
  for (const auto& r : rows) {
    for (size_t k = 0; k < r.size(); ++k) {
      hi[k] = std::max(hi[k], r[k]);
      lo[k] = std::min(lo[k], r[k]);
    }
  }
  return judge_replica_payload(hi, lo, members, buffers, known);
}

TEST(ReplicaPayload, EqualRowsAgree) {
  const auto v = judge({row(2, 1), row(2, 1), row(2, 1)}, {"a", "b"}, {"bn.mean"});
  EXPECT_EQ(v.outcome, Outcome::kAgree);
  EXPECT_TRUE(v.differ.empty());
  EXPECT_TRUE(v.fetch.empty());
}

TEST(ReplicaPayload, HeaderDifferencesComeFirst) {
  auto other = row(1);
  other[R::kDigest] = 78;
  other[field(0, 1)] = 1;  // a weight differs too: not compared
  EXPECT_EQ(judge({row(1), other}, {"a"}).outcome, Outcome::kNotReplicas);
  other = row(1);
  other[R::kCount] = 4;
  other[R::kForwards] = 4;
  auto v = judge({row(1), other}, {"a"});
  EXPECT_EQ(v.outcome, Outcome::kOutOfStep);
  EXPECT_EQ(v.fetch, (std::vector<int64_t>{R::kStep, R::kForwards}));
  EXPECT_TRUE(v.forwards_differ);
  other = row(1);
  other[R::kOpt] = 1;
  EXPECT_EQ(judge({row(1), other}, {"a"}).outcome, Outcome::kOutOfStep);
  other = row(1);
  other[R::kSkipped] = 1;
  v = judge({row(1), other}, {"a"});
  EXPECT_EQ(v.outcome, Outcome::kSkipsDiffer);
  EXPECT_EQ(v.fetch, std::vector<int64_t>{R::kSkipped});
  EXPECT_FALSE(v.forwards_differ);
}

TEST(ReplicaPayload, ADifferingWeightWithAgreeingGradients) {
  auto other = row(2, 1);
  other[field(1, 1)] = 999;  // b's weight on one rank
  const auto v = judge({row(2, 1), row(2, 1), other}, {"a", "b"}, {"bn.mean"});
  EXPECT_EQ(v.outcome, Outcome::kTensorsDiffer);
  ASSERT_EQ(v.differ.size(), 1u);
  EXPECT_EQ(v.differ[0].field, field(1, 1));
  EXPECT_EQ(v.differ[0].tensor, "b");
  EXPECT_EQ(v.differ[0].what, "parameter");
  EXPECT_TRUE(v.differ[0].shown);
  EXPECT_TRUE(v.grads_compared);
  EXPECT_FALSE(v.grads_differ);
  EXPECT_FALSE(v.forwards_differ);
  EXPECT_EQ(v.fetch, (std::vector<int64_t>{R::kForwards, field(1, 1)}));
}

TEST(ReplicaPayload, GradientsStateAndBuffersInRowOrder) {
  auto other = row(2, 2);
  other[field(0, 5)] = 1;                                     // a's optimizer state
  other[field(1, 3)] = 1;                                     // b's gradient
  other[R::kHeader + R::kSlot * 2 + R::kBufferSlot + 1] = 1;  // the second buffer
  const auto v = judge({row(2, 2), other}, {"a", "b"}, {"bn.mean", "bn.var"});
  ASSERT_EQ(v.differ.size(), 3u);
  EXPECT_EQ(v.differ[0].tensor, "a");
  EXPECT_EQ(v.differ[0].what, "optimizer state");
  EXPECT_EQ(v.differ[1].tensor, "b");
  EXPECT_EQ(v.differ[1].what, "gradient");
  EXPECT_EQ(v.differ[2].tensor, "bn.var");
  EXPECT_EQ(v.differ[2].what, "buffer");
  EXPECT_TRUE(v.grads_compared);
  EXPECT_TRUE(v.grads_differ);
}

TEST(ReplicaPayload, TensorsAbsentOnSomeRankOrReportedBeforeAreLeftOut) {
  auto other = row(2);
  other[field(0, 2)] = 0;  // a has no gradient on this rank (its hash 0 differs)
  other[field(0, 3)] = 0;
  other[field(1, 2)] = 0;
  other[field(1, 3)] = 0;
  auto v = judge({row(2), other}, {"a", "b"});
  EXPECT_EQ(v.outcome, Outcome::kAgree);
  EXPECT_FALSE(v.grads_compared);
  other = row(2);
  other[field(0, 1)] = 5;
  other[field(1, 1)] = 5;
  v = judge({row(2), other}, {"a", "b"}, {}, {{"parameter", "a"}, {"gradient", "b"}});
  ASSERT_EQ(v.differ.size(), 1u);
  EXPECT_EQ(v.differ[0].tensor, "b");
  v = judge({row(2), other}, {"a", "b"}, {}, {{"parameter", "a"}, {"parameter", "b"}});
  EXPECT_EQ(v.outcome, Outcome::kAgree);
}

TEST(ReplicaPayload, OnlyTheFirstFewOfAKindAreShownWithTheirRanks) {
  const std::vector<std::string> names = {"m0", "m1", "m2", "m3", "m4", "m5"};
  auto other = row(6);
  for (size_t j = 0; j < 6; ++j) other[field(j, 1)] = -1;
  other[field(5, 3)] = -1;  // and one gradient: its own kind, shown
  const auto v = judge({row(6), other}, names);
  ASSERT_EQ(v.differ.size(), 7u);
  std::vector<int64_t> expected_fetch = {R::kForwards};
  for (size_t k = 0; k < v.differ.size(); ++k) {
    const bool gradient = v.differ[k].what == "gradient";
    EXPECT_EQ(v.differ[k].shown, gradient || k < 4) << k;
    if (v.differ[k].shown) expected_fetch.push_back(v.differ[k].field);
  }
  EXPECT_EQ(v.fetch, expected_fetch);
}

TEST(ReplicaPayload, RowsOfAnotherLayoutAreAnError) {
  EXPECT_THROW(judge_replica_payload(row(2), row(2), {"a"}, {}, {}), std::invalid_argument);
  EXPECT_THROW(judge_replica_payload(row(1), row(2), {"a"}, {}, {}), std::invalid_argument);
}

TEST(ReplicaRowLayout, HeaderThenSlotsOfMembersThenBuffers) {
  ReplicaRowFacts f;
  f.digest = 11;
  f.opt = 0;
  f.count = 3;
  f.step = 2;
  f.skipped = false;
  f.forwards = 5;
  // The pass fingerprinted parameters 4 and 7 (7 with a gradient); 9 is not in it.
  f.fingerprints.index = {7, 4};
  f.fingerprints.param = {70, 40};
  f.fingerprints.has_grad = {true, false};
  f.fingerprints.grad = {-71, 0};
  f.grads = {7, 4};
  f.state = {{4, 44}};
  f.buffers = {100};
  const std::vector<int64_t> row = replica_row(f, {4, 7, 9}, 1);
  const std::vector<int64_t> want = {11, 0,  3, 2,   0, 5,   // header
                                     1,  40, 0, 0,   1, 44,  // member 4: weight, state
                                     1,  70, 1, -71, 0, 0,   // member 7: weight, gradient
                                     0,  0,  0, 0,   0, 0,   // member 9: absent
                                     1,  100};               // the buffer
  EXPECT_EQ(row, want);
  // The verdict reads the same layout: two equal rows agree.
  EXPECT_EQ(judge_replica_payload(row, row, {"a", "b", "c"}, {"buf"}, {}).outcome,
            ReplicaVerdict::Outcome::kAgree);
  // A gradient not asked for stays absent; buffers not fingerprinted at this event too.
  f.grads.clear();
  f.buffers.clear();
  const std::vector<int64_t> bare = replica_row(f, {4, 7, 9}, 1);
  EXPECT_EQ(bare[6 + 6 + 2], 0);
  EXPECT_EQ(bare[6 + 18], 0);
  f.buffers = {1, 2};
  EXPECT_THROW(replica_row(f, {4, 7, 9}, 1), std::invalid_argument);
}

TEST(ReplicaLabels, ClassesByHowManyRanksHoldEachValue) {
  EXPECT_EQ(replica_labels({5, 5, 7, 5}), (std::vector<int64_t>{0, 0, 1, 0}));
  EXPECT_EQ(replica_labels({9, 8, 8}), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(replica_labels({7, 5, 5, 7}), (std::vector<int64_t>{0, 1, 1, 0}));  // tie: rank order
  EXPECT_EQ(replica_labels({3, 1, 2}), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(replica_labels({}).empty());
}

}  // namespace
}  // namespace trainsan::host
