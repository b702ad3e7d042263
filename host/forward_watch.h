// ForwardWatch: sees a model's forward in a LibTorch program, which has no module hooks, at its
// first op that reads one of the model's parameters together with a batch (Note [C++ attach] in
// host/attach.cpp). A thread-local RecordFunction callback, registered only while armed: from the
// end of a step until the next grad-enabled forward, so the ops of the forward, backward and
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
  /// and once under grad mode, after which that group is done; the watch disarms itself when
  /// every group is done, or after kMaxOps ops since arm() (bounded cost in a loop where some
  /// group never meets a grad-enabled forward).
  using OnForward = std::function<void(std::vector<at::Tensor> batch, int64_t group)>;
  static constexpr int64_t kMaxOps = 4096;

  /// `groups[k]`: the group of params[k] (any integer; one group for all is fine).
  ForwardWatch(const std::vector<at::Tensor>& params, const std::vector<int64_t>& groups,
               OnForward on_forward);
  ~ForwardWatch();
  ForwardWatch(const ForwardWatch&) = delete;
  ForwardWatch& operator=(const ForwardWatch&) = delete;

  /// Watch the next forward (on this thread: the training loop's).
  void arm();
  void disarm();
  bool armed() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace trainsan::host
