// ResumeCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/resume.cpp (and resume_data.cpp). Torch-free.
#pragma once

#include "checks/check.h"
#include "trainsan/resume_facts.h"

namespace trainsan::host {

class ResumeCheck {  // resume.cpp, resume_data.cpp: optimizer_reset, bad_checkpoint, data position
 public:
  ResumeCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  void on_resume(const ResumeFacts& facts, int64_t step);

 private:
  void renamed_layers(const ResumeFacts& f, int64_t step);  // resume_data.cpp
  void data_position(const ResumeFacts& f, int64_t step);   // resume_data.cpp
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

}  // namespace trainsan::host
