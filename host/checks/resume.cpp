// optimizer_reset (and bad_checkpoint for a load that dropped parameters): a resume that does
// not resume the run it loads.
#include "checks/resume.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

namespace trainsan::host {

// Note [Resume checks]
// ~~~~~~~~~~~~~~~~~~~~
// A resume is model.load_state_dict on the attached model. What it loaded is known when it came
// from a torch.load this process made while attached (the loaded object is remembered by
// identity, without keeping it alive): whether the same checkpoint holds an optimizer state, a
// scheduler state, a step or epoch counter. At the first step of each optimizer after it:
//   * the checkpoint holds a (non-empty) optimizer state, but optimizer.load_state_dict was not
//     called: the optimizer restarts from empty state (Adam's moments, momentum) — error, unless
//     the run is a fine-tune (below);
//   * the optimizer was restored, keeps state, and still has none while the checkpoint is from a
//     trained run: its saved state was empty — error;
//   * the checkpoint holds a scheduler state past its first epoch and no scheduler of this
//     optimizer was restored: the learning rate restarts its schedule (warm-up) — a warning, and
//     an error where the learning rate at this step already differs from the checkpoint's by
//     more than kLrJump (relative): the schedule restarted before the step (a scheduler built
//     after optimizer.load_state_dict sets its initial rate). Where either rate is unknown, or they
//     agree (the optimizer's state restored the saved rate: the restart comes at the scheduler's
//     next step; a constant schedule), or the optimizer was not restored either (that error
//     explains the rate), it stays a warning. None of this for a fine-tune, nor where the live
//     scheduler is at or past the checkpoint's epoch (rebuilt there: last_epoch=...). Where the
//     restarted schedule takes effect later: Note [Restarted schedule].
// Fine-tuning from pretrained weights (a checkpoint without optimizer state) is none of these.
// Fine-tuning from a checkpoint that holds its pretraining's optimizer and scheduler (torchvision
// and HF recipes save {"model", "optimizer", "epoch"} and fine-tune from it) leaves them unloaded
// on purpose. It is told from a forgotten restore by what a resume of the same run cannot show:
//   * a parameter this optimizer trains that the model's load did not write — a head built after
//     the load (model.fc = nn.Linear(512, 10)), or a missing key of a strict=False load (a new
//     classifier): a resume restores every trained parameter;
//   * no optimizer state in the checkpoint could be loaded into this optimizer — another number
//     or size of parameter groups (an optimizer over the head only, a dropped classifier), or
//     another optimizer type (its hyper-parameter names: betas, momentum, ...): load_state_dict
//     would raise, so not calling it is no mistake;
//   * the checkpoint's optimizer state holds more parameters with state than this optimizer
//     trains: parts trained then are frozen now (a frozen backbone).
// Unexpected keys alone (a dropped buffer) and other hyper-parameter values (schedulers move the
// learning rate, OneCycleLR the momentum and betas) are not signals: the forgotten optimizer of
// the same model stays an error.
// At optimizer.load_state_dict: per-element state (exp_avg, momentum_buffer, ...) whose shape is
// not its parameter's — state binds by position, so the parameter order changed — error. When
// the shapes happen to match (two layers of one shape registered in another order), the first
// step after the load compares, once, each parameter's restored state with its gradient at that
// step (MomentScale, gathered in one pass with one device read): the gradient RMS the state
// implies — the square root of Adam's bias-corrected mean exp_avg_sq, of RMSprop's square_avg, of
// Adagrad's sum per step, or SGD's momentum_buffer RMS times (1 - momentum) / (1 - dampening) —
// against the gradient's RMS. A legitimate resume continues the same run: the weights, the data
// and the loss are the saved ones, so the first gradient comes from the distribution the state
// averaged (over the last ~1/(1 - beta2) steps): batch noise, a warm-up's rate, AMP (the
// gradients are read unscaled), coupled weight decay (added to the gradient as the optimizer
// does) move it by a small factor, and momentum of noisy gradients lowers SGD's figure to about
// sqrt((1 - m) / (1 + m)) of it (0.07 at m = 0.99). State given to the wrong parameter is off by
// the ratio of the two parameters' scales, and a permutation is off both ways: within a cycle of
// swapped parameters the ratios multiply to one. So the error needs parameters of the same shape
// off by more than kMomentOff both above and below; a parameter off one way alone (a layer whose
// gradient changed, a spike) is not reported, nor one without a gradient (None, sparse, frozen)
// or with a zero scale (unused: no state built, or no gradient this step). A swap of parameters
// whose gradient scales are less than kMomentOff apart goes unseen (a language model's embedding
// and output layer of one shape measure ~7x apart). The Python package gathers MomentScale before
// the step; the LibTorch binding (Note [C++ resume]) judges after the step, whose update already
// mixed the new gradient into the state, and gives none. Where the checkpoint holds the model's
// state dict too, its key order names each saved slot whatever the scales (resume_slots.cpp:
// Note [Optimizer slots by name], whose finding, where it has one, replaces this rule's).
// At model.load_state_dict(strict=False): keys it dropped for parameters that are frozen or in
// no optimizer stay at their initial values for good, and a state dict whose keys are the
// model's under another prefix loaded nothing — bad_checkpoint (a new head that trains is
// legitimate: it is not reported); so are layers it left at their initial values while the state
// dict holds their tensors under other names (Note [Renamed layers], resume_data.cpp). At the
// first training forward after the model's load: the data position (Note [Data position]).

// Note [Restarted schedule]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A resume that restores the model and the optimizer but rebuilds the learning-rate scheduler
// without scheduler.load_state_dict is judged twice. At the optimizer's first step the restored
// rate usually still holds (optimizer.load_state_dict brought the saved "lr" back; a scheduler
// built after it has set its own first rate already: the jump of Note [Resume checks], an error
// there): a warning that the schedule restarts. The bug takes effect at the scheduler's first
// step after the resume: the fresh schedule sets the rate of its own epoch 1 — a warm-up's first
// rate, a cosine's peak, a step decay counted from zero — where the checkpoint's schedule was at
// its epoch E. So each later step whose rate differs from the previous step's is judged
// (kScheduleStep; the Python package sends one per change, for an optimizer it watches after such
// a first step, up to 1000 of them): an error naming the scheduler, at the first change where
//   * at the first step, the live scheduler of this optimizer (scheduler_type) was found at an
//     epoch below the checkpoint's (scheduler_epoch_now < scheduler_epoch: it restarted), its rate
//     at an epoch can be computed (scheduler_by_epoch: LambdaLR, and the closed forms of StepLR,
//     CosineAnnealingLR, OneCycleLR, ...; not ReduceLROnPlateau, which lowers whatever rate it
//     finds, so a fresh one continues from the restored rate), the optimizer was restored (a
//     forgotten optimizer is its own error, and a fine-tune with a new optimizer builds a new
//     schedule on purpose) and the rate had not jumped yet (that was the error already);
//   * the scheduler set the new rate (the group's rate is the scheduler's last rate): a rate set by
//     hand after the resume is the user's own choice (a documented new value) and ends the watch
//     silently, as does a scheduler whose rate at an epoch has no formula;
//   * the new rate differs by more than kLrJump (relative) from the rate the checkpoint's schedule
//     has at this step (schedule_lr: the live scheduler's own formula evaluated at the checkpoint's
//     epoch plus the epochs it stepped since the resume — the rate a restored scheduler would have
//     set). A scheduler that multiplies the rate it finds (ExponentialLR, StepLR: chainable forms)
//     continues from the restored rate: its changes land on the checkpoint's schedule (StepLR
//     decays late, and agrees again where it does): silent.
// A change that agrees with the checkpoint's schedule keeps the watch: a restart can leave the
// schedule gradually. CosineAnnealingLR's recursive form continues from the restored rate along a
// cosine that starts over (flat at its top) where the checkpoint's was already falling: stepped per
// batch over 1000 steps and resumed at step 16, its 13th change is the first more than kLrJump
// off (an error there); per epoch, its first change already is.
// Silent: a restored scheduler (nothing watched), one rebuilt at the checkpoint's epoch
// (StepLR(..., last_epoch=restored_epoch): scheduler_epoch_now >= scheduler_epoch — not even
// today's first-step warning), a fine-tune, ReduceLROnPlateau, a constant schedule (its rate never
// changes: the warning alone), a rate set by hand. Where no live scheduler is found
// (scheduler_epoch_now = -1: a scheduler of another library) the first step's warning is all.
// LibTorch's schedulers keep no state to save (torch::optim::LRScheduler has no state_dict), so
// trainsan::load gathers none of these facts; a program can send them with Sanitizer::resume().

namespace {

constexpr double kLrJump = 1e-3;    // relative difference of the learning rates that is a jump
constexpr double kMomentOff = 100;  // restored state's scale against the gradient's, either way

bool lr_jumped(double lr, double saved) {
  if (std::isnan(lr) || std::isnan(saved)) return false;
  return std::abs(lr - saved) > kLrJump * std::max(std::abs(lr), std::abs(saved));
}

/// The parameters whose restored state is off from their gradient both ways within one shape
/// (Note [Resume checks]): "name [shape] (state 320x its gradient's scale)"; empty when none.
std::vector<std::string> swapped_moments(const std::vector<MomentScale>& ms, std::string& first) {
  std::map<std::string, std::pair<bool, bool>> ways;  // shape -> (some above, some below)
  auto ratio = [](const MomentScale& m) {
    bool ok = std::isfinite(m.moment) && std::isfinite(m.grad) && m.moment > 0 && m.grad > 0;
    return ok ? m.moment / m.grad : 1.0;
  };
  for (const MomentScale& m : ms) {
    double r = ratio(m);
    if (r > kMomentOff) ways[m.shape].first = true;
    if (r < 1 / kMomentOff) ways[m.shape].second = true;
  }
  std::vector<std::string> out;
  for (const MomentScale& m : ms) {
    double r = ratio(m);
    auto it = ways.find(m.shape);
    if ((r > kMomentOff || r < 1 / kMomentOff) && it != ways.end() && it->second.first &&
        it->second.second) {
      if (out.empty()) first = m.name;
      out.push_back(m.name + " " + m.shape + " (state " + fmt(r) + "x its gradient's scale)");
    }
  }
  return out;
}

}  // namespace

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
      // A fine-tune leaves the pretraining's optimizer and scheduler unloaded on purpose.
      const bool fine_tune =
          f.params_not_loaded > 0 || !f.checkpoint_optimizer_fits ||
          (f.trainable_params >= 0 && f.checkpoint_state_params > f.trainable_params);
      bool forgotten = false;
      if (f.scheduler_epoch_at_attach > 0 && !f.optimizer_restored && f.stateful &&
          f.optimizer_with_state == 0) {
        // Note [Loads before attach] (resume.py): the loads were not journaled; what attach saw.
        forgotten = true;
        sink_.add(Kind::optimizer_reset, "",
                  "a learning-rate scheduler of " + opt + " was at epoch " +
                      std::to_string(f.scheduler_epoch_at_attach) +
                      " when TrainSan attached, but the optimizer held no state and was not "
                      "restored before this step: the run resumes its schedule with a fresh "
                      "optimizer — momentum and Adam's moments from zero, bias correction from "
                      "step 1 — call optimizer.load_state_dict(...) with the checkpoint's "
                      "optimizer state (trainsan.watch_loads() before the loads lets TrainSan "
                      "judge them in full)",
                  static_cast<double>(f.scheduler_epoch_at_attach), step);
      }
      if (!forgotten && f.checkpoint_has_optimizer_state && !f.optimizer_restored &&
          f.optimizer_with_state == 0 && !fine_tune) {
        forgotten = true;
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
      restarts_.erase(f.opt);  // a new resume of this optimizer
      // A scheduler rebuilt at the checkpoint's epoch (last_epoch=...) is positioned: silent.
      if (f.scheduler_epoch > 0 && !f.scheduler_restored && !fine_tune &&
          f.scheduler_epoch_now < f.scheduler_epoch) {
        const bool jumped = !forgotten && lr_jumped(f.lr, f.checkpoint_lr);
        std::ostringstream os;
        os << "the checkpoint holds a learning-rate scheduler's state at epoch "
           << f.scheduler_epoch << ", but no scheduler of " << opt
           << " was restored (scheduler.load_state_dict)";
        if (!f.scheduler_type.empty() && f.scheduler_epoch_now >= 0) {
          os << " — its " << f.scheduler_type << " is at epoch " << f.scheduler_epoch_now;
        }
        os << ": the schedule restarts";
        if (jumped) {
          os << " — the learning rate jumped from " << fmt(f.checkpoint_lr) << " when saved to "
             << fmt(f.lr) << " at this step";
        } else if (!std::isnan(f.lr)) {
          os << " — the learning rate is " << fmt(f.lr) << " at this step";
          if (!std::isnan(f.checkpoint_lr)) os << ", " << fmt(f.checkpoint_lr) << " when saved";
        }
        os << "; restore the scheduler with the optimizer";
        if (jumped) os << " (scheduler.load_state_dict after building it)";
        sink_.add(Kind::optimizer_reset, "", os.str(), f.lr, step,
                  jumped ? Severity::kError : Severity::kWarning);
        // Note [Restarted schedule]: watched until the rate first changes.
        if (!jumped && !forgotten && f.optimizer_restored && f.scheduler_by_epoch &&
            !f.scheduler_type.empty() && f.scheduler_epoch_now >= 0) {
          restarts_[f.opt] = Restart{f.scheduler_epoch, f.scheduler_epoch_now, f.checkpoint_lr,
                                     f.scheduler_type, opt};
        }
      }
      if (slots_moved(f, opt, step)) return;  // Note [Optimizer slots by name]
      std::string first;
      const std::vector<std::string> swapped = swapped_moments(f.moments, first);
      if (!swapped.empty()) {
        sink_.add(Kind::optimizer_reset, first,
                  opt +
                      "'s restored state does not fit its parameters: at the first step after "
                      "optimizer.load_state_dict, the gradient scale the state implies is off "
                      "by more than " +
                      fmt(kMomentOff) +
                      "x, both ways among parameters of one shape: " + join_names(swapped) +
                      " — the state was restored by position after the parameter order changed "
                      "(the optimizer is built over the parameters in another order than the one "
                      "that saved it: modules registered in another order, a refactor); build "
                      "the optimizer over the parameters in the saved order, or remap the saved "
                      "state by parameter name",
                  static_cast<double>(swapped.size()), step);
      }
      return;
    }
    case M::kScheduleStep:
      scheduler_restart(f, step);
      return;
  }
}

void ResumeCheck::scheduler_restart(const ResumeFacts& f, int64_t step) {
  const auto it = restarts_.find(f.opt);
  if (it == restarts_.end()) return;
  const Restart r = it->second;
  const bool by_scheduler =
      !std::isnan(f.lr) && !std::isnan(f.scheduler_lr) && !lr_jumped(f.lr, f.scheduler_lr);
  if (!by_scheduler || std::isnan(f.schedule_lr)) {  // set by hand, or no formula: the watch ends
    restarts_.erase(it);
    return;
  }
  // Still on the checkpoint's schedule: watched on, each change judged (Note [Restarted schedule]).
  if (!lr_jumped(f.lr, f.schedule_lr)) return;
  restarts_.erase(it);
  const int64_t now = f.scheduler_epoch_now >= 0 ? f.scheduler_epoch_now : r.epoch_then;
  std::ostringstream os;
  os << "the learning-rate scheduler " << r.scheduler << " of " << r.opt
     << " was rebuilt but not restored after the resume, and its restarted schedule took "
        "effect at this step: it set the learning rate to "
     << fmt(f.lr) << " (its epoch " << now << "), where the checkpoint's schedule is at epoch "
     << r.checkpoint_epoch + (now - r.epoch_then) << " with " << fmt(f.schedule_lr)
     << " (it was saved at epoch " << r.checkpoint_epoch << " with " << fmt(r.checkpoint_lr)
     << ") — the run follows its schedule from the start again (a warm-up, a cosine's peak, "
        "decays counted from zero), "
     << r.checkpoint_epoch - r.epoch_then
     << " epoch(s) behind the checkpoint; call scheduler.load_state_dict(...) with the "
        "checkpoint's scheduler state after building it";
  // Named by its scheduler: a finding of its own next to the first step's warning (the sink
  // counts a second finding of one kind and subject as a repeat).
  sink_.add(Kind::optimizer_reset, r.scheduler + " of optimizer " + std::to_string(f.opt), os.str(),
            f.lr, step, Severity::kError);
}

}  // namespace trainsan::host
