// Re-run attribution's verdicts (host/checks/attribution.cpp) on synthetic outcomes: which
// outcome reproduces a finding, which does not, and which cannot tell.
#include <gtest/gtest.h>

#include <string>

#include "trainsan/determinism_facts.h"

namespace trainsan {
namespace {

RerunOutcome ran() {
  RerunOutcome o;
  o.ran = true;
  o.fingerprint = "00000000000000ab";
  return o;
}

TEST(Attribution, Kinds) {
  EXPECT_TRUE(rerun_attributable("nonfinite_loss"));
  EXPECT_TRUE(rerun_attributable("nonfinite_grad"));
  EXPECT_TRUE(rerun_attributable("loss_spike"));
  for (const char* k : {"nonfinite_param", "grad_explosion", "fp16_overflow",
                        "nonfinite_activation", "stale_grad"}) {
    EXPECT_FALSE(rerun_attributable(k)) << k;
  }
}

TEST(Attribution, NonfiniteLossOfTheBatchReproduces) {
  RerunOutcome o = ran();
  o.outputs_compared = true;
  o.step_outputs_nonfinite = true;
  o.outputs_nonfinite = true;
  o.outputs_match = true;
  const RerunVerdict v = judge_rerun("nonfinite_loss", o);
  ASSERT_TRUE(v.reproduces.has_value());
  EXPECT_TRUE(*v.reproduces);
  EXPECT_NE(v.text.find("reproduces (a data or code fault"), std::string::npos) << v.text;
  EXPECT_NE(v.text.find("00000000000000ab"), std::string::npos) << v.text;
  // Not bit for bit (a GPU's reductions), NaN again: still the batch's.
  o.outputs_match = false;
  EXPECT_TRUE(judge_rerun("nonfinite_loss", o).reproduces.value_or(false));
  // Finite outputs, equal: the NaN arises in the loss from them and the targets.
  o.step_outputs_nonfinite = false;
  o.outputs_nonfinite = false;
  o.outputs_match = true;
  const RerunVerdict w = judge_rerun("nonfinite_loss", o);
  EXPECT_TRUE(w.reproduces.value_or(false));
  EXPECT_NE(w.text.find("arises in the loss"), std::string::npos) << w.text;
}

TEST(Attribution, TransientNonfiniteLossDoesNotReproduce) {
  RerunOutcome o = ran();
  o.outputs_compared = true;
  o.step_outputs_nonfinite = true;  // the step's outputs held a NaN, the re-run's do not
  const RerunVerdict v = judge_rerun("nonfinite_loss", o);
  ASSERT_TRUE(v.reproduces.has_value());
  EXPECT_FALSE(*v.reproduces);
  EXPECT_NE(v.text.find("does not reproduce (a transient"), std::string::npos) << v.text;
  EXPECT_NE(v.text.find("finite where the step's held NaN/Inf"), std::string::npos) << v.text;
}

TEST(Attribution, CouldNotTell) {
  RerunOutcome failed;
  failed.error = "RuntimeError: out of memory";
  const RerunVerdict v = judge_rerun("nonfinite_loss", failed);
  EXPECT_FALSE(v.reproduces.has_value());
  EXPECT_EQ(v.text, "could not re-run this step: RuntimeError: out of memory");
  // The update already wrote NaN into the weights: every re-run computes from them.
  RerunOutcome o = ran();
  o.params_changed = true;
  o.params_nonfinite = true;
  o.grads_rerun = true;
  o.grads_nonfinite = true;
  EXPECT_FALSE(judge_rerun("nonfinite_grad", o).reproduces.has_value());
  // A spike judged after the update: the outputs are not the step's.
  RerunOutcome s = ran();
  s.params_changed = true;
  s.outputs_compared = true;
  s.outputs_match = false;
  EXPECT_FALSE(judge_rerun("loss_spike", s).reproduces.has_value());
  // Accumulated gradients: only the last forward is kept.
  RerunOutcome a = ran();
  a.forwards = 4;
  a.grads_rerun = true;
  a.grads_nonfinite = true;
  const RerunVerdict av = judge_rerun("nonfinite_grad", a);
  EXPECT_FALSE(av.reproduces.has_value());
  EXPECT_NE(av.text.find("4 training forwards"), std::string::npos) << av.text;
}

TEST(Attribution, Gradients) {
  RerunOutcome o = ran();
  o.grads_rerun = true;
  o.grads_nonfinite = true;
  EXPECT_TRUE(judge_rerun("nonfinite_grad", o).reproduces.value_or(false));
  o.grads_nonfinite = false;
  EXPECT_FALSE(judge_rerun("nonfinite_grad", o).reproduces.value_or(true));
  // At the updated (finite) parameters: said so.
  o.params_changed = true;
  o.grads_nonfinite = true;
  const RerunVerdict v = judge_rerun("nonfinite_grad", o);
  EXPECT_TRUE(v.reproduces.value_or(false));
  EXPECT_NE(v.text.find("after this step's update"), std::string::npos) << v.text;
}

TEST(Attribution, Spike) {
  RerunOutcome o = ran();
  o.outputs_compared = true;
  o.outputs_match = true;
  EXPECT_TRUE(judge_rerun("loss_spike", o).reproduces.value_or(false));
  o.outputs_match = false;
  EXPECT_FALSE(judge_rerun("loss_spike", o).reproduces.value_or(true));
}

}  // namespace
}  // namespace trainsan
