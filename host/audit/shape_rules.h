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

// The value rules of probs_as_logits (Note [Probabilities as logits] in audit/probs.cpp), on a
// summary of the loss input that the audit reduces on the input's device.

/// Where a class-index loss's input holds its classes: dim 1 of an [N, C, d...] input, dim 0 of a
/// [C] one; `rows` is the number of distributions (numel / C). Nothing for a 0-d input.
struct ClassLayout {
  int64_t dim = 0;
  int64_t classes = 0;
  int64_t rows = 0;
};
std::optional<ClassLayout> class_layout(const Shape& input);

/// A loss input as probs_as_logits reads it.
struct ProbSummary {
  int64_t numel = 0;
  double lo = 0.0;       ///< smallest element (NaN when some element is NaN)
  double hi = 0.0;       ///< largest element (NaN when some element is NaN)
  double max_dev = 0.0;  ///< class losses: the largest |sum over the class dim - 1| of a row
  int64_t zeros = 0;     ///< binary losses: elements exactly 0
};

/// A row of probabilities sums to 1 within this for an input of machine epsilon `eps` (2^-23
/// float32, 2^-10 float16, 2^-7 bfloat16): kRowSumTolerance, or 4 eps where that is larger.
constexpr double kRowSumTolerance = 1e-3;
double row_sum_tolerance(double eps);
/// The class-loss rule: a nonempty input of layout `l` (C >= 2) whose every element is finite and
/// in [0, 1] and whose every row sums to 1 within `tolerance`.
bool rows_are_probabilities(const ProbSummary& s, const ClassLayout& l, double tolerance);

/// The binary-loss rule on one call: at least kSigmoidMinElements elements, every one finite and in
/// [0, 1], the largest at least kSigmoidMinMax and at most a quarter of them exactly 0. The
/// finding needs kSigmoidSteps audited steps in a row where every call of the site is so.
constexpr int64_t kSigmoidMinElements = 64;
constexpr double kSigmoidMinMax = 0.1;
constexpr int kSigmoidSteps = 3;
bool looks_like_sigmoid(const ProbSummary& s);
/// What an autograd node named `node` (e.g. "SigmoidBackward0") says of the tensor it made: a
/// sigmoid's output (sigmoid, expit, hardsigmoid), the same values reshaped, selected or cast
/// (view, reshape, squeeze, unsqueeze, flatten, transpose, permute, expand, select, slice,
/// index, clone, a dtype cast: look at its input), or anything else.
enum class Producer { kSigmoid, kSameValues, kOther };
Producer producer_of(const std::string& node);

}  // namespace trainsan::host::audit
