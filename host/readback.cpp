// The read-back queue (Note [Lagged checks] in readback.h).
#include "readback.h"

#include <algorithm>
#include <tuple>
#include <utility>

namespace trainsan::host {

bool ReadbackQueue::Entry::on_host() const {
  for (const HostCopy& c : copies) {
    if (c.event != nullptr) return false;
  }
  return true;
}

void ReadbackQueue::push(HostCopy copy, Phase phase, Consumer consume) {
  std::vector<HostCopy> copies;
  copies.push_back(std::move(copy));
  push(std::move(copies), phase,
       [consume = std::move(consume)](const std::vector<HostCopy>& c) { consume(c[0].host); });
}

void ReadbackQueue::push(std::vector<HostCopy> copies, Phase phase, MultiConsumer consume) {
  entries_.push_back({generation_, phase, std::move(copies), std::move(consume)});
}

void ReadbackQueue::push_or_consume(HostCopy copy, Phase phase, Consumer consume) {
  if (copy.event == nullptr || sync_) {
    wait_host_copy(copy);
    consume(copy.host);
    return;
  }
  push(std::move(copy), phase, std::move(consume));
}

void ReadbackQueue::run(bool earlier_generations, bool current_generation) {
  std::vector<Entry> due, kept;
  for (Entry& e : entries_) {
    const bool earlier = e.generation < generation_;
    const bool now = earlier ? earlier_generations : current_generation && (e.on_host() || sync_);
    (now ? due : kept).push_back(std::move(e));
  }
  entries_ = std::move(kept);
  std::stable_sort(due.begin(), due.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.generation, a.phase) < std::tie(b.generation, b.phase);
  });
  for (Entry& e : due) {
    for (const HostCopy& c : e.copies) wait_host_copy(c);
    e.consume(e.copies);
  }
}

void ReadbackQueue::step_end() {
  run(/*earlier_generations=*/true, /*current_generation=*/true);
  generation_ += 1;
}

void ReadbackQueue::drain_all() {
  // Everything is due: treat the current generation as an earlier one.
  generation_ += 1;
  run(true, true);
}

}  // namespace trainsan::host
