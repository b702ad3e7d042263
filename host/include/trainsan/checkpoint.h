// Public C++ API of the checkpoint check (bad_checkpoint) for LibTorch programs and the Python
// package: a checkpoint's tensors, judged against a model and its optimizers. The tensors become
// plain descriptions (one fused statistics pass for their NaN/Inf counts), gather_checkpoint
// (trainsan/checkpoint_facts.h) turns those into facts and judge_checkpoint into findings.
//
//   torch::save(net, "net.pt");
//   for (const trainsan::Finding& f : trainsan::check_checkpoint("net.pt", net.get())) ...
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "trainsan/checkpoint_facts.h"
#include "trainsan/facts_table.h"
#include "trainsan/finding.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace trainsan {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
/// A dict of tensors in a checkpoint and where it is ("": the object itself, "model", ...).
using NamedStateDict = std::pair<std::string, NamedTensors>;

/// An optimizer by parameter position (fields: optimizer_tensors.def).
struct OptimizerTensors {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/optimizer_tensors.def"
#undef TRAINSAN_FACT
};

/// A model's state dict and trainable parameters (fields: model_tensors.def).
struct ModelTensors {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/model_tensors.def"
#undef TRAINSAN_FACT
};

/// A checkpoint's tensors and what it is checked against (fields: checkpoint_contents.def).
struct CheckpointContents {
#define TRAINSAN_FACT TRAINSAN_FACT_FIELD
#include "trainsan/checkpoint_contents.def"
#undef TRAINSAN_FACT
};

template <>
struct FactTable<OptimizerTensors> {
  static constexpr const char* kName = "OptimizerTensors";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/optimizer_tensors.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<ModelTensors> {
  static constexpr const char* kName = "ModelTensors";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/model_tensors.def"
#undef TRAINSAN_FACT
  }
};

template <>
struct FactTable<CheckpointContents> {
  static constexpr const char* kName = "CheckpointContents";
  template <class S, class F>
  static void each(S& s, F&& f) {
#define TRAINSAN_FACT TRAINSAN_FACT_VISIT
#include "trainsan/checkpoint_contents.def"
#undef TRAINSAN_FACT
  }
};

/// A module's state dict (its own parameters and buffers, then its children's, as
/// torch::save(module) writes them) and its parameters that require grad.
ModelTensors model_tensors(const torch::nn::Module& module);

/// The description of an optimizer's tensors (no statistics pass: only the shapes and the step
/// counters are read).
OptimizerDesc describe_optimizer(const OptimizerTensors& optimizer);

/// The facts of a checkpoint: one statistics pass over its floating-point tensors (any device),
/// then gather_checkpoint.
CheckpointFacts checkpoint_facts(const CheckpointContents& contents);

/// The bad_checkpoint findings of a checkpoint (messages prefixed "bad_checkpoint: ", step 0).
std::vector<Finding> check_checkpoint(const CheckpointContents& contents);

/// The findings of checkpoint entries (key, tensor) — a state dict, or a torch::save archive's
/// tensors by their dotted keys — against `model` when given (its keys, shapes, dtypes).
std::vector<Finding> check_checkpoint(const NamedTensors& entries,
                                      const torch::nn::Module* model = nullptr,
                                      const std::string& source = "the checkpoint");

/// The findings of a file written by torch::save(module, path) (or any
/// torch::serialize::OutputArchive: nested archives give dotted keys) against `model` when given.
/// Throws c10::ValueError when the file cannot be read as such an archive.
std::vector<Finding> check_checkpoint(const std::string& path,
                                      const torch::nn::Module* model = nullptr);

/// The tensors of a torch::serialize archive file by dotted key ("fc1.weight"); throws
/// c10::ValueError naming the file when it cannot be read.
NamedTensors read_archive(const std::string& path);

}  // namespace trainsan
