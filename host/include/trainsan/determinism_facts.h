// Facts of a re-run (nondeterminism): the caller re-ran a step's forward and backward on the same
// batch with the same RNG state and buffers (bindings/trainsan/determinism.py) and says where the
// bits first differed; host/checks/determinism.cpp words it. Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace trainsan {

struct RerunFacts {
  enum class Where : uint8_t {
    kForward = 0,       ///< two re-runs' forwards differ: first at module `tensor`'s output
    kBackward = 1,      ///< the forwards agree, two re-runs' gradients differ: first `tensor`
    kBetweenCalls = 2,  ///< the re-runs agree with each other, not with the step's own forward
  };
  Where where = Where::kForward;
  std::string tensor;    ///< a module (forward) or parameter (backward) name
  std::string type;      ///< the module's class, e.g. "Linear"
  int64_t position = 0;  ///< 1-based place in execution order
  int64_t checked = 0;   ///< how many were compared
};

}  // namespace trainsan
