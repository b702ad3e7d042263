// The read-back queue: every result that comes back from the device after the step that launched
// it (the step pass, watched losses, input fingerprints, label flags) is one entry here, and
// drain() is the one place that knows the one-step lag and `sync` (Note [Lagged checks]).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "stats_internal.h"

namespace trainsan::host {

// Note [Lagged checks]
// ~~~~~~~~~~~~~~~~~~~~
// On a GPU the fused pass and every other device-side result are copied to pinned host memory
// asynchronously, and read at the *next* step end, when the copy has long landed, so the training
// stream never waits for TrainSan. Each entry is tagged with the step end it belongs to (its
// generation: the number of step ends before it) and a phase that orders the entries of one
// generation as the checks expect them (label flags, losses, inputs, then the pass). At a step
// end, drain() runs the consumers of the entries of earlier generations, waiting for their copies,
// then those of this generation whose results are already on the host (CPU results: no event) or
// all of them with `sync`. close() drains everything. Consumers run in (generation, phase,
// insertion) order. A consumer may push new entries; they wait for the next drain.
class ReadbackQueue {
 public:
  enum class Phase : uint8_t { kLabels = 0, kLoss = 1, kInputs = 2, kPass = 3 };
  using Consumer = std::function<void(const PackedStats& host)>;
  /// For a result made of several copies (one per device): all of them at once, in order.
  using MultiConsumer = std::function<void(const std::vector<HostCopy>& copies)>;

  explicit ReadbackQueue(bool sync) : sync_(sync) {}

  /// Queue `copy` (started with start_host_copy) for the current generation.
  void push(HostCopy copy, Phase phase, Consumer consume);
  void push(std::vector<HostCopy> copies, Phase phase, MultiConsumer consume);
  /// For events that report at once (watch_loss): consume now when the result needs no wait
  /// (CPU) or with sync (waiting for it); else queue it like push().
  void push_or_consume(HostCopy copy, Phase phase, Consumer consume);
  /// A step end: drain the due entries (see the Note), then start the next generation.
  void step_end();
  /// Drain everything, waiting for every copy (close()).
  void drain_all();
  bool empty() const { return entries_.empty(); }

 private:
  struct Entry {
    int64_t generation;
    Phase phase;
    std::vector<HostCopy> copies;
    MultiConsumer consume;
    bool on_host() const;  // no copy needs a wait (CPU results)
  };
  void run(bool earlier_generations, bool current_generation);
  bool sync_;
  int64_t generation_ = 0;
  std::vector<Entry> entries_;
};

}  // namespace trainsan::host
