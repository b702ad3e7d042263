# LibTorch from the installed torch wheel: its share/cmake/Torch, found through
# torch.utils.cmake_prefix_path of the Python that will import trainsan. Where Torch_DIR is set
# already (a parent project that found Torch first, for TrainSan added with add_subdirectory or
# FetchContent; a reconfigure), that LibTorch is used and Python is not asked.
if(NOT Torch_DIR)
  find_package(Python3 REQUIRED COMPONENTS Interpreter)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c "import torch, sys; sys.stdout.write(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _torch_prefix
    RESULT_VARIABLE _torch_rc
    ERROR_VARIABLE _torch_err)
  if(NOT _torch_rc EQUAL 0)
    message(FATAL_ERROR
      "TrainSan needs the torch wheel in ${Python3_EXECUTABLE}: `import torch` failed:\n${_torch_err}\n"
      "Run scripts/install_deps.sh (pip install torch==2.11.0) or pass -DPython3_EXECUTABLE=...")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
endif()

# No GPU is probed at configure time: without an architecture list torch's CMake would try.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0+PTX")
endif()
find_package(Torch REQUIRED)

# Torch's CMake (Caffe2/public/cuda.cmake, run by the first find_package(Torch) of the build,
# possibly the parent's) appends -gencode flags for TORCH_CUDA_ARCH_LIST to CMAKE_CUDA_FLAGS: by
# default its "common" list, from compute_50, which nvcc 13 rejects. TrainSan's kernels take
# their architectures from their CUDA_ARCHITECTURES property (cmake/TrainSanCuda.cmake), so
# torch's flags are dropped; this sets the variable in TrainSan's directory scope, a parent
# project keeps its own.
string(REGEX REPLACE "(^| )-gencode[ =]arch=[^ ]+" "" CMAKE_CUDA_FLAGS "${CMAKE_CUDA_FLAGS}")

# The torch target adds the wheel's ABI flags (TORCH_CXX_FLAGS) to whatever links it.
get_filename_component(TRAINSAN_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
message(STATUS "TrainSan: torch ${Torch_VERSION} from ${Torch_DIR}, flags ${TORCH_CXX_FLAGS}")
