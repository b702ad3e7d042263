// The one-line C++ front door: trainsan::attach(model, optimizer, options).
//
//   #include <trainsan/trainsan.h>
//   auto san = trainsan::attach(model, optimizer);    // policy "raise"; Options for the rest
//   for (auto& batch : *loader) {
//     optimizer.zero_grad();
//     auto loss = torch::nll_loss(model->forward(batch.data), batch.target);
//     loss.backward();
//     optimizer.step();
//     san.end_step(loss);   // the one call per iteration: checks (and raises) here
//   }
//
// What Python's trainsan.attach finds from the model, this finds from the torch::nn::Module and
// the torch::optim::Optimizer(s) (Note [C++ attach] in host/attach.cpp): the parameters' dotted
// names; which optimizer and param group holds each, and the groups' learning rates at every step;
// the modules whose forward depends on train/eval (Dropout, BatchNorm, InstanceNorm with running
// statistics, RNNs with dropout) and those with parameters, whose modes are read at each forward.
// The forward is seen at its first op that reads a parameter together with a batch (grad mode,
// train/eval state, and that op's other inputs, fingerprinted for duplicate_batch); a NaN loss
// when the program reads it with item() before its backward (in the trace before the program can
// abort on it); an optimizer step from its parameters' version counters at end_step. attach returns a
// trainsan::Sanitizer: a function of the loop takes it as `trainsan::Sanitizer& san`. The sanitizer must not outlive
// the model and optimizers it was attached to; close() (or the destructor) removes every hook.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainsan/options.h"
#include "trainsan/sanitizer.h"

namespace trainsan {

/// The optimizers a sanitizer judges: one, several (a GAN's two), or none (parameters updated by
/// hand; steps are then delimited by the training forwards).
class Optimizers {
 public:
  Optimizers() = default;
  Optimizers(torch::optim::Optimizer& optimizer) : list_{&optimizer} {}  // NOLINT: implicit
  Optimizers(std::initializer_list<torch::optim::Optimizer*> list) : list_(list) {}
  Optimizers(std::vector<torch::optim::Optimizer*> list) : list_(std::move(list)) {}  // NOLINT
  const std::vector<torch::optim::Optimizer*>& list() const { return list_; }

 private:
  std::vector<torch::optim::Optimizer*> list_;
};

/// One model of several watched by one sanitizer, with the optimizers that train it; its
/// parameters and modules are named "<name>.<dotted name>".
struct Part {
  std::string name;
  torch::nn::Module& model;
  Optimizers optimizers;
};

/// Attaches one sanitizer to several models (a GAN's generator and discriminator), each with its
/// optimizers (numbered in the order given): their forwards are told apart by the optimizer whose
/// parameters each reads, so a generator run under no_grad is found although the discriminator
/// trains. `auto san = trainsan::attach({{"G", *generator, g_opt}, {"D", *discriminator, d_opt}});`
Sanitizer attach(const std::vector<Part>& parts, Options options = {});

/// Attaches a sanitizer to `model` trained by `optimizers`. The environment variable
/// TRAINSAN_OPTIONS ("policy=record,trace=run.jsonl,check.loss_spike=false") is applied over
/// `options`. Throws c10::Error (ValueError) for a model without parameters, an optimizer holding a
/// tensor that is not one of the model's, or a bad option.
Sanitizer attach(torch::nn::Module& model, const Optimizers& optimizers, Options options = {});
inline Sanitizer attach(torch::nn::Module& model, Options options = {}) {
  return attach(model, Optimizers{}, std::move(options));
}
/// A TORCH_MODULE holder (torch::nn::Linear, a user's `Net` declared with TORCH_MODULE).
template <typename Contained>
Sanitizer attach(torch::nn::ModuleHolder<Contained>& model, const Optimizers& optimizers,
                 Options options = {}) {
  return attach(static_cast<torch::nn::Module&>(*model), optimizers, std::move(options));
}
template <typename Contained>
Sanitizer attach(torch::nn::ModuleHolder<Contained>& model, Options options = {}) {
  return attach(static_cast<torch::nn::Module&>(*model), Optimizers{}, std::move(options));
}
/// A model held by shared_ptr (std::make_shared<Net>()).
template <typename M>
Sanitizer attach(const std::shared_ptr<M>& model, const Optimizers& optimizers,
                 Options options = {}) {
  return attach(static_cast<torch::nn::Module&>(*model), optimizers, std::move(options));
}
template <typename M>
Sanitizer attach(const std::shared_ptr<M>& model, Options options = {}) {
  return attach(static_cast<torch::nn::Module&>(*model), Optimizers{}, std::move(options));
}

/// torch::load(model, path) seen by the sanitizer (Note [C++ resume] in host/attach.cpp): the
/// first step of each optimizer after it is judged for optimizer_reset (an optimizer of a resumed
/// run left unrestored while another was restored). The sanitizer must come from attach().
void load(Sanitizer& san, torch::nn::Module& model, const std::string& path);
/// torch::load(optimizer, path) seen by the sanitizer: state of other shapes than its parameters
/// (a reordered model) is optimizer_reset; the optimizer counts as restored for the next step.
void load(Sanitizer& san, torch::optim::Optimizer& optimizer, const std::string& path);
template <typename Contained>
void load(Sanitizer& san, torch::nn::ModuleHolder<Contained>& model, const std::string& path) {
  load(san, static_cast<torch::nn::Module&>(*model), path);
}

}  // namespace trainsan
