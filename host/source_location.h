// Where in the user's Python code an op was called: the innermost Python frame that is not in a
// skipped file (TrainSan's own package, torch). Empty for C++ callers. Torch-free header.
#pragma once

#include <string>
#include <vector>

namespace trainsan::host {

struct Source {
  std::string where;  ///< "path/train.py:42 in loss_fn"
  std::string file;   ///< "train.py:42", for the finding's name
  std::string via;    ///< the torch function it went through, e.g. "torch.nn.functional.mse_loss"
};

/// The caller's frame, found among the Python frames of the calling thread (torch's
/// CapturedTraceback, installed by the torch Python module; none without it). A frame whose file
/// name contains one of `skip` (path substrings given by the bindings: the trainsan files that
/// call into ops, torch's package directory) is passed over; the first skipped frame in
/// torch/nn/functional.py names `via`. With `skip` empty, the innermost Python frame. Never throws:
/// a frame that cannot be symbolised gives an empty Source.
Source python_source(const std::vector<std::string>& skip);

/// "aten::mse_loss (train.py:42)": the finding's tensor name.
std::string finding_name(const std::string& op, const Source& src);
/// "aten::mse_loss (from torch.nn.functional.mse_loss)"
std::string op_desc(const std::string& op, const Source& src);
/// ", at path/train.py:42 in loss_fn", or nothing for a C++ caller.
std::string at_source(const Source& src);

}  // namespace trainsan::host
