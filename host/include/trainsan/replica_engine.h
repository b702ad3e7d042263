// rank_desync's schedule of collectives for one replica set (Note [Replica comparison over c10d]
// in host/replicas_pg.cpp): the one implementation that trainsan::compare_replicas (a LibTorch
// program) and the Python package (bindings/trainsan/replicas.py, through _trainsan_hot) drive.
//
//   trainsan::ReplicaEngine e(group, spec, steps);
//   e.launch(facts);   // per step event: this rank's row, all-reduced (MAX) over [row, ~row]
//   e.drain(1);        // read every comparison but the newest (0: all of them, e.g. at close)
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>
#include <vector>

#include "trainsan/replica_facts.h"

namespace trainsan {

/// What a replica set is: who its members are and what its rows hold.
struct ReplicaSetSpec {
  /// How findings name the set, e.g. "the data-parallel group (DDP)".
  std::string context;
  /// The members' ranks as findings name them (global ranks), in the order of the group's ranks.
  std::vector<int64_t> ranks;
  /// This process's rank among `ranks` (its value, not its position).
  int64_t rank = 0;
  /// The row's parameter slots: the parameters' indices (StepFingerprints::index) and names.
  std::vector<int64_t> members;
  std::vector<std::string> member_names;
  /// The row's buffer slots, by name.
  std::vector<std::string> buffer_names;
  /// Of the members' names, shapes and placements: equal on every replica (ReplicaRow::kDigest).
  int64_t digest = 0;
  /// How long a comparison waits for the other members before reporting them missing.
  double timeout_s = 600.0;
  /// The collectives' own timeout (finite, past timeout_s, so that one given up on ends by
  /// itself); unset: the group's own.
  std::optional<std::chrono::milliseconds> collective_timeout;
  /// How the user switches rank_desync off, for the warning that the ranks are not replicas.
  std::string switch_off = "check.rank_desync=false";
};

/// The ranks that did not take part in a comparison, with a detail each ("" for none).
struct ReplicaMissing {
  std::vector<int64_t> ranks;
  std::vector<std::string> detail;
};

/// The steps of a comparison that depend on who drives the engine. Unset ones take the c10d
/// defaults; `report` is required.
struct ReplicaSteps {
  /// A finding's facts (ReplicaReport) for the sanitizer.
  std::function<void(const ReplicaReport&)> report;
  /// Polled while a comparison is waited for: whether some member will never arrive at
  /// comparison `seq` (it closed its sanitizer after fewer). Default: never known.
  std::function<bool(int64_t seq)> gone;
  /// The members that did not take part in comparison `seq` (`timed_out`: the wait gave up
  /// after timeout_s; else gone() said so, or the collective failed). Default: every other rank.
  std::function<ReplicaMissing(int64_t seq, bool timed_out)> missing;
  /// Every member's values of `fields` (ReplicaRow fields) at comparison `seq`, one vector per
  /// member in the order of ReplicaSetSpec::ranks, given this rank's `row`; nullopt when some
  /// member does not answer. Default: an all-gather of the rows on the group (a failure ends the
  /// comparison: later collectives would pair with the wrong ones).
  std::function<std::optional<std::vector<std::vector<int64_t>>>(
      int64_t seq, const std::vector<int64_t>& row, const std::vector<int64_t>& fields)>
      rows;
  /// Why the comparison stops (its machinery failed, or the ranks are not replicas). Default:
  /// a line on stderr.
  std::function<void(const std::string& why)> warn;
};

/// The comparison of one replica set across its members (Note [Replica comparison over c10d]):
/// per step event launch() all-reduces this rank's row; drain() reads the comparisons launched
/// before, waiting up to timeout_s for each (never longer: missing members are reported and the
/// set is not compared any more), judges them (judge_replica_payload) and, where something
/// differs, asks rows() which member holds which value before reporting. It stops after missing
/// members, misaligned sequences (out of step, skips that differ, different training forwards)
/// and ranks that are not replicas; after a failure of its own machinery when told (stop()).
/// The schedule depends only on the sequence of calls, never on timing, so every member issues the
/// same collectives in the same order. Exceptions from the steps propagate to the caller.
class ReplicaEngine {
 public:
  ReplicaEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, ReplicaSetSpec spec,
                ReplicaSteps steps);
  ~ReplicaEngine();
  ReplicaEngine(const ReplicaEngine&) = delete;
  ReplicaEngine& operator=(const ReplicaEngine&) = delete;

  /// Launches the comparison of one event: `facts` without its digest (the spec's); `first`: the
  /// weights before the first step (reported as such). Nothing once stopped.
  void launch(ReplicaRowFacts facts, bool first = false);
  /// Reads the comparisons in flight, oldest first, until `keep` are left (or it stops).
  void drain(size_t keep);
  /// Stops comparing, with a warning saying why.
  void give_up(const std::string& why);
  /// Stops comparing, silently (the caller reports why).
  void stop() { dead_ = true; }
  bool stopped() const { return dead_; }
  /// Comparisons launched so far.
  int64_t launched() const { return launched_; }
  const ReplicaSetSpec& spec() const { return spec_; }

 private:
  struct InFlight {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor payload;
    std::vector<int64_t> row;
    int64_t seq = 0;
    int64_t step = 0;
    int64_t opt = -1;
    bool first = false;
  };

  std::string wait(const c10::intrusive_ptr<c10d::Work>& work, int64_t seq, bool& timed_out);
  void missing(const InFlight& f, bool timed_out, const std::string& error);
  void judge(const InFlight& f);
  std::optional<std::vector<std::vector<int64_t>>> gather(int64_t seq,
                                                          const std::vector<int64_t>& row,
                                                          const std::vector<int64_t>& fields);
  ReplicaReport report_of(const InFlight& f, ReplicaReport::Moment m) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReplicaSetSpec spec_;
  ReplicaSteps steps_;
  std::chrono::duration<double> timeout_;
  int64_t launched_ = 0;
  std::deque<InFlight> in_flight_;
  // Collectives given up on, with their tensors: kept while they may run.
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, std::vector<at::Tensor>>> gone_;
  std::set<std::pair<std::string, std::string>> known_;  // (what, tensor) already reported
  bool dead_ = false;
};

}  // namespace trainsan
