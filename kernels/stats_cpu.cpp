// CPU backend, torch-free inner part: the statistics of one chunk. The parallel driver over chunks
// (at::parallel_for) is host/stats.cpp. The inner loop runs the element maths of
// kernels/stats.cuh in kLanes independent lanes so that the compiler vectorises it; on x86-64
// with GCC it is compiled for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline, and the loader
// picks the best one the CPU supports (target_clones).
#include <algorithm>
#include <cstring>

#include "check.h"
#include "stats.cuh"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TRAINSAN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TRAINSAN_CLONES
#endif

namespace trainsan::kernels {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64: return 8;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16: return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool: return 1;
  }
  TRAINSAN_CHECK(false, "unknown dtype code " << static_cast<int>(dtype));
}

bool dtype_is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat64;
}

namespace {

constexpr int kLanes = 16;

// Lane-parallel form of accumulate<T>() over a contiguous run; same maths, same result per lane
// as calling accumulate() element by element, merged in a fixed lane order.
template <typename T>
inline __attribute__((always_inline)) void chunk_body(const T* p, int64_t base, int64_t n,
                                                      StatsRecord* out) {
  using Tr = ElemTraits<T>;
  using Acc = typename Tr::Acc;
  uint32_t c_nan[kLanes] = {}, c_pinf[kLanes] = {}, c_ninf[kLanes] = {}, c_zero[kLanes] = {},
           c_sub[kLanes] = {}, c_ovf[kLanes] = {};
  Acc mn[kLanes], mx[kLanes], amx[kLanes];
  double s[kLanes] = {}, ss[kLanes] = {};
  uint64_t h[kLanes] = {};
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = std::numeric_limits<Acc>::infinity();
    mx[l] = -std::numeric_limits<Acc>::infinity();
    amx[l] = 0;
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const uint64_t idx0 = static_cast<uint64_t>(base + i);
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const T v = p[i + l];
      const Acc x = Tr::value(v);
      const ElemClass c = classify<T>(v, x);
      c_nan[l] += c.nan;
      c_pinf[l] += c.posinf;
      c_ninf[l] += c.neginf;
      c_zero[l] += c.zero;
      c_sub[l] += c.subnormal;
      c_ovf[l] += c.overflow;
      const Acc xf = c.finite ? x : Acc(0);
      const Acc xlo = c.finite ? x : std::numeric_limits<Acc>::infinity();
      const Acc xhi = c.finite ? x : -std::numeric_limits<Acc>::infinity();
      mn[l] = xlo < mn[l] ? xlo : mn[l];
      mx[l] = xhi > mx[l] ? xhi : mx[l];
      const Acc ax = xf < 0 ? -xf : xf;
      amx[l] = ax > amx[l] ? ax : amx[l];
      const double d = static_cast<double>(xf);
      s[l] += d;
      ss[l] += d * d;
      h[l] += mix64(static_cast<uint64_t>(Tr::bits(v)) + (idx0 + l) * kHashIndexMul);
    }
  }
  StatsRecord r;
  init_record(r);
  for (int l = 0; l < kLanes; ++l) {
    r.nan += c_nan[l];
    r.posinf += c_pinf[l];
    r.neginf += c_ninf[l];
    r.zero += c_zero[l];
    r.subnormal += c_sub[l];
    r.fp16_overflow += c_ovf[l];
    r.min = min_(r.min, static_cast<double>(mn[l]));
    r.max = max_(r.max, static_cast<double>(mx[l]));
    r.absmax = max_(r.absmax, static_cast<double>(amx[l]));
    r.sum += s[l];
    r.sumsq += ss[l];
    r.hash += h[l];
  }
  r.numel = i;
  for (; i < n; ++i) accumulate<T>(r, p[i], base + i);
  *out = r;
}

TRAINSAN_CLONES void chunk_f32(const float* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<float>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_f64(const double* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<double>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_f16(const Half* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<Half>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_bf16(const BFloat16* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<BFloat16>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_i8(const int8_t* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<int8_t>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_i16(const int16_t* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<int16_t>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_i32(const int32_t* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<int32_t>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_i64(const int64_t* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<int64_t>(p, b, n, o);
}
TRAINSAN_CLONES void chunk_u8(const uint8_t* p, int64_t b, int64_t n, StatsRecord* o) {
  chunk_body<uint8_t>(p, b, n, o);
}

// Copy logical elements [start, start + count) of a strided tensor into `dst`, row-major.
template <int kSize>
void gather_strided(const TensorDesc& t, int64_t start, int64_t count, char* dst) {
  const char* base = static_cast<const char*>(t.data);
  const int nd = t.ndim;
  int64_t idx[kMaxDims];
  int64_t rem = start;
  for (int d = nd - 1; d >= 0; --d) {
    idx[d] = rem % t.sizes[d];
    rem /= t.sizes[d];
  }
  int64_t offset = 0;
  for (int d = 0; d < nd; ++d) offset += idx[d] * t.strides[d];
  const int64_t inner = t.sizes[nd - 1];
  const int64_t inner_stride = t.strides[nd - 1];
  int64_t done = 0;
  while (done < count) {
    const int64_t run = std::min(inner - idx[nd - 1], count - done);
    const char* src = base + offset * kSize;
    if (inner_stride == 1) {
      std::memcpy(dst + done * kSize, src, static_cast<size_t>(run * kSize));
    } else {
      for (int64_t k = 0; k < run; ++k) {
        std::memcpy(dst + (done + k) * kSize, src + k * inner_stride * kSize, kSize);
      }
    }
    done += run;
    offset += run * inner_stride;
    idx[nd - 1] += run;
    // Carry into the outer dimensions.
    for (int d = nd - 1; d > 0 && idx[d] == t.sizes[d]; --d) {
      offset -= idx[d] * t.strides[d];
      idx[d] = 0;
      idx[d - 1] += 1;
      offset += t.strides[d - 1];
    }
  }
}

}  // namespace

void cpu_chunk_stats(const TensorDesc& t, int64_t start, int64_t count, void* scratch,
                     StatsRecord* out) {
  const int64_t es = dtype_size(t.dtype);
  const char* p;
  if (t.contiguous) {
    p = static_cast<const char*>(t.data) + start * es;
  } else {
    char* dst = static_cast<char*>(scratch);
    switch (es) {
      case 1: gather_strided<1>(t, start, count, dst); break;
      case 2: gather_strided<2>(t, start, count, dst); break;
      case 4: gather_strided<4>(t, start, count, dst); break;
      default: gather_strided<8>(t, start, count, dst); break;
    }
    p = dst;
  }
  switch (t.dtype) {
    case DType::kFloat32: chunk_f32(reinterpret_cast<const float*>(p), start, count, out); break;
    case DType::kFloat64: chunk_f64(reinterpret_cast<const double*>(p), start, count, out); break;
    case DType::kFloat16: chunk_f16(reinterpret_cast<const Half*>(p), start, count, out); break;
    case DType::kBFloat16:
      chunk_bf16(reinterpret_cast<const BFloat16*>(p), start, count, out);
      break;
    case DType::kInt8: chunk_i8(reinterpret_cast<const int8_t*>(p), start, count, out); break;
    case DType::kInt16: chunk_i16(reinterpret_cast<const int16_t*>(p), start, count, out); break;
    case DType::kInt32: chunk_i32(reinterpret_cast<const int32_t*>(p), start, count, out); break;
    case DType::kInt64: chunk_i64(reinterpret_cast<const int64_t*>(p), start, count, out); break;
    case DType::kUInt8:
    case DType::kBool: chunk_u8(reinterpret_cast<const uint8_t*>(p), start, count, out); break;
  }
}

void combine_records(const StatsRecord* parts, int64_t n, StatsRecord* out) {
  StatsRecord r;
  init_record(r);
  for (int64_t i = 0; i < n; ++i) combine(r, parts[i]);
  *out = r;
}

}  // namespace trainsan::kernels
