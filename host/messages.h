// The wording helpers of the findings' messages. Torch-free (part of trainsan_checks).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "trainsan/finding.h"

namespace trainsan::host {

/// Number formatting of the messages: 4 significant digits.
std::string fmt(double v);
/// "a, b, c, d and 3 more": the first `shown` names of a list, for the messages.
std::string join_names(const std::vector<std::string>& names, size_t shown = 4);
/// "[trainsan] <severity>: <message>" on stderr: the "warn" answer outside Python.
void print_finding(const Finding& f);

}  // namespace trainsan::host
