# trainsan_version: an INTERFACE target whose include path holds the generated
# <trainsan/version.h> (TRAINSAN_VERSION "x.y.z" and its parts), from project(trainsan VERSION ...),
# the one place the version is written (pyproject.toml reads it with a regex, the Python package
# from the installed metadata). Included from the top-level CMakeLists.txt after project().
configure_file("${CMAKE_CURRENT_LIST_DIR}/version.h.in"
               "${PROJECT_BINARY_DIR}/generated/trainsan/version.h" @ONLY)
add_library(trainsan_version INTERFACE)
target_include_directories(trainsan_version INTERFACE "${PROJECT_BINARY_DIR}/generated")
