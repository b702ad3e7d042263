// The checkpoint check's LibTorch layer (trainsan/checkpoint.h): tensors become the plain
// descriptions gather_checkpoint reads (host/checks/checkpoint_facts.cpp), a torch::save archive
// becomes tensors by dotted key, a torch::nn::Module its state dict.
#include "trainsan/checkpoint.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>

#include <cmath>
#include <fstream>

#include "trainsan/sanitizer.h"
#include "trainsan/stats.h"

namespace trainsan {
namespace {

constexpr int kMaxArchiveDepth = 16;

// The NaN/Inf counts come from the fused pass, which reads these dtypes; other floating types
// (float8, complex) are described without a count.
bool counted(const at::Tensor& t) {
  if (!t.defined() || t.layout() != at::kStrided || t.is_meta()) return false;
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

TensorDesc describe(const std::string& key, const at::Tensor& t, int64_t nonfinite = 0) {
  TensorDesc d;
  d.key = key;
  if (!t.defined()) return d;  // a value that is no tensor: a key, nothing to compare
  d.sizes = t.sizes().vec();
  d.dtype = c10::getDtypeNames(t.scalar_type()).first;  // "float32", as Python names it
  d.numel = t.numel();
  d.nonfinite = nonfinite;
  return d;
}

std::vector<TensorDesc> describe(const NamedTensors& ts) {
  std::vector<TensorDesc> out;
  out.reserve(ts.size());
  for (const auto& [k, t] : ts) out.push_back(describe(k, t));
  return out;
}

// A "step" counter: a one-element tensor holding a finite number; -1 otherwise.
int64_t step_of(const NamedTensors& state) {
  for (const auto& [k, t] : state) {
    if (k != "step" || !t.defined() || t.numel() != 1 || t.is_meta()) continue;
    if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) return t.item<int64_t>();
    const double v = t.item<double>();
    // Python's int(): truncation; a NaN/Inf counter is left to the non-finite scan.
    return std::isfinite(v) && std::fabs(v) < 9.0e18 ? static_cast<int64_t>(v) : -1;
  }
  return -1;
}

void read_archive(torch::serialize::InputArchive& archive, const std::string& prefix, int depth,
                  NamedTensors& out) {
  for (const std::string& key : archive.keys()) {
    at::Tensor t;
    if (archive.try_read(key, t)) {
      out.emplace_back(prefix + key, t);
      continue;
    }
    torch::serialize::InputArchive child;
    if (depth < kMaxArchiveDepth && archive.try_read(key, child)) {
      read_archive(child, prefix + key + ".", depth + 1, out);
    }
  }
}

}  // namespace

ModelTensors model_tensors(const torch::nn::Module& module) {
  ModelTensors out;
  // torch::save's order: a module's own parameters and buffers, then each child's, depth first.
  // The root by reference: a module made on the stack has no shared_ptr to give named_modules.
  auto own = [&](const torch::nn::Module& m, const std::string& prefix) {
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      out.state.emplace_back(prefix + p.key(), p.value());
    }
    for (const auto& b : m.named_buffers(/*recurse=*/false)) {
      out.state.emplace_back(prefix + b.key(), b.value());
    }
  };
  own(module, "");
  for (const auto& m : module.named_modules("", /*include_self=*/false)) {
    own(*m.value(), m.key() + ".");
  }
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (p.value().requires_grad()) out.trainable.emplace_back(p.key(), p.value());
  }
  return out;
}

OptimizerDesc describe_optimizer(const OptimizerTensors& o) {
  TORCH_CHECK_VALUE(o.params.empty() || o.params.size() == o.state.size(), "OptimizerTensors ",
                    o.path.empty() ? "(live)" : "'" + o.path + "'", ": ", o.params.size(),
                    " params but ", o.state.size(),
                    " state entries: give the state of every parameter position (empty where it "
                    "has none)");
  OptimizerDesc d;
  d.path = o.path;
  d.slots.resize(o.state.size());
  for (size_t k = 0; k < o.state.size(); ++k) {
    OptimizerSlotDesc& s = d.slots[k];
    if (!o.params.empty()) s.param = describe(o.params[k].first, o.params[k].second);
    s.has_state = !o.state[k].empty();
    s.step = step_of(o.state[k]);
    s.state = describe(o.state[k]);
  }
  return d;
}

namespace {

// Entries in hand (a state dict, an archive's tensors): the checkpoint is that one state dict.
CheckpointContents entries_contents(const NamedTensors& entries, const torch::nn::Module* model,
                                    const std::string& source) {
  CheckpointContents c;
  c.source = source;
  c.tensors = entries;
  c.state_dicts = {{"", entries}};
  if (model != nullptr) c.model = {model_tensors(*model)};
  return c;
}

}  // namespace

CheckpointFacts checkpoint_facts(const CheckpointContents& c) {
  CheckpointDesc d;
  d.source = c.source;
  d.load_error = c.load_error;
  d.part_ok = c.part_ok;
  // One fused statistics pass over every floating-point tensor for its NaN/Inf count.
  std::vector<at::Tensor> floats;
  std::vector<size_t> at;
  for (size_t k = 0; k < c.tensors.size(); ++k) {
    if (counted(c.tensors[k].second)) {
      floats.push_back(c.tensors[k].second.detach());
      at.push_back(k);
    }
  }
  std::vector<int64_t> bad(c.tensors.size(), 0);
  if (!floats.empty()) {
    const std::vector<TensorStats> stats = tensor_stats(floats);
    for (size_t j = 0; j < at.size(); ++j) bad[at[j]] = stats[j].nonfinite();
  }
  for (size_t k = 0; k < c.tensors.size(); ++k) {
    d.tensors.push_back(describe(c.tensors[k].first, c.tensors[k].second, bad[k]));
  }
  for (const auto& [path, entries] : c.state_dicts)
    d.state_dicts.push_back({path, describe(entries)});
  for (const ModelTensors& m : c.model)
    d.model.push_back({describe(m.state), describe(m.trainable)});
  for (const OptimizerTensors& o : c.saved_optimizers) {
    d.saved_optimizers.push_back(describe_optimizer(o));
  }
  for (const OptimizerTensors& o : c.optimizers) d.optimizers.push_back(describe_optimizer(o));
  return gather_checkpoint(d);
}

std::vector<Finding> check_checkpoint(const CheckpointContents& contents) {
  return judge_checkpoint(checkpoint_facts(contents));
}

std::vector<Finding> check_checkpoint(const NamedTensors& entries, const torch::nn::Module* model,
                                      const std::string& source) {
  return check_checkpoint(entries_contents(entries, model, source));
}

NamedTensors read_archive(const std::string& path) {
  TORCH_CHECK_VALUE(std::ifstream(path).good(), "check_checkpoint: ", path,
                    ": no such file (or it cannot be opened)");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const c10::Error& e) {
    const std::string why = e.what_without_backtrace();
    TORCH_CHECK_VALUE(false, "check_checkpoint: ", path,
                      " cannot be read as a torch::save archive (", why.substr(0, why.find('\n')),
                      "): truncated (a save that did not finish), or not written by torch::save "
                      "/ torch::serialize::OutputArchive (a Python torch.save file is checked "
                      "with `python -m trainsan check`)");
  }
  NamedTensors out;
  read_archive(archive, "", 0, out);
  return out;
}

std::vector<Finding> check_checkpoint(const std::string& path, const torch::nn::Module* model) {
  return check_checkpoint(read_archive(path), model, path);
}

void Sanitizer::check_checkpoint(const std::string& path, const torch::nn::Module* model) {
  check_checkpoint(read_archive(path), model, path);
}

void Sanitizer::check_checkpoint(const NamedTensors& entries, const torch::nn::Module* model,
                                 const std::string& source) {
  checkpoint(checkpoint_facts(entries_contents(entries, model, source)));
}

}  // namespace trainsan
