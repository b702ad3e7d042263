// Error checks for the torch-free kernel layer. Every failure throws std::runtime_error with the
// file and line, so the host layer can turn it into a clear Python/C++ exception.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace trainsan::kernels::detail {

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  std::ostringstream os;
  os << "trainsan: " << what << " (" << file << ":" << line << ")";
  throw std::runtime_error(os.str());
}

}  // namespace trainsan::kernels::detail

#define TRAINSAN_CHECK(cond, msg)                                                      \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::ostringstream trainsan_check_os_;                                           \
      trainsan_check_os_ << msg;                                                       \
      ::trainsan::kernels::detail::fail(__FILE__, __LINE__, trainsan_check_os_.str()); \
    }                                                                                  \
  } while (0)

#ifdef __CUDACC__
#define TRAINSAN_CHECK_CUDA(expr)                                                          \
  do {                                                                                     \
    cudaError_t trainsan_err_ = (expr);                                                    \
    if (trainsan_err_ != cudaSuccess) {                                                    \
      ::trainsan::kernels::detail::fail(                                                   \
          __FILE__, __LINE__,                                                              \
          std::string("CUDA error: ") + cudaGetErrorString(trainsan_err_) + " in " #expr); \
    }                                                                                      \
  } while (0)

// After every <<<>>> launch: catches bad configurations at the launch site.
#define TRAINSAN_CHECK_LAUNCH() TRAINSAN_CHECK_CUDA(cudaGetLastError())
#endif
