// Re-run attribution (Options::rerun_on_error; Note [Re-run attribution] in
// host/checks/attribution.cpp): which new findings get a re-run of their step, and the answer put
// into the finding and the trace. The re-run itself is the caller's (bindings/trainsan/
// attribution.py) or, for a LibTorch loop with Setup::rerun_step, RerunFeed::rerun_for
// (rerun_feed.h), run by report() before the policy acts.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "feeds/feed.h"

namespace trainsan::host {

class AttributionFeed final : public Feed {
 public:
  using Feed::Feed;

  /// Sanitizer::rerun_needed.
  Sanitizer::RerunNeed need(const Finding& f) const;
  /// Sanitizer::attribute.
  Finding attribute(const Finding& f, const std::optional<RerunOutcome>& outcome);

 private:
  int64_t reruns_ = 0;  // re-runs made (at most opts.rerun_on_error)
  // step -> the kind whose re-run it had and the verdict (the last few steps)
  std::map<int64_t, std::pair<std::string, RerunVerdict>> attributed_;
  std::set<std::string> answered_;  // kind + "\x1f" + tensor
};

}  // namespace trainsan::host
