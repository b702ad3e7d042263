// The Python package's handle on a trainsan::Sanitizer (torch.classes.trainsan.Sanitizer), and the
// per-step events it takes, shared by the two bindings that call them: the torch.classes methods
// (ops.cpp: no Python C API, one build for every Python version) and the hot-path module
// (hot.cpp, Note [Hot path]).
//
// Note [Hot path]
// ~~~~~~~~~~~~~~~
// The events every training step makes — forward, the loss root's walk and the loss, the step's
// begin and end, zero_grad — are five entries into C++ a step. Measured on the CPU in a step of
// a small CNN (bench/probes.py cold_calls, 1 or 2 threads), a torch.classes method call right after
// the backward costs ~120 us (its code and data are cold; ~6 us when called again at once), the
// same call through pybind11 ~22 us (~1 us warm). So those events are also bound in a small Python
// extension module, _trainsan_hot (built for the Python it was compiled with, next to the op
// library), that calls the same functions below on the handle registered under an id (hot_id()).
// The package uses it when it loads, and the torch.classes methods otherwise (another Python
// version, no Python headers at build time): the same results either way.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "trainsan/trainsan.h"

namespace trainsan::bindings {

// A reported finding: the finding by field name (Note [Facts by name]: facts_to_dict<Finding>,
// its table finding.def) and the policy's answer (trainsan::Action as an int).
using Report = std::tuple<trainsan::FactsDict, int64_t>;
using Reports = std::vector<Report>;
// What the gatherers ask at a training forward (Note [Gatherers]): the step, the saved-tensor
// check's step, and whether a re-run, a recompute check, the precision headroom and overflow
// provenance are due (DUE_* in _hooks.py).
using DueFields = std::tuple<int64_t, int64_t, bool, bool, bool, bool>;

// torch.classes.trainsan.Sanitizer. Each event returns the findings reported at that event with
// the policy's answer, which Python maps to TrainingBugError / warnings.warn.
struct SanitizerHandle : torch::CustomClassHolder {
  Reports reports;
  std::unique_ptr<trainsan::Sanitizer> san;
  int64_t id = 0;  // in the hot path's registry while alive (Note [Hot path])

  // Built from one dict by name: facts_from_dict<trainsan::SanitizerArgs> (the parameters, the
  // options, Setup's table; Note [Facts by name]).
  explicit SanitizerHandle(const trainsan::FactsDict& args);
  ~SanitizerHandle() override;
  SanitizerHandle(const SanitizerHandle&) = delete;
  SanitizerHandle& operator=(const SanitizerHandle&) = delete;

  Reports take();
};

// The handle registered under `id`, or nullptr when there is none (closed and collected).
SanitizerHandle* handle_by_id(int64_t id);

// The per-step events (Note [Hot path]).
std::tuple<Reports, DueFields> handle_forward(SanitizerHandle& h, bool training,
                                              std::vector<at::Tensor> inputs,
                                              std::vector<bool> module_eval, double extra_s,
                                              int64_t data_restarts, int64_t loader_pass,
                                              int64_t loader_workers, bool loader_worker_init,
                                              std::vector<at::Tensor> batch, int64_t loader_batch);
DueFields due_fields(const trainsan::Sanitizer& s);
Reports handle_loss(SanitizerHandle& h, const at::Tensor& loss);
int64_t handle_loss_reaches(SanitizerHandle& h, const at::Tensor& loss);
// The reports, and the step whose precision headroom is due at this step's end (-1: none;
// headroom_due() asked before the step begins).
std::tuple<Reports, int64_t> handle_step_begin(SanitizerHandle& h, int64_t opt, bool grads_final);
Reports handle_step_end(SanitizerHandle& h, int64_t opt, bool lr_zero, double extra_s,
                        const std::vector<double>& group_lr);
Reports handle_gradients_cleared(SanitizerHandle& h, int64_t opt);

}  // namespace trainsan::bindings
