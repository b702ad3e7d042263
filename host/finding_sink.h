// Where checks and audits write findings (torch-free). The sanitizer's implementation
// (findings.h) enables, de-duplicates, counts, traces and queues each one for the policy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "messages.h"
#include "trainsan/finding.h"
#include "trainsan/kinds.h"

namespace trainsan::host {

class FindingSink {
 public:
  virtual ~FindingSink() = default;
  /// Records a finding of `kind` about `tensor` (a parameter or module name, or "") seen at
  /// `step`. `message` is the text after the "<kind> at step <step>: " prefix the sink adds.
  /// Returns the finding when it is new; nullptr when its kind is switched off or it repeats an
  /// earlier one (same kind and tensor), which is then counted. `severity` overrides the kind's
  /// (kinds.def) for this finding: a rule whose milder case is a warning (no_grad_leak: a no_grad
  /// forward in train mode that costs no gradient but runs dropout/BatchNorm as in training).
  virtual const Finding* add(Kind kind, const std::string& tensor, const std::string& message,
                             std::optional<double> value, int64_t step,
                             std::optional<Severity> severity = std::nullopt) = 0;
  /// The finding of `kind` about `tensor` has been printed already (an op about to fail on it):
  /// close() does not report it again.
  virtual void said(Kind /*kind*/, const std::string& /*tensor*/) {}
};

/// A sink that keeps every finding it is given, outside a sanitizer (no enablement, no
/// de-duplication): the judgements of one checkpoint or one custom Function on their own, with
/// the "<kind>: " prefix on each message.
class CollectingSink : public FindingSink {
 public:
  const Finding* add(Kind kind, const std::string& tensor, const std::string& message,
                     std::optional<double> value, int64_t step,
                     std::optional<Severity> severity) override;
  std::vector<Finding> out;
};

}  // namespace trainsan::host
