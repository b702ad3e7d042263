// Gradient accumulation windows (Note [Accumulation windows], host/checks/accumulation.cpp): what
// SanitizerImpl counts per optimizer step — training forwards, training losses, batch sizes — and
// hands to AccumulationCheck. Host bookkeeping only: no tensor is read.
#include <algorithm>
#include <set>

#include "sanitizer_impl.h"

namespace trainsan::host {

void SanitizerImpl::window_forward(const ForwardFacts& facts) {
  int64_t b = -1;  // the batch: the first input's first dimension (metadata, no sync)
  for (const at::Tensor& t : facts.inputs) {
    if (t.defined() && t.dim() > 0) {
      b = t.size(0);
      break;
    }
  }
  if (win_forwards == 0) win_batch = b;
  win_uniform = win_uniform && b == win_batch;
  win_samples = b < 0 || win_samples < 0 ? -1 : win_samples + b;
  win_forwards += 1;
  checks.accumulation.on_forward(facts.loader_pass);  // judges a pending short window first
  if (facts.loader_pass >= 0) win_pass = facts.loader_pass;
}

int64_t SanitizerImpl::window_end(int64_t step_no, int64_t opt, bool judged) {
  WindowView w;
  w.step = step_no;
  w.opt = opt;
  // trainsan::attach sees one forward an iteration (the watch): its end_step(losses) counts.
  w.backwards = setup.binding ? win_losses : std::min(win_losses, win_forwards);
  w.samples = win_forwards == w.backwards     ? win_samples
              : win_uniform && win_batch >= 0 ? win_batch * w.backwards
                                              : -1;
  w.pass = win_pass;
  if (judged) checks.accumulation.on_step(w);
  win_losses = win_forwards = win_samples = 0;
  win_batch = -1;
  win_uniform = true;
  return w.backwards;
}

void SanitizerImpl::window_cleared(int64_t opt) {
  // Gradients of the current window cleared without a step (a guard's zero_grad(); a GAN's
  // discriminator gradients the generator's backward left): the window starts again.
  std::set<int64_t> of;
  for (const TrackedParam& p : params) {
    if (p.opt >= 0 && (opt < 0 || p.opt == opt)) of.insert(p.opt);
  }
  for (const int64_t o : of) {
    if (grads.got_grad(o)) {
      win_losses = win_forwards = win_samples = 0;
      win_batch = -1;
      win_uniform = true;
      return;
    }
  }
}

}  // namespace trainsan::host
