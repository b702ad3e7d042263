// The accumulation family (host/checks/accumulation.cpp, Note [Accumulation windows]) on synthetic
// windows: a declared window kept, a mid-epoch deviation, an epoch's last partial window, an epoch
// shorter than the window, a window that runs on, undeclared windows (only counted).
#include <gtest/gtest.h>

#include <string>

#include "checks/checks.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;

struct Windows {
  Options opts;
  FakeSink sink;
  AccumulationCheck check{sink, opts};
  int64_t step = 0;
  explicit Windows(int64_t declared) { opts.accumulation_steps = declared; }
  // One window of `k` micro-batches of `b` samples from loader pass `pass`: its forwards (each
  // decides a pending window), then its step.
  void window(int64_t k, int64_t pass, int64_t b = 8) {
    for (int64_t i = 0; i < k; ++i) check.on_forward(pass);
    check.on_step({step++, 0, k, k * b, pass});
  }
  // An epoch of `batches` micro-batches stepped every `n` and at its last batch (the frameworks).
  void epoch(int64_t batches, int64_t n, int64_t pass) {
    for (int64_t left = batches; left > 0; left -= n) window(std::min(left, n), pass);
  }
  int64_t errors() const {
    int64_t e = 0;
    for (const auto& r : sink.calls) e += r.severity == Severity::kError ? 1 : 0;
    return e;
  }
  int64_t warnings() const { return static_cast<int64_t>(sink.calls.size()) - errors(); }
};

TEST(Accumulation, DeclaredWindowKeptIsSilent) {
  Windows r(4);
  for (int64_t pass = 1; pass <= 3; ++pass) r.epoch(12, 4, pass);
  r.check.on_close();
  EXPECT_TRUE(r.sink.calls.empty());
  const WindowsSeen s = r.check.seen();
  EXPECT_EQ(s.counted, 9);
  EXPECT_EQ(s.common, 4);
  EXPECT_EQ(s.at_common, 9);
  EXPECT_EQ(s.samples, 32);
}

TEST(Accumulation, StepEveryThreeWithFourDeclaredIsAnError) {
  Windows r(4);
  r.epoch(12, 3, 1);  // mid-pass short windows
  ASSERT_GE(r.errors(), 1);
  const auto& first = r.sink.calls.front();
  EXPECT_EQ(first.kind, Kind::accumulation_mismatch);
  EXPECT_EQ(first.severity, Severity::kError);
  EXPECT_EQ(first.step, 0);
  EXPECT_EQ(*first.value, 3.0);
  EXPECT_NE(first.message.find("middle of a data loader pass"), std::string::npos);
  EXPECT_NE(first.message.find("effective batch 24 samples instead of 4 x 8 = 32"),
            std::string::npos)
      << first.message;
  EXPECT_NE(first.message.find("3/4 of its size"), std::string::npos);
}

TEST(Accumulation, LastPartialWindowOfAnEpochIsAWarning) {
  Windows r(4);
  r.epoch(10, 4, 1);                  // 4, 4, 2
  EXPECT_TRUE(r.sink.calls.empty());  // not judged until the next forward
  r.epoch(10, 4, 2);
  ASSERT_EQ(r.sink.calls.size(), 1u);
  const auto& w = r.sink.calls.front();
  EXPECT_EQ(w.severity, Severity::kWarning);
  EXPECT_EQ(w.tensor, "<last window>");
  EXPECT_EQ(w.step, 2);
  EXPECT_NE(w.message.find("the last window of an epoch"), std::string::npos);
  EXPECT_NE(w.message.find("effective batch 16 samples instead of 32 samples"), std::string::npos)
      << w.message;
  EXPECT_NE(w.message.find("2/4 of its size"), std::string::npos);
  r.check.on_close();  // the run's last window (2 of 4) too: the same finding, counted
  EXPECT_EQ(r.errors(), 0);
  EXPECT_EQ(r.sink.count(Kind::accumulation_mismatch, "<last window>"), 2);
}

TEST(Accumulation, EpochShorterThanTheWindowIsAnError) {
  Windows r(8);
  for (int64_t pass = 1; pass <= 3; ++pass) r.epoch(3, 8, pass);  // steps every 3
  r.check.on_close();
  EXPECT_EQ(r.warnings(), 1);  // the first short window: an epoch's end, as far as it could know
  EXPECT_EQ(r.sink.count(Kind::accumulation_mismatch, "<window>"), 2);  // then: never reached
  const testing::Recorded* e = nullptr;
  for (const auto& c : r.sink.calls) {
    if (c.severity == Severity::kError && e == nullptr) e = &c;
  }
  EXPECT_EQ(e->tensor, "<window>");
  EXPECT_NE(e->message.find("no optimizer step followed 8 backward passes"), std::string::npos);
  EXPECT_NE(e->message.find("steps every 3"), std::string::npos);
  EXPECT_NE(e->message.find("epoch of 3 batches is shorter"), std::string::npos) << e->message;
  EXPECT_NE(e->message.find("24 samples instead of 8 x 8 = 64"), std::string::npos);
}

TEST(Accumulation, OneShortEpochAloneIsAWarning) {
  Windows r(8);
  r.epoch(3, 8, 1);
  r.check.on_close();
  EXPECT_EQ(r.errors(), 0);
  EXPECT_EQ(r.warnings(), 1);
  EXPECT_NE(r.sink.calls.front().message.find("the last window of the run"), std::string::npos);
}

TEST(Accumulation, WindowThatRunsOnIsAnErrorAtOnce) {
  Windows r(4);
  r.window(4, 1);
  r.window(6, 1);  // an epoch's remainder carried on
  ASSERT_EQ(r.sink.calls.size(), 1u);
  EXPECT_EQ(r.sink.calls.front().severity, Severity::kError);
  EXPECT_EQ(r.sink.calls.front().step, 1);
  EXPECT_NE(r.sink.calls.front().message.find("ran on past its end"), std::string::npos);
}

TEST(Accumulation, UnknownPassShortWindowIsAWarningThenAnErrorWhenRepeated) {
  Windows r(4);
  r.window(4, -1);
  r.window(2, -1);
  r.window(4, -1);  // its first forward judges the short one: unknown pass
  ASSERT_EQ(r.sink.calls.size(), 1u);
  EXPECT_EQ(r.sink.calls.front().severity, Severity::kWarning);
  EXPECT_NE(r.sink.calls.front().message.find("pass is unknown"), std::string::npos);
  Windows s(4);
  for (int i = 0; i < 4; ++i) s.window(3, -1);
  EXPECT_EQ(s.sink.count(Kind::accumulation_mismatch, "<window>"), 2);  // never a full window
}

TEST(Accumulation, ForwardWithoutANewBatchWaits) {
  Windows r(4);
  r.window(4, 1);
  r.window(2, 1);
  r.check.on_forward(-1);  // no batch taken (a prefetching loader's last one): undecided
  EXPECT_TRUE(r.sink.calls.empty());
  r.check.on_forward(1);  // same pass: mid-epoch
  ASSERT_EQ(r.sink.calls.size(), 1u);
  EXPECT_EQ(r.sink.calls.front().severity, Severity::kError);
}

TEST(Accumulation, StepsWithoutBackwardsAreNoWindows) {
  Windows r(4);
  r.window(4, 1);
  r.check.on_step({r.step++, 1, 0, 0, 1});  // a second optimizer on the same backwards
  r.check.on_step({r.step++, 0, 0, 0, 1});  // a closure step
  r.window(4, 1);
  r.check.on_close();
  EXPECT_TRUE(r.sink.calls.empty());
  EXPECT_EQ(r.check.seen().counted, 2);
}

TEST(Accumulation, UndeclaredWindowsAreCountedNotJudged) {
  Windows r(0);
  r.epoch(10, 4, 1);
  r.epoch(10, 4, 2);
  r.window(7, 3);
  r.check.on_close();
  EXPECT_TRUE(r.sink.calls.empty());
  const WindowsSeen s = r.check.seen();
  EXPECT_EQ(s.counted, 7);
  EXPECT_EQ(s.common, 4);
  EXPECT_EQ(s.at_common, 4);
  EXPECT_EQ(s.samples, 32);
}

TEST(Accumulation, SwitchedOffKindIsSilent) {
  Windows r(4);
  r.sink.enabled[Kind::accumulation_mismatch] = false;
  r.epoch(12, 3, 1);
  r.check.on_close();
  EXPECT_TRUE(r.sink.calls.empty());
}

}  // namespace
}  // namespace trainsan::host
