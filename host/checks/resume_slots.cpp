// optimizer_reset of optimizer state restored onto other parameters of the same shape, read from
// the checkpoint's own key order: the ResumeCheck rule of Note [Optimizer slots by name].
#include <map>
#include <set>
#include <string>
#include <vector>

#include "checks/resume.h"

namespace trainsan::host {

// Note [Optimizer slots by name]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Optimizer.load_state_dict binds the saved state to today's parameters by position: slot k of
// the saved param_groups (the groups one after another) goes to the k-th parameter of today's
// groups. Where two layers of one shape were registered in the other order since the save, their
// moments swap and nothing raises; the moment-scale rule (Note [Resume checks]) sees it only
// when their gradient scales differ by more than 100x. A checkpoint that holds the model's state
// dict next to the optimizer's says more: its keys are the saved model's registration order,
// and an optimizer built from model.parameters() (or from groups that filter
// model.named_parameters(): decay and no-decay, a frozen backbone left out) numbered its slots in
// that order. So, at the optimizer's first step after its load from such a checkpoint, the
// model's load from the same checkpoint gives, per group g of today's optimizer with parameters
// T_g (named as in the loaded model, in slot order), the saved slots S_g: the checkpoint's keys
// that name today's parameters (saved_param_order, a tied parameter once), kept where they are in
// T_g, in the saved order. Slot i of group g held the state of S_g[i] and gave it to T_g[i]; a
// parameter given the state of another one of its shape is optimizer_reset (error), whatever the
// gradient scales, naming both. State of another shape is the load's own rule (state_mismatched).
// Only an unambiguous mapping is judged; the optimizer is left to the moment-scale rule when
//  * the groups differ in number or sizes from the saved ones, or a slot holds a parameter that is
//    not the loaded model's (another model's, a copy) or holds one twice;
//  * a group is not in today's registration order (hand-listed modules in another order, a
//    construction this mapping does not predict), or is also in name order while S_g differs
//    from it (minGPT sorts its groups by name: under that construction the saved slots are
//    T_g, under registration order S_g — the construction is not known, so neither is judged);
//  * S_g does not have the group's saved size (a parameter renamed, trained then and frozen now).
// Silent: the same model resumed (S_g == T_g), groups that bind by module (the backbone's
// parameters, then the head's: each group's set is the same whatever the declaration order),
// compiled (_orig_mod.) and DDP (module.) models (names are taken relative to the module the
// state dict was loaded into, as its keys are), tied weights. LibTorch saves the model and the
// optimizer in archives of their own (torch::save(model, ...), torch::save(optimizer, ...)):
// trainsan::load has no saved key order to read, and a C++ program that knows one gives these
// facts with Sanitizer::resume().

namespace {

bool sorted_by_name(const std::vector<std::string>& names) {
  for (size_t k = 1; k < names.size(); ++k) {
    if (names[k] < names[k - 1]) return false;
  }
  return true;
}

}  // namespace

bool ResumeCheck::slots_moved(const ResumeFacts& f, const std::string& opt, int64_t step) {
  const auto& slots = f.slot_params;
  if (slots.empty() || f.slot_shapes.size() != slots.size() || f.group_sizes.empty() ||
      f.group_sizes != f.saved_group_sizes) {
    return false;
  }
  int64_t total = 0;
  for (int64_t n : f.group_sizes) total += n;
  if (total != static_cast<int64_t>(slots.size())) return false;
  std::map<std::string, size_t> pos;  // name -> registration order now
  for (size_t k = 0; k < f.param_order.size(); ++k) pos.emplace(f.param_order[k], k);
  std::map<std::string, std::string> shape;  // name -> shape
  for (size_t k = 0; k < slots.size(); ++k) {
    if (slots[k].empty() || pos.count(slots[k]) == 0 ||
        !shape.emplace(slots[k], f.slot_shapes[k]).second) {
      return false;  // not the model's, or twice
    }
  }
  std::vector<std::string> moved;
  std::string first;
  size_t off = 0;
  for (int64_t n : f.group_sizes) {
    const std::vector<std::string> now(slots.begin() + static_cast<std::ptrdiff_t>(off),
                                       slots.begin() + static_cast<std::ptrdiff_t>(off + n));
    off += static_cast<size_t>(n);
    for (size_t i = 1; i < now.size(); ++i) {
      if (pos[now[i]] < pos[now[i - 1]]) return false;  // not in registration order
    }
    const std::set<std::string> members(now.begin(), now.end());
    std::vector<std::string> saved;
    for (const std::string& k : f.saved_param_order) {
      if (members.count(k) != 0) saved.push_back(k);
    }
    if (saved.size() != now.size()) return false;
    if (saved != now && sorted_by_name(now)) return false;  // name order explains it too
    for (size_t i = 0; i < now.size(); ++i) {
      if (saved[i] != now[i] && shape[saved[i]] == shape[now[i]]) {
        if (moved.empty()) first = now[i];
        moved.push_back(now[i] + " " + shape[now[i]] + " (the state of " + saved[i] + ")");
      }
    }
  }
  if (moved.empty()) return false;
  sink_.add(Kind::optimizer_reset, first,
            opt +
                "'s restored state does not fit its parameters: the checkpoint's model state "
                "dict orders them otherwise than the model does now, and optimizer state "
                "binds by position, so " +
                std::to_string(moved.size()) +
                " parameter(s) took the state of another of the same shape: " + join_names(moved) +
                " — the state was restored by position after the parameter order changed "
                "(modules registered in another order, a refactor); build the optimizer over "
                "the parameters in the saved order, or remap the saved state by parameter name",
            static_cast<double>(moved.size()), step);
  return true;
}

}  // namespace trainsan::host
