// Re-run attribution (attribution_feed.h; Note [Re-run attribution] in
// host/checks/attribution.cpp): the bookkeeping of which findings were answered, and the answer
// put into the finding and the trace (rerun_attribution and poison_batch records).
#include "feeds/attribution_feed.h"

#include <sstream>

namespace trainsan::host {

namespace {

std::string key(const Finding& f) { return f.kind + '\x1f' + f.tensor; }

constexpr size_t kStepsKept = 4;  // re-run outcomes kept, by step (a lagged finding's included)

}  // namespace

Sanitizer::RerunNeed AttributionFeed::need(const Finding& f) const {
  using RerunNeed = Sanitizer::RerunNeed;
  if (ctx_.opts.rerun_on_error <= 0 || !rerun_attributable(f.kind) || answered_.count(key(f)) > 0) {
    return RerunNeed::kNone;
  }
  if (attributed_.count(f.step) > 0 || reruns_ >= ctx_.opts.rerun_on_error) {
    return RerunNeed::kKnown;
  }
  return RerunNeed::kRun;
}

Finding AttributionFeed::attribute(const Finding& f, const std::optional<RerunOutcome>& outcome) {
  answered_.insert(key(f));
  RerunVerdict v;
  std::string earlier;
  if (outcome) {
    reruns_ += 1;
    v = judge_rerun(f.kind, *outcome);
    attributed_[f.step] = {f.kind, v};
    while (attributed_.size() > kStepsKept) attributed_.erase(attributed_.begin());
  } else if (const auto it = attributed_.find(f.step); it != attributed_.end()) {
    v = it->second.second;
    earlier = " (the re-run of this step for its " + it->second.first + ")";
  } else {
    v.text = "not re-run: the " + std::to_string(ctx_.opts.rerun_on_error) +
             " re-run(s) rerun_on_error allows went to earlier findings";
  }
  const std::string text = " — re-run: " + v.text + earlier;
  const Finding out = ctx_.store.attribute(f, v.reproduces, text);
  std::ostringstream os;
  os << "{\"type\":\"rerun_attribution\",\"kind\":" << json_escape(f.kind) << ",\"step\":" << f.step
     << ",\"tensor\":" << (f.tensor.empty() ? "null" : json_escape(f.tensor))
     << ",\"reproduces\":" << (v.reproduces ? (*v.reproduces ? "true" : "false") : "null")
     << ",\"rerun\":" << (outcome ? "true" : "false") << ",\"message\":" << json_escape(v.text)
     << "}";
  if (!ctx_.closed) ctx_.trace.line(os.str());
  // The batch of a step that reproduces, once per step (its first finding's kind).
  if (outcome && v.reproduces.value_or(false) && !outcome->fingerprint.empty() && !ctx_.closed) {
    std::ostringstream p;
    p << "{\"type\":\"poison_batch\",\"rank\":" << outcome->rank << ",\"step\":" << f.step
      << ",\"fingerprint\":" << json_escape(outcome->fingerprint) << ",\"tensors\":[";
    const char* sep = "";
    for (const std::string& t : outcome->tensors) {
      p << sep << json_escape(t);
      sep = ",";
    }
    p << "],\"kind\":" << json_escape(f.kind) << "}";
    ctx_.trace.line(p.str());
  }
  return out;
}

}  // namespace trainsan::host
