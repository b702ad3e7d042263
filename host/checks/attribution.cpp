// Re-run attribution: does the step of a non-finite loss or gradient, or of a loss spike,
// reproduce it when re-run from the same inputs, RNG state and buffers? Torch-free: the callers
// (host/feeds/attribution_feed.cpp and rerun_feed.cpp for LibTorch loops,
// bindings/trainsan/attribution.py) gather the facts.
#include <string>

#include "trainsan/determinism_facts.h"

namespace trainsan {

// Note [Re-run attribution]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Opt-in (rerun_on_error=N). A NaN or a spike is either the batch's or the code's (it comes back
// every time the step runs: a data or code fault) or a transient one (an fp rounding race, a bit
// flip, a flaky device: it does not). On a new finding of
//   * nonfinite_loss (an error) and loss_spike (a warning, but the classic poison batch): judged
//     at the loss, before the backward (on a GPU without sync, or with a loss scaler, at the
//     step's end, after the update), and
//   * nonfinite_grad: judged with the step's statistics, after the optimizer step (or, for
//     gradients a loop clears without stepping, before it),
// and before the policy acts (the exception carries the answer), the caller re-runs that step's
// last training forward once — from references to its inputs, the RNG state and a copy of the
// buffers taken when it started, and for nonfinite_grad the backward from the gradients that
// reached its outputs (torch.autograd.grad: .grad is never touched) — puts the RNG and the
// buffers back, and hands over a RerunOutcome. judge_rerun (below) says:
//   * reproduces: the re-run's outputs equal the step's (the loss computed from them repeats),
//     or hold NaN/Inf again where the step's did; the re-run's gradients hold NaN/Inf again;
//   * does not reproduce: the re-run's outputs are finite where the step's were not, or differ;
//     its gradients are finite;
//   * could not tell: the re-run raised; the optimizer step had already written NaN/Inf into the
//     parameters (every re-run then computes from them); a spike judged after the update (the
//     parameters moved: the outputs are not comparable); gradients accumulated over several
//     forwards (only the last is kept).
// Where the parameters changed before the re-run (a finding judged after the optimizer step) the
// text says the re-run ran at the updated parameters. The other numeric kinds are left out:
// nonfinite_param and fp16_overflow follow from the update (the step's nonfinite_grad carries
// the answer), grad_explosion compares a norm with a running average over steps whose
// parameters a re-run no longer has, nonfinite_activation is a warning.
// Bounded: a finding is answered once (a repeat is counted, never re-run), a step is re-run
// once (its later findings get the same answer), at most N re-runs in a run (then "not re-run"),
// and a re-run that raises is reported, never retried. A finding that reproduces also writes a
// poison_batch trace record of the batch's fingerprint, which a resumed run may be told to skip
// (trainsan.skip_poison): the sanitizer itself never skips a batch.

bool rerun_attributable(const std::string& kind) {
  return kind == "nonfinite_loss" || kind == "nonfinite_grad" || kind == "loss_spike";
}

namespace {

constexpr const char* kFault = "reproduces (a data or code fault: look at this batch";
constexpr const char* kTransient =
    "does not reproduce (a transient numerical or hardware fault: the step's code and batch give "
    "finite values when run again; watch for it recurring on other steps or devices)";

RerunVerdict yes(const std::string& what, const RerunOutcome& o) {
  const std::string fp = o.fingerprint.empty() ? "" : ", fingerprint " + o.fingerprint;
  return {true, std::string(kFault) + fp + "): " + what};
}

RerunVerdict no(const std::string& what) { return {false, std::string(kTransient) + ": " + what}; }

RerunVerdict unknown(const std::string& why) { return {std::nullopt, "could not tell: " + why}; }

}  // namespace

RerunVerdict judge_rerun(const std::string& kind, const RerunOutcome& o) {
  if (!o.ran) return {std::nullopt, "could not re-run this step: " + o.error};
  const std::string from = o.params_changed
                               ? " at the parameters after this step's update (the finding was "
                                 "judged after the optimizer step)"
                               : " from the step's inputs, RNG state and buffers";
  if (o.params_changed && o.params_nonfinite) {
    return unknown(
        "the optimizer step had already written NaN/Inf into the parameters when the finding was "
        "judged, so a re-run computes from them (on a GPU, sync=True judges the step before its "
        "update)");
  }
  if (kind == "nonfinite_grad") {
    if (o.forwards > 1) {
      return unknown(std::to_string(o.forwards) +
                     " training forwards accumulated into this step's gradients; only the last "
                     "is kept for a re-run");
    }
    if (!o.grads_rerun) {
      return unknown("the backward could not be re-run (no gradient reached the step's outputs)");
    }
    const std::string what = "its backward, re-run" + from + ", gives gradients that ";
    if (o.grads_nonfinite) return yes(what + "hold NaN/Inf again", o);
    return no(what + "are finite");
  }
  const std::string outs = "the model's outputs, re-run" + from + ", ";
  if (kind == "loss_spike") {
    if (o.params_changed) {
      return unknown(
          "the loss was judged after this step's update (on a GPU the loss is read a step late; "
          "sync=True judges it in its own step), so the re-run's outputs are not the step's");
    }
    if (!o.outputs_compared) return unknown("nothing of the step was kept to compare with");
    if (o.outputs_match) {
      return yes(outs +
                     "equal the step's, so the loss computed from them and the batch's "
                     "targets spikes again",
                 o);
    }
    return no(outs + "differ from the step's");
  }
  // nonfinite_loss
  if (!o.outputs_compared) {
    if (o.outputs_nonfinite) return yes(outs + "hold NaN/Inf again", o);
    return unknown("the step's outputs were not kept and the re-run's are finite");
  }
  if (o.params_changed && !o.step_outputs_nonfinite) {
    return unknown(
        "the step's outputs were finite (the NaN/Inf arose in the loss computed from them) and "
        "the parameters changed before the re-run, so its outputs are not the step's");
  }
  if (!o.params_changed && o.outputs_match) {
    return yes(outs + "equal the step's" +
                   (o.step_outputs_nonfinite
                        ? " (NaN/Inf at the same places)"
                        : " (finite: the NaN/Inf arises in the loss computed from them and "
                          "the batch's targets)"),
               o);
  }
  if (o.step_outputs_nonfinite && o.outputs_nonfinite) return yes(outs + "hold NaN/Inf again", o);
  if (o.step_outputs_nonfinite) return no(outs + "are finite where the step's held NaN/Inf");
  return no(outs + "differ from the step's");
}

}  // namespace trainsan
