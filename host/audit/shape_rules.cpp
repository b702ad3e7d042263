// The shape rules of the op audits. Torch-free.
#include "audit/shape_rules.h"

#include <algorithm>
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

}  // namespace trainsan::host::audit
