// loss_spike, trivial_loss and empty_loss: the loss stream of one sanitizer (Note [Loss stream]).
#include "checks/loss.h"

#include <algorithm>
#include <cmath>

namespace trainsan::host {

// Note [Loss stream]
// ~~~~~~~~~~~~~~~~~~
// A sanitizer has one loss stream: every loss it is handed (the roots of the training backwards
// attributed to it, Python; watch_loss), in order, each with the step it belongs to. A value is
// the loss's sum / numel (a scalar's value); non-finite losses are nonfinite_loss's and stay out
// of the stream, as do losses evaluated inside an optimizer step (LBFGS's closure: line-search
// trials, not the step's loss).
//
// loss_spike compares a loss with the window of the loss_spike_window unflagged losses before
// it, once loss_spike_warmup losses were seen: its median m, MAD, largest value top, and the
// spread of its logarithms s = 1.4826 MAD(ln w) (a window of positive losses). It fires when
//   x - m > factor * max(1.4826 * MAD, 0.2 * |m|, 1e-4 |first loss|)  (far outside the noise
//                                     band; on a steady positive loss: x > (1 + 0.2 factor) m)
//   and x - m > 2 * (top - m)         (twice the largest excursion of the window)
//   and ln(x / top) > 3 s             (positive windows: beyond the largest loss by three
//                                      log-spreads)
// The first condition is a robust z-score with relative floors, so a loss that has settled
// with almost no noise does not fire on a modest rise (a learning-rate restart doubling it), nor
// one that has fallen to ~0 on a rise that is nothing on the run's scale. The other two keep
// heavy-tailed minibatch noise silent: small batches whose loss now and then jumps to 10x or
// 100x the median because of one hard example (a polynomial regression over x..x^4, as the
// LibTorch regression example: batch losses spread over three decades, the largest of a window
// exceeded 3x now and then). Measured on that loop and on small-batch classification over 10
// seeds each, the largest excess was 1.5 log-spreads; a bad shard 1000x off is ~9.
// Before the warm-up a loss fires when it exceeds 100x the largest loss seen so far (positive):
// a jump of orders of magnitude, from the second loss on.
// A flagged loss stays out of the window, so one spike never hides the next (the largest
// excursion would absorb it); only a run of kPersist flagged losses in a row is a new level and
// enters it. A run is reported once, at its first loss. When the reported spikes recur at a
// fixed interval (the last three spikes P steps apart) the message gives the period: the same
// position of each epoch, a bad sample or shard the loader serves once an epoch.
// Several losses per step (gradient accumulation, a GAN's two losses reaching one model) share
// the stream; the median and the largest excursion absorb a mix of two levels.
// A loss whose step a loss scaler skipped (GradScaler found Inf/NaN in the scaled gradients: no
// update was made from it) is not a spike: fp16 training meets such batches now and then, and
// amp_scale_collapse judges a scaler that keeps skipping. Its flagged loss stays out of the
// window. So once a scaler has reported a step, each loss waits for its step's outcome
// (SanitizerImpl numbers the outcomes: a step end, or the scaler's report, whichever comes first
// after the loss — GradScaler reports after the optimizer's step end, a skip instead of one; a
// LibTorch end_step(loss) after the scaler's report) and is judged then: a spike of a step that
// ran is reported at its step end (its warning comes from the optimizer step, after the update),
// one whose step never ended at close. On a GPU the loss is read back after its outcome and judged
// at once. Without a scaler a loss is judged when it is read, as before.
//
// trivial_loss looks at the losses of the first trivial_loss_steps steps: a loss that is exactly
// 0 (every element), a loss at or below trivial_loss_ratio x the first loss (positive) — a
// collapse no real task shows that early — or the same bits for the first min(5,
// trivial_loss_steps) steps. Beyond them, for a loss whose class-index ops the op audit saw
// (cross_entropy, nll_loss: C classes), the collapse rule judges the *rate* of the fall: the
// mean of the last kCollapseWindow (10) losses at or below trivial_loss_collapse_ratio (1e-2) x
// min(ln C, first loss) within the first trivial_loss_collapse_steps (50) steps. ln C is the loss
// of an untrained model that spreads its probability evenly, the first loss the run's own start;
// a loss that falls two orders of magnitude below them in a few dozen steps has been handed the
// answer (next-token targets not shifted, a label column left among the features). Measured
// (4 seeds each, Adam, minibatches; the step at which the mean of the last 10 first reaches
// 1e-2 x ref; '-': not within 300 steps):
//   collapses: the example (3.5 -> 0.01 in 30 steps, then flat at ~0.011, 27 classes)
//     30; a GRU char LM with unshifted targets, lr 1e-2: 27-28 (3e-3: 76-81; on varied text
//     151-168); an embedding+linear LM, unshifted, lr 1e-2: 53-57; a binary target column left
//     among 20 features, lr 1e-2: 69-78;
//   honest: two blobs 5.7 sigma apart (lr 1e-2) 111-196, 7 sigma apart 83-128; sklearn's digits
//     (lr 1e-2, 1e-3), char LMs (GRU, a causal transformer) on repetitive or varied text, noisy
//     tabular data, ten blobs: '-' (their mean stays above 1.5e-2 x ref in 300 steps).
// 50 steps sits between them with a margin of 1.6x to each side (30 and 83). Collapses slower
// than that (a small model from scratch at a small learning rate learning the identity in 80+
// steps) fall no faster than an honest easy task and are not told apart: the rule keeps quiet.
// A noise-free separable data set (classes many sigma apart: synthetic prototypes plus noise
// reach it at 33-37) is indistinguishable from a leak and is reported; trivial_loss=off, a
// smaller ratio or fewer steps silence it. A run that fits one fixed batch (the inputs of most
// steps are the step before's, by their fingerprint: a full-batch fit, LBFGS — which reaches
// 1e-7 in 10 steps on separable data — or overfitting one batch as a sanity check, 128-147
// steps) memorizes, which is honest: not judged. A task with no class count (regression) is
// left to the early rules: an exact fit is honest there.
//
// empty_loss: the op audit counts, per audited step, the targets of the class-index loss calls
// that are not ignore_index. A call whose targets are all ignore_index averages over no element
// ('mean': NaN, 0/0; 'sum': 0) and teaches nothing: completion-only fine-tuning whose response
// template is never found, a collator masking every label. Reported from the second audited
// step with such a call, with the fraction of audited steps (one such batch in a long run is
// noise; the count says how often). A NaN loss with such a call is that 0/0: empty_loss, not
// nonfinite_loss, unless the step's gradients are not finite (NonfiniteCheck).

namespace {

constexpr int64_t kConstantSteps = 5;
constexpr double kMadToSigma = 1.4826;
constexpr double kRelativeFloor = 0.2;
constexpr double kFirstLossFloor = 1e-4;
constexpr double kLogSpreads = 3.0;
constexpr double kOrders = 100.0;
constexpr int64_t kPersist = 3;
constexpr size_t kCollapseWindow = 10;
constexpr size_t kSpikesKept = 3;
constexpr size_t kSkipsKept = 64;

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
  empty(v);
  const TensorStats& s = v.stats;
  if (v.in_step || s.numel <= 0 || s.nonfinite() > 0) return;
  const double x = s.sum / static_cast<double>(s.numel);
  if (!std::isfinite(x)) return;
  if (v.classes > 0) classes_ = std::max(classes_, v.classes);
  trivial(v, x);
  collapse(x, v.step);
  if (scaler_ && v.outcome >= 0 && (!waiting_.empty() || v.outcome >= resolved_)) {
    waiting_.push_back({x, v.step, v.outcome});  // judged at its step's outcome, in order
    return;
  }
  spike(x, v.step, was_skipped(v.outcome));
}

bool LossCheck::was_skipped(int64_t outcome) const {
  return outcome >= 0 && std::find(skipped_.begin(), skipped_.end(), outcome) != skipped_.end();
}

void LossCheck::on_outcome(int64_t outcome, bool skipped) {
  resolved_ = std::max(resolved_, outcome + 1);
  if (skipped) {
    skipped_.push_back(outcome);
    if (skipped_.size() > kSkipsKept) skipped_.pop_front();
  }
  while (!waiting_.empty() && waiting_.front().outcome < resolved_) {
    const Waiting w = waiting_.front();
    waiting_.pop_front();
    spike(w.x, w.step, was_skipped(w.outcome));
  }
}

void LossCheck::flush() {
  while (!waiting_.empty()) {
    const Waiting w = waiting_.front();
    waiting_.pop_front();
    spike(w.x, w.step, was_skipped(w.outcome));
  }
}

void LossCheck::spike(double x, int64_t step, bool skipped) {
  const auto cap = static_cast<size_t>(std::max<int64_t>(opts_.loss_spike_window, 1));
  bool flagged = false;
  std::string what;
  double factor = 0.0;
  if (seen_ >= opts_.loss_spike_warmup && !window_.empty()) {
    // Every step runs this: the three conditions are tested cheapest first, each statistic
    // computed only when the ones before it hold (a loss at or below the window's largest never
    // gets past the second), which changes no verdict.
    const double m = median_of(window_);
    const double excess = x - m;
    const double top = *std::max_element(window_.begin(), window_.end());
    bool spiked = excess > 0.0 && excess > 2.0 * (top - m);
    double band = 0.0;
    if (spiked) {
      std::vector<double> dev(window_.size());
      for (size_t k = 0; k < window_.size(); ++k) dev[k] = std::abs(window_[k] - m);
      const double mad = median_of(dev);
      const double first = first_ ? std::abs(*first_) : 0.0;
      band = std::max(
          {kMadToSigma * mad, kRelativeFloor * std::abs(m), kFirstLossFloor * first, 1e-12});
      spiked = excess > opts_.loss_spike_factor * band;
    }
    if (spiked && x > 0.0 && *std::min_element(window_.begin(), window_.end()) > 0.0) {
      std::vector<double> logs(window_.size());
      for (size_t k = 0; k < window_.size(); ++k) logs[k] = std::log(window_[k]);
      const double lm = median_of(logs);
      for (double& l : logs) l = std::abs(l - lm);
      spiked = std::log(x / top) > kLogSpreads * kMadToSigma * median_of(logs);
    }
    if (spiked) {
      flagged = true;
      const bool ratio = m > 0.0;
      factor = ratio ? x / m : excess / band;
      what = "the loss jumped to " + fmt(x) + ", " + fmt(factor) +
             (ratio ? "x its running median " : " noise bands above its running median ") + fmt(m) +
             " over the last " + std::to_string(window_.size()) +
             " losses (the largest of them: " + fmt(top) + ")";
    }
  } else if (seen_ > 0 && largest_ > 0.0 && x > kOrders * largest_) {
    flagged = true;
    factor = x / largest_;
    what = "the loss jumped to " + fmt(x) + ", " + fmt(factor) + "x the largest of the " +
           std::to_string(seen_) + " losses before it (" + fmt(largest_) + ")";
  }
  if (flagged && skipped) {
    // The loss scaler skipped this step (Inf/NaN in the scaled gradients): no update was made
    // from this loss; amp_scale_collapse judges a scaler that keeps skipping. Not a spike, and
    // out of the window.
    seen_ += 1;
    return;
  }
  if (flagged) {
    flagged_run_ += 1;
    if (flagged_run_ == 1) {
      std::string tensor;
      std::string period;
      if (spikes_.size() >= 2) {
        const int64_t p = step - spikes_.back();
        const int64_t q = spikes_.back() - spikes_[spikes_.size() - 2];
        if (p > 0 && p == q) {
          tensor = "loss, every " + std::to_string(p) + " steps";
          period = "; it recurs every " + std::to_string(p) + " steps (steps " +
                   std::to_string(spikes_[spikes_.size() - 2]) + ", " +
                   std::to_string(spikes_.back()) + ", " + std::to_string(step) +
                   "): the same position of each epoch — a bad sample or data shard the loader "
                   "serves once an epoch (targets on another scale, corrupt values); look at "
                   "the batch at that position, index " +
                   std::to_string(step % p) + " of the period";
        }
      }
      spikes_.push_back(step);
      if (spikes_.size() > kSpikesKept) spikes_.erase(spikes_.begin());
      sink_.add(Kind::loss_spike, tensor,
                what + period +
                    " — a corrupted or outlier batch, a learning-rate jump, or an optimizer "
                    "instability; look at this step's batch and learning rate, and consider "
                    "gradient clipping (torch.nn.utils.clip_grad_norm_)",
                factor, step);
    }
    seen_ += 1;
    if (flagged_run_ <= kPersist) return;  // kept out of the window: it hides no later spike
  } else {
    flagged_run_ = 0;
  }
  largest_ = std::max(largest_, x);
  if (window_.size() < cap) {
    window_.push_back(x);
  } else {
    window_[next_ % cap] = x;
  }
  next_ = (next_ + 1) % cap;
  seen_ += 1;
}

void LossCheck::on_inputs(uint64_t hash) {
  const bool repeated = (fresh_inputs_ + repeated_inputs_) > 0 && hash == last_inputs_;
  (repeated ? repeated_inputs_ : fresh_inputs_) += 1;
  last_inputs_ = hash;
}

void LossCheck::collapse(double x, int64_t step) {
  if (recent_.size() < kCollapseWindow) {
    recent_.push_back(x);
  } else {
    recent_[recent_next_] = x;
  }
  recent_next_ = (recent_next_ + 1) % kCollapseWindow;
  if (collapsed_ || classes_ < 2 || !first_ || *first_ <= 0.0 ||
      step >= opts_.trivial_loss_collapse_steps || recent_.size() < kCollapseWindow ||
      repeated_inputs_ > fresh_inputs_) {
    return;  // a fixed batch (full-batch fit, LBFGS, overfitting one batch): memorized, honest
  }
  const double chance = std::log(static_cast<double>(classes_));
  const double ref = std::min(chance, *first_);
  double mean = 0.0;
  for (const double r : recent_) mean += r;
  mean /= static_cast<double>(recent_.size());
  if (mean > opts_.trivial_loss_collapse_ratio * ref) return;
  collapsed_ = true;
  sink_.add(Kind::trivial_loss, "",
            "the loss collapsed to a mean of " + fmt(mean) + " over the last " +
                std::to_string(kCollapseWindow) + " losses by step " + std::to_string(step) + ", " +
                fmt(mean / ref) + "x " +
                (ref == chance ? "the loss of an untrained model, ln " + std::to_string(classes_) +
                                     " classes = " + fmt(chance)
                               : "the first loss " + fmt(*first_)) +
                " — a real task does not get this easy this fast: the model sees the answer. "
                "Usual causes: next-token targets not shifted (labels = input_ids without the "
                "shift by one), a label or target column left among the features, the target "
                "reused as an input; check what the model is given against what it predicts",
            mean / ref, step);
}

void LossCheck::empty(const LossView& v) {
  if (v.class_calls <= 0 || v.step == last_target_step_) {
    // Several losses of one step share its facts: count the step once (but a later loss of the
    // same step may bring the first facts).
    return;
  }
  last_target_step_ = v.step;
  target_steps_ += 1;
  if (v.class_empty_calls <= 0) return;
  empty_steps_ += 1;
  const bool nan = v.stats.nan > 0;
  if (empty_steps_ < 2 && !nan) return;
  const double fraction =
      static_cast<double>(empty_steps_) / static_cast<double>(std::max<int64_t>(target_steps_, 1));
  sink_.add(Kind::empty_loss, "",
            "every target of a class-index loss (cross_entropy / nll_loss) was ignore_index on " +
                std::to_string(empty_steps_) + " of the " + std::to_string(target_steps_) +
                " audited steps (" + fmt(100.0 * fraction) + "%)" +
                (nan ? ", and the loss of this step is NaN: the mean over no target is 0/0 (its "
                       "gradients are zero)"
                     : "") +
                " — such a batch teaches nothing (reduction='mean' gives NaN, 'sum' 0): a "
                "completion-only mask that covers no token (the response template never found "
                "after tokenization, a prompt longer than max_length), a collator masking every "
                "label, or padding with the ignore_index everywhere; check the labels of these "
                "batches",
            fraction, v.step);
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
