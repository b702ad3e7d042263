// trainsan::attach (trainsan/attach.h): the one-line C++ front door over torch::nn::Module and
// torch::optim::Optimizer. The only host file that includes torch/nn and torch/optim.
#include "trainsan/attach.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/rnn.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <unordered_map>

namespace trainsan {

// Note [C++ attach]
// ~~~~~~~~~~~~~~~~~
// A LibTorch program has no module hooks and no optimizer hooks, so what Python's attach learns
// from them is found another way, at no cost to a healthy step:
// - The forward: a thread-local RecordFunction callback (host/forward_watch.h), armed from the end
//   of a step (end_step) until the step's training forwards were seen and its backward began,
//   takes the first op that reads one of the model's parameters together with another tensor of
//   at least one dimension (the batch, or what the model made of it before its first parameter):
//   a forward of the model. Grad mode is read there, at the forward — a forward under
//   torch::NoGradGuard is seen as one — and the model's and its mode-dependent modules'
//   train/eval flags are read then, so an eval mode is judged at the step whose forward it is;
//   that op's other inputs are fingerprinted (duplicate_batch). In-place ops (the optimizer's
//   add_, copy_, _foreach_*) are not forwards. After a no_grad forward (a validation pass) the
//   watch stays armed for a grad-enabled one, with no bound but a large one (kMaxIdleOps, 4M ops:
//   a program that stops training pays for that many once): the ops between two training
//   forwards — a loader's per-example transforms, a validation pass of large batches — are not
//   a reason to miss the next one. (It was a bound of 4096 ops since end_step: pytorch/examples'
//   MNIST, whose test pass loads batches of 1000 examples at ~8 ops each, hid the first training
//   forward of every epoch, and with it an eval mode left by that pass until the step after.)
// - The loss: Tensor::backward() (and torch::autograd::backward/grad without a gradient) seeds
//   its root's gradient with ones_like(root, LEGACY_CONTIGUOUS_MEMORY_FORMAT) on the calling
//   thread before the engine runs, so the root of the step's backward is seen there, for a CPU
//   and a CUDA backward alike (a program's own ones_like keeps the default memory format:
//   not a root). A root whose graph reaches none of the model's parameters (a probe's) is not
//   the step's and the watch waits on. A CPU root is read there and, when not finite, checked as
//   the step's loss at once: written to the trace, printed under warn and raise (raised at the
//   next event: a callback cannot throw), so a program that aborts after its backward does not
//   take it away. A finite root is left to end_step(loss): it may be a scaled loss
//   ((loss * scale).backward() with a hand-written scaler), which must not enter the loss
//   stream. A CUDA root is not read (the CPU would wait for the forward); instead, until the
//   optimizer's update, the program's reads of it are watched. From the first grad-enabled
//   forward until then, a one-element tensor with a graph that the program reads (aten::item,
//   isnan, isinf, isfinite) — `AT_ASSERT(!std::isnan(loss.item<float>()))`, before the backward
//   as pytorch/examples' MNIST writes it, or after it — is read too, and when not finite it is
//   the step's loss (its check drained from the read-back queue at once: the program waits for
//   the value anyway). end_step(loss) does not check a loss seen here twice. A backward given an
//   explicit gradient has no ones_like: its beginning is its first node on this thread (a CPU
//   backward) or the first in-place write of a parameter (the optimizer step, through .data()
//   too) after the forward. Once every group's training forward was seen and the backward began
//   (for a CUDA root: the update; or kMaxOpsAfterForward, 32768 ops after the first training
//   forward, passed: a group whose forward never comes), the callback is removed, so the rest of
//   the step runs without it. Its own time goes to the sanitizer's (Note [Own time]), taken at
//   each event, with the dispatcher's price of calling it (Note [Watch price] in
//   host/forward_watch.cpp).
// - The step: an optimizer step updates its parameters in place, which moves their version
//   counters; at end_step, each optimizer whose parameters' versions moved since the previous
//   end_step is judged (step_end), with its param groups' learning rates as they are then. An
//   optimizer that did not step (a loss scaler skipped it; the loop forgot it) is not judged
//   there: a skipped step is found by the step rules at the next backward, and a scaler's skip is
//   reported with scaler_step() first (docs/cpp.md, "Loss scalers").
// - Names, optimizer and param group of each parameter: the model's named_parameters() (a
//   parameter shared by two modules once, under its first name) and the optimizers'
//   param_groups(); parameters in no optimizer are watched too (param_not_in_optimizer). Modules
//   whose forward depends on train/eval (Dropout, BatchNorm, InstanceNorm with running statistics,
//   RNNs and MultiheadAttention with dropout) and modules with parameters are the mode modules
//   (Note [Mode rules]); a parameterless one is tied to the parameters of its nearest ancestor
//   that has some, as in Python.

namespace {

// "torch::nn::DropoutImpl" -> "Dropout"; "(anonymous namespace)::Net" -> "Net".
std::string short_type(const std::string& full) {
  std::string t = full;
  const size_t colon = t.rfind("::");
  if (colon != std::string::npos) t = t.substr(colon + 2);
  if (t.size() > 4 && t.compare(t.size() - 4, 4, "Impl") == 0) t.resize(t.size() - 4);
  return t;
}

template <typename Impl>
bool dropout_of(torch::nn::Module& m, bool* found) {
  if (auto* r = dynamic_cast<Impl*>(&m)) {
    *found = true;
    return r->options.dropout() > 0.0;
  }
  return false;
}

bool mode_dependent(torch::nn::Module& m, const std::string& type) {
  if (type.find("Dropout") != std::string::npos || type.find("BatchNorm") != std::string::npos) {
    return true;
  }
  if (type.find("InstanceNorm") != std::string::npos) {
    return m.named_buffers(/*recurse=*/false).contains("running_mean");
  }
  bool found = false;
  const bool rnn = dropout_of<torch::nn::LSTMImpl>(m, &found) ||
                   dropout_of<torch::nn::GRUImpl>(m, &found) ||
                   dropout_of<torch::nn::RNNImpl>(m, &found) ||
                   dropout_of<torch::nn::MultiheadAttentionImpl>(m, &found);
  return found && rnn;
}

class Binding : public ModelBinding {
 public:
  // models[k] is trained by the optimizers whose model_of_opt entry is k.
  Binding(std::vector<torch::nn::Module*> models, std::vector<torch::optim::Optimizer*> optimizers,
          std::vector<size_t> model_of_opt)
      : models_(std::move(models)),
        optimizers_(std::move(optimizers)),
        model_of_opt_(std::move(model_of_opt)) {
    for (auto* o : optimizers_) {
      versions_.push_back(version(*o));
      state_now_.push_back(with_state(*o));
    }
    state_before_ = state_now_;
  }

  bool training(int64_t opt) const override {
    const size_t k = opt >= 0 && static_cast<size_t>(opt) < model_of_opt_.size()
                         ? model_of_opt_[static_cast<size_t>(opt)]
                         : 0;
    return models_[k]->is_training();
  }

  std::vector<bool> module_eval() const override {
    std::vector<bool> out;
    out.reserve(modules_.size());
    for (const auto& m : modules_) out.push_back(!m->is_training());
    return out;
  }

  std::vector<int64_t> stepped() override {
    std::vector<int64_t> out;
    for (size_t k = 0; k < optimizers_.size(); ++k) {
      const int64_t v = version(*optimizers_[k]);
      if (v != versions_[k]) out.push_back(static_cast<int64_t>(k));
      versions_[k] = v;
      state_before_[k] = state_now_[k];
      state_now_[k] = with_state(*optimizers_[k]);
    }
    return out;
  }

  // Note [C++ resume]: trainsan::load of a model or an optimizer goes through here; the first
  // step of each optimizer after a model load is judged by Note [Resume checks] with what the
  // program restored. A LibTorch checkpoint is one archive per object (torch::save(model, ...),
  // torch::save(optimizer, ...)), so "the checkpoint holds an optimizer state" is known only when
  // the program restored some optimizer of this sanitizer: then another one not restored
  // restarts from empty state (a GAN resumed with one optimizer forgotten). A model loaded with
  // no optimizer state at all is a fine-tune from pretrained weights, and not reported.
  void model_loaded() {
    loaded_ = true;
    first_step_done_.clear();
  }
  void optimizer_loaded(int64_t opt) {
    restored_.insert(opt);
    if (opt >= 0 && static_cast<size_t>(opt) < optimizers_.size()) {
      versions_[opt] = version(*optimizers_[opt]);
      state_now_[opt] = with_state(*optimizers_[opt]);
    }
  }
  int64_t index_of(const torch::optim::Optimizer& o) const {
    for (size_t k = 0; k < optimizers_.size(); ++k) {
      if (optimizers_[k] == &o) return static_cast<int64_t>(k);
    }
    return -1;
  }

  std::optional<ResumeFacts> first_step_after_load(int64_t opt) override {
    if (!loaded_ || opt < 0 || first_step_done_.count(opt) != 0) return std::nullopt;
    first_step_done_.insert(opt);
    ResumeFacts f;
    f.moment = ResumeFacts::Moment::kFirstStep;
    f.opt = opt;
    f.optimizer_type = short_type(c10::demangle(typeid(*optimizers_[opt]).name()));
    f.checkpoint_has_optimizer_state = !restored_.empty();
    f.optimizer_restored = restored_.count(opt) != 0;
    f.stateful = state_now_[opt] > 0;
    f.optimizer_with_state = state_before_[opt];
    const auto lr = group_lr(opt);
    if (!lr.empty()) f.lr = lr.front();
    return f;
  }

  std::vector<double> group_lr(int64_t opt) const override {
    std::vector<double> out;
    if (opt < 0 || static_cast<size_t>(opt) >= optimizers_.size()) return out;
    for (const auto& g : optimizers_[opt]->param_groups()) {
      double lr = std::numeric_limits<double>::quiet_NaN();
      try {
        lr = g.options().get_lr();
      } catch (const c10::Error&) {
        // an optimizer whose options do not implement get_lr(): unknown
      }
      out.push_back(lr);
    }
    return out;
  }

  std::vector<std::shared_ptr<torch::nn::Module>> modules_;  // per Setup::mode_modules

 private:
  static int64_t with_state(const torch::optim::Optimizer& o) {
    return static_cast<int64_t>(o.state().size());
  }

  static int64_t version(const torch::optim::Optimizer& o) {
    int64_t v = 0;
    for (const auto& g : o.param_groups()) {
      for (const auto& p : g.params()) {
        if (p.defined()) v += p._version();
      }
    }
    return v;
  }

  std::vector<torch::nn::Module*> models_;
  std::vector<torch::optim::Optimizer*> optimizers_;
  std::vector<size_t> model_of_opt_;
  std::vector<int64_t> versions_;
  std::vector<int64_t> state_now_, state_before_;  // parameters with optimizer state
  bool loaded_ = false;                            // trainsan::load of a model ran
  std::set<int64_t> restored_;                     // optimizers restored since
  std::set<int64_t> first_step_done_;
};

// TRAINSAN_OPTIONS="policy=record,trace=run.jsonl,check.loss_spike=false": set over the options
// the program gives, so that a run is reconfigured without a rebuild.
void apply_environment(Options* options) {
  const char* env = std::getenv("TRAINSAN_OPTIONS");
  if (env == nullptr) return;
  std::string all = env;
  size_t start = 0;
  while (start <= all.size()) {
    size_t end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    const std::string item = all.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    TORCH_CHECK_VALUE(eq != std::string::npos, "trainsan: TRAINSAN_OPTIONS entry '", item,
                      "' is not name=value (e.g. TRAINSAN_OPTIONS=policy=record,trace=run.jsonl)");
    options->set(item.substr(0, eq), item.substr(eq + 1));
  }
}

}  // namespace

Sanitizer attach(const std::vector<Part>& parts, Options options) {
  apply_environment(&options);
  TORCH_CHECK_VALUE(!parts.empty(), "trainsan::attach: no model given");
  const bool several = parts.size() > 1;
  auto prefixed = [&](const Part& part, const std::string& name) {
    if (!several) return name;
    return name.empty() ? part.name : part.name + "." + name;
  };
  std::vector<Parameter> params;
  std::unordered_map<const c10::TensorImpl*, int64_t> index;
  std::vector<torch::nn::Module*> models;
  std::vector<torch::optim::Optimizer*> all_opts;
  std::vector<size_t> model_of_opt;
  for (size_t k = 0; k < parts.size(); ++k) {
    const Part& part = parts[k];
    TORCH_CHECK_VALUE(!several || !part.name.empty(), "trainsan::attach: model ", k,
                      " of several has no name; name each part ({\"generator\", ...})");
    models.push_back(&part.model);
    for (const auto& item : part.model.named_parameters(/*recurse=*/true)) {
      const at::Tensor& t = item.value();
      if (!t.defined() || index.count(t.unsafeGetTensorImpl()) != 0) continue;
      index[t.unsafeGetTensorImpl()] = static_cast<int64_t>(params.size());
      params.push_back({prefixed(part, item.key()), t, /*optimizer=*/-1, /*group=*/0});
    }
    for (auto* o : part.optimizers.list()) {
      TORCH_CHECK_VALUE(o != nullptr, "trainsan::attach: optimizer ", all_opts.size(), " is null");
      all_opts.push_back(o);
      model_of_opt.push_back(k);
    }
  }
  TORCH_CHECK_VALUE(!params.empty(), "trainsan::attach: the model (", parts[0].model.name(),
                    ") has no parameters; attach to the module that holds the trained weights");
  for (size_t o = 0; o < all_opts.size(); ++o) {
    const auto& groups = all_opts[o]->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const auto& p : groups[g].params()) {
        const auto it = index.find(p.unsafeGetTensorImpl());
        TORCH_CHECK_VALUE(it != index.end(), "trainsan::attach: optimizer ", o, " (param group ", g,
                          ") holds a tensor of shape ", p.sizes(),
                          " that is not a parameter of the model (",
                          parts[model_of_opt[o]].model.name(),
                          "); attach to the module whose parameters the optimizer steps (a "
                          "common parent of them), or build the optimizer from "
                          "model->parameters()");
        Parameter& prm = params[static_cast<size_t>(it->second)];
        TORCH_CHECK_VALUE(prm.optimizer < 0 || prm.optimizer == static_cast<int64_t>(o),
                          "trainsan::attach: parameter '", prm.name, "' is in optimizers ",
                          prm.optimizer, " and ", o, "; give each parameter to one optimizer");
        prm.optimizer = static_cast<int64_t>(o);
        prm.group = static_cast<int64_t>(g);
      }
    }
  }
  Setup setup;
  setup.manual = all_opts.empty();
  for (const Part& part :
       parts) {  // what a re-run starts from and puts back (feeds/rerun_feed.cpp)
    for (const at::Tensor& b : part.model.buffers()) setup.buffers.push_back(b);
  }
  auto binding = std::make_shared<Binding>(models, all_opts, model_of_opt);
  for (const Part& part : parts) {
    auto own_params = [&](torch::nn::Module& m, bool recurse) {
      std::vector<int64_t> out;
      for (const auto& p : m.parameters(recurse)) {
        const auto it = index.find(p.unsafeGetTensorImpl());
        if (it != index.end()) out.push_back(it->second);
      }
      return out;
    };
    const auto modules = part.model.named_modules(/*name_prefix=*/"", /*include_self=*/false);
    for (const auto& item : modules) {
      torch::nn::Module& m = *item.value();
      const std::string type = short_type(m.name());
      const bool dep = mode_dependent(m, type);
      std::vector<int64_t> own = own_params(m, /*recurse=*/false);
      if (own.empty() && dep) {
        std::string anc = item.key();  // itself (recursively), then its ancestors up to the root
        while (own.empty()) {
          if (anc.empty()) {
            own = own_params(part.model, /*recurse=*/true);
            break;
          }
          if (const auto* found = modules.find(anc)) own = own_params(**found, /*recurse=*/true);
          const size_t dot = anc.rfind('.');
          anc = dot == std::string::npos ? std::string() : anc.substr(0, dot);
        }
      }
      if (own.empty() && !dep) continue;
      setup.mode_modules.push_back({prefixed(part, item.key()), type, own, dep});
      binding->modules_.push_back(item.value());
    }
  }
  setup.binding = binding;
  return Sanitizer(std::move(params), std::move(options), std::move(setup));
}

Sanitizer attach(torch::nn::Module& model, const Optimizers& optimizers, Options options) {
  return attach(std::vector<Part>{Part{"", model, optimizers}}, std::move(options));
}

namespace {

Binding& binding_of(Sanitizer& san, const char* what) {
  auto* b = dynamic_cast<Binding*>(san.binding());
  TORCH_CHECK_VALUE(b != nullptr, "trainsan::load(", what,
                    "): the sanitizer was not made by trainsan::attach; use torch::load and give "
                    "the facts with Sanitizer::resume()");
  return *b;
}

// Per-element state tensors of a parameter (Adam's moments, momentum, ...), by name.
std::vector<std::pair<const char*, at::Tensor>> state_tensors(
    torch::optim::OptimizerParamState& s) {
  std::vector<std::pair<const char*, at::Tensor>> out;
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&s)) {
    out = {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}};
  } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(&s)) {
    out = {{"exp_avg", w->exp_avg()}, {"exp_avg_sq", w->exp_avg_sq()}};
  } else if (auto* m = dynamic_cast<torch::optim::SGDParamState*>(&s)) {
    out = {{"momentum_buffer", m->momentum_buffer()}};
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(&s)) {
    out = {{"square_avg", r->square_avg()}, {"momentum_buffer", r->momentum_buffer()}};
  } else if (auto* g = dynamic_cast<torch::optim::AdagradParamState*>(&s)) {
    out = {{"sum", g->sum()}};
  }
  return out;
}

std::string sizes_text(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t k = 0; k < sizes.size(); ++k) out += (k ? ", " : "") + std::to_string(sizes[k]);
  return out + "]";
}

}  // namespace

void load(Sanitizer& san, torch::nn::Module& model, const std::string& path) {
  Binding& b = binding_of(san, "model");
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  model.load(archive);
  b.model_loaded();
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kModelLoad;
  san.resume(f);
}

void load(Sanitizer& san, torch::optim::Optimizer& optimizer, const std::string& path) {
  Binding& b = binding_of(san, "optimizer");
  const int64_t opt = b.index_of(optimizer);
  TORCH_CHECK_VALUE(opt >= 0,
                    "trainsan::load(optimizer): this optimizer was not given to "
                    "trainsan::attach; load it with torch::load, or attach it");
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  optimizer.load(archive);
  b.optimizer_loaded(opt);
  ResumeFacts f;
  f.moment = ResumeFacts::Moment::kOptimizerLoad;
  f.opt = opt;
  f.optimizer_type = short_type(c10::demangle(typeid(optimizer).name()));
  // State binds to parameters by position: state of another shape than its parameter means the
  // parameters are in another order (or of another model) than when it was saved.
  auto& state = optimizer.state();
  int64_t position = 0;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = state.find(p.unsafeGetTensorImpl());
      if (it != state.end() && it->second) {
        for (const auto& [name, t] : state_tensors(*it->second)) {
          if (t.defined() && t.sizes() != p.sizes()) {
            f.state_mismatched.push_back(std::string(name) + " of parameter " +
                                         std::to_string(position) + ": " + sizes_text(t.sizes()) +
                                         ", the parameter " + sizes_text(p.sizes()));
          }
        }
      }
      position += 1;
    }
  }
  san.resume(f);
}

}  // namespace trainsan
