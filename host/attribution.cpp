// Re-run attribution (Options::rerun_on_error; Note [Re-run attribution] in
// host/checks/attribution.cpp): which new findings get a re-run of their step, and the answer put
// into the finding and the trace. The re-run itself is the caller's (bindings/trainsan/
// attribution.py) or, for a LibTorch loop with Setup::rerun_step, SanitizerImpl::rerun_for
// (rerun.cpp), run by report() before the policy acts.
#include <sstream>

#include "sanitizer_impl.h"

namespace trainsan {

namespace {

std::string key(const Finding& f) { return f.kind + '\x1f' + f.tensor; }

constexpr size_t kStepsKept = 4;  // re-run outcomes kept, by step (a lagged finding's included)

}  // namespace

Sanitizer::RerunNeed Sanitizer::rerun_needed(const Finding& f) const {
  const host::SanitizerImpl& im = *impl_;
  if (im.opts.rerun_on_error <= 0 || !rerun_attributable(f.kind) ||
      im.attribution_answered.count(key(f)) > 0) {
    return RerunNeed::kNone;
  }
  if (im.attributed.count(f.step) > 0 || im.attribution_reruns >= im.opts.rerun_on_error) {
    return RerunNeed::kKnown;
  }
  return RerunNeed::kRun;
}

Finding Sanitizer::attribute(const Finding& f, const std::optional<RerunOutcome>& outcome) {
  host::SanitizerImpl& im = *impl_;
  im.attribution_answered.insert(key(f));
  RerunVerdict v;
  std::string earlier;
  if (outcome) {
    im.attribution_reruns += 1;
    v = judge_rerun(f.kind, *outcome);
    im.attributed[f.step] = {f.kind, v};
    while (im.attributed.size() > kStepsKept) im.attributed.erase(im.attributed.begin());
  } else if (const auto it = im.attributed.find(f.step); it != im.attributed.end()) {
    v = it->second.second;
    earlier = " (the re-run of this step for its " + it->second.first + ")";
  } else {
    v.text = "not re-run: the " + std::to_string(im.opts.rerun_on_error) +
             " re-run(s) rerun_on_error allows went to earlier findings";
  }
  const std::string text = " — re-run: " + v.text + earlier;
  const Finding out = im.store.attribute(f, v.reproduces, text);
  std::ostringstream os;
  os << "{\"type\":\"rerun_attribution\",\"kind\":" << json_escape(f.kind) << ",\"step\":" << f.step
     << ",\"tensor\":" << (f.tensor.empty() ? "null" : json_escape(f.tensor))
     << ",\"reproduces\":" << (v.reproduces ? (*v.reproduces ? "true" : "false") : "null")
     << ",\"rerun\":" << (outcome ? "true" : "false") << ",\"message\":" << json_escape(v.text)
     << "}";
  if (!im.closed) im.trace.line(os.str());
  // The batch of a step that reproduces, once per step (its first finding's kind).
  if (outcome && v.reproduces.value_or(false) && !outcome->fingerprint.empty() && !im.closed) {
    std::ostringstream p;
    p << "{\"type\":\"poison_batch\",\"rank\":" << outcome->rank << ",\"step\":" << f.step
      << ",\"fingerprint\":" << json_escape(outcome->fingerprint) << ",\"tensors\":[";
    const char* sep = "";
    for (const std::string& t : outcome->tensors) {
      p << sep << json_escape(t);
      sep = ",";
    }
    p << "],\"kind\":" << json_escape(f.kind) << "}";
    im.trace.line(p.str());
  }
  return out;
}

void Sanitizer::set_rerun_step(std::function<RerunRecord()> step_fn) {
  impl_->rerun_step = std::move(step_fn);
}

}  // namespace trainsan
