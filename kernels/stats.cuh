// Element-level maths of the statistics pass, shared by the CUDA kernel and the CPU backend.
// Everything here is __host__ __device__ and branch-free where it sits in the inner loop, so that
// both backends compute exactly the same integers and the same float64 values per element.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "stats.h"

#ifdef __CUDACC__
#define TRAINSAN_HD __host__ __device__ __forceinline__
#else
#define TRAINSAN_HD inline __attribute__((always_inline))
#endif

namespace trainsan::kernels {

// Storage types for the 16-bit floats: raw bits only, decoded by the functions below so that the
// CPU and GPU decode identically without cuda_fp16.h.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

template <typename To, typename From>
TRAINSAN_HD To bit_cast_(From from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast_ size mismatch");
  return __builtin_bit_cast(To, from);
}

// fp16 -> fp32, exact for every input (subnormals, ±inf, NaN payloads), without relying on the
// FPU's denormal mode: subnormal halves become m * 2^-24, a normal float.
TRAINSAN_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  const uint32_t normal_bits = ((e + 112u) << 23) | (m << 13);
  const uint32_t special_bits = 0x7f800000u | (m << 13);
  const float sub = static_cast<float>(m) * 5.9604644775390625e-08f;  // 2^-24
  const uint32_t mag = e == 0 ? bit_cast_<uint32_t>(sub) : (e == 31u ? special_bits : normal_bits);
  return bit_cast_<float>(mag | sign);
}

TRAINSAN_HD float bfloat16_to_float(uint16_t b) {
  return bit_cast_<float>(static_cast<uint32_t>(b) << 16);
}

// Note [Element classes]
// Classification reads the bits, never the FPU (flush-to-zero/denormals-are-zero modes cannot
// hide a subnormal): with `a` the bits without the sign,
//   nan: a > inf_bits;  ±inf: a == inf_bits;  zero: a == 0 (+0 and -0);
//   subnormal: 0 < a < min_normal_bits, per the tensor's own dtype (fp16: |x| < 2^-14);
//   fp16_overflow: finite and |x| > 65504 (so always 0 for fp16 itself).
// Integer and bool tensors have no nan/inf/subnormal; zero and fp16_overflow apply to them too
// (an int beyond ±65504 does not survive a cast to fp16).
// Every statistic of a finite element is computed on its exact float64 value.
template <typename T>
struct ElemTraits;

template <>
struct ElemTraits<float> {
  using Bits = uint32_t;
  using Acc = float;  // exact for the element values; widened to double for sums
  static constexpr bool kFloating = true;
  static constexpr Bits kAbsMask = 0x7fffffffu;
  static constexpr Bits kInfBits = 0x7f800000u;
  static constexpr Bits kMinNormalBits = 0x00800000u;
  TRAINSAN_HD static Acc value(float v) { return v; }
  TRAINSAN_HD static Bits bits(float v) { return bit_cast_<Bits>(v); }
};

template <>
struct ElemTraits<double> {
  using Bits = uint64_t;
  using Acc = double;
  static constexpr bool kFloating = true;
  static constexpr Bits kAbsMask = 0x7fffffffffffffffull;
  static constexpr Bits kInfBits = 0x7ff0000000000000ull;
  static constexpr Bits kMinNormalBits = 0x0010000000000000ull;
  TRAINSAN_HD static Acc value(double v) { return v; }
  TRAINSAN_HD static Bits bits(double v) { return bit_cast_<Bits>(v); }
};

template <>
struct ElemTraits<Half> {
  using Bits = uint16_t;
  using Acc = float;
  static constexpr bool kFloating = true;
  static constexpr Bits kAbsMask = 0x7fff;
  static constexpr Bits kInfBits = 0x7c00;
  static constexpr Bits kMinNormalBits = 0x0400;
  TRAINSAN_HD static Acc value(Half v) { return half_to_float(v.bits); }
  TRAINSAN_HD static Bits bits(Half v) { return v.bits; }
};

template <>
struct ElemTraits<BFloat16> {
  using Bits = uint16_t;
  using Acc = float;
  static constexpr bool kFloating = true;
  static constexpr Bits kAbsMask = 0x7fff;
  static constexpr Bits kInfBits = 0x7f80;
  static constexpr Bits kMinNormalBits = 0x0080;
  TRAINSAN_HD static Acc value(BFloat16 v) { return bfloat16_to_float(v.bits); }
  TRAINSAN_HD static Bits bits(BFloat16 v) { return v.bits; }
};

template <typename I, typename UBits>
struct IntTraits {
  using Bits = UBits;
  using Acc = double;  // int64 values beyond 2^53 are rounded in min/max/sum (documented)
  static constexpr bool kFloating = false;
  TRAINSAN_HD static Acc value(I v) { return static_cast<double>(v); }
  TRAINSAN_HD static Bits bits(I v) { return static_cast<Bits>(v); }
};
template <>
struct ElemTraits<int8_t> : IntTraits<int8_t, uint8_t> {};
template <>
struct ElemTraits<int16_t> : IntTraits<int16_t, uint16_t> {};
template <>
struct ElemTraits<int32_t> : IntTraits<int32_t, uint32_t> {};
template <>
struct ElemTraits<int64_t> : IntTraits<int64_t, uint64_t> {};
template <>
struct ElemTraits<uint8_t> : IntTraits<uint8_t, uint8_t> {};  // bool is read as uint8 0/1

// Note [Hash]
// For a tensor with elements x_0 .. x_{n-1} in logical row-major order, let b_i be the storage bits
// of x_i read as an unsigned integer of the element's width and zero-extended to 64 bits. Then
//   S = sum_i mix64(b_i + i * kHashIndexMul)    (mod 2^64)
//   hash = mix64(S ^ n)
// mix64 is MurmurHash3's 64-bit finalizer (a bijection), so for a fixed index every bit of b_i
// changes the term and hence S; i enters every term, so moving an element changes its term;
// the sum is commutative and associative mod 2^64, so S does not depend on memory layout, thread
// count or reduction order. Chunks carry S; hash is finalized once per tensor.
constexpr uint64_t kHashIndexMul = 0x9e3779b97f4a7c15ull;

TRAINSAN_HD uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

TRAINSAN_HD uint64_t hash_term(uint64_t bits, int64_t index) {
  return mix64(bits + static_cast<uint64_t>(index) * kHashIndexMul);
}

TRAINSAN_HD uint64_t finalize_hash(uint64_t s, int64_t numel) {
  return mix64(s ^ static_cast<uint64_t>(numel));
}

TRAINSAN_HD void init_record(StatsRecord& r) {
  r.numel = r.nan = r.posinf = r.neginf = r.zero = r.subnormal = r.fp16_overflow = 0;
  r.hash = 0;
  r.min = INFINITY;
  r.max = -INFINITY;
  r.absmax = 0.0;
  r.sum = 0.0;
  r.sumsq = 0.0;
  r.changed = 0;
  r.dsumsq = 0.0;
  r.dmax = 0.0;
}

// Min/max over finite values only: non-finite elements never reach these (they are replaced by
// the identity), so a plain comparison is exact and order-independent.
TRAINSAN_HD double min_(double a, double b) { return b < a ? b : a; }
TRAINSAN_HD double max_(double a, double b) { return b > a ? b : a; }

// Combining is associative for every field: integer sums, min/max, and the mod-2^64 hash sum.
// The float64 sums are the only order-dependent fields; callers combine in a fixed order.
TRAINSAN_HD void combine(StatsRecord& a, const StatsRecord& b) {
  a.numel += b.numel;
  a.nan += b.nan;
  a.posinf += b.posinf;
  a.neginf += b.neginf;
  a.zero += b.zero;
  a.subnormal += b.subnormal;
  a.fp16_overflow += b.fp16_overflow;
  a.hash += b.hash;
  a.min = min_(a.min, b.min);
  a.max = max_(a.max, b.max);
  a.absmax = max_(a.absmax, b.absmax);
  a.sum += b.sum;
  a.sumsq += b.sumsq;
  a.changed += b.changed;
  a.dsumsq += b.dsumsq;
  a.dmax = max_(a.dmax, b.dmax);
}

// Per-element flags (0/1) of one element, Note [Element classes].
struct ElemClass {
  uint32_t nan, posinf, neginf, zero, subnormal, overflow, finite;
};

template <typename T>
TRAINSAN_HD ElemClass classify(T v, typename ElemTraits<T>::Acc x) {
  using Tr = ElemTraits<T>;
  ElemClass c;
  if constexpr (Tr::kFloating) {
    const auto b = Tr::bits(v);
    const auto a = static_cast<typename Tr::Bits>(b & Tr::kAbsMask);
    const bool neg = b != a;
    c.nan = a > Tr::kInfBits;
    c.posinf = (a == Tr::kInfBits) & !neg;
    c.neginf = (a == Tr::kInfBits) & neg;
    c.zero = a == 0;
    c.subnormal = (a != 0) & (a < Tr::kMinNormalBits);
    c.finite = a < Tr::kInfBits;
  } else {
    c.nan = c.posinf = c.neginf = c.subnormal = 0;
    c.zero = x == 0;
    c.finite = 1;
  }
  const auto ax = x < 0 ? -x : x;
  c.overflow = c.finite & (ax > static_cast<typename ElemTraits<T>::Acc>(65504));
  return c;
}

// Note [Lean rows]: the counts, sum, sumsq and absmax of one element, nothing else (min/max keep
// their identities and are written as NaN by pack_record(..., kModeLean)).
template <typename T>
TRAINSAN_HD void accumulate_lean(StatsRecord& r, T v) {
  using Tr = ElemTraits<T>;
  const auto x = Tr::value(v);
  const ElemClass c = classify<T>(v, x);
  r.numel += 1;
  r.nan += c.nan;
  r.posinf += c.posinf;
  r.neginf += c.neginf;
  r.zero += c.zero;
  r.subnormal += c.subnormal;
  r.fp16_overflow += c.overflow;
  const double d = c.finite ? static_cast<double>(x) : 0.0;
  r.absmax = max_(r.absmax, d < 0 ? -d : d);
  r.sum += d;
  r.sumsq += d * d;
}

// Add one element (value v at logical index `index`) to a record: the lean fields, the hash, min
// and max. The GPU kernel calls this per element; the CPU backend runs the same classify/hash_term
// maths in lane-parallel form.
template <typename T, bool kHash = true>
TRAINSAN_HD void accumulate(StatsRecord& r, T v, int64_t index) {
  using Tr = ElemTraits<T>;
  accumulate_lean<T>(r, v);
  if constexpr (kHash) r.hash += hash_term(static_cast<uint64_t>(Tr::bits(v)), index);
  const auto x = Tr::value(v);
  const bool finite = classify<T>(v, x).finite != 0;
  // Note [Signed zero]: min and max see -0 as +0 (d + 0.0 is +0 for both zeros), so which zero
  // they return cannot depend on the order of comparisons: CPU and GPU give the same bits.
  const double dm = (finite ? static_cast<double>(x) : 0.0) + 0.0;
  r.min = min_(r.min, finite ? dm : INFINITY);
  r.max = max_(r.max, finite ? dm : -INFINITY);
}

// Note [Update]
// With a snapshot s of the previous values: changed counts elements whose bits differ (so a NaN
// that stays NaN is unchanged, +0 -> -0 is a change); the difference d = x - s is taken in float64
// over elements finite in both (exact for every dtype but float64, where it rounds once), and
// dsumsq/dmax accumulate d^2 and |d|.
template <typename T>
TRAINSAN_HD void accumulate_update(StatsRecord& r, T v, T prev) {
  using Tr = ElemTraits<T>;
  const auto x = Tr::value(v);
  const auto px = Tr::value(prev);
  const ElemClass c = classify<T>(v, x);
  const ElemClass cp = classify<T>(prev, px);
  r.changed += Tr::bits(v) != Tr::bits(prev);
  const double d = (c.finite & cp.finite) ? static_cast<double>(x) - static_cast<double>(px) : 0.0;
  r.dsumsq += d * d;
  r.dmax = max_(r.dmax, d < 0 ? -d : d);
}

// Note [Update sample]: the logical index of sample j of a tensor of `numel` elements cut into
// strata of `stride` elements (stride > 1): one element of stratum j, at an offset that a hash of
// j fixes inside it.
TRAINSAN_HD int64_t sample_index(int64_t j, int64_t stride, int64_t numel) {
  const int64_t lo = j * stride;
  const int64_t size = numel - lo < stride ? numel - lo : stride;
  const uint64_t h = mix64(static_cast<uint64_t>(j) * kHashIndexMul + 0x2545f4914f6cdd1dULL);
  return lo + static_cast<int64_t>(h % static_cast<uint64_t>(size));
}

// Final record -> packed public row (Note [Packed row]); min/max/absmax are NaN when no element
// is finite; the row's PassMode (Note [Lean rows]) blanks what it did not compute: a lean row has
// NaN for min and max and hash 0, a hash row only numel and the hash.
TRAINSAN_HD void pack_record(const StatsRecord& r, int64_t* ints, double* floats,
                             int32_t mode = kModeFull) {
  ints[kColNumel] = r.numel;
  ints[kColNan] = r.nan;
  ints[kColPosinf] = r.posinf;
  ints[kColNeginf] = r.neginf;
  ints[kColZero] = r.zero;
  ints[kColSubnormal] = r.subnormal;
  ints[kColFp16Overflow] = r.fp16_overflow;
  ints[kColHash] = static_cast<int64_t>(finalize_hash(r.hash, r.numel));
  const int64_t finite = r.numel - r.nan - r.posinf - r.neginf;
  const double nan = static_cast<double>(NAN);
  floats[kColMin] = finite > 0 ? r.min : nan;
  floats[kColMax] = finite > 0 ? r.max : nan;
  floats[kColAbsmax] = finite > 0 ? r.absmax : nan;
  floats[kColSum] = r.sum;
  floats[kColL2] = sqrt(r.sumsq);
  if (mode == kModeLean) {
    ints[kColHash] = 0;
    floats[kColMin] = floats[kColMax] = nan;
  }
  if (mode == kModeHash) {
    ints[kColNan] = ints[kColPosinf] = ints[kColNeginf] = ints[kColZero] = ints[kColSubnormal] =
        ints[kColFp16Overflow] = 0;
    floats[kColMin] = floats[kColMax] = floats[kColAbsmax] = floats[kColSum] = floats[kColL2] = nan;
  }
}

// Packed row with update statistics: pack_record's columns, then the update columns.
TRAINSAN_HD void pack_record_update(const StatsRecord& r, int64_t* ints, double* floats,
                                    int32_t mode = kModeFull) {
  pack_record(r, ints, floats, mode);
  ints[kColChanged] = r.changed;
  floats[kColUpdateL2] = sqrt(r.dsumsq);
  floats[kColUpdateMax] = r.dmax;
}

}  // namespace trainsan::kernels
