# CUDA toolkit detection and architectures. The GPU is never probed (there may be none): the
# architectures default to sm_80 and sm_90 SASS plus compute_90 PTX, and can be overridden with
# -DCMAKE_CUDA_ARCHITECTURES=...
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  set(TRAINSAN_NVCC_FOUND ON)
else()
  set(TRAINSAN_NVCC_FOUND OFF)
endif()

macro(trainsan_enable_cuda)
  if(NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "80-real;90" CACHE STRING "CUDA architectures" FORCE)
  endif()
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  # CUDA 13 keeps CUB/Thrust/libcu++ under include/cccl.
  set(TRAINSAN_CCCL_INCLUDE "")
  foreach(dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
    if(EXISTS "${dir}/cccl/cub/cub.cuh")
      set(TRAINSAN_CCCL_INCLUDE "${dir}/cccl")
    endif()
  endforeach()
endmacro()
