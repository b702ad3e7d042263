// AutogradCheck: a check family (Note [Checks as units], checks/check.h), its rules in
// host/checks/autograd.cpp. Torch-free.
#pragma once

#include "checks/check.h"

namespace trainsan::host {

class AutogradCheck {  // autograd.cpp: inplace_before_backward, bad_custom_grad
 public:
  AutogradCheck(FindingSink& sink, const Options& opts) : sink_(sink), opts_(opts) {}
  /// Whether the training forward of `step` gets the saved-tensor check: the steps the op audit
  /// samples (audit_first_steps, then every audit_every-th).
  bool inplace_sampled(int64_t step) const;
  /// Whether custom Functions are checked again at `step` (besides at their first use): every
  /// gradcheck_every-th step (0: never).
  bool gradcheck_sampled(int64_t step) const;
  /// A saved tensor changed while its version counter did not (the caller compared them).
  void on_saved_tensor_changed(const SavedTensorChange& c, int64_t step);
  /// One directional finite-difference check of a custom Function's backward.
  void on_custom_grad(const CustomGradResult& r, int64_t step);
  /// The checks of one application of custom Functions (one per differentiable input, several
  /// Functions possibly): a Function with a surrogate input (Note [Surrogate gradients]) is not
  /// judged on any input, the others as by on_custom_grad().
  void on_custom_grads(const std::vector<CustomGradResult>& results, int64_t step);

  enum class Verdict : uint8_t { kAgrees, kMismatch, kInconclusive };
  /// Whether the backward passes a gradient where the forward is flat along the direction, or
  /// one that is not the identity's through an identity output (Note [Surrogate gradients]).
  static bool surrogate(const CustomGradResult& r);
  /// The tolerance rule of bad_custom_grad (Note [Directional gradcheck], autograd.cpp).
  static Verdict judge(const CustomGradResult& r);

 private:
  FindingSink& sink_;
  const Options& opts_;
};

/// The bad_custom_grad findings of custom-Function checks outside a sanitizer
/// (trainsan::check_custom_grad): messages with the "bad_custom_grad: " prefix, step 0.
std::vector<Finding> judge_custom_grad(const std::vector<CustomGradResult>& results);

}  // namespace trainsan::host
