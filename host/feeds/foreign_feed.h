// Note [Foreign backwards] (host/checks/gradient_flow.cpp): the backwards that reached none of the
// sanitizer's parameters but other requires-grad leaves, counted per optimizer step for the pass;
// for a LibTorch loop, the walk of a loss's graph that finds them (walk_loss_graph, which the
// Python package's Note [Loss roots] calls too, reporting through Sanitizer::foreign_backward).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "feeds/feed.h"

namespace trainsan::host {

class ForeignFeed final : public Feed {
 public:
  using Feed::Feed;

  /// Sanitizer::foreign_backward.
  void foreign_backward(const ForeignBackward& facts);
  /// A LibTorch loss (Setup::gathers_events false): its graph walked as Note [Loss roots] does in
  /// Python, reported to foreign_backward when it reaches none of our parameters.
  void on_loss(const at::Tensor& loss) override;
  /// The count since the step's optimizer's previous step (-1: manual mode), and the latest.
  void on_step_end(StepEnd& e) override;
  /// Sanitizer::loss_reaches: 1 when `loss` reaches one of the parameters, 0 when not, -1 unknown.
  int loss_reaches(const at::Tensor& loss);
  /// Whether a foreign backward came since optimizer `opt`'s previous step.
  bool since_step(int64_t opt);

 private:
  // The walk from `loss`: 1 when it reaches one of the parameters, 0 when it ends without (the
  // other leaves counted in *f), -1 out of budget or no graph.
  int walk(const at::Tensor& loss, ForeignBackward* f);

  int64_t total_ = 0;  // such backwards so far
  ForeignBackward latest_;
  std::map<int64_t, int64_t> at_step_;    // the count at each optimizer's previous step
  std::vector<const void*> param_impls_;  // the parameters' TensorImpls, sorted
};

}  // namespace trainsan::host
