# LibTorch from the installed torch wheel: its share/cmake/Torch, found through
# torch.utils.cmake_prefix_path of the Python that will import trainsan.
find_package(Python3 REQUIRED COMPONENTS Interpreter)
execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c "import torch, sys; sys.stdout.write(torch.utils.cmake_prefix_path)"
  OUTPUT_VARIABLE TRAINSAN_TORCH_PREFIX
  RESULT_VARIABLE _torch_rc
  ERROR_VARIABLE _torch_err)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR
    "TrainSan needs the torch wheel in ${Python3_EXECUTABLE}: `import torch` failed:\n${_torch_err}\n"
    "Run scripts/install_deps.sh (pip install torch==2.11.0) or pass -DPython3_EXECUTABLE=...")
endif()
list(APPEND CMAKE_PREFIX_PATH "${TRAINSAN_TORCH_PREFIX}")

# No GPU is probed at configure time: torch's CMake needs the architectures spelled out.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0+PTX")
endif()
# Silence torch's CMake when the toolkit is absent and we build CPU-only.
find_package(Torch REQUIRED)

# The torch target adds the wheel's ABI flags (TORCH_CXX_FLAGS) to whatever links it.
get_filename_component(TRAINSAN_TORCH_LIB_DIR "${TORCH_LIBRARY}" DIRECTORY)
message(STATUS "TrainSan: torch from ${TRAINSAN_TORCH_PREFIX}, flags ${TORCH_CXX_FLAGS}")
