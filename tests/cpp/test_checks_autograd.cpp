// The autograd family (host/checks/autograd.cpp) on synthetic facts: the sampling schedules, the
// saved-tensor finding, and the tolerance rule of the directional gradcheck at its edges.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "checks/checks.h"
#include "fake_sink.h"

namespace trainsan::host {
namespace {

using testing::FakeSink;
using testing::kNaN;
using Verdict = AutogradCheck::Verdict;

CustomGradResult agreeing(double value = 2.0) {
  CustomGradResult r;
  r.function = "mymod.MyExp";
  r.input_index = 0;
  r.analytic = value;
  r.central = value;
  r.curvature = 0.0;
  r.scale = std::abs(value) * 3.0;
  r.unit = 10.0;
  r.noise = 1e-10;
  return r;
}

TEST(AutogradCheck, InplaceSamplingFollowsTheAuditSchedule) {
  FakeSink sink;
  Options o;
  o.audit_first_steps = 3;
  o.audit_every = 5;
  AutogradCheck c(sink, o);
  EXPECT_TRUE(c.inplace_sampled(0));
  EXPECT_TRUE(c.inplace_sampled(2));
  EXPECT_FALSE(c.inplace_sampled(3));
  EXPECT_FALSE(c.inplace_sampled(4));
  EXPECT_TRUE(c.inplace_sampled(5));
  EXPECT_TRUE(c.inplace_sampled(10));
  o.audit_every = 0;
  EXPECT_FALSE(c.inplace_sampled(5));
  EXPECT_TRUE(c.inplace_sampled(1));
}

TEST(AutogradCheck, GradcheckIsRepeatedEveryNthStep) {
  FakeSink sink;
  Options o;
  AutogradCheck c(sink, o);
  EXPECT_EQ(o.gradcheck_every, 1000);  // besides each Function's first use (the caller's)
  EXPECT_TRUE(c.gradcheck_sampled(0));
  EXPECT_FALSE(c.gradcheck_sampled(999));
  EXPECT_TRUE(c.gradcheck_sampled(2000));
  o.gradcheck_every = 0;  // first use only
  EXPECT_FALSE(c.gradcheck_sampled(0));
  o.gradcheck_every = 1;
  EXPECT_TRUE(c.gradcheck_sampled(0));
  EXPECT_TRUE(c.gradcheck_sampled(7));
  o.gradcheck_every = 4;
  EXPECT_TRUE(c.gradcheck_sampled(0));
  EXPECT_FALSE(c.gradcheck_sampled(3));
  EXPECT_TRUE(c.gradcheck_sampled(8));
}

TEST(AutogradCheck, SavedTensorChangeNamesTheParameterAndTheNode) {
  FakeSink sink;
  Options o;
  AutogradCheck c(sink, o);
  c.on_saved_tensor_changed({"MmBackward0", "fc1.weight", {8, 4}, "float32"}, 3);
  ASSERT_EQ(sink.calls.size(), 1u);
  const auto& r = sink.calls[0];
  EXPECT_EQ(r.kind, Kind::inplace_before_backward);
  EXPECT_EQ(r.tensor, "fc1.weight");
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(r.message.rfind("parameter fc1.weight ([8, 4] float32), saved for backward by "
                            "MmBackward0, was changed between the forward and its backward",
                            0),
            0u);
  EXPECT_NE(r.message.find("make the change after backward()"), std::string::npos);
  // Repeats of the same tensor are counted, not new.
  c.on_saved_tensor_changed({"AddmmBackward0", "fc1.weight", {8, 4}, "float32"}, 4);
  EXPECT_EQ(sink.count(Kind::inplace_before_backward, "fc1.weight"), 2);
}

TEST(AutogradCheck, SavedTensorChangeWithoutAParameterIsKeyedByNodeAndShape) {
  FakeSink sink;
  Options o;
  AutogradCheck c(sink, o);
  c.on_saved_tensor_changed({"ExpBackward0", "", {2, 3}, "float64"}, 0);
  c.on_saved_tensor_changed({"", "", {5}, ""}, 0);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_EQ(sink.calls[0].tensor, "ExpBackward0 [2, 3] float64");
  EXPECT_EQ(sink.calls[0].message.rfind("a tensor [2, 3] float64, saved for backward by "
                                        "ExpBackward0",
                                        0),
            0u);
  EXPECT_EQ(sink.calls[1].message.rfind("a tensor [5], saved for backward by an autograd node", 0),
            0u);
}

TEST(AutogradCheck, JudgeAgreesWithinRelativeTolerance) {
  CustomGradResult r = agreeing(2.0);
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.scale = 0.0;
  r.noise = 0.0;
  r.unit = 0.0;
  r.analytic = 2.0 * (1.0 + 0.9e-4);  // rtol 1e-4 of max(|a|, |c|)
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.analytic = 2.0 * (1.0 + 1.1e-4);
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
}

TEST(AutogradCheck, JudgeFlagsAFactorTwoAndAWrongSign) {
  CustomGradResult r = agreeing(1.5);
  r.analytic = 3.0;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  r.analytic = -1.5;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  // A backward that returns a gradient where the function does not move.
  r = agreeing(0.0);
  r.analytic = 0.5;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
}

TEST(AutogradCheck, JudgeAbsoluteToleranceFromNoiseScaleAndUnit) {
  CustomGradResult r = agreeing(0.0);
  r.scale = 1.0;
  r.noise = 0.0;
  r.unit = 0.0;
  r.analytic = 0.9e-7;  // atol = 1e-7 · scale
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.analytic = 1.1e-7;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  r.noise = 1e-8;  // + 10 · noise
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.noise = 0.0;
  r.scale = 0.0;
  r.unit = 1e5;  // + 1e-12 · ‖u‖‖v‖
  r.analytic = 0.9e-7;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.analytic = 1.1e-7;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
}

TEST(AutogradCheck, JudgeLowPrecisionIsLooser) {
  CustomGradResult r = agreeing(1.0);
  r.scale = 0.0;
  r.noise = 0.0;
  r.unit = 0.0;
  r.analytic = 1.015;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  r.low_precision = true;  // rtol 2e-2
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.analytic = 1.03;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  r.analytic = 2.0;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
}

TEST(AutogradCheck, SharedMemoryParametersAreLeftToOtherProcesses) {
  // Note [Shared-memory parameters]: Hogwild's lock-free updates from other processes.
  FakeSink sink;
  Options o;
  AutogradCheck c(sink, o);
  SavedTensorChange shared{"MmBackward0", "fc1.weight", {8, 4}, "float32"};
  shared.shared_memory = true;
  c.on_saved_tensor_changed(shared, 3);
  EXPECT_TRUE(sink.calls.empty());
  // A saved tensor that is not a parameter (a DataLoader worker's batch is in shared memory too).
  SavedTensorChange batch{"MmBackward0", "", {8, 4}, "float32"};
  batch.shared_memory = true;
  c.on_saved_tensor_changed(batch, 3);
  EXPECT_EQ(sink.calls.size(), 1u);
}

// A flat (or identity) part: w·(Jv) by the backward against the differences'.
CustomGradResult with_surrogate(double analytic, double central, double unit) {
  CustomGradResult r = agreeing(1.0);
  r.surrogate_analytic = analytic;
  r.surrogate_central = central;
  r.surrogate_unit = unit;
  return r;
}

TEST(AutogradCheck, SurrogateGradientsAreToldApartAtTheirEdges) {
  // Note [Surrogate gradients]: tol = 1e-6·‖w‖‖v‖ (1e-3 in lower precision) + 1e-4·|central|.
  EXPECT_FALSE(AutogradCheck::surrogate(agreeing()));                     // nothing flat
  EXPECT_FALSE(AutogradCheck::surrogate(with_surrogate(0.9e-5, 0, 10)));  // a true 0 (rounding)
  EXPECT_TRUE(AutogradCheck::surrogate(with_surrogate(1.1e-5, 0, 10)));   // straight through
  EXPECT_TRUE(AutogradCheck::surrogate(with_surrogate(-3.0, 3.0, 10)));   // gradient reversal
  EXPECT_FALSE(AutogradCheck::surrogate(with_surrogate(3.0, 3.0 + 2e-4, 10)));  // an identity
  CustomGradResult low = with_surrogate(0.9e-2, 0, 10);
  low.low_precision = true;
  EXPECT_FALSE(AutogradCheck::surrogate(low));
  low.surrogate_analytic = 1.1e-2;
  EXPECT_TRUE(AutogradCheck::surrogate(low));
  EXPECT_FALSE(AutogradCheck::surrogate(with_surrogate(kNaN, 0, 10)));  // inconclusive
}

TEST(AutogradCheck, ASurrogateFunctionIsNotReportedOnAnyInput) {
  FakeSink sink;
  Options o;
  AutogradCheck c(sink, o);
  // LSQ: straight through on x (input 0); its scale gradient (input 1) is not the derivative.
  CustomGradResult x = with_surrogate(2.0, 0.0, 10);
  x.function = "q.Lsq";
  CustomGradResult s = agreeing(1.5);
  s.function = "q.Lsq";
  s.input_index = 1;
  s.analytic = -0.4;
  c.on_custom_grads({s, x}, 1);
  EXPECT_TRUE(sink.calls.empty());
  // A slip on the judged part of a Function without a surrogate is still found, alongside.
  CustomGradResult relu = with_surrogate(0.0, 0.0, 10);  // flat zeros that pass no gradient
  relu.function = "m.DoubledReLU";
  relu.analytic = 2.0;
  c.on_custom_grads({s, x, relu}, 1);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].tensor, "m.DoubledReLU:input 0");
}

TEST(AutogradCheck, KinksWidenTheToleranceAndNonFiniteFiguresAreInconclusive) {
  CustomGradResult r = agreeing(1.0);
  r.scale = 0.0;
  r.noise = 0.0;
  r.unit = 0.0;
  r.central = 1.5;  // relu at 0: the central difference sees half of each kinked element
  r.analytic = 1.0;
  r.curvature = 0.2;  // atol = 2 · curvature = 0.4 < 0.5 - 1.5e-4
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  r.curvature = 0.25;  // atol 0.5 + rtol 1.5e-4: within the differences' own error
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kAgrees);
  r.analytic = -1.0;  // a wrong sign still shows through a small kink
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kMismatch);
  r.curvature = kNaN;
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kInconclusive);
  r = agreeing(1.0);
  r.analytic = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kInconclusive);
  r = agreeing(1.0);
  r.central = std::numeric_limits<double>::infinity();
  EXPECT_EQ(AutogradCheck::judge(r), Verdict::kInconclusive);
}

TEST(AutogradCheck, MismatchMessageNamesTheFunctionInputAndFactor) {
  FakeSink sink;
  Options o;
  AutogradCheck c(sink, o);
  CustomGradResult r = agreeing(1.5);
  r.input_index = 1;
  r.analytic = 3.0;
  c.on_custom_grad(r, 2);
  ASSERT_EQ(sink.calls.size(), 1u);
  EXPECT_EQ(sink.calls[0].kind, Kind::bad_custom_grad);
  EXPECT_EQ(sink.calls[0].tensor, "mymod.MyExp:input 1");
  EXPECT_EQ(sink.calls[0].step, 2);
  EXPECT_EQ(sink.calls[0].value, std::optional<double>(2.0));
  EXPECT_EQ(sink.calls[0].message.rfind("custom autograd.Function mymod.MyExp: its backward "
                                        "disagrees with finite differences on input 1 — along a "
                                        "random direction, uᵀJv is 3 by backward() but 1.5 by "
                                        "central differences in float64 (2x)",
                                        0),
            0u)
      << sink.calls[0].message;
  r.analytic = -1.5;
  r.function = "mymod.Neg";
  c.on_custom_grad(r, 2);
  ASSERT_EQ(sink.calls.size(), 2u);
  EXPECT_NE(sink.calls[1].message.find("(the opposite sign)"), std::string::npos);
  // Agreement and inconclusive results write nothing.
  c.on_custom_grad(agreeing(), 3);
  EXPECT_EQ(sink.calls.size(), 2u);
}

TEST(AutogradCheck, JudgedOutsideASanitizerEachMismatchIsAFinding) {
  CustomGradResult bad = agreeing(1.5);
  bad.analytic = -1.5;
  CustomGradResult other = bad;
  other.input_index = 2;
  const std::vector<Finding> fs = judge_custom_grad({agreeing(), bad, other});
  ASSERT_EQ(fs.size(), 2u);
  EXPECT_EQ(fs[0].kind, "bad_custom_grad");
  EXPECT_EQ(fs[0].severity, "error");
  EXPECT_EQ(fs[0].step, 0);
  EXPECT_EQ(fs[0].tensor, "mymod.MyExp:input 0");
  EXPECT_EQ(fs[1].tensor, "mymod.MyExp:input 2");
  EXPECT_EQ(fs[0].message.rfind("bad_custom_grad: custom autograd.Function mymod.MyExp", 0), 0u);
  EXPECT_NE(fs[0].message.find("(the opposite sign)"), std::string::npos);
  EXPECT_TRUE(judge_custom_grad({}).empty());
}

}  // namespace
}  // namespace trainsan::host
