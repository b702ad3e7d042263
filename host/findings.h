// The sanitizer's findings: the FindingSink every check and audit writes to. It enables (Options),
// prefixes, de-duplicates and counts, traces each new finding, and keeps the new ones for the
// policy until the event that reports them (take_fresh).
#pragma once

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "finding_sink.h"
#include "trace.h"
#include "trainsan/options.h"

namespace trainsan::host {

class FindingStore final : public FindingSink {
 public:
  FindingStore(const Options& opts, TraceWriter& trace) : opts_(opts), trace_(trace) {}
  const Finding* add(Kind kind, const std::string& tensor, const std::string& message,
                     std::optional<double> value, int64_t step,
                     std::optional<Severity> severity = std::nullopt) override;
  /// Every distinct finding so far, with counts (a copy: callbacks may add concurrently).
  std::vector<Finding> all() const;
  /// The findings that are new since the last call, for the policy.
  std::vector<Finding> take_fresh();
  /// Re-run attribution (Note [Re-run attribution]): the stored finding of `kind` and `tensor`
  /// gets `reproduces` and `text` appended to its message; a copy of it (`fallback`, so
  /// changed, where none is stored).
  Finding attribute(const Finding& fallback, std::optional<bool> reproduces,
                    const std::string& text);
  void said(Kind kind, const std::string& tensor) override;
  /// Prints the fresh findings the policy answers (warn, raise) now, and marks them said; they
  /// stay fresh for the policy at the next event (Note [C++ attach]: a loss seen at its backward).
  void say_fresh(const std::string& policy);
  /// Whether `f` was printed when it was found (said): close() does not report it again.
  bool was_said(const Finding& f) const;

 private:
  const Options& opts_;
  TraceWriter& trace_;
  mutable std::mutex mu_;
  std::vector<bool> enabled_;  // per Kind, resolved once
  std::vector<Finding> findings_;
  std::map<std::string, size_t> index_;  // kind + "\x1f" + tensor -> position in findings_
  std::vector<Finding> fresh_;
  std::set<std::string> said_;  // keys (as index_) of the findings printed when found
};

}  // namespace trainsan::host
