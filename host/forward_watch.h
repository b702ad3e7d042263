// ForwardWatch: sees a model's forward in a LibTorch program, which has no module hooks, at its
// first op that reads one of the model's parameters together with a batch, and the step's loss at
// the start of its backward or when the program reads a non-finite one (Note [C++ attach] in
// host/attach.cpp). A thread-local RecordFunction callback, registered only while armed: from the
// end of a step until the step's training forwards were seen and its backward began, so the rest
// of a healthy step runs without it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>

#include <functional>
#include <memory>
#include <thread>
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
  /// How a one-element tensor with a graph reached the watch after a training forward.
  enum class LossMoment {
    kBackward,  // the root of a backward (Tensor::backward() seeds it with ones_like)
    kRead,      // the program reads its value (item(), isnan(), ...) and the value is not finite
  };
  /// Called with the step's loss candidate (Note [C++ attach]). Returns whether the sanitizer
  /// took it as the step's loss (its graph reaches the model's parameters): a probe's backward
  /// does not end the watch.
  using OnLoss = std::function<bool(const at::Tensor& root, LossMoment moment)>;
  /// Bounds on the ops the callback looks at (Note [C++ attach]): since arm() while no
  /// grad-enabled forward came (a validation pass, data loading, the program's end), and since
  /// the first grad-enabled forward while a group's forward or the backward is still to come.
  static constexpr int64_t kMaxIdleOps = int64_t{1} << 22;
  static constexpr int64_t kMaxOpsAfterForward = int64_t{1} << 15;

  /// `groups[k]`: the group of params[k] (any integer; one group for all is fine).
  ForwardWatch(const std::vector<at::Tensor>& params, const std::vector<int64_t>& groups,
               OnForward on_forward, OnLoss on_loss = nullptr);
  ~ForwardWatch();
  ForwardWatch(const ForwardWatch&) = delete;
  ForwardWatch& operator=(const ForwardWatch&) = delete;

  /// Watch the next forward (on this thread: the training loop's).
  void arm();
  void disarm();
  bool armed() const;
  /// Seconds the watch cost since the last call (Note [Own time]: the sanitizer adds them to its
  /// own time): its callback's work, and the dispatcher's price of calling it at each op it saw
  /// (Note [Watch price]).
  double take_seconds();
  /// Ops it looked at in all.
  int64_t ops_seen() const;
  /// The dispatcher's price of one op call with the watch's callback, measured once per process
  /// (Note [Watch price]).
  static double price_per_op();

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace trainsan::host
