// PrecisionCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/precision.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class PrecisionCheck {  // precision.cpp: amp_scale_collapse, update_underflow,
                        // low_precision_loss, fp16_overflow of module outputs
 public:
  PrecisionCheck(FindingSink& sink, const Options& opts, Origins& origins)
      : sink_(sink), opts_(opts), origins_(origins) {}
  /// One step of a gradient scaler (amp_scale_collapse).
  void on_scaler(const ScalerStep& s, int64_t step);
  /// What the armed module hooks found (kept in Origins; fp16_overflow of the cause).
  void on_provenance(const Provenance& p);
  void on_loss(const LossView& v);  // low_precision_loss
  void on_step(const StepView& v);  // update_underflow
  /// The scale history kept for optimizer `opt`'s scaler, oldest first: (step, scale, skipped).
  struct ScaleEntry {
    int64_t step = 0;
    double scale = 0.0;
    bool skipped = false;
  };

 private:
  struct Scaler {
    int64_t opt = 0;
    bool stepped = false;       // a step was taken since attach: the scale is past its warm-up
    int64_t run = 0;            // consecutive skips
    int64_t skips = 0;          // all skips
    bool backward_nan = false;  // reported a NaN born in the backward (Note [Backward NaN])
    std::deque<bool> window;    // the last amp_skip_window events after warm-up (true: skipped)
    std::deque<ScaleEntry> history;  // the scales at the last skips and steps (bounded)
  };
  Scaler& scaler(int64_t opt);
  void backward_nan(Scaler& s, int64_t step);  // Note [Backward NaN]
  void collapse(const Scaler& s, const std::string& why, double value, int64_t step);
  FindingSink& sink_;
  const Options& opts_;
  Origins& origins_;
  std::vector<Scaler> scalers_;
  // Per parameter index: consecutive measured steps with most updates rounded away.
  std::vector<int64_t> underflow_steps_;
};

}  // namespace trainsan::host
