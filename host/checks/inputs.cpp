// duplicate_batch: the same inputs, bit for bit, at two consecutive steps.
#include "checks/check.h"

namespace trainsan::host {

void InputsCheck::on_inputs(uint64_t hash, int64_t step) {
  if (last_hash_ && *last_hash_ == hash) {
    sink_.add(Kind::duplicate_batch, "",
              "the training forward received exactly the same inputs (bit for bit) as at the "
              "previous step — the data loader or the batch variable is not advancing (e.g. `x, "
              "y = next(iter(loader))` inside the loop, or a batch reused by mistake)",
              std::nullopt, step);
  }
  last_hash_ = hash;
}

}  // namespace trainsan::host
