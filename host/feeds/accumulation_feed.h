// Gradient accumulation windows (Note [Accumulation windows], host/checks/accumulation.cpp): what
// is counted per optimizer step — training forwards, training losses, batch sizes — and handed to
// AccumulationCheck. Host bookkeeping only: no tensor is read.
#pragma once

#include <cstdint>

#include "feeds/feed.h"

namespace trainsan::host {

class AccumulationFeed final : public Feed {
 public:
  using Feed::Feed;

  void on_forward(const ForwardFacts& facts) override;
  void on_loss(const at::Tensor& loss) override;
  /// The window ends with its step (judged unless the step was partial); StepEnd::backwards.
  void on_step_end(StepEnd& e) override;
  void on_scaler(int64_t opt, bool skipped) override;  // a skipped step consumed its window
  void before_clear(int64_t opt) override;  // zero_grad outside a step: the window starts again
  void close() override;                    // a short window pending: the run's last
  void add_coverage(Coverage& c) const override;

 private:
  int64_t end(int64_t step, int64_t opt, bool judged);  // the window's count of backwards
  void restart();

  // Since the previous optimizer step (outside steps): training losses and training forwards,
  // the forwards' batch sizes summed (-1: one unknown), the first one's and whether all were
  // equal; the latest known data loader pass.
  int64_t losses_ = 0;
  int64_t forwards_ = 0;
  int64_t samples_ = 0;
  int64_t batch_ = -1;
  bool uniform_ = true;
  int64_t pass_ = -1;
};

}  // namespace trainsan::host
