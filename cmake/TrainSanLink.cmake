# trainsan_link(<target>): links trainsan::trainsan (privately) into a program, whichever
# target_link_libraries signature the project uses for that target: CMake refuses to mix the plain
# form (target_link_libraries(app lib)) and the keyword form (target_link_libraries(app PRIVATE
# lib)) on one target, and public examples use both. It appends to LINK_LIBRARIES, as a PRIVATE
# target_link_libraries does. Shipped with the CMake package and defined in a parent project that
# adds TrainSan with add_subdirectory.
if(NOT COMMAND trainsan_link)
  function(trainsan_link target)
    if(NOT TARGET ${target})
      message(FATAL_ERROR "trainsan_link: '${target}' is not a target; call it after "
                          "add_executable(${target} ...) or add_library(${target} ...)")
    endif()
    set_property(TARGET ${target} APPEND PROPERTY LINK_LIBRARIES trainsan::trainsan)
  endfunction()
endif()
