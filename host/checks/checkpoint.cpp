// bad_checkpoint: a checkpoint whose numbers or structure would not resume the run it came from.
#include "checks/checkpoint.h"

#include <sstream>

namespace trainsan::host {

// Note [Checkpoint checks]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint is checked where it is made (torch.save while attached: before it is written, so
// that under policy "raise" a bad one never reaches the disk) and where it is found
// (`python -m trainsan check`, `trainsan.check_checkpoint`). The caller reads the object — never
// running its code: torch.load(weights_only=True) — and states facts: the tensors holding
// NaN/±Inf, how the state dict it holds compares with the model's (missing trainable parameters,
// other missing entries, unexpected keys, shapes and dtypes), and the optimizer state against
// the parameters it belongs to. Each kind of fault is one finding: a checkpoint that a resume
// would load silently wrong (strict=False dropping parameters, Adam restarting from empty state,
// state bound by position to parameters of another shape) is as bad as one that fails to load.
// Saving only the weights (no optimizer state at all) is legitimate: an export, a best-model
// copy; so is saving only the trainable part (adapters: the frozen entries missing) or, while
// attached, a submodule (its keys cover less than half of the model's: not judged as the
// model). An optimizer state that is present but covers fewer parameters than the optimizer has
// state for is not.

void CheckpointCheck::sub_stale(const CheckpointFacts& f, const std::string& src, int64_t step) {
  sink_.add(Kind::bad_checkpoint, "",
            src + ": the optimizer state is from its step " +
                std::to_string(f.optimizer_step_saved) + " while the optimizer is at step " +
                std::to_string(f.optimizer_step_live) +
                " — it was captured earlier (a state_dict() kept or deep-copied before the last "
                "steps), so a resume pairs these weights with older moments: save "
                "optimizer.state_dict() when you save the model",
            static_cast<double>(f.optimizer_step_saved), step);
}

void CheckpointCheck::on_checkpoint(const CheckpointFacts& f, int64_t step) {
  const std::string src = f.source.empty() ? std::string("the checkpoint") : f.source;
  if (!f.load_error.empty()) {
    sink_.add(Kind::bad_checkpoint, "",
              src + ": cannot be loaded with torch.load(weights_only=True): " + f.load_error +
                  " — it needs arbitrary code to load (pickled classes or functions), which was "
                  "not run; save state dicts of tensors and plain values, or load it with "
                  "weights_only=False only if you trust where it came from",
              std::nullopt, step);
    return;
  }
  if (!f.nonfinite.empty()) {
    std::vector<std::string> names;
    int64_t total = 0;
    for (const auto& n : f.nonfinite) {
      names.push_back(n.key + " (" + std::to_string(n.count) + " of " + std::to_string(n.numel) +
                      ")");
      total += n.count;
    }
    sink_.add(Kind::bad_checkpoint, f.nonfinite.front().key,
              src + ": holds NaN/±Inf values in " + std::to_string(f.nonfinite.size()) +
                  " tensor(s): " + join_names(names) +
                  " — the run had diverged when it was saved; a resume from it continues from "
                  "broken weights: keep the previous checkpoint and find where the values went "
                  "non-finite",
              static_cast<double>(total), step);
  }
  if (f.have_model && !f.model_found) {
    sink_.add(Kind::bad_checkpoint, "",
              src + ": holds no state dict of the model (none of its " +
                  std::to_string(f.model_keys) +
                  " keys were found at any level): it belongs to another model, or was saved "
                  "from something else than model.state_dict()",
              std::nullopt, step);
  } else if (f.have_model) {
    const std::string at = f.model_key.empty() ? "" : " (under '" + f.model_key + "')";
    if (f.ddp_prefix) {
      sink_.add(Kind::bad_checkpoint, "",
                src + ": the model state" + at +
                    " carries DistributedDataParallel's 'module.' prefix on every key: "
                    "load_state_dict into the bare model fails, and with strict=False loads "
                    "nothing — save ddp_model.module.state_dict(), or strip the prefix when "
                    "loading",
                std::nullopt, step);
    } else if (!f.missing_trainable.empty() || !f.unexpected.empty()) {
      // Frozen parameters and buffers alone missing: a save of the trainable part (adapters).
      std::ostringstream os;
      os << src << ": the model state" << at << " does not match the model:";
      if (!f.missing_trainable.empty()) {
        os << " it lacks " << f.missing_trainable.size() << " trainable parameter(s) ("
           << join_names(f.missing_trainable)
           << "), which load_state_dict(strict=False) would leave at their initial values;";
      }
      if (!f.missing_other.empty()) {
        os << " it lacks " << f.missing_other.size() << " other entr"
           << (f.missing_other.size() == 1 ? "y" : "ies") << " (" << join_names(f.missing_other)
           << ");";
      }
      if (!f.unexpected.empty()) {
        os << " it holds " << f.unexpected.size() << " key(s) the model does not have ("
           << join_names(f.unexpected) << ");";
      }
      os << " it was saved from another version of the model, or from part of it";
      const std::string tensor = !f.missing_trainable.empty() ? f.missing_trainable.front()
                                 : !f.missing_other.empty()   ? f.missing_other.front()
                                                              : f.unexpected.front();
      sink_.add(Kind::bad_checkpoint, tensor, os.str(),
                static_cast<double>(f.missing_trainable.size() + f.missing_other.size() +
                                    f.unexpected.size()),
                step);
    }
    if (!f.mismatched.empty()) {
      sink_.add(
          Kind::bad_checkpoint, f.mismatched.front().substr(0, f.mismatched.front().find(':')),
          src + ": tensors do not match the model's shapes or dtypes: " + join_names(f.mismatched) +
              " — load_state_dict fails on a shape (and silently "
              "casts a dtype)",
          static_cast<double>(f.mismatched.size()), step);
    }
  }
  if (f.have_optimizer_state && f.live_with_state > 0 &&
      f.optimizer_with_state < f.live_with_state) {
    sink_.add(Kind::bad_checkpoint, "",
              src + ": the optimizer state covers " + std::to_string(f.optimizer_with_state) +
                  " parameter(s) of " + std::to_string(f.optimizer_params) +
                  " while the optimizer holds state for " + std::to_string(f.live_with_state) +
                  " — a resume restarts the moments (Adam's exp_avg/exp_avg_sq, momentum) of the "
                  "others from zero: save optimizer.state_dict() of the optimizer that trained, "
                  "after its steps",
              static_cast<double>(f.optimizer_with_state), step);
  }
  if (f.optimizer_step_saved >= 0 && f.optimizer_step_live > f.optimizer_step_saved) {
    sub_stale(f, src, step);
  }
  if (!f.state_mismatched.empty()) {
    sink_.add(Kind::bad_checkpoint, "",
              src + ": the optimizer state does not fit its parameters: " +
                  join_names(f.state_mismatched) +
                  " — optimizer state is bound to parameters by position, so the parameter "
                  "order (or the model) changed between the optimizer that saved it and this "
                  "one: build the optimizer over the same parameters in the same order",
              static_cast<double>(f.state_mismatched.size()), step);
  }
}

std::vector<Finding> judge_checkpoint(const CheckpointFacts& facts) {
  CollectingSink sink;
  const Options opts;
  CheckpointCheck check(sink, opts);
  check.on_checkpoint(facts, 0);
  return sink.out;
}

}  // namespace trainsan::host
