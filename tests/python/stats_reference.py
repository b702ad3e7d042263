"""Independent oracles and test data for the fused statistics pass (test_stats*.py).

Nothing here calls TrainSan: the float64 reference uses torch ops on ``x.double()`` and exact
``math.fsum`` sums, and the hash reference re-implements Note [Hash] (kernels/stats.cuh) in numpy
uint64 arithmetic, which wraps mod 2^64.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import torch

CHUNK = 1 << 16  # kChunkSize, Note [Chunking]
FP16_MAX = 65504.0
SUM_RTOL = 1e-12

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES

COUNT_FIELDS = ("numel", "nan", "posinf", "neginf", "zero", "subnormal", "fp16_overflow")
EXACT_FLOAT_FIELDS = ("min", "max", "absmax")
ALL_FIELDS = COUNT_FIELDS + EXACT_FLOAT_FIELDS + ("sum", "l2", "hash")

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_M64 = (1 << 64) - 1
_HASH_INDEX_MUL = np.uint64(0x9E3779B97F4A7C15)


def one_thread(fn):
    """Run fn with torch on one thread: the oracles do many small elementwise ops, which run
    far slower on a thread pool when the machine's cores are busy. The previous count is
    restored."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(saved)

    return wrapper


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


# ---------------------------------------------------------------------------------------------
# Bits


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width, to read or write an element's storage bits."""
    return _BITS_DTYPE[torch.empty((), dtype=dtype).element_size()]


def to_signed(u: int, width_bytes: int) -> int:
    """Unsigned bit pattern -> the value of the same bits in a signed integer of that width."""
    bits = 8 * width_bytes
    return u - (1 << bits) if u >= 1 << (bits - 1) else u


def storage_bits(t: torch.Tensor) -> np.ndarray:
    """Bits of every element in logical row-major order, zero-extended to uint64."""
    x = t.detach().cpu().contiguous().reshape(-1)
    width = x.element_size()
    raw = x.view(bits_dtype(x.dtype)).numpy().view(_NP_UNSIGNED[width])
    return raw.astype(np.uint64)


def set_bits(t: torch.Tensor, index: int, u: int) -> None:
    """Write the unsigned bit pattern u into flat element `index` of contiguous t, in place."""
    assert t.is_contiguous()
    flat = t.view(-1).view(bits_dtype(t.dtype))
    flat[index] = to_signed(u, t.element_size())


def get_bits(t: torch.Tensor, index: int) -> int:
    flat = t.contiguous().view(-1).view(bits_dtype(t.dtype))
    return int(flat[index].item()) & ((1 << (8 * t.element_size())) - 1)


# ---------------------------------------------------------------------------------------------
# Hash, Note [Hash], independently in numpy


def _mix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xFF51AFD7ED558CCD)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(0xC4CEB9FE1A85EC53)
    x = x ^ (x >> np.uint64(33))
    return x


def hash_reference(t: torch.Tensor) -> int:
    """hash = mix64(S ^ n), S = sum_i mix64(b_i + i * K) mod 2^64, over row-major elements."""
    b = storage_bits(t)
    n = b.shape[0]
    with np.errstate(over="ignore"):
        idx = np.arange(n, dtype=np.uint64) * _HASH_INDEX_MUL
        s = np.sum(_mix64(b + idx), dtype=np.uint64) if n else np.uint64(0)
        h = _mix64(np.array([np.uint64(s) ^ np.uint64(n)], dtype=np.uint64))[0]
    return int(h) & _M64


# ---------------------------------------------------------------------------------------------
# Float64 reference of every field


@one_thread
def reference_stats(t: torch.Tensor) -> dict:
    """Every TensorStats field of t from torch ops in float64 and exact fsum sums.

    Also returns ``abs_sum`` (sum of |x| over finite elements), the scale for the tolerance of
    ``sum``.
    """
    x = t.detach().cpu()
    flat = x.reshape(-1)
    xd = flat.double()
    out: dict = {"numel": flat.numel()}
    if is_float(x.dtype):
        finite = torch.isfinite(xd)
        out["nan"] = int(torch.isnan(xd).sum())
        out["posinf"] = int((xd == math.inf).sum())
        out["neginf"] = int((xd == -math.inf).sum())
        tiny = torch.finfo(x.dtype).tiny  # smallest normal of the tensor's own dtype
        out["subnormal"] = int(((xd != 0) & (xd.abs() < tiny) & finite).sum())
        fv = xd[finite]
        exact_min = exact_max = None
    else:
        out["nan"] = out["posinf"] = out["neginf"] = out["subnormal"] = 0
        fv = xd
        # Integers: exact extremes in Python ints, then rounded to float64 once.
        if flat.numel():
            ints = flat.to(torch.int64) if x.dtype == torch.bool else flat
            exact_min, exact_max = int(ints.min()), int(ints.max())
        else:
            exact_min = exact_max = None
    out["zero"] = int((flat == 0).sum())
    if is_float(x.dtype):
        out["fp16_overflow"] = int((fv.abs() > FP16_MAX).sum())
    else:
        wide = flat.to(torch.int64)
        # |x| > 65504 without overflowing on int64's minimum.
        out["fp16_overflow"] = int(((wide > FP16_MAX) | (wide < -FP16_MAX)).sum())
    if fv.numel():
        if exact_min is not None:
            out["min"], out["max"] = float(exact_min), float(exact_max)
            out["absmax"] = max(abs(float(exact_min)), abs(float(exact_max)))
        else:
            out["min"], out["max"] = float(fv.min()), float(fv.max())
            out["absmax"] = float(fv.abs().max())
    else:
        out["min"] = out["max"] = out["absmax"] = None
    out["sum"] = math.fsum(fv.tolist())
    out["abs_sum"] = math.fsum(fv.abs().tolist())
    out["l2"] = math.sqrt(math.fsum((fv * fv).tolist()))  # squares rounded once, as a kernel does
    out["hash"] = hash_reference(x)
    return out


def sum_tolerance(scale: float) -> float:
    """The one tolerance for float64 accumulations: relative SUM_RTOL of the sum's scale."""
    return SUM_RTOL * scale


def assert_float_close(actual: float, expected: float, scale: float, what: str) -> None:
    if math.isinf(expected):
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"
        return
    tol = sum_tolerance(scale)
    assert abs(actual - expected) <= tol, (
        f"{what}: {actual!r} vs {expected!r} (diff {abs(actual - expected):.3e} > tol {tol:.3e})"
    )


def assert_matches_reference(s, ref: dict, what: str = "") -> None:
    """Counts, min/max/absmax and hash exactly; sum and l2 within sum_tolerance."""
    for f in COUNT_FIELDS:
        assert getattr(s, f) == ref[f], f"{what} {f}: {getattr(s, f)} != {ref[f]}"
    for f in EXACT_FLOAT_FIELDS:
        got, want = getattr(s, f), ref[f]
        if want is None:
            assert got is None, f"{what} {f}: {got!r}, expected None (no finite element)"
        else:
            assert got is not None and got == want, f"{what} {f}: {got!r} != {want!r}"
    assert_float_close(s.sum, ref["sum"], ref["abs_sum"], f"{what} sum")
    assert_float_close(s.l2, ref["l2"], ref["l2"], f"{what} l2")
    assert s.hash == ref["hash"], f"{what} hash: {s.hash:#x} != {ref['hash']:#x}"


def float_bits(v):
    return None if v is None else struct.pack("<d", v)


def bitwise_key(s) -> tuple:
    """Every field of a TensorStats, floats by their exact bits (so -0.0 != 0.0, NaN == NaN)."""
    return tuple(
        float_bits(getattr(s, f)) if f in EXACT_FLOAT_FIELDS + ("sum", "l2") else getattr(s, f)
        for f in ALL_FIELDS
    )


def assert_same_stats(a, b, scale: float, what: str = "") -> None:
    """Two results of the same tensor: everything exact except sum/l2 (within tolerance)."""
    for f in COUNT_FIELDS + EXACT_FLOAT_FIELDS + ("hash",):
        assert getattr(a, f) == getattr(b, f), f"{what} {f}: {getattr(a, f)!r} != {getattr(b, f)!r}"
    assert_float_close(a.sum, b.sum, scale, f"{what} sum")
    assert_float_close(a.l2, b.l2, b.l2, f"{what} l2")


# ---------------------------------------------------------------------------------------------
# Test data


def boundary_positions(n: int) -> list[int]:
    """First, last, middle and chunk-boundary indices (k*CHUNK - 1, k*CHUNK, k*CHUNK + 1)."""
    cand = [0, 1, n - 2, n - 1, n // 2]
    for k in range(1, n // CHUNK + 1):
        cand += [k * CHUNK - 1, k * CHUNK, k * CHUNK + 1]
    return sorted({p for p in cand if 0 <= p < n})


def float_specials(dtype: torch.dtype) -> list[float]:
    """Values that exercise every element class of `dtype` (after rounding to it)."""
    fi = torch.finfo(dtype)
    min_sub = fi.tiny * fi.eps  # smallest subnormal
    # float64's own maximum would overflow the float64 sum of squares; test_stats.py covers that
    # separately.
    big = 1.0e150 if dtype == torch.float64 else fi.max
    return [
        math.nan,
        math.inf,
        -math.inf,
        0.0,
        -0.0,
        min_sub,
        -min_sub,
        fi.tiny - min_sub,  # largest subnormal
        fi.tiny / 4,
        fi.tiny,  # smallest normal: not subnormal
        -fi.tiny,
        big,
        -big,
        FP16_MAX,  # not an fp16 overflow
        -FP16_MAX,
        65536.0,  # an fp16 overflow (inf in fp16 itself)
        -1.0e5,
        3.0e6,
    ]


def nan_bit_patterns(dtype: torch.dtype) -> list[int]:
    """NaNs with different payloads and signs, as unsigned bit patterns."""
    width = torch.empty((), dtype=dtype).element_size()
    inf = get_bits(torch.tensor([math.inf], dtype=dtype), 0)
    sign = 1 << (8 * width - 1)
    mant = (sign - 1) ^ inf  # mantissa bits
    quiet = (mant + 1) >> 1
    return [
        inf | 1,  # signalling, smallest payload
        inf | quiet,  # the default quiet NaN
        inf | mant,  # every payload bit
        sign | inf | quiet,
        sign | inf | 1,
        inf | (quiet >> 1),
    ]


def int_specials(dtype: torch.dtype) -> list[int]:
    if dtype == torch.bool:
        return [0, 1]
    ii = torch.iinfo(dtype)
    vals = [0, ii.min, ii.max, 1, -1, 65504, -65504, 65505, -65505, 70000, -70000]
    return [v for v in vals if ii.min <= v <= ii.max]


@one_thread
def random_tensor(dtype: torch.dtype, n: int, seed: int, plant: bool = True) -> torch.Tensor:
    """Seeded random data of `dtype` with specials planted at boundary_positions(n) and at a few
    random positions (NaN payloads included for floats)."""
    g = torch.Generator().manual_seed(seed)
    if is_float(dtype):
        scale = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-9.0, 9.0, generator=g))
        x = (torch.randn(n, dtype=torch.float64, generator=g) * scale).to(dtype)
        specials = torch.tensor(float_specials(dtype), dtype=torch.float64).to(dtype)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, (n,), generator=g).bool()
        specials = torch.tensor(int_specials(dtype), dtype=dtype)
    else:
        ii = torch.iinfo(dtype)
        wide = torch.randint(ii.min, ii.max, (n,), generator=g, dtype=dtype)
        small = torch.randint(-70000, 70001, (n,), generator=g).clamp(ii.min, ii.max).to(dtype)
        x = torch.where(torch.rand(n, generator=g) < 0.5, wide, small)
        specials = torch.tensor(int_specials(dtype), dtype=dtype)
    if not plant or n == 0:
        return x
    positions = boundary_positions(n)
    extra = torch.randint(0, n, (max(n // 200, min(n, 40)),), generator=g).tolist()
    for k, p in enumerate(positions + extra):
        x[p] = specials[k % specials.numel()]
    if is_float(dtype):
        nans = nan_bit_patterns(dtype)
        for k, p in enumerate(torch.randint(0, n, (min(n, 7),), generator=g).tolist()):
            set_bits(x, p, nans[k % len(nans)])
    return x


# ---------------------------------------------------------------------------------------------
# Views: non-contiguous, permuted, > 6 dims, expanded. Each takes a flat base of FLAT_N
# (VIEWS) or HIGH_N (HIGH_VIEWS) elements.


def collapsed_ndim(t: torch.Tensor) -> int:
    """How many dimensions t has once size-1 dims are dropped and mergeable neighbours merged;
    used to make sure a view really exercises the path it is meant to (<= 6: read in place,
    > 6: copied first)."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1] *= size
            strides[-1] = stride
            continue
        sizes.append(size)
        strides.append(stride)
    return len(sizes)


FLAT_N = 150 * 517  # > one chunk
HIGH_N = 4**9  # four chunks exactly

VIEWS = {
    "transpose": lambda b: b.reshape(150, 517).t(),
    "step_slice": lambda b: b.reshape(150, 517)[::3, 1::2],
    "offset_slice": lambda b: b.reshape(150, 517)[5:140:7, 3:500:11],
    "column": lambda b: b.reshape(150, 517)[:, 7],
    "misaligned_1d": lambda b: b[3:-5],
    "strided_1d": lambda b: b[1::3],
    "diagonal": lambda b: b.reshape(150, 517).diagonal(),
    "permute_3d": lambda b: b.reshape(150, 11, 47).permute(1, 2, 0),
    "permute_4d": lambda b: b.reshape(6, 25, 11, 47).permute(2, 0, 3, 1),
    "permute_4d_sliced": lambda b: b.reshape(6, 25, 11, 47)[:, 1::3, :, ::2].permute(3, 1, 0, 2),
    "channels_last": lambda b: b.reshape(6, 25, 11, 47).contiguous(
        memory_format=torch.channels_last
    ),
    "six_dims": lambda b: b.reshape(2, 3, 5, 5, 11, 47).permute(5, 3, 1, 4, 2, 0),
    "six_dims_sliced": lambda b: b.reshape(2, 3, 5, 5, 11, 47)[:, ::2, 1:, ::2, :, 1::3],
    "expand_rows": lambda b: b.reshape(150, 517)[:1].expand(150, 517),
    "expand_cols": lambda b: b.reshape(150, 517)[:, :1].expand(150, 517),
    "expand_middle": lambda b: b.reshape(150, 517)[:, None, :40].expand(150, 3, 40),
    "expand_scalar": lambda b: b[9].expand(2 * CHUNK + 1),
    "unfold_overlapping": lambda b: b.unfold(0, 1000, 333),
}
HIGH_VIEWS = {
    "nine_dims_reversed": lambda h: h.reshape((4,) * 9).permute(*reversed(range(9))),
    "eight_dims_permuted": lambda h: h.reshape(4, 4, 4, 4, 4, 4, 4, 16).permute(
        7, 0, 6, 1, 5, 2, 4, 3
    ),
    "seven_dims_sliced": lambda h: h.reshape((4,) * 9)[1:, ::2, 1:, 1:, ::2, 1:, 1:, 1:, 1:],
    "six_dims_permuted": lambda h: h.reshape(4, 4, 4, 4, 4, 4, 4, 16).permute(
        0, 2, 4, 6, 1, 3, 5, 7
    )[:, :, :, :, 0, 0],
}
# What each view must exercise: the collapsed dimension count (> 6 goes through a copy).
EXPECTED_NDIM = {
    "six_dims": 6,
    "six_dims_sliced": 6,
    "nine_dims_reversed": 9,
    "eight_dims_permuted": 8,
    "seven_dims_sliced": 7,
    "six_dims_permuted": 6,
}


VIEW_NAMES = list(VIEWS) + list(HIGH_VIEWS)


def make_view(name: str, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """The view `name` of seeded random data (random_tensor) on `device`."""
    if name in HIGH_VIEWS:
        return HIGH_VIEWS[name](random_tensor(dtype, HIGH_N, seed=seed).to(device))
    return VIEWS[name](random_tensor(dtype, FLAT_N, seed=seed).to(device))


def mixed_batch() -> list[torch.Tensor]:
    """Multi-chunk tensors of every dtype, small ones, views and an empty tensor."""
    out = [random_tensor(d, 5 * CHUNK + 99, seed=40 + k) for k, d in enumerate(ALL_DTYPES)]
    out += [random_tensor(d, 17, seed=60 + k) for k, d in enumerate(ALL_DTYPES)]
    out += [make_view("permute_4d", torch.float32, seed=1)]
    out += [make_view("nine_dims_reversed", torch.float16, seed=2)]
    out += [torch.empty(0)]
    return out
