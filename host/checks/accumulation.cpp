// accumulation_mismatch: the declared gradient accumulation window (Options::accumulation_steps)
// against the backward passes each optimizer step followed.
#include "checks/accumulation.h"

#include <algorithm>
#include <string>

namespace trainsan::host {

// Note [Accumulation windows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A window is what one optimizer step consumes: the micro-batches (training backwards of the
// model) since the previous step. The sanitizer counts, per window, the training losses it owns
// (the roots of training backwards, or watch_loss / end_step(losses); never those inside an
// optimizer step: a closure's re-evaluations, LBFGS) and the training forwards, and takes the
// smaller: several backwards of one forward (loss_a.backward(retain_graph=True);
// loss_b.backward()) and several forwards of one backward (a siamese pair, Lightning's reported
// forward plus self(x)) are one micro-batch each; a sum of losses is one backward. A step that
// follows none (a closure step, the second optimizer stepping on the same backward) is not a
// window. The effective batch is the forwards' batch sizes (the first input's first dimension)
// summed, where the forwards and the backwards agree. A zero_grad() outside a step that clears
// gradients of the window (a guard that discards a bad micro-batch's window, a GAN's
// discriminator gradients left by the generator's backward) starts the window again
// (AccumulationFeed::before_clear, host/feeds/accumulation_feed.cpp).
//
// Declared windows (accumulation_steps = N, which the Hugging Face and Lightning callbacks set
// from the trainer's own setting): a step after N backwards keeps it. A step after more is an
// error at once (the window runs on: a step skipped, an epoch's remainder carried into the next
// epoch). A step after fewer is judged at the next training forward, which tells where it was:
// with the data loader pass known (ForwardFacts::loader_pass, Note [Repeated batches]), a new
// pass means the short window was the last of an epoch (its remainder), the same pass means the
// run stepped mid-epoch (an error). The last window of an epoch is legitimate but mis-scaled in
// the usual loop: the loss divided by N makes that step's gradient k/N of its size, so it is a
// warning that says so, with the effective batch. A short window after another short one with no
// full window between means the declared window is never reached: an epoch shorter than the
// window, where the frameworks step at each epoch's last batch, so accumulation is silently
// changed to the epoch's length — an error. At the end of the run a pending short window is the
// run's last (a warning, unless the window was never reached); with the pass unknown (LibTorch,
// batches not from a DataLoader) a single short window is a warning that names both readings.
//
// Undeclared windows (accumulation_steps = 0) are not judged: the summary and coverage() show
// the most frequent window and how many steps followed it, and each step record its count
// ("backwards"), so an accumulation nobody declared is visible.
namespace {
constexpr size_t kMaxWindowSizes = 64;

std::string batch_of(int64_t samples) {
  return samples >= 0 ? std::to_string(samples) + " samples" : "unknown";
}

std::string declared_batch(int64_t n, int64_t k, int64_t samples, int64_t full_samples) {
  if (full_samples >= 0) return std::to_string(full_samples) + " samples";
  if (samples >= 0 && k > 0 && samples % k == 0) {
    return std::to_string(n) + " x " + std::to_string(samples / k) + " = " +
           std::to_string(n * (samples / k)) + " samples";
  }
  return std::to_string(n) + " micro-batches";
}
}  // namespace

void AccumulationCheck::on_step(const WindowView& w) {
  if (w.backwards <= 0) return;
  counted_ += 1;
  if (steps_at_.count(w.backwards) != 0 || steps_at_.size() < kMaxWindowSizes) {
    steps_at_[w.backwards] += 1;
    samples_at_[w.backwards] = w.samples;
  }
  const int64_t n = opts_.accumulation_steps;
  if (n <= 0) return;
  if (pending_) {  // no training forward since the previous short window: where is unknown
    const WindowView p = *pending_;
    pending_.reset();
    judge(p, Where::kUnknown);
  }
  if (w.backwards == n) {
    full_seen_ = true;
    shorts_in_row_ = 0;
    full_samples_ = w.samples;
    return;
  }
  if (w.backwards > n) {
    judge(w, Where::kMidPass);
    return;
  }
  pending_ = w;
}

void AccumulationCheck::on_forward(int64_t pass) {
  if (!pending_) return;
  if (pending_->pass >= 0 && pass < 0) return;  // no new batch yet: wait for one
  const WindowView p = *pending_;
  pending_.reset();
  judge(p, p.pass < 0 ? Where::kUnknown : pass != p.pass ? Where::kPassEnd : Where::kMidPass);
}

void AccumulationCheck::on_close() {
  if (!pending_) return;
  const WindowView p = *pending_;
  pending_.reset();
  judge(p, Where::kRunEnd);
}

void AccumulationCheck::judge(const WindowView& w, Where where) {
  const int64_t n = opts_.accumulation_steps;
  const int64_t k = w.backwards;
  const std::string declared = "accumulation_steps=" + std::to_string(n);
  const std::string effective = "effective batch " + batch_of(w.samples) + " instead of " +
                                declared_batch(n, k, w.samples, full_samples_);
  const std::string scaled = "a loss divided by the full factor (loss / " + std::to_string(n) +
                             ") makes this step's gradient " + std::to_string(k) + "/" +
                             std::to_string(n) + " of its size";
  if (k > n) {
    sink_.add(Kind::accumulation_mismatch, "<window>",
              "optimizer step after " + std::to_string(k) + " backward passes, but " + declared +
                  " was declared: the window ran on past its end (a step skipped, or an epoch's "
                  "remainder carried into the next epoch), " +
                  effective + " — step after every " + std::to_string(n) +
                  " micro-batches (and at the end of each epoch), or declare the window the loop "
                  "keeps",
              static_cast<double>(k), w.step);
    shorts_in_row_ = 0;
    return;
  }
  shorts_in_row_ += 1;
  if (!full_seen_ && shorts_in_row_ >= 2) {
    sink_.add(Kind::accumulation_mismatch, "<window>",
              declared + " was declared but no optimizer step followed " + std::to_string(n) +
                  " backward passes: the run steps every " + std::to_string(k) +
                  (where == Where::kMidPass || where == Where::kUnknown
                       ? ""
                       : " (at each epoch's last batch, as the frameworks do: an epoch of " +
                             std::to_string(k) + " batches is shorter than the window)") +
                  ", so gradient accumulation is silently changed: " + effective + "; " + scaled +
                  " — make an epoch at least as long as the window (more batches per epoch, a "
                  "smaller window) or declare the window the run keeps",
              static_cast<double>(k), w.step);
    return;
  }
  if (where == Where::kMidPass) {
    sink_.add(Kind::accumulation_mismatch, "<window>",
              "optimizer step after " + std::to_string(k) + " backward passes in the middle of " +
                  "a data loader pass, but " + declared +
                  " was declared: the run does not keep its accumulation window (a step "
                  "condition such as (i + 1) % N == 0 off by one, or counting the wrong "
                  "variable), " +
                  effective + "; " + scaled + " — step after every " + std::to_string(n) +
                  " micro-batches, or declare the window the loop keeps",
              static_cast<double>(k), w.step);
    return;
  }
  const std::string what = where == Where::kPassEnd ? "the last window of an epoch (a data loader "
                                                      "pass)"
                           : where == Where::kRunEnd
                               ? "the last window of the run"
                               : "a window (its data loader pass is unknown: the end of an epoch? "
                                 "if not, the run does not keep its window)";
  sink_.add(Kind::accumulation_mismatch, "<last window>",
            what + " ended with " + std::to_string(k) + " of the " + declared +
                " backward passes: its step's " + effective + "; " + scaled +
                " — divide the loss by the window's own count of micro-batches, or drop the "
                "incomplete window (DataLoader(drop_last=True), an epoch length divisible by " +
                std::to_string(n) + ")",
            static_cast<double>(k), w.step, Severity::kWarning);
}

WindowsSeen AccumulationCheck::seen() const {
  WindowsSeen s;
  s.counted = counted_;
  for (const auto& [k, steps] : steps_at_) {
    if (steps > s.at_common) {
      s.common = k;
      s.at_common = steps;
      s.samples = samples_at_.at(k);
    }
  }
  return s;
}

}  // namespace trainsan::host
