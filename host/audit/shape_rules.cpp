// The shape rules of the op audits. Torch-free.
#include "audit/shape_rules.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace trainsan::host::audit {

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (const int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

std::optional<Shape> broadcast_shape(const std::vector<Operand>& ops) {
  size_t rank = 0;
  for (const auto& o : ops) rank = std::max(rank, o.shape.size());
  Shape out(rank, 1);
  for (const auto& o : ops) {
    const size_t lead = rank - o.shape.size();
    for (size_t k = 0; k < o.shape.size(); ++k) {
      const int64_t d = o.shape[k];
      int64_t& r = out[lead + k];
      if (d == 1) continue;
      if (r == 1) {
        r = d;
      } else if (r != d) {
        return std::nullopt;
      }
    }
  }
  return out;
}

int64_t dim_at(const Operand& o, size_t i, size_t rank) {
  const size_t lead = rank - o.shape.size();
  return i < lead ? 1 : o.shape[i - lead];
}

bool implicit_cross_broadcast(const std::vector<Operand>& ops, const Shape& out) {
  if (ops.size() < 2) return false;
  int64_t largest = 0;
  bool same_rank = true, grad = false;
  for (const auto& o : ops) {
    largest = std::max(largest, numel_of(o.shape));
    same_rank = same_rank && o.shape.size() == ops[0].shape.size();
    grad = grad || o.grad;
  }
  if (numel_of(out) <= largest || same_rank || !grad) return false;
  const size_t rank = out.size();
  for (const auto& a : ops) {
    for (const auto& b : ops) {
      if (&a == &b) continue;
      for (size_t i = 0; i < rank; ++i) {
        const int64_t s = dim_at(b, i, rank);
        if (dim_at(a, i, rank) != 1 || s <= 1) continue;  // b expands a along i by s
        for (size_t j = 0; j < rank; ++j) {
          if (j != i && dim_at(b, j, rank) == 1 && dim_at(a, j, rank) == s) return true;
        }
      }
    }
  }
  return false;
}

std::string operands_str(const std::vector<Operand>& ops) {
  std::string s;
  for (size_t k = 0; k < ops.size(); ++k) {
    if (k) s += k + 1 == ops.size() ? " and " : ", ";
    if (!ops[k].role.empty()) s += ops[k].role + " ";
    s += shape_str(ops[k].shape);
  }
  return s;
}

SequenceMatch match_sequence(const int64_t* target, const int64_t* seq, int64_t rows, int64_t len,
                             std::optional<int64_t> ignore) {
  SequenceMatch m;
  bool equal = true, shifted = true, any_shifted = false, have_first = false;
  int64_t first = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* t = target + r * len;
    const int64_t* s = seq + r * len;
    for (int64_t k = 0; k < len; ++k) {
      if (ignore && t[k] == *ignore) continue;
      m.valid += 1;
      if (!have_first) first = t[k];
      have_first = true;
      m.varies = m.varies || t[k] != first;
      equal = equal && s[k] == t[k];
      if (k + 1 < len) {
        any_shifted = true;
        shifted = shifted && s[k + 1] == t[k];
      }
    }
  }
  m.equal = m.valid > 0 && equal;
  m.shifted = any_shifted && shifted;
  return m;
}

std::vector<int64_t> last_valid_positions(const int64_t* target, int64_t rows, int64_t len,
                                          std::optional<int64_t> ignore) {
  std::vector<int64_t> last(static_cast<size_t>(rows), -1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = len - 1; k >= 0; --k) {
      if (!ignore || target[r * len + k] != *ignore) {
        last[static_cast<size_t>(r)] = k;
        break;
      }
    }
  }
  return last;
}

std::optional<int64_t> leaked_column(const double* table, int64_t rows, int64_t cols,
                                     const double* target) {
  if (rows <= 0 || cols < 2) return std::nullopt;
  bool varies = false, integral = true;
  for (int64_t r = 0; r < rows; ++r) {
    varies = varies || target[r] != target[0];
    integral = integral && std::isfinite(target[r]) && target[r] == std::floor(target[r]);
  }
  if (!varies || rows < (integral ? kLeakRowsInteger : kLeakRowsReal)) return std::nullopt;
  const auto at = [&](int64_t r, int64_t c) { return table[r * cols + c]; };
  for (int64_t c = 0; c < cols; ++c) {
    bool equal = true;
    for (int64_t r = 0; r < rows && equal; ++r) equal = at(r, c) == target[r];
    if (!equal) continue;
    bool binary = true;
    for (int64_t r = 0; r < rows && binary; ++r) binary = at(r, c) == 0.0 || at(r, c) == 1.0;
    bool paired = false;
    for (int64_t o = 0; binary && o < cols && !paired; ++o) {
      if (o == c) continue;
      bool complement = true;
      for (int64_t r = 0; r < rows && complement; ++r) complement = at(r, o) == 1.0 - at(r, c);
      paired = complement;
    }
    if (!paired) return c;
  }
  return std::nullopt;
}

std::optional<ClassLayout> class_layout(const Shape& input) {
  if (input.empty()) return std::nullopt;
  ClassLayout l;
  l.dim = input.size() >= 2 ? 1 : 0;
  l.classes = input[static_cast<size_t>(l.dim)];
  l.rows = l.classes > 0 ? numel_of(input) / l.classes : 0;
  return l;
}

double row_sum_tolerance(double eps) { return std::max(kRowSumTolerance, 4.0 * eps); }

namespace {
bool within_unit_interval(const ProbSummary& s) {
  return s.numel > 0 && std::isfinite(s.lo) && std::isfinite(s.hi) && s.lo >= 0.0 && s.hi <= 1.0;
}
}  // namespace

bool rows_are_probabilities(const ProbSummary& s, const ClassLayout& l, double tolerance) {
  return l.classes >= 2 && l.rows >= 1 && within_unit_interval(s) && std::isfinite(s.max_dev) &&
         s.max_dev <= tolerance;
}

Producer producer_of(const std::string& node) {
  static const char* const kSuffix = "Backward";
  const size_t at = node.rfind(kSuffix);
  if (at == std::string::npos || at == 0) return Producer::kOther;
  for (size_t k = at + std::string(kSuffix).size(); k < node.size(); ++k) {
    if (node[k] < '0' || node[k] > '9') return Producer::kOther;
  }
  const std::string op = node.substr(0, at);
  if (op == "Sigmoid" || op == "Hardsigmoid") return Producer::kSigmoid;
  static const char* const kSame[] = {
      "View",  "UnsafeView", "Reshape", "ReshapeAlias", "Squeeze", "Unsqueeze",
      "T",     "Transpose",  "Permute", "Expand",       "Select",  "Slice",
      "Index", "Clone",      "ToCopy",  "AsStrided",    "Alias"};
  for (const char* same : kSame) {
    if (op == same) return Producer::kSameValues;
  }
  return Producer::kOther;
}

bool looks_like_sigmoid(const ProbSummary& s) {
  return s.numel >= kSigmoidMinElements && within_unit_interval(s) && s.hi >= kSigmoidMinMax &&
         4 * s.zeros <= s.numel;
}

}  // namespace trainsan::host::audit
