// no_grad_leak and eval_mode: judged by what trains (Note [Mode rules]).
#include "checks/mode.h"

#include <algorithm>

namespace trainsan::host {

// Note [Mode rules]
// ~~~~~~~~~~~~~~~~~
// A forward under no_grad while the model is in train mode is normal: a prediction between LBFGS
// steps, an RL rollout, a teacher or EMA model, a metric on the training batch. It costs the
// training only when it *was* the training forward: then the parameters miss their gradient at
// the step. So no_grad_leak is an error at an optimizer step when (1) none of the trainable
// parameters of the stepping optimizer got a gradient since its previous step, (2) the model ran
// at least one forward under no_grad in train mode since that step, and (3) no forward with grad
// enabled. Forwards inside a step (an LBFGS closure) are the step's own and not counted; their
// gradients count for (1). One sanitizer per model: another model's forwards are not this one's.
// A train-mode no_grad forward of a model with mode-dependent modules in train mode (Dropout,
// BatchNorm tracking running statistics, RNN/attention dropout: Setup::mode_modules with
// mode_dependent) is a *warning* at the forward naming the consequence; without such modules it
// is silent.
//
// eval_mode: a module in eval mode matters when what it owns trains. At a step, a registered
// module that was in eval mode at the last grad-enabled forward is flagged when one of its
// parameters (ModeModule::params: its own; for a parameterless module such as Dropout, those of
// its nearest ancestor with parameters; empty: every parameter) is trainable, in the stepping
// optimizer and got a gradient — whatever its class. The model's own train flag false at that
// forward is the whole model trained in eval mode. Modules left in eval mode on purpose whose
// parameters are frozen (requires_grad False, or in no optimizer) are silent: a frozen backbone
// with frozen BatchNorm, and the Dropout inside it.

namespace {

bool is_norm(const ModuleRef& m) { return m.type.find("Norm") != std::string::npos; }

std::string named(const ModuleRef& m) {
  return "'" + m.name + "'" + (m.type.empty() ? "" : " (" + m.type + ")");
}

}  // namespace

std::string ModeCheck::forward_named() const {
  return last_site_.empty() ? std::string("the model's forward")
                            : "the model's forward (called at " + last_site_ + ")";
}

void ModeCheck::on_graphless_backward(int64_t step, int64_t no_grad_forwards) {
  sink_.add(Kind::no_grad_leak, "",
            "backward() was called on a loss without an autograd graph because " + forward_named() +
                " ran with gradients disabled (torch.no_grad / inference_mode) in train mode (" +
                std::to_string(no_grad_forwards) +
                " forward(s) since the previous step, none with gradients enabled): nothing of "
                "the model can train — remove the no_grad context around the training forward",
            static_cast<double>(no_grad_forwards), step);
}

void ModeCheck::on_forward(const ForwardView& v) {
  if (!v.grad_enabled && v.training && !v.site.empty()) last_site_ = v.site;
  if (v.grad_enabled || !v.training || v.train_mode_dependent.empty()) return;
  std::vector<const ModuleRef*> mods;
  for (const size_t k : v.train_mode_dependent) {
    if (k < modules_.size()) mods.push_back(&modules_[k].ref);
  }
  if (mods.empty()) return;
  const bool norm = std::any_of(mods.begin(), mods.end(), [](auto* m) { return is_norm(*m); });
  const bool other = std::any_of(mods.begin(), mods.end(), [](auto* m) { return !is_norm(*m); });
  std::string effect;
  if (norm) {
    effect =
        "BatchNorm running statistics are updated with this forward's data (evaluation "
        "data leaks into the statistics used at inference)";
  }
  if (other) {
    effect += std::string(norm ? ", and " : "") +
              "dropout is active, so these outputs are randomly perturbed";
  }
  const size_t n = mods.size();
  const std::string others =
      n > 1 ? " and " + std::to_string(n - 1) + " other mode-dependent module(s)" : std::string();
  sink_.add(Kind::no_grad_leak, mods.front()->name,
            "the model's forward ran under torch.no_grad / inference_mode while the model is in "
            "train mode, so module " +
                named(*mods.front()) + others + " behaved as in training — " + effect +
                "; for evaluation or prediction call model.eval() first (and model.train() "
                "after); if the no_grad forward is part of training on purpose (e.g. generating "
                "samples for another model), this warning can be ignored",
            static_cast<double>(n), v.step, Severity::kWarning);
}

void ModeCheck::on_step(const StepView& v) {
  if (v.manual || !v.have_optimizer) return;
  no_grad_step(v);
  eval_step(v);
}

// True for a parameter this step trains: trainable, in the stepping optimizer, with a gradient.
static bool trains(const ParamView& p, int64_t opt) {
  return p.trainable && p.opt >= 0 && (opt < 0 || p.opt == opt) && p.observed.got_grad;
}

void ModeCheck::no_grad_step(const StepView& v) {
  if (v.no_grad_train_forwards == 0 || v.grad_forwards > 0) return;
  int64_t trainable = 0;
  const ParamView* first = nullptr;
  for (const ParamView& p : v.params) {
    if (!p.trainable || p.opt < 0 || (v.opt >= 0 && p.opt != v.opt)) continue;
    if (p.observed.got_grad) return;  // the step trains something: the no_grad forward was extra
    if (first == nullptr) first = &p;
    trainable += 1;
  }
  if (trainable == 0) return;  // frozen on purpose
  const std::string count = std::to_string(v.no_grad_train_forwards);
  sink_.add(Kind::no_grad_leak, "",
            forward_named() +
                " ran with gradients disabled (torch.no_grad / inference_mode) in train mode (" +
                count +
                " forward(s) since the previous step) and never with gradients enabled, so "
                "none of its " +
                std::to_string(trainable) + " trainable parameter(s) in this optimizer (e.g. " +
                first->name +
                ") got a gradient for this step — remove the no_grad context around the "
                "training forward; if the model is meant to stay frozen, set "
                "requires_grad_(False) on it or leave it out of the optimizer",
            static_cast<double>(trainable), v.step);
}

void ModeCheck::eval_step(const StepView& v) {
  if (!v.model_eval && v.eval_modules.empty()) return;
  size_t n = 0;
  for (const ParamView& p : v.params) n = std::max(n, p.index + 1);
  std::vector<char> trained(n, 0);
  const ParamView* any = nullptr;
  for (const ParamView& p : v.params) {
    if (trains(p, v.opt)) {
      trained[p.index] = 1;
      if (any == nullptr) any = &p;
    }
  }
  if (any == nullptr) return;  // nothing trains: eval mode is deliberate (frozen)
  auto trained_param = [&](const ModeModule& m) -> const ParamView* {
    if (m.params.empty()) return any;
    for (const size_t i : m.params) {
      if (i < n && trained[i]) {
        for (const ParamView& p : v.params) {
          if (p.index == i) return &p;
        }
      }
    }
    return nullptr;
  };
  std::vector<std::pair<const ModuleRef*, const ParamView*>> hits;
  for (const size_t k : v.eval_modules) {
    if (k >= modules_.size()) continue;
    if (const ParamView* p = trained_param(modules_[k])) hits.emplace_back(&modules_[k].ref, p);
  }
  if (v.model_eval) {
    sink_.add(Kind::eval_mode, "<model>",
              "the model ran in eval mode (model.training is False) during a training step "
              "while its parameters are being trained (e.g. " +
                  any->name +
                  ") — Dropout is off, BatchNorm normalises with (and stops updating) its "
                  "running statistics, and any module that reads self.training behaves as at "
                  "inference; call model.train() after validation (or after loading the model)",
              static_cast<double>(hits.size() + 1), v.step);
    return;
  }
  if (hits.empty()) return;
  const ModuleRef& first = *hits.front().first;
  const size_t h = hits.size();
  const std::string others =
      h > 1 ? " and " + std::to_string(h - 1) + " other module(s)" : std::string();
  const std::string& pname = hits.front().second->name;
  const bool own = pname.compare(0, first.name.size() + 1, first.name + ".") == 0;
  sink_.add(Kind::eval_mode, first.name,
            "module " + named(first) + others + " ran in eval mode during a training step while " +
                (own ? "its parameters are" : "the parameters of its enclosing module are") +
                " being trained (e.g. " + pname +
                ") — it behaves as at inference (Dropout off, BatchNorm on frozen running "
                "statistics); call model.train() after validation, or, if it is frozen on "
                "purpose, freeze its parameters too (requires_grad_(False))",
            static_cast<double>(h), v.step);
}

}  // namespace trainsan::host
