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

// The value rules of target_leak (Note [Target leak] in audit/leaks.cpp), on host copies.

/// A class-index target [rows, len] against an integer sequence of the same shape the model
/// embedded, over the target's positions that are not ignore_index.
struct SequenceMatch {
  int64_t valid = 0;     ///< positions whose target is not ignore_index
  bool equal = false;    ///< seq == target at every valid position (valid > 0)
  bool shifted = false;  ///< seq[r, t + 1] == target[r, t] at every valid t < len - 1 (some)
  bool varies = false;   ///< the valid targets hold at least two values
};
SequenceMatch match_sequence(const int64_t* target, const int64_t* seq, int64_t rows, int64_t len,
                             std::optional<int64_t> ignore);
/// Per row, the last position whose target is not ignore_index (-1: none).
std::vector<int64_t> last_valid_positions(const int64_t* target, int64_t rows, int64_t len,
                                          std::optional<int64_t> ignore);
/// Rows a feature column must equal the target on before it counts as the target itself:
/// kLeakRowsInteger where every target value is an integer (class indices, counts: a strongly
/// predictive feature can agree with them by chance on a few rows), kLeakRowsReal otherwise.
constexpr int64_t kLeakRowsInteger = 32;
constexpr int64_t kLeakRowsReal = 8;
/// The column of a row-major [rows, cols] feature table (cols >= 2) that equals `target` on every
/// row, or nullopt: none, too few rows, a constant target, or the column is one of a 0/1 pair
/// whose other column is its complement (a one-hot code of a two-valued label, as conditioning).
std::optional<int64_t> leaked_column(const double* table, int64_t rows, int64_t cols,
                                     const double* target);

}  // namespace trainsan::host::audit
