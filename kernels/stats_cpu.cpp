// CPU backend, torch-free inner part: the statistics of one chunk. The parallel driver over chunks
// (at::parallel_for) is host/stats.cpp. The inner loop runs the element maths of
// kernels/stats.cuh in kLanes independent lanes so that the compiler vectorises it; on x86-64
// with GCC it is compiled for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline, and the loader
// picks the best one the CPU supports (target_clones).
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "check.h"
#include "dispatch.h"
#include "stats.cuh"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TRAINSAN_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TRAINSAN_CLONES
#endif

namespace trainsan::kernels {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  TRAINSAN_CHECK(false, "unknown dtype code " << static_cast<int>(dtype));
}

bool dtype_is_floating(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat64;
}

namespace {

constexpr int kLanes = 16;
// Elements per block of the fast-path test below: a multiple of kLanes, small enough that a block
// read by the test is still in L1 when the body reads it again.
constexpr int64_t kBlock = 1024;

// Note [Ordinary elements]
// An element is ordinary when it is zero, or normal and finite with |x| <= 65504: it is then not
// NaN/±Inf/subnormal/fp16-overflow, so classify() can only flag `zero`, and its finite-masked
// value is itself. Ordinary<T>::kMax is the bit pattern (sign cleared) of the largest value
// <= 65504 of the dtype. The CPU loop scans each block of kBlock elements and, when all are
// ordinary, runs a body without the other five classes and the finite masks (and without the zero
// count when the block has no zero); per lane it accumulates the same values in the same order,
// so every result has the same bits as with the full body.
template <typename T>
struct Ordinary;
template <>
struct Ordinary<float> {
  static constexpr uint32_t kMax = 0x477fe000u;  // 65504
};
template <>
struct Ordinary<double> {
  static constexpr uint64_t kMax = 0x40effc0000000000ull;  // 65504
};
template <>
struct Ordinary<Half> {
  static constexpr uint16_t kMax = 0x7bff;  // 65504, the largest finite half
};
template <>
struct Ordinary<BFloat16> {
  static constexpr uint16_t kMax = 0x477f;  // 65280; the next bfloat16 is 65536
};

// Element i of a run. The 16-bit floats are read as their uint16_t bits: GCC does not vectorise
// loads of the one-member structs (the loops would run scalar, about 5x slower).
template <typename T>
inline __attribute__((always_inline)) T load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T{reinterpret_cast<const uint16_t*>(p)[i]};
  } else {
    return p[i];
  }
}

enum class BlockKind { kFull, kOrdinary, kOrdinaryNoZero };

// Per-lane class counts of the lane-parallel loops (Note [Element classes]), merged into a record
// in lane order.
struct LaneCounts {
  uint32_t nan[kLanes] = {}, pinf[kLanes] = {}, ninf[kLanes] = {}, zero[kLanes] = {},
           sub[kLanes] = {}, ovf[kLanes] = {};
  inline __attribute__((always_inline)) void add(int l, const ElemClass& c) {
    nan[l] += c.nan;
    pinf[l] += c.posinf;
    ninf[l] += c.neginf;
    zero[l] += c.zero;
    sub[l] += c.subnormal;
    ovf[l] += c.overflow;
  }
  void merge(StatsRecord& r) const {
    for (int l = 0; l < kLanes; ++l) {
      r.nan += nan[l];
      r.posinf += pinf[l];
      r.neginf += ninf[l];
      r.zero += zero[l];
      r.subnormal += sub[l];
      r.fp16_overflow += ovf[l];
    }
  }
};

// One read of a block (it stays in L1 for the body): the largest |bits|, the smallest, and the
// smallest |bits| - 1 (zero wraps to the top, so this is the smallest nonzero |bits|, minus 1).
template <typename T>
inline __attribute__((always_inline)) BlockKind scan_block(
    const T* p, int64_t n, typename ElemTraits<T>::Bits* top = nullptr) {
  using Tr = ElemTraits<T>;
  using Bits = typename Tr::Bits;
  Bits hi = 0, lo = static_cast<Bits>(~Bits{0}), lo_nonzero = static_cast<Bits>(~Bits{0});
#pragma omp simd reduction(max : hi) reduction(min : lo, lo_nonzero)
  for (int64_t i = 0; i < n; ++i) {
    const Bits a = static_cast<Bits>(Tr::bits(load(p, i)) & Tr::kAbsMask);
    const Bits a1 = static_cast<Bits>(a - 1);
    hi = a > hi ? a : hi;
    lo = a < lo ? a : lo;
    lo_nonzero = a1 < lo_nonzero ? a1 : lo_nonzero;
  }
  if (top != nullptr) *top = hi;
  if (hi > Ordinary<T>::kMax || lo_nonzero < Tr::kMinNormalBits - 1) return BlockKind::kFull;
  return lo == 0 ? BlockKind::kOrdinary : BlockKind::kOrdinaryNoZero;
}

// Lane-parallel form of accumulate<T>() over a contiguous run; same maths, same result per lane
// as calling accumulate() element by element, merged in a fixed lane order. Lane l of the
// vectorised part takes elements l, l + kLanes, ... of the run.
template <typename T, bool kHash>
inline __attribute__((always_inline)) void chunk_body(const T* p, int64_t base, int64_t n,
                                                      StatsRecord* out) {
  using Tr = ElemTraits<T>;
  using Acc = typename Tr::Acc;
  LaneCounts cnt;
  Acc mn[kLanes], mx[kLanes];
  double s[kLanes] = {}, ss[kLanes] = {};
  uint64_t h[kLanes] = {};
  uint64_t ik[kLanes];  // (logical index of lane l's next element) * kHashIndexMul, mod 2^64
  for (int l = 0; l < kLanes; ++l) {
    mn[l] = std::numeric_limits<Acc>::infinity();
    mx[l] = -std::numeric_limits<Acc>::infinity();
    ik[l] = static_cast<uint64_t>(base + l) * kHashIndexMul;
  }
  constexpr uint64_t kStep = static_cast<uint64_t>(kLanes) * kHashIndexMul;
  const int64_t n_vec = n - n % kLanes;
  for (int64_t b = 0; b < n_vec; b += kBlock) {
    const int64_t b_end = std::min(b + kBlock, n_vec);
    if constexpr (Tr::kFloating) {
      // Note [Ordinary elements]
      const BlockKind kind = scan_block<T>(p + b, b_end - b);
      auto ordinary_body = [&](auto count_zero) {
        for (int64_t i = b; i < b_end; i += kLanes) {
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) {
            const T v = load(p, i + l);
            const auto bits = Tr::bits(v);
            const Acc x = Tr::value(v);
            if constexpr (decltype(count_zero)::value) cnt.zero[l] += (bits & Tr::kAbsMask) == 0;
            const Acc xm = x + Acc(0);  // Note [Signed zero]
            mn[l] = xm < mn[l] ? xm : mn[l];
            mx[l] = xm > mx[l] ? xm : mx[l];
            const double d = static_cast<double>(x);
            s[l] += d;
            ss[l] += d * d;
            if constexpr (kHash) {
              h[l] += mix64(static_cast<uint64_t>(bits) + ik[l]);
              ik[l] += kStep;
            }
          }
        }
      };
      if (kind == BlockKind::kOrdinaryNoZero) {
        ordinary_body(std::false_type{});
        continue;
      }
      if (kind == BlockKind::kOrdinary) {
        ordinary_body(std::true_type{});
        continue;
      }
    }
    {
      for (int64_t i = b; i < b_end; i += kLanes) {
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) {
          const T v = load(p, i + l);
          const Acc x = Tr::value(v);
          const ElemClass c = classify<T>(v, x);
          cnt.add(l, c);
          const Acc xf = c.finite ? x : Acc(0);
          const Acc xm = x + Acc(0);  // Note [Signed zero]
          const Acc xlo = c.finite ? xm : std::numeric_limits<Acc>::infinity();
          const Acc xhi = c.finite ? xm : -std::numeric_limits<Acc>::infinity();
          mn[l] = xlo < mn[l] ? xlo : mn[l];
          mx[l] = xhi > mx[l] ? xhi : mx[l];
          const double d = static_cast<double>(xf);
          s[l] += d;
          ss[l] += d * d;
          if constexpr (kHash) {
            h[l] += mix64(static_cast<uint64_t>(Tr::bits(v)) + ik[l]);
            ik[l] += kStep;
          }
        }
      }
    }
  }
  StatsRecord r;
  init_record(r);
  cnt.merge(r);
  for (int l = 0; l < kLanes; ++l) {
    r.min = min_(r.min, static_cast<double>(mn[l]));
    r.max = max_(r.max, static_cast<double>(mx[l]));
    r.sum += s[l];
    r.sumsq += ss[l];
    r.hash += h[l];
  }
  // Over finite values max|x| = max(-min, max) exactly; against +0 this is also the per-element
  // form's value when every finite value is ±0 or none is finite (min = +inf, max = -inf).
  r.absmax = max_(0.0, max_(-r.min, r.max));
  r.numel = n_vec;
  for (int64_t i = n_vec; i < n; ++i) accumulate<T, kHash>(r, p[i], base + i);
  *out = r;
}

// Lane-parallel form of accumulate_lean<T>() (Note [Lean rows]) over a contiguous run of a floating
// dtype: the counts, sum, sumsq and absmax only. sum and sumsq are accumulated per lane in the
// same order as in chunk_body (and merged in the same lane order), so they have the same bits;
// absmax is the largest finite |x|, taken on the bits (exact), which is chunk_body's
// max(-min, max).
template <typename T>
inline __attribute__((always_inline)) void lean_body(const T* p, int64_t n, StatsRecord* out) {
  using Tr = ElemTraits<T>;
  using Acc = typename Tr::Acc;
  using Bits = typename Tr::Bits;
  LaneCounts cnt;
  double s[kLanes] = {}, ss[kLanes] = {};
  Bits amax[kLanes] = {};
  Bits block_max = 0;
  const int64_t n_vec = n - n % kLanes;
  for (int64_t b = 0; b < n_vec; b += kBlock) {
    const int64_t b_end = std::min(b + kBlock, n_vec);
    Bits hi = 0;
    const BlockKind kind = scan_block<T>(p + b, b_end - b, &hi);
    if (kind != BlockKind::kFull) {
      // Note [Ordinary elements]: every element finite, so |x| max is the block's largest bits.
      block_max = hi > block_max ? hi : block_max;
      const bool count_zero = kind == BlockKind::kOrdinary;
      auto body = [&](auto with_zero) {
        for (int64_t i = b; i < b_end; i += kLanes) {
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) {
            const T v = load(p, i + l);
            if constexpr (decltype(with_zero)::value) {
              cnt.zero[l] += (Tr::bits(v) & Tr::kAbsMask) == 0;
            }
            const double d = static_cast<double>(Tr::value(v));
            s[l] += d;
            ss[l] += d * d;
          }
        }
      };
      if (count_zero) {
        body(std::true_type{});
      } else {
        body(std::false_type{});
      }
      continue;
    }
    for (int64_t i = b; i < b_end; i += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const T v = load(p, i + l);
        const Acc x = Tr::value(v);
        const ElemClass c = classify<T>(v, x);
        cnt.add(l, c);
        const Bits a = c.finite ? static_cast<Bits>(Tr::bits(v) & Tr::kAbsMask) : Bits{0};
        amax[l] = a > amax[l] ? a : amax[l];
        const double d = static_cast<double>(c.finite ? x : Acc(0));
        s[l] += d;
        ss[l] += d * d;
      }
    }
  }
  StatsRecord r;
  init_record(r);
  cnt.merge(r);
  for (int l = 0; l < kLanes; ++l) {
    r.sum += s[l];
    r.sumsq += ss[l];
    block_max = amax[l] > block_max ? amax[l] : block_max;
  }
  T top;
  std::memcpy(&top, &block_max, sizeof(top));
  r.absmax = static_cast<double>(Tr::value(top));
  r.numel = n_vec;
  for (int64_t i = n_vec; i < n; ++i) accumulate_lean<T>(r, p[i]);
  *out = r;
}

// Note [Lean rows]'s kModeHash: numel and the un-finalized fingerprint sum S of Note [Hash] over a
// contiguous run whose first element has logical index `base`, lane l summing the terms of
// elements l, l + kLanes, ... (the sum is exact mod 2^64, so S has the same bits as chunk_body's).
template <typename T>
inline __attribute__((always_inline)) void hash_body(const T* p, int64_t base, int64_t n,
                                                     StatsRecord* out) {
  using Tr = ElemTraits<T>;
  uint64_t h[kLanes] = {};
  uint64_t ik[kLanes];
  for (int l = 0; l < kLanes; ++l) ik[l] = static_cast<uint64_t>(base + l) * kHashIndexMul;
  constexpr uint64_t kStep = static_cast<uint64_t>(kLanes) * kHashIndexMul;
  const int64_t n_vec = n - n % kLanes;
  for (int64_t i = 0; i < n_vec; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      h[l] += mix64(static_cast<uint64_t>(Tr::bits(load(p, i + l))) + ik[l]);
      ik[l] += kStep;
    }
  }
  StatsRecord r;
  init_record(r);
  for (int l = 0; l < kLanes; ++l) r.hash += h[l];
  for (int64_t i = n_vec; i < n; ++i) {
    r.hash += hash_term(static_cast<uint64_t>(Tr::bits(p[i])), base + i);
  }
  r.numel = n;
  *out = r;
}

// Integer tensors take the statistics without the fingerprint (min, max and sum packed as NaN).
template <typename T>
inline __attribute__((always_inline)) void lean_chunk(const T* p, int64_t base, int64_t n,
                                                      StatsRecord* out) {
  if constexpr (ElemTraits<T>::kFloating) {
    lean_body<T>(p, n, out);
  } else {
    chunk_body<T, false>(p, base, n, out);
  }
}

// Lane-parallel form of accumulate_update<T>() (Note [Update]) over a contiguous run, merged into
// *out in a fixed lane order; then the snapshot holds the current values.
template <typename T>
inline __attribute__((always_inline)) void update_body(const T* p, T* s, int64_t n,
                                                       StatsRecord* out) {
  using Tr = ElemTraits<T>;
  using Acc = typename Tr::Acc;
  uint32_t ch[kLanes] = {};
  double dss[kLanes] = {}, dmx[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) {
      const T v = load(p, i + l);
      const T prev = s[i + l];
      const Acc x = Tr::value(v);
      const Acc px = Tr::value(prev);
      const ElemClass c = classify<T>(v, x);
      const ElemClass cp = classify<T>(prev, px);
      ch[l] += Tr::bits(v) != Tr::bits(prev);
      const double d =
          (c.finite & cp.finite) ? static_cast<double>(x) - static_cast<double>(px) : 0.0;
      dss[l] += d * d;
      const double ad = d < 0 ? -d : d;
      dmx[l] = ad > dmx[l] ? ad : dmx[l];
      s[i + l] = v;
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    out->changed += ch[l];
    out->dsumsq += dss[l];
    out->dmax = max_(out->dmax, dmx[l]);
  }
  for (; i < n; ++i) {
    accumulate_update<T>(*out, p[i], s[i]);
    s[i] = p[i];
  }
}

// The entry points of the inner loops, one per element type, each compiled per target
// (TRAINSAN_CLONES): GCC does not clone templates, so the templates are wrapped in plain
// overloads. The integer updates are not cloned (update_chunk's template below).
#define TRAINSAN_CLONED_CHUNK(T)                                                               \
  TRAINSAN_CLONES void chunk(const T* p, int64_t b, int64_t n, StatsRecord* o, int32_t mode) { \
    if (mode == kModeLean) {                                                                   \
      lean_chunk<T>(p, b, n, o);                                                               \
      return;                                                                                  \
    }                                                                                          \
    if (mode == kModeHash) {                                                                   \
      hash_body<T>(p, b, n, o);                                                                \
      return;                                                                                  \
    }                                                                                          \
    if (mode == kModeFull) {                                                                   \
      chunk_body<T, true>(p, b, n, o);                                                         \
    } else {                                                                                   \
      chunk_body<T, false>(p, b, n, o);                                                        \
    }                                                                                          \
  }
#define TRAINSAN_CLONED_UPDATE(T)                                                  \
  TRAINSAN_CLONES void update_chunk(const T* p, T* s, int64_t n, StatsRecord* o) { \
    update_body<T>(p, s, n, o);                                                    \
  }

TRAINSAN_CLONED_CHUNK(float)
TRAINSAN_CLONED_CHUNK(double)
TRAINSAN_CLONED_CHUNK(Half)
TRAINSAN_CLONED_CHUNK(BFloat16)
TRAINSAN_CLONED_CHUNK(int8_t)
TRAINSAN_CLONED_CHUNK(int16_t)
TRAINSAN_CLONED_CHUNK(int32_t)
TRAINSAN_CLONED_CHUNK(int64_t)
TRAINSAN_CLONED_CHUNK(uint8_t)
TRAINSAN_CLONED_UPDATE(float)
TRAINSAN_CLONED_UPDATE(double)
TRAINSAN_CLONED_UPDATE(Half)
TRAINSAN_CLONED_UPDATE(BFloat16)
#undef TRAINSAN_CLONED_CHUNK
#undef TRAINSAN_CLONED_UPDATE

// Integer updates: overload resolution prefers the exact non-template overloads above for the
// floating types.
template <typename T>
void update_chunk(const T* p, T* s, int64_t n, StatsRecord* o) {
  update_body<T>(p, s, n, o);
}

// Note [Update sample]: the update statistics of the sampled elements that lie in the chunk
// [start, start + count), whose logical elements are at p[0, count); the sample then holds their
// current values.
template <typename T>
void sample_update(const TensorDesc& t, const T* p, int64_t start, int64_t count,
                   StatsRecord* out) {
  T* sample = static_cast<T*>(t.snapshot);
  const int64_t stride = t.sample_stride;
  const int64_t last = (start + count - 1) / stride;
  for (int64_t j = start / stride; j <= last; ++j) {
    const int64_t i = sample_index(j, stride, t.numel) - start;
    if (i < 0 || i >= count) continue;
    accumulate_update<T>(*out, p[i], sample[j]);
    sample[j] = p[i];
  }
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
      case 1:
        gather_strided<1>(t, start, count, dst);
        break;
      case 2:
        gather_strided<2>(t, start, count, dst);
        break;
      case 4:
        gather_strided<4>(t, start, count, dst);
        break;
      default:
        gather_strided<8>(t, start, count, dst);
        break;
    }
    p = dst;
  }
  TRAINSAN_DISPATCH_DTYPE(t.dtype, T,
                          chunk(reinterpret_cast<const T*>(p), start, count, out, t.mode));
  if (t.snapshot == nullptr) return;
  if (t.sample_stride > 1) {
    // Note [Update sample]: the strata that reach into this chunk; a sampled element is read
    // here, where the chunk was just read (in cache, gathered where strided).
    TRAINSAN_DISPATCH_DTYPE(t.dtype, T,
                            sample_update(t, reinterpret_cast<const T*>(p), start, count, out));
    return;
  }
  char* snap = static_cast<char*>(t.snapshot) + start * es;
  TRAINSAN_DISPATCH_DTYPE(
      t.dtype, T,
      update_chunk(reinterpret_cast<const T*>(p), reinterpret_cast<T*>(snap), count, out));
}

void combine_records(const StatsRecord* parts, int64_t n, StatsRecord* out) {
  StatsRecord r;
  init_record(r);
  for (int64_t i = 0; i < n; ++i) combine(r, parts[i]);
  *out = r;
}

}  // namespace trainsan::kernels
