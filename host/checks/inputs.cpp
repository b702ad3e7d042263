// duplicate_batch: the data stopped advancing (Note [Stuck data]).
#include "checks/check.h"

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

void InputsCheck::on_inputs(uint64_t hash, int64_t step, int64_t restarts) {
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
