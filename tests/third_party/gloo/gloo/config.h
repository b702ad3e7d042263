// Hand-written for TrainSan's tests (gloo's CMake generates it from config.h.in): the options of
// a CPU-only, TCP-only build. Only the declarations ProcessGroupGloo.hpp needs are used; the gloo
// code itself is the one compiled into libtorch_cpu.so.
#pragma once

#define GLOO_VERSION_MAJOR 0
#define GLOO_VERSION_MINOR 5
#define GLOO_VERSION_PATCH 0

static_assert(GLOO_VERSION_MINOR < 100, "Programming error: you set a minor version that is too big.");
static_assert(GLOO_VERSION_PATCH < 100, "Programming error: you set a patch version that is too big.");

#define GLOO_VERSION (GLOO_VERSION_MAJOR * 10000 + GLOO_VERSION_MINOR * 100 + GLOO_VERSION_PATCH)

#define GLOO_USE_CUDA 0
#define GLOO_USE_NCCL 0
#define GLOO_USE_ROCM 0
#define GLOO_USE_RCCL 0
#define GLOO_USE_REDIS 0
#define GLOO_USE_IBVERBS 0
#define GLOO_USE_MPI 0
#define GLOO_USE_AVX 0
#define GLOO_USE_LIBUV 0

#define GLOO_HAVE_TRANSPORT_TCP 1
#define GLOO_HAVE_TRANSPORT_TCP_TLS 0
#define GLOO_HAVE_TRANSPORT_IBVERBS 0
#define GLOO_HAVE_TRANSPORT_UV 0

#define GLOO_USE_TORCH_DTYPES 0
