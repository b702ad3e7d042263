# trainsan_checks: the torch-free check families (host/checks/, Note [Checks as units]) and the
# kind table, so the rules build and are unit-tested without LibTorch. Included from
# host/CMakeLists.txt; needs trainsan_warnings() (TrainSanCompiler.cmake).
add_library(trainsan_checks STATIC
  "${PROJECT_SOURCE_DIR}/host/kinds.cpp"
  "${PROJECT_SOURCE_DIR}/host/messages.cpp"
  "${PROJECT_SOURCE_DIR}/host/json.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/step_view.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/nonfinite.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/gradient_flow.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/magnitudes.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/step_integrity.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/mode.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/inputs.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/autograd.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/loss.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/replicas.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/precision.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/checkpoint.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/checkpoint_facts.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/resume.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/resume_data.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/resume_slots.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/determinism.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/accumulation.cpp"
  "${PROJECT_SOURCE_DIR}/host/checks/attribution.cpp"
  "${PROJECT_SOURCE_DIR}/host/audit/shape_rules.cpp"
  "${PROJECT_SOURCE_DIR}/host/overhead_budget.cpp")
target_include_directories(trainsan_checks PUBLIC
  "${PROJECT_SOURCE_DIR}/host" "${PROJECT_SOURCE_DIR}/host/include")
target_compile_features(trainsan_checks PUBLIC cxx_std_17)
set_target_properties(trainsan_checks PROPERTIES POSITION_INDEPENDENT_CODE ON)
trainsan_warnings(trainsan_checks)
# Linked into trainsan_host: its std::string interfaces must follow torch's C++ ABI.
if(TORCH_CXX_FLAGS)
  separate_arguments(_trainsan_torch_flags UNIX_COMMAND "${TORCH_CXX_FLAGS}")
  target_compile_options(trainsan_checks PUBLIC ${_trainsan_torch_flags})
endif()
