# Install rules (TRAINSAN_INSTALL): the C++ API for LibTorch programs, consumed with
#
#   find_package(trainsan CONFIG REQUIRED)   # CMAKE_PREFIX_PATH: python -c "import trainsan;
#   trainsan_link(app)                       #   print(trainsan.cmake_prefix_path)"
#
# The library is the op library itself: libtrainsan_ops.so exports the whole public API
# (trainsan::Sanitizer, tensor_stats, Options, ...; nm -DC shows it), so the wheel ships one
# native library for Python and C++ alike. trainsan::trainsan is an imported target over it that
# carries the public headers, C++17 and torch (trainsanConfig.cmake finds Torch). In the build
# tree the same name is the static library (host/CMakeLists.txt).
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)
if(SKBUILD)
  # The wheel: all inside the package directory, site-packages/trainsan/, whose share/cmake is
  # trainsan.cmake_prefix_path (as torch.utils.cmake_prefix_path is torch's).
  set(TRAINSAN_INSTALL_LIBDIR trainsan)
  set(TRAINSAN_INSTALL_INCLUDEDIR trainsan/include)
  set(TRAINSAN_INSTALL_CMAKEDIR trainsan/share/cmake/trainsan)
  # Torch for the consumer: the torch wheel next to this package (site-packages/torch).
  set(TRAINSAN_CONFIG_TORCH_HINTS "\${PACKAGE_PREFIX_DIR}/torch/share/cmake/Torch")
else()
  set(TRAINSAN_INSTALL_LIBDIR ${CMAKE_INSTALL_LIBDIR})
  set(TRAINSAN_INSTALL_INCLUDEDIR ${CMAKE_INSTALL_INCLUDEDIR})
  set(TRAINSAN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/trainsan)
  # Torch for the consumer: the LibTorch this build used.
  set(TRAINSAN_CONFIG_TORCH_HINTS "${Torch_DIR}")
endif()

# What linking trainsan::trainsan brings (interface only: the op library's own build is unchanged).
set_target_properties(trainsan_ops PROPERTIES EXPORT_NAME trainsan)
target_include_directories(trainsan_ops INTERFACE
  "$<INSTALL_INTERFACE:${TRAINSAN_INSTALL_INCLUDEDIR}>")
target_compile_features(trainsan_ops INTERFACE cxx_std_17)
target_link_libraries(trainsan_ops INTERFACE torch)

install(TARGETS trainsan_ops EXPORT trainsanTargets
        LIBRARY DESTINATION ${TRAINSAN_INSTALL_LIBDIR})
install(DIRECTORY "${PROJECT_SOURCE_DIR}/host/include/trainsan"
        DESTINATION ${TRAINSAN_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h" PATTERN "*.def")
install(FILES "${PROJECT_BINARY_DIR}/generated/trainsan/version.h"
        DESTINATION ${TRAINSAN_INSTALL_INCLUDEDIR}/trainsan)

install(EXPORT trainsanTargets NAMESPACE trainsan:: DESTINATION ${TRAINSAN_INSTALL_CMAKEDIR})
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/trainsanConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/trainsanConfig.cmake"
  INSTALL_DESTINATION ${TRAINSAN_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/trainsanConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/trainsanConfig.cmake"
              "${PROJECT_BINARY_DIR}/trainsanConfigVersion.cmake"
              "${CMAKE_CURRENT_LIST_DIR}/TrainSanLink.cmake"
        DESTINATION ${TRAINSAN_INSTALL_CMAKEDIR})
