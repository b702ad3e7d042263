# Builds and runs tests/consumer, a LibTorch program that uses TrainSan through
# find_package(trainsan CONFIG): the installed CMake package works for a C++ user.
#   SOURCE_DIR, BINARY_DIR  the consumer project and its build directory
#   PREFIX                  where TrainSan is installed; empty: the installed Python package,
#                           whose trainsan.cmake_prefix_path (and torch's) PYTHON prints
#   GENERATOR, MAKE_PROGRAM the generator of the parent build; CCACHE, a compiler launcher
if(PREFIX)
  set(prefix_path "${PREFIX}")
else()
  # Run in the test's build directory: `import trainsan` finds the installed package, not bindings/.
  execute_process(
    COMMAND "${PYTHON}" -c "import sys, trainsan; sys.stdout.write(trainsan.cmake_prefix_path)"
    OUTPUT_VARIABLE prefix_path
    ERROR_VARIABLE err
    RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "trainsan.cmake_prefix_path: ${PYTHON} failed (${rc}):\n${err}\n"
                        "Is the package installed (pip install --no-build-isolation .)?")
  endif()
endif()
message(STATUS "CMAKE_PREFIX_PATH=${prefix_path}")

set(args -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -G "${GENERATOR}" -DCMAKE_BUILD_TYPE=Release
         "-DCMAKE_PREFIX_PATH=${prefix_path}")
if(MAKE_PROGRAM)
  list(APPEND args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CCACHE)
  list(APPEND args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE}")
endif()
function(run step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer: ${step} failed (${rc}): ${ARGN}")
  endif()
endfunction()
# --fresh: the package may have moved since the last run (trainsan_DIR would be cached).
run(configure "${CMAKE_COMMAND}" --fresh ${args})
run(build "${CMAKE_COMMAND}" --build "${BINARY_DIR}")
run(run "${BINARY_DIR}/trainsan_consumer")
