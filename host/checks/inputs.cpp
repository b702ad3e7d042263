// duplicate_batch: the data stopped advancing (Note [Stuck data]).
#include "checks/inputs.h"

namespace trainsan::host {

// Note [Stuck data]
// ~~~~~~~~~~~~~~~~~
// Repeated inputs are not a bug by themselves: full-batch training (graph networks, LBFGS fits,
// physics-informed fits) feeds the same whole data set at every step, and a multi-model loop
// legitimately feeds one model the same tensor at two consecutive steps (a GAN discriminator sees
// fake.detach() before its step and fake after it). The check flags the stuck-data bug by its
// own signature: the fingerprint of a step's first training inputs equals the previous step's
// and either
//  * a data loader was iterated anew in between after its previous iterator had yielded only its
//    first batch of several (`next(iter(loader))` inside the loop; the Python package counts
//    these: ForwardFacts::data_restarts), or
//  * the inputs had been advancing: at some earlier point they changed at two consecutive steps
//    (three different batches in a row), and now they stopped (an exhausted iterator whose last
//    batch is kept, a batch variable no longer reassigned).
// Identical inputs from step 0 on (full batch), a single repeat after one change (a probe
// forward before full-batch training; the GAN pattern) and data echoing (A A B B C C: never two
// changes in a row) stay silent.

// Note [Replayed data]
// ~~~~~~~~~~~~~~~~~~~~
// After a resume the loop should see the batches that come after the checkpoint, not those it
// trained on before: a sampler re-seeded from scratch, a loader that restarts at its first shard,
// a checkpoint saved before the batch counter moved, all replay them. Every step's input
// fingerprint is kept (bounded: the first 2^20 distinct ones), and those of a previous run's
// trace are seeded (resume_trace); after a resume the first `kReplaySteps` steps whose inputs
// equal a batch trained before it are reported (duplicate_batch, warning). Data that repeats by
// design is exempt: once a fingerprint was seen twice before the resume (full-batch training,
// unshuffled epochs, a sampler without set_epoch) a match says nothing. The case this cannot tell
// apart: unshuffled data resumed exactly at its first epoch boundary (its next batch is step 0's,
// correctly) — reported, as a warning. Without a trace, the checkpoint's counters and the loader
// judge the data position in process (Note [Data position], resume_data.cpp).
// Note [Repeated batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Within one pass over a data loader every batch should be new: a sampler draws each index
// once. DataLoader workers that share one random state hand the model the same batch more than
// once: a NumPy Generator or random.Random made in the Dataset's __init__ is copied into every
// worker process at the same state (the DataLoader reseeds the global torch, random and NumPy
// RNGs per worker, not an object the dataset holds), so a dataset that draws its samples from it
// gives each worker the same draws, and the batches arrive as A A B B (2 workers: A B C A B C for
// 3 that yield in turn); an IterableDataset that every worker iterates whole (not split with
// get_worker_info()) does the same. The rule: with the loader pass known (ForwardFacts::
// loader_pass; the Python package numbers DataLoader iterations), a step's input fingerprint
// equal to one of the last kRecent steps of the same pass counts as a repeat, and the second
// repeat of a pass is reported, once the pass also had a different batch (constant data is full-
// batch training, not this). Two repeats in a short window of one pass are not chance for a
// sampler without replacement; a new pass starts afresh (an unshuffled loader repeats its
// batches epoch after epoch, correctly; a full-batch loader has one batch per pass). Without the
// loader pass (LibTorch, batches not from a DataLoader) only the stuck-data rules run: short
// unshuffled epochs and data echoing cannot be told apart from this without it. Evaluation passes
// are no training forwards and are not fingerprinted. The worker count and a missing
// worker_init_fn are named in the message.
namespace {
constexpr int64_t kReplaySteps = 3;
constexpr size_t kRecent = 8;
constexpr size_t kSeenCap = size_t{1} << 20;
constexpr int64_t kIgnoredSteps = 2;  // Note [Ignored batches]
}  // namespace

void InputsCheck::on_resume(int64_t step) {
  resumed_at_ = step;
  replay_left_ = kReplaySteps;
}

void InputsCheck::seed(const std::vector<uint64_t>& hashes, const std::vector<int64_t>& steps) {
  for (size_t k = 0; k < hashes.size() && k < steps.size() && seen_.size() < kSeenCap; ++k) {
    if (!seen_.emplace(hashes[k], steps[k]).second) repeated_ = true;
  }
  on_resume(0);
}

// Note [Ignored batches]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A loop that fetches its loader's batch and then trains on another one: a Lightning
// training_step that uses a fixed batch, `for batch in loader:` around a step on a batch kept
// from before, a tensor the forward reads instead of the one it was given. The loader yields a new
// batch every step, the model sees the same inputs every step. The Python package gives, with
// each training forward, a sampled fingerprint of the batch a DataLoader yielded since the
// previous one (ForwardFacts::loader_batch: 64 evenly spaced elements of its first tensor, read
// on the host, so only where that tensor is on the CPU, as a loader yields it). The rule: at
// kIgnoredSteps consecutive steps the inputs' fingerprint equals the previous step's while the
// loader's batches differ — duplicate_batch, an error. A full-batch fit or an overfit-one-batch
// loop without a loader (nothing yielded: 0) and one whose loader yields the same batch again
// (a loader over one batch) stay silent, as do inputs that change.
void InputsCheck::ignored(uint64_t hash, int64_t step, const LoaderView& loader) {
  const bool same_inputs = last_hash_ && *last_hash_ == hash;
  const bool new_batch = loader.batch != 0 && last_batch_ != 0 && loader.batch != last_batch_;
  ignored_in_row_ = same_inputs && new_batch ? ignored_in_row_ + 1 : 0;
  last_batch_ = loader.batch;
  if (ignored_in_row_ != kIgnoredSteps) return;
  sink_.add(Kind::duplicate_batch, "",
            "the training forward received exactly the same inputs (bit for bit) at the last " +
                std::to_string(kIgnoredSteps + 1) +
                " steps while the DataLoader yielded a different batch before each — the step "
                "uses another batch than the one its loader yielded (a training_step or loop body "
                "that trains on a fixed or kept batch, a forward that reads a stored tensor "
                "instead of its argument); pass the batch the loader yields to the model",
            static_cast<double>(kIgnoredSteps + 1), step, Severity::kError);
}

void InputsCheck::repeated(uint64_t hash, int64_t step, const LoaderView& loader) {
  if (loader.pass < 0) return;
  if (loader.pass != pass_) {
    pass_ = loader.pass;
    pass_repeats_ = 0;
    recent_.clear();
  }
  int64_t earlier = -1;
  bool other = false;
  for (const auto& [h, s] : recent_) {
    if (h == hash) {
      earlier = s;
    } else {
      other = true;
    }
  }
  recent_.emplace_back(hash, step);
  while (recent_.size() > kRecent) recent_.pop_front();
  if (earlier < 0) return;
  pass_repeats_ += 1;
  if (pass_repeats_ < 2 || !other) return;
  std::string who = "the data loader";
  if (loader.workers > 1) {
    who += " (num_workers=" + std::to_string(loader.workers) +
           (loader.worker_init ? std::string(", with a worker_init_fn")
                               : std::string(", no worker_init_fn")) +
           ")";
  }
  std::string why =
      loader.workers > 1
          ? " — its " + std::to_string(loader.workers) +
                " worker processes draw the same random numbers: a random state the Dataset "
                "holds (np.random.default_rng(...), random.Random(...) made in __init__) is "
                "copied into every worker at the same state, so each worker samples or augments "
                "alike; reseed it per worker in a worker_init_fn (e.g. from "
                "torch.utils.data.get_worker_info().seed), or draw from torch's RNG, which the "
                "DataLoader seeds per worker. An IterableDataset must also split its stream "
                "between workers (get_worker_info())"
          : " — the dataset or sampler yields the same samples again within one pass (a random "
            "state that is reset or copied, indices that repeat); each batch of a pass should "
            "be new";
  sink_.add(Kind::duplicate_batch, "",
            "the training forward received exactly the same inputs (bit for bit) as at step " +
                std::to_string(earlier) + ", within the same pass over " + who + ", " +
                std::to_string(pass_repeats_) +
                " times in this pass while its other batches "
                "differ" +
                why,
            static_cast<double>(step - earlier), step);
}

void InputsCheck::on_inputs(uint64_t hash, int64_t step, int64_t restarts,
                            const LoaderView& loader) {
  if (replay_left_ > 0) {
    replay_left_ -= 1;
    const auto it = seen_.find(hash);
    if (it != seen_.end() && !repeated_) {
      sink_.add(Kind::duplicate_batch, "",
                "after the resume at step " + std::to_string(resumed_at_) +
                    ", this step's inputs are exactly those of step " + std::to_string(it->second) +
                    ", trained before the checkpoint — the data order was not restored: the "
                    "sampler or loader restarted (seed it per epoch and restore its state, or "
                    "skip the batches already trained), or the checkpoint was saved before its "
                    "batch counter moved",
                static_cast<double>(it->second), step);
      replay_left_ = 0;
    }
  }
  if (seen_.size() < kSeenCap && !seen_.emplace(hash, step).second && replay_left_ == 0 &&
      resumed_at_ < 0) {
    repeated_ = true;  // the data repeats by design (before any resume)
  }

  ignored(hash, step, loader);
  const bool stuck = last_hash_ && *last_hash_ == hash && (restarts > last_restarts_ || advancing_);
  if (!stuck) repeated(hash, step, loader);
  if (last_hash_ && *last_hash_ == hash) {
    const bool restarted = restarts > last_restarts_;
    if (restarted) {
      sink_.add(Kind::duplicate_batch, "",
                "the training forward received exactly the same inputs (bit for bit) as at the "
                "previous step, and a DataLoader was iterated anew in between after its previous "
                "iterator had yielded only its first batch — `next(iter(loader))` inside the loop "
                "takes the same first batch every step: create the iterator once (`it = "
                "iter(loader)` before the loop, `next(it)` inside) or loop `for x, y in loader`",
                std::nullopt, step);
    } else if (advancing_) {
      sink_.add(Kind::duplicate_batch, "",
                "the training forward received exactly the same inputs (bit for bit) as at the "
                "previous step, after earlier steps each got new inputs — the data stopped "
                "advancing (an exhausted iterator whose last batch is kept, a batch variable no "
                "longer reassigned, a cached batch); check where the loop fetches its batch",
                std::nullopt, step);
    }
    changes_in_row_ = 0;
  } else if (last_hash_) {
    changes_in_row_ += 1;
    if (changes_in_row_ >= 2) advancing_ = true;
  }
  last_hash_ = hash;
  last_restarts_ = restarts;
}

}  // namespace trainsan::host
