// Dtype dispatch: one switch from the runtime DType to a C++ element type, written once.
//
//   TRAINSAN_DISPATCH_DTYPE(t.dtype, T, chunk_stats<T>(t, start, count, r));
//
// runs the statements after T with T bound to the element type (uint8_t for both kUInt8 and kBool:
// a bool is one byte holding 0 or 1). An unknown code throws, naming the supported dtypes
// (TRAINSAN_SUPPORTED_DTYPES, the list the host layer quotes to users). Device code cannot throw:
// TRAINSAN_DISPATCH_DTYPE_DEVICE does nothing for an unknown code, which the host layer has
// already rejected before any launch.
#pragma once

#include <cstdint>

#include "check.h"
#include "stats.cuh"

// The dtypes every backend handles, in DType order.
#define TRAINSAN_SUPPORTED_DTYPES \
  "float32, float16, bfloat16, float64, int8, int16, int32, int64, uint8, bool"

// Internal: the switch, with `fallback` as the default case (it may name trainsan_dtype_, the code
// switched on; `dtype` is evaluated once). The cases are spelled out because a macro cannot hand T
// and the body on to a per-dtype X-macro.
#define TRAINSAN_DISPATCH_DTYPE_IMPL_(dtype, T, fallback, ...)                           \
  switch (const ::trainsan::kernels::DType trainsan_dtype_ = (dtype); trainsan_dtype_) { \
    case ::trainsan::kernels::DType::kFloat32: {                                         \
      using T = float;                                                                   \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kFloat16: {                                         \
      using T = ::trainsan::kernels::Half;                                               \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kBFloat16: {                                        \
      using T = ::trainsan::kernels::BFloat16;                                           \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kFloat64: {                                         \
      using T = double;                                                                  \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kInt8: {                                            \
      using T = int8_t;                                                                  \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kInt16: {                                           \
      using T = int16_t;                                                                 \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kInt32: {                                           \
      using T = int32_t;                                                                 \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kInt64: {                                           \
      using T = int64_t;                                                                 \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    case ::trainsan::kernels::DType::kUInt8:                                             \
    case ::trainsan::kernels::DType::kBool: {                                            \
      using T = uint8_t;                                                                 \
      __VA_ARGS__;                                                                       \
    } break;                                                                             \
    default:                                                                             \
      fallback;                                                                          \
  }

#define TRAINSAN_DISPATCH_DTYPE(dtype, T, ...)                                     \
  TRAINSAN_DISPATCH_DTYPE_IMPL_(                                                   \
      dtype, T,                                                                    \
      TRAINSAN_CHECK(false, "unsupported dtype code "                              \
                                << static_cast<int>(trainsan_dtype_)               \
                                << " (supported: " TRAINSAN_SUPPORTED_DTYPES ")"), \
      __VA_ARGS__)

#define TRAINSAN_DISPATCH_DTYPE_DEVICE(dtype, T, ...) \
  TRAINSAN_DISPATCH_DTYPE_IMPL_(dtype, T, break, __VA_ARGS__)
