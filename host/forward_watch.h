// ForwardWatch: sees a model's forward in a LibTorch program, which has no module hooks, at its
// first op that reads one of the model's parameters together with a batch, and a non-finite loss
// the program reads before its backward (Note [C++ attach] in host/attach.cpp). A thread-local
// RecordFunction callback, registered only while armed: from the end of a step until the step's
// training forwards were seen and its backward began, so the rest of the backward and the
// optimizer step of a healthy loop run without it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <functional>
#include <memory>
#include <thread>
#include <unordered_set>
#include <vector>

namespace trainsan::host {

class ForwardWatch {
 public:
  /// Called at the first op of a forward that reads a parameter of group `group` (the parameters'
  /// optimizer: a GAN's generator and discriminator are told apart), inside that op's dispatch,
  /// with grad mode as the forward has it and the op's other tensor inputs (the batch, or what
  /// the model made of it before its first parameter). Per group: called once under no_grad,
  /// and once under grad mode, after which that group is done.
  using OnForward = std::function<void(std::vector<at::Tensor> batch, int64_t group)>;
  /// Called when the program reads (Tensor::item()) a one-element tensor with a graph between a
  /// grad-enabled forward and the backward, and its value is not finite: the step's loss, about
  /// to be asserted on (Note [C++ attach]).
  using OnBackward = std::function<void(const at::Tensor& root)>;
  /// Bounds on the ops the callback looks at (Note [C++ attach]): since arm() while no
  /// grad-enabled forward came (a validation pass, data loading, the program's end), and since
  /// the first grad-enabled forward while a group's forward or the backward is still to come.
  static constexpr int64_t kMaxIdleOps = int64_t{1} << 22;
  static constexpr int64_t kMaxOpsAfterForward = int64_t{1} << 15;

  /// `groups[k]`: the group of params[k] (any integer; one group for all is fine).
  ForwardWatch(const std::vector<at::Tensor>& params, const std::vector<int64_t>& groups,
               OnForward on_forward, OnBackward on_backward = nullptr);
  ~ForwardWatch();
  ForwardWatch(const ForwardWatch&) = delete;
  ForwardWatch& operator=(const ForwardWatch&) = delete;

  /// Watch the next forward (on this thread: the training loop's).
  void arm();
  void disarm();
  bool armed() const;
  /// Seconds spent in the callback since the last call (Note [Own time]: the sanitizer adds them
  /// to its own time), and ops it looked at in all.
  double take_seconds();
  int64_t ops_seen() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace trainsan::host
