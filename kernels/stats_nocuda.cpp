// Stand-ins for the CUDA entry points in a build without the CUDA toolkit.
#include "check.h"
#include "stats.h"

namespace trainsan::kernels {

void cuda_tensor_stats(const TensorDesc*, int64_t, const int64_t*, int64_t, StatsRecord*, int32_t*,
                       int64_t*, double*, bool, CUstream_st*) {
  TRAINSAN_CHECK(false,
                 "this TrainSan build has no CUDA support; rebuild with the CUDA toolkit "
                 "(TRAINSAN_WITH_CUDA=ON) to compute statistics of CUDA tensors");
}

void cuda_stop_if_nonfinite(const int64_t*, int64_t, int64_t, CUstream_st*) {
  TRAINSAN_CHECK(false,
                 "this TrainSan build has no CUDA support; device_stop needs CUDA tensors and a "
                 "build with the CUDA toolkit (TRAINSAN_WITH_CUDA=ON)");
}

bool cuda_compiled() { return false; }

}  // namespace trainsan::kernels
