// CheckpointCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/checkpoint.cpp. Torch-free.
#pragma once

#include "checks/check.h"
#include "trainsan/checkpoint_facts.h"

namespace trainsan::host {

class CheckpointCheck {  // checkpoint.cpp: bad_checkpoint (Note [Checkpoint checks])
 public:
  CheckpointCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_checkpoint(const CheckpointFacts& facts, int64_t step);

 private:
  void sub_stale(const CheckpointFacts& f, const std::string& src, int64_t step);
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

/// The findings of one checkpoint outside a sanitizer (python -m trainsan check): messages with
/// the "bad_checkpoint: " prefix, step 0.
std::vector<Finding> judge_checkpoint(const CheckpointFacts& facts);

}  // namespace trainsan::host
