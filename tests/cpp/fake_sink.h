// A FindingSink for the check unit tests: records what the checks report, with the real sink's
// enablement (kinds.def defaults, overridable) and de-duplication (same kind and tensor).
#pragma once

#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checks/check.h"

namespace trainsan::host::testing {

struct Recorded {
  Kind kind;
  std::string tensor;
  std::string message;
  std::optional<double> value;
  int64_t step;
  Severity severity;  ///< the kind's, or the override the check gave
};

class FakeSink : public FindingSink {
 public:
  const Finding* add(Kind kind, const std::string& tensor, const std::string& message,
                     std::optional<double> value, int64_t step,
                     std::optional<Severity> severity = std::nullopt) override {
    const auto on = enabled.find(kind);
    if (!(on == enabled.end() ? info(kind).default_on : on->second)) return nullptr;
    calls.push_back({kind, tensor, message, value, step, severity.value_or(info(kind).severity)});
    const auto key = std::make_pair(kind, tensor);
    if (const auto it = index_.find(key); it != index_.end()) {
      findings_[it->second].count += 1;
      return nullptr;
    }
    Finding f;
    f.kind = name_of(kind);
    f.step = step;
    f.tensor = tensor;
    f.message = message;
    f.value = value;
    f.severity = severity_name(severity.value_or(info(kind).severity));
    index_[key] = findings_.size();
    findings_.push_back(f);
    return &findings_.back();
  }
  /// The kinds of every enabled call, in order.
  std::vector<Kind> kinds() const {
    std::vector<Kind> out;
    for (const Recorded& r : calls) out.push_back(r.kind);
    return out;
  }
  int64_t count(Kind kind, const std::string& tensor = "") const {
    const auto it = index_.find({kind, tensor});
    return it == index_.end() ? 0 : findings_[it->second].count;
  }

  std::map<Kind, bool> enabled;  // overrides of the kinds.def defaults
  std::vector<Recorded> calls;   // every enabled call, repeats included

 private:
  std::map<std::pair<Kind, std::string>, size_t> index_;
  std::deque<Finding> findings_;  // stable addresses for the returned pointers
};

inline TensorStats stats(double l2, int64_t numel = 4) {
  TensorStats s;
  s.numel = numel;
  s.l2 = l2;
  return s;
}

/// A parameter in optimizer 0 whose hooks saw a gradient of norm `grad_l2`.
inline ParamView param(size_t index, const std::string& name, double grad_l2 = 1.0,
                       double param_l2 = 1.0) {
  ParamView p;
  p.index = index;
  p.name = name;
  p.opt = 0;
  p.observed.got_grad = true;
  p.grad = stats(grad_l2);
  p.param = stats(param_l2);
  return p;
}

inline const double kNaN = std::nan("");

}  // namespace trainsan::host::testing
