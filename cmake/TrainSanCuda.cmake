# CUDA toolkit detection and architectures. The GPU is never probed (there may be none).
#
# TrainSan's kernels get their architectures as a target property (kernels/CMakeLists.txt), from
# TRAINSAN_CUDA_ARCHITECTURES: sm_80 and sm_90 SASS plus compute_90 PTX ("80-real;90") unless
# given. As the top-level project, -DCMAKE_CUDA_ARCHITECTURES=... sets it too. As a subproject
# the parent's CMAKE_CUDA_ARCHITECTURES is not used: a parent that found Torch first has it OFF
# (torch's CMake turns it off and adds -gencode flags of its own, which cmake/TrainSanTorch.cmake
# drops in TrainSan's directories).
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  set(TRAINSAN_NVCC_FOUND ON)
else()
  set(TRAINSAN_NVCC_FOUND OFF)
endif()
set(TRAINSAN_CUDA_ARCHITECTURES "" CACHE STRING
    "CUDA architectures of TrainSan's kernels (empty: 80-real;90, or CMAKE_CUDA_ARCHITECTURES when top level)")

macro(trainsan_enable_cuda)
  set(_trainsan_default_archs "80-real;90")
  if(PROJECT_IS_TOP_LEVEL AND NOT CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "${_trainsan_default_archs}" CACHE STRING "CUDA architectures" FORCE)
  endif()
  # Read before find_package(Torch), which sets CMAKE_CUDA_ARCHITECTURES to OFF.
  if(TRAINSAN_CUDA_ARCHITECTURES)
    set(TRAINSAN_KERNEL_ARCHS "${TRAINSAN_CUDA_ARCHITECTURES}")
  elseif(PROJECT_IS_TOP_LEVEL)
    set(TRAINSAN_KERNEL_ARCHS "${CMAKE_CUDA_ARCHITECTURES}")
  else()
    set(TRAINSAN_KERNEL_ARCHS "${_trainsan_default_archs}")
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
