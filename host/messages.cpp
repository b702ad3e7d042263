#include "messages.h"

#include <iostream>
#include <sstream>

namespace trainsan::host {

std::string join_names(const std::vector<std::string>& names, size_t shown) {
  std::string out;
  for (size_t k = 0; k < names.size() && k < shown; ++k) out += (k ? ", " : "") + names[k];
  if (names.size() > shown) out += " and " + std::to_string(names.size() - shown) + " more";
  return out;
}

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(4);
  os << v;
  return os.str();
}

void print_finding(const Finding& f) {
  std::cerr << "[trainsan] " << f.severity << ": " << f.message << '\n';
}

}  // namespace trainsan::host
