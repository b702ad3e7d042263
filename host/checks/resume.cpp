// optimizer_reset (and bad_checkpoint for a load that dropped parameters): a resume that does
// not resume the run it loads.
#include <cmath>
#include <sstream>

#include "checks/check.h"

namespace trainsan::host {

// Note [Resume checks]
// ~~~~~~~~~~~~~~~~~~~~
// A resume is model.load_state_dict on the attached model. What it loaded is known when it came
// from a torch.load this process made while attached (the loaded object is remembered by
// identity, without keeping it alive): whether the same checkpoint holds an optimizer state, a
// scheduler state, a step or epoch counter. At the first step of each optimizer after it:
//   * the checkpoint holds a (non-empty) optimizer state, but optimizer.load_state_dict was not
//     called: the optimizer restarts from empty state (Adam's moments, momentum) — error;
//   * the optimizer was restored, keeps state, and still has none while the checkpoint is from a
//     trained run: its saved state was empty — error;
//   * the checkpoint holds a scheduler state past its first epoch and no scheduler of this
//     optimizer was restored: the learning rate restarts its schedule (warm-up) — warning.
// Fine-tuning from pretrained weights (a checkpoint without optimizer state) is none of these.
// At optimizer.load_state_dict: per-element state (exp_avg, momentum_buffer, ...) whose shape is
// not its parameter's — state binds by position, so the parameter order changed — error.
// At model.load_state_dict(strict=False): keys it dropped for parameters that are frozen or in
// no optimizer stay at their initial values for good, and a state dict whose keys are the
// model's under another prefix loaded nothing — bad_checkpoint (a new head that trains is
// legitimate: it is not reported); so are layers it left at their initial values while the state
// dict holds their tensors under other names (Note [Renamed layers], resume_data.cpp). At the
// first training forward after the model's load: the data position (Note [Data position]).

void ResumeCheck::on_resume(const ResumeFacts& f, int64_t step) {
  using M = ResumeFacts::Moment;
  const std::string opt = "optimizer " + std::to_string(f.opt) +
                          (f.optimizer_type.empty() ? "" : " (" + f.optimizer_type + ")");
  if (f.first_forward) {
    data_position(f, step);
    return;
  }
  switch (f.moment) {
    case M::kModelLoad: {
      if (!f.prefix.empty()) {
        sink_.add(Kind::bad_checkpoint, "",
                  "model.load_state_dict(strict=False) loaded none of " +
                      std::to_string(f.prefix_keys) +
                      " keys: they are the model's under the "
                      "prefix '" +
                      f.prefix +
                      "' — the model keeps its initial weights; strip "
                      "the prefix (or load into the module it was saved from)",
                  static_cast<double>(f.prefix_keys), step);
      }
      std::vector<std::string> stuck = f.dropped_frozen;
      stuck.insert(stuck.end(), f.dropped_unoptimized.begin(), f.dropped_unoptimized.end());
      if (!stuck.empty()) {
        sink_.add(Kind::bad_checkpoint, stuck.front(),
                  "model.load_state_dict(strict=False) dropped " + std::to_string(stuck.size()) +
                      " parameter(s) that will never train: " + join_names(stuck) + " (" +
                      (f.dropped_frozen.empty() ? "in no optimizer" : "frozen") +
                      ") — they keep their initial values; the checkpoint lacks them (another "
                      "model version, a renamed module): load them, or train them",
                  static_cast<double>(stuck.size()), step);
      }
      if (f.prefix.empty()) renamed_layers(f, step);
      return;
    }
    case M::kOptimizerLoad:
      if (!f.state_mismatched.empty()) {
        sink_.add(Kind::optimizer_reset, "",
                  opt + ".load_state_dict gave parameters state of other shapes: " +
                      join_names(f.state_mismatched) +
                      " — optimizer state binds to parameters by position: the optimizer was "
                      "built over the parameters in another order (or another model) than the "
                      "one that saved it",
                  static_cast<double>(f.state_mismatched.size()), step);
      }
      return;
    case M::kFirstStep: {
      const std::string from =
          f.progress.empty() ? std::string("") : " (the checkpoint is from " + f.progress + ")";
      if (f.checkpoint_has_optimizer_state && !f.optimizer_restored &&
          f.optimizer_with_state == 0) {
        sink_.add(Kind::optimizer_reset, "",
                  "the model was resumed from a checkpoint that holds an optimizer state" + from +
                      ", but " + opt +
                      " was not restored (no optimizer.load_state_dict before this step): it "
                      "restarts from empty state — momentum and Adam's moments from zero, "
                      "bias correction from step 1 — call optimizer.load_state_dict(...) with "
                      "the checkpoint's optimizer state",
                  std::nullopt, step);
      } else if (f.optimizer_restored && f.stateful && f.optimizer_with_state == 0 &&
                 !f.progress.empty()) {
        sink_.add(Kind::optimizer_reset, "",
                  opt + " was restored with an empty state" + from +
                      ": the checkpoint's optimizer state was saved from a fresh optimizer (or "
                      "before its first step), so the resumed run restarts its moments from zero "
                      "— save the state_dict() of the optimizer that trained",
                  std::nullopt, step);
      }
      if (f.scheduler_epoch > 0 && !f.scheduler_restored) {
        std::ostringstream os;
        os << "the checkpoint holds a learning-rate scheduler's state at epoch "
           << f.scheduler_epoch << ", but no scheduler of " << opt
           << " was restored (scheduler.load_state_dict): the schedule restarts";
        if (!std::isnan(f.lr)) {
          os << " — the learning rate is " << fmt(f.lr) << " at this step";
          if (!std::isnan(f.checkpoint_lr)) os << ", " << fmt(f.checkpoint_lr) << " when saved";
        }
        os << "; restore the scheduler with the optimizer";
        sink_.add(Kind::optimizer_reset, "", os.str(), f.lr, step, Severity::kWarning);
      }
      return;
    }
  }
}

}  // namespace trainsan::host
