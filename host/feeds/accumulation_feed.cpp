// Gradient accumulation windows (Note [Accumulation windows], host/checks/accumulation.cpp): the
// feeder of AccumulationCheck (accumulation_feed.h).
#include "feeds/accumulation_feed.h"

#include <algorithm>
#include <set>

namespace trainsan::host {

void AccumulationFeed::on_forward(const ForwardFacts& facts) {
  int64_t b = -1;  // the batch: the first input's first dimension (metadata, no sync)
  for (const at::Tensor& t : facts.inputs) {
    if (t.defined() && t.dim() > 0) {
      b = t.size(0);
      break;
    }
  }
  if (forwards_ == 0) batch_ = b;
  uniform_ = uniform_ && b == batch_;
  samples_ = b < 0 || samples_ < 0 ? -1 : samples_ + b;
  forwards_ += 1;
  ctx_.checks.accumulation.on_forward(facts.loader_pass);  // judges a pending short window first
  if (facts.loader_pass >= 0) pass_ = facts.loader_pass;
}

void AccumulationFeed::on_loss(const at::Tensor& loss) {
  // A training loss outside an optimizer step (not a closure's).
  if (loss.requires_grad() && !ctx_.grads.in_step()) losses_ += 1;
}

void AccumulationFeed::on_step_end(StepEnd& e) {
  if (!e.manual) e.backwards = end(e.step, e.opt, /*judged=*/!e.partial);
}

void AccumulationFeed::on_scaler(int64_t opt, bool skipped) {
  if (skipped) end(ctx_.step, opt, /*judged=*/true);
}

int64_t AccumulationFeed::end(int64_t step_no, int64_t opt, bool judged) {
  WindowView w;
  w.step = step_no;
  w.opt = opt;
  // trainsan::attach sees one forward an iteration (the watch): its end_step(losses) counts.
  w.backwards = ctx_.setup.binding ? losses_ : std::min(losses_, forwards_);
  w.samples = forwards_ == w.backwards  ? samples_
              : uniform_ && batch_ >= 0 ? batch_ * w.backwards
                                        : -1;
  w.pass = pass_;
  if (judged) ctx_.checks.accumulation.on_step(w);
  restart();
  return w.backwards;
}

void AccumulationFeed::restart() {
  losses_ = forwards_ = samples_ = 0;
  batch_ = -1;
  uniform_ = true;
}

void AccumulationFeed::before_clear(int64_t opt) {
  // Gradients of the current window cleared without a step (a guard's zero_grad(); a GAN's
  // discriminator gradients the generator's backward left): the window starts again.
  std::set<int64_t> of;
  for (const TrackedParam& p : ctx_.params) {
    if (p.opt >= 0 && (opt < 0 || p.opt == opt)) of.insert(p.opt);
  }
  for (const int64_t o : of) {
    if (ctx_.grads.got_grad(o)) {
      restart();
      return;
    }
  }
}

void AccumulationFeed::close() { ctx_.checks.accumulation.on_close(); }

void AccumulationFeed::add_coverage(Coverage& c) const {
  const WindowsSeen w = ctx_.checks.accumulation.seen();
  c.window_declared = ctx_.opts.accumulation_steps;
  c.windows = w.counted;
  c.window_backwards = w.common;
  c.window_steps = w.at_common;
  c.window_samples = w.samples;
}

}  // namespace trainsan::host
