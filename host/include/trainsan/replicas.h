// rank_desync for a LibTorch program: the replica comparison over a c10d process group the
// caller gives (Note [Replica comparison over c10d] in host/replicas_pg.cpp): one
// trainsan::ReplicaEngine (trainsan/replica_engine.h), the engine the Python package drives per
// replica set over torch.distributed (bindings/trainsan/replicas.py).
//
//   auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
//   auto san = trainsan::attach(model, optimizer, opts);
//   trainsan::compare_replicas(san, pg);   // every rank of the data-parallel group, once
//   for (...) { ...; optimizer.step(); san.end_step(loss); }
//   san.close();
#pragma once

#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "trainsan/sanitizer.h"

namespace trainsan {

/// What compare_replicas() compares besides the sanitizer's parameters.
struct ReplicaSetup {
  /// How findings name the group, e.g. "the data-parallel group (DDP)"; empty: "the
  /// data-parallel group (the process group given to compare_replicas)".
  std::string name;
  /// Buffers that must be identical across the replicas (a model's named_buffers()), compared
  /// on the sampled steps (desync_state_every) when the option desync_buffers is on.
  Sanitizer::NamedTensors buffers;
  /// The gradients are averaged across the group (DDP, or the loop's own all-reduce): compare
  /// them too on the sampled steps. False: the gradients are per-rank (only weights compared).
  bool grads = true;
};

/// rank_desync across the ranks of `group`, whose copies of `san`'s parameters are replicas (a
/// data-parallel program: its world group). Call it on every rank of `group`, after attaching
/// `san` and before the first step. It compares the parameters as they are now (the weights the
/// replicas start from: a blocking collective), then at every step event of every optimizer (a
/// step, or a step its scaler skipped: scaler_step) the ranks' step counts, and on the
/// desync_every-th steps the parameters' fingerprints (gradients and buffers on the
/// desync_state_every-th of those), one all-reduce per event on `group`, read at the next event.
/// A comparison that does not complete within desync_timeout seconds is reported as missing
/// ranks and the comparison stops; the training never waits longer. `san.close()` compares what is
/// still pending. Nothing is done when rank_desync is disabled. Use a group of its own (a second
/// ProcessGroupGloo on the same store): its collectives must not interleave with the training's.
/// Throws c10::Error (ValueError) for a null group, a group of one rank, or a sanitizer that has
/// stepped or is closed or already compares replicas.
void compare_replicas(Sanitizer& san, c10::intrusive_ptr<c10d::ProcessGroup> group,
                      ReplicaSetup setup = {});

}  // namespace trainsan
