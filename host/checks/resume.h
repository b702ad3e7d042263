// ResumeCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/resume.cpp (and resume_data.cpp, resume_slots.cpp). Torch-free.
#pragma once

#include <map>
#include <string>

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
  // resume_slots.cpp: state restored onto another parameter reported (true) or not
  bool slots_moved(const ResumeFacts& f, const std::string& opt, int64_t step);
  void replayed_order(const ResumeFacts& f, int64_t step);  // resume_data.cpp
  void scheduler_restart(const ResumeFacts& f, int64_t step);
  /// An unrestored scheduler behind the checkpoint's epoch, watched until the rate first changes
  /// (Note [Restarted schedule]).
  struct Restart {
    int64_t checkpoint_epoch = 0;  // the saved scheduler's last_epoch
    int64_t epoch_then = 0;        // the live scheduler's at the first step after the resume
    double checkpoint_lr = 0;      // the rate when saved
    std::string scheduler;         // its type
    std::string opt;               // "optimizer 0 (AdamW)"
  };
  std::map<int64_t, Restart> restarts_;  // optimizer index -> its watched scheduler
  FindingSink& sink_;
  [[maybe_unused]] const Options& opts_;  // no option yet
};

}  // namespace trainsan::host
