// The shape rules of the op audits (Note [Op audit] in audit/observer.cpp): pure functions on
// shapes given as std::vector<int64_t>. Torch-free, so that they are unit-tested without LibTorch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace trainsan::host::audit {

using Shape = std::vector<int64_t>;

/// One tensor argument of an op, as the rules see it.
struct Operand {
  std::string role;  ///< "input", "target", "operand 0", ... or "" (elementwise operands)
  Shape shape;
  bool grad = false;  ///< requires grad
};

int64_t numel_of(const Shape& s);
/// "[32, 1]"
std::string shape_str(const Shape& s);
/// The shape the operands broadcast into; empty when they do not broadcast (the op then fails on
/// its own).
std::optional<Shape> broadcast_shape(const std::vector<Operand>& ops);
/// Size of operand `o` along result axis `i` of a result of rank `rank` (right-aligned; 1 where
/// the operand has no such dim).
int64_t dim_at(const Operand& o, size_t i, size_t rank);
/// The elementwise rule of Note [Op audit]: the result `out` outgrows every operand through
/// implicit rank promotion, some operand requires grad, and the growth is the [N,1]-vs-[N]
/// signature (one operand expanded along an axis by a size s the other brings, and the other
/// along another axis by the same s).
bool implicit_cross_broadcast(const std::vector<Operand>& ops, const Shape& out);
/// "input [32, 1] and target [32]"
std::string operands_str(const std::vector<Operand>& ops);

}  // namespace trainsan::host::audit
