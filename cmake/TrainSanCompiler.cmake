# Compiler launcher and warnings shared by every TrainSan target.
find_program(TRAINSAN_CCACHE ccache)
if(TRAINSAN_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${TRAINSAN_CCACHE}")
  set(CMAKE_CUDA_COMPILER_LAUNCHER "${TRAINSAN_CCACHE}")
endif()

# Warnings for TrainSan's own C++ sources (not applied to third-party code).
function(trainsan_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
endfunction()
