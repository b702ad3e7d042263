// bad_custom_grad's feeder (Sanitizer::check_custom_grad): the custom functions measured so far
// (each at its first call, then on the gradcheck_every steps) and the measurement handed to
// AutogradCheck. The measurement itself is measure_custom_grad (host/custom_grad.cpp).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "feeds/feed.h"
#include "trainsan/custom_grad.h"

namespace trainsan::host {

class CustomGradFeed final : public Feed {
 public:
  using Feed::Feed;

  /// Whether `name` was never measured: its first call is checked whatever the step.
  bool first_use(const std::string& name) const { return checked_.count(name) == 0; }
  /// Measures `fn` (custom_grad.cpp) and hands the results to AutogradCheck.
  void check(const std::string& name, const TensorFunction& fn,
             const std::vector<at::Tensor>& inputs);

 private:
  std::set<std::string> checked_;
};

}  // namespace trainsan::host
