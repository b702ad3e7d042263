// loss_spike and trivial_loss: the loss stream of one sanitizer (Note [Loss stream]).
#include <algorithm>
#include <cmath>

#include "checks/check.h"

namespace trainsan::host {

// Note [Loss stream]
// ~~~~~~~~~~~~~~~~~~
// A sanitizer has one loss stream: every loss it is handed (the roots of the training backwards
// attributed to it, Python; watch_loss), in order, each with the step it belongs to. A value is
// the loss's sum / numel (a scalar's value); non-finite losses are nonfinite_loss's and stay out
// of the stream, as do losses evaluated inside an optimizer step (LBFGS's closure: line-search
// trials, not the step's loss).
//
// loss_spike compares a loss with the window of the loss_spike_window losses before it, once
// loss_spike_warmup losses were seen: its median m, MAD and largest value. It fires when
//   x - m > factor * max(1.4826 * MAD, 0.2 * |m|)   (far outside the noise band; on a steady
//                                                     positive loss: x > (1 + 0.2 factor) m)
//   and x - m > 2 * (max(window) - m)                (twice the largest excursion of the window)
// The first condition is a robust z-score with a relative floor, so a loss that has settled
// with almost no noise does not fire on a modest rise (a learning-rate restart doubling it);
// the second keeps heavy-tailed minibatch noise silent (small batches whose loss now and then
// jumps to 10x the median because of one hard example: such jumps are in the window already).
// Several losses per step (gradient accumulation, a GAN's two losses reaching one model) share
// the stream; the median and the largest excursion absorb a mix of two levels.
//
// trivial_loss looks at the losses of the first trivial_loss_steps steps only (a legitimately
// easy task reaching a small loss later stays silent): a loss that is exactly 0 (every element),
// a loss at or below trivial_loss_ratio x the first loss (positive) — a collapse no real task
// shows that early — or the same bits for the first min(5, trivial_loss_steps) steps.

namespace {

constexpr int64_t kConstantSteps = 5;
constexpr double kMadToSigma = 1.4826;
constexpr double kRelativeFloor = 0.2;

double median_of(std::vector<double> v) {
  const size_t n = v.size();
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n / 2), v.end());
  const double hi = v[n / 2];
  if (n % 2 == 1) return hi;
  const double lo = *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n / 2));
  return 0.5 * (lo + hi);
}

}  // namespace

void LossCheck::on_loss(const LossView& v) {
  const TensorStats& s = v.stats;
  if (v.in_step || s.numel <= 0 || s.nonfinite() > 0) return;
  const double x = s.sum / static_cast<double>(s.numel);
  if (!std::isfinite(x)) return;
  trivial(v, x);
  spike(x, v.step);
}

void LossCheck::spike(double x, int64_t step) {
  const auto cap = static_cast<size_t>(std::max<int64_t>(opts_.loss_spike_window, 1));
  if (seen_ >= opts_.loss_spike_warmup && !window_.empty()) {
    const double m = median_of(window_);
    std::vector<double> dev(window_.size());
    for (size_t k = 0; k < window_.size(); ++k) dev[k] = std::abs(window_[k] - m);
    const double mad = median_of(dev);
    const double top = *std::max_element(window_.begin(), window_.end());
    const double band = std::max({kMadToSigma * mad, kRelativeFloor * std::abs(m), 1e-12});
    const double excess = x - m;
    if (excess > opts_.loss_spike_factor * band && excess > 2.0 * (top - m)) {
      const bool ratio = m > 0.0;
      const double factor = ratio ? x / m : excess / band;
      sink_.add(Kind::loss_spike, "",
                "the loss jumped to " + fmt(x) + ", " + fmt(factor) +
                    (ratio ? "x its running median " : " noise bands above its running median ") +
                    fmt(m) + " over the last " + std::to_string(window_.size()) +
                    " losses (the largest of them: " + fmt(top) +
                    ") — a corrupted or outlier batch, a learning-rate jump, or an optimizer "
                    "instability; look at this step's batch and learning rate, and consider "
                    "gradient clipping (torch.nn.utils.clip_grad_norm_)",
                factor, step);
    }
  }
  if (window_.size() < cap) {
    window_.push_back(x);
  } else {
    window_[next_ % cap] = x;
  }
  next_ = (next_ + 1) % cap;
  seen_ += 1;
}

void LossCheck::trivial(const LossView& v, double x) {
  const TensorStats& s = v.stats;
  const bool first = !first_.has_value();
  if (first) {
    first_ = x;
    first_hash_ = s.hash;
  }
  if (s.hash != first_hash_) constant_ = false;
  const bool new_step = v.step != last_step_;
  if (new_step) {
    last_step_ = v.step;
    if (constant_) constant_steps_ += 1;
  }
  if (v.step >= opts_.trivial_loss_steps) return;
  const std::string within =
      " within the first " + std::to_string(opts_.trivial_loss_steps) + " steps";
  if (s.zero == s.numel) {
    sink_.add(Kind::trivial_loss, "",
              "the loss is exactly 0" + within +
                  " — it cannot teach anything: a target equal to the prediction (loss(pred, "
                  "pred), a swapped variable), a mask or ignore_index covering every term "
                  "(reduction='sum' gives 0, 'mean' NaN), or labels leaked into the inputs; check "
                  "what the loss compares",
              0.0, v.step);
    return;
  }
  if (!first && *first_ > 0.0 && x >= 0.0 && x <= opts_.trivial_loss_ratio * *first_) {
    sink_.add(Kind::trivial_loss, "",
              "the loss fell from " + fmt(*first_) + " to " + fmt(x) + " (" + fmt(x / *first_) +
                  "x)" + within +
                  " — a task this easy this early usually means the answer is in the inputs: a "
                  "label or target column left among the features, the target reused as an "
                  "input, or a target equal to the input of an identity-capable model; check the "
                  "features against the target",
              x / *first_, v.step);
    return;
  }
  const int64_t need = std::min(kConstantSteps, opts_.trivial_loss_steps);
  if (constant_ && need >= 2 && constant_steps_ == need && new_step) {
    sink_.add(Kind::trivial_loss, "",
              "the loss has had exactly the same value (" + fmt(x) +
                  ", bit for bit) for the "
                  "first " +
                  std::to_string(need) +
                  " steps — it depends on neither the parameters nor the data: a detached "
                  "output, a loss computed from constants, or a learning rate of 0 on a fixed "
                  "batch",
              x, v.step);
  }
}

}  // namespace trainsan::host
