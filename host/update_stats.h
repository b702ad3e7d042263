// The step pass's update statistics (||dtheta||, max |dtheta|, the elements a step changed): the
// parameter snapshots or their samples and fingerprints (Note [Update statistics without a
// snapshot], update_stats.cpp), which steps get them (Note [Overhead budget], Note [Version
// trigger], overhead_budget.h), each parameter's norm before its step and latest measured
// statistics (Note [Every-step tier]), and update_outside_step's comparison against the
// snapshot. The step pass (sanitizer_pass.cpp) asks it what to read and hands it what it read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "feeds/feed.h"
#include "overhead_budget.h"
#include "readback.h"

namespace trainsan::host {

/// What a step's pass reads for its update statistics (UpdateStatistics::plan).
struct UpdatePlan {
  bool with_snapshot = false;  // the pass rewrites the snapshots (samples) of its parameters
  bool read_params = false;    // a step with update statistics, or the step before one
  bool report_update = false;  // update statistics against a fresh snapshot
};

class UpdateStatistics {
 public:
  UpdateStatistics(FeedContext& ctx, ReadbackQueue& readback);

  /// At attach: the snapshots, and the norms before the first step (the first update ratio's).
  void init();
  /// Note [Version trigger]: optimizer `opt`'s step begins (its parameters' versions).
  void record_versions(int64_t opt);
  /// A step's pass about to be launched (step: its optimizer's count; opt_key -1 in manual mode).
  UpdatePlan plan(int64_t step, int64_t opt, bool manual, bool lr_zero, bool partial);
  /// The snapshot parameter `i` is compared with in a pass that writes it (undefined: none yet,
  /// or the parameter was replaced: a new snapshot is started).
  at::Tensor snapshot_for(size_t i, const at::Tensor& prm);
  /// A landed pass: parameter `i`'s figures in its ParamView (pv.grad already set): `now`, its
  /// row of this pass (nullptr: not read, Note [Every-step tier]), and `update` from the row.
  void fill(ParamView& pv, size_t i, const TensorStats* now,
            const std::optional<UpdateStats>& update, bool with_snapshot);
  /// update_outside_step (opt-in): the parameters of optimizer `opt` (-1: all) changed since the
  /// snapshot of the previous step's end (Sanitizer::begin_step, step_begin, a watched forward).
  void check_outside_step(int64_t opt);

  OverheadBudget budget;  // Note [Overhead budget]: which steps get update statistics

 private:
  bool versions_unmoved(int64_t opt);
  void sampled_update(size_t i, const TensorStats& now, const std::optional<TensorStats>& grad,
                      std::optional<UpdateStats>& update);
  static constexpr int64_t kUnseenSparse = 8;

  FeedContext& ctx_;
  ReadbackQueue& readback_;
  // Per optimizer, the step whose pass last wrote the snapshots of its parameters (-1: attach).
  std::map<int64_t, int64_t> snapshot_step_;
  // Note [Version trigger]: per optimizer, its parameters' version counters at its step's begin
  // (-1: no gradient then), whether its previous step left one of them unmoved, and the step a
  // trigger made an update step.
  std::map<int64_t, std::vector<int64_t>> versions_at_begin_;
  std::map<int64_t, bool> unmoved_last_;
  std::map<int64_t, int64_t> forced_update_;
  // Previous parameter values (track_updates): each a full copy with exact_updates, else its
  // sample (Note [Update sample]); and the fingerprint of the parameter when its snapshot was
  // written (Note [Update statistics without a snapshot]; nullopt where not known).
  std::vector<at::Tensor> snapshots_;
  std::vector<std::optional<uint64_t>> snapshot_hash_;
  // ||theta|| of each parameter as of its previous pass (at attach before the first): the
  // denominator of the update ratio, which must be the norm *before* the step (NaN: unknown).
  std::vector<double> prev_param_l2_;
  // Each parameter's latest measured statistics (Note [Every-step tier]: steps without a
  // parameter pass show these, marked not measured).
  std::vector<TensorStats> param_stats_;
};

}  // namespace trainsan::host
