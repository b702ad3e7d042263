"""trainsan.tensor_stats on CPU against independent oracles (stats_reference.py).

Every field of every dtype is checked against a float64 reference built from torch ops and exact
fsum sums, and the hash against a numpy re-implementation of Note [Hash] (kernels/stats.cuh), on
seeded random data with NaN/±Inf/±0/subnormal/fp16-overflow values planted at the first, last
and chunk-boundary indices (Note [Chunking]).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import trainsan
from stats_reference import (
    ALL_DTYPES,
    CHUNK,
    EXPECTED_NDIM,
    FLOAT_DTYPES,
    VIEW_NAMES,
    assert_matches_reference,
    assert_same_stats,
    bitwise_key,
    boundary_positions,
    collapsed_ndim,
    get_bits,
    hash_reference,
    is_float,
    make_view,
    mixed_batch,
    nan_bit_patterns,
    random_tensor,
    reference_stats,
    set_bits,
    storage_bits,
)

tensor_stats = trainsan.tensor_stats


def ids(dtype):
    return str(dtype).replace("torch.", "")


def check_one(t: torch.Tensor, what: str = ""):
    """tensor_stats([t]) against the float64 and numpy-hash references; returns the stats."""
    (s,) = tensor_stats([t])
    assert_matches_reference(s, reference_stats(t), what)
    return s


# ---------------------------------------------------------------------------------------------
# Hand-computed cases


def test_hand_computed_float32():
    t = torch.tensor(
        [1.0, -2.0, 0.0, math.nan, math.inf, -math.inf, -0.0, 1e-40, 7.0e4, 65504.0],
        dtype=torch.float32,
    )
    (s,) = tensor_stats([t])
    assert (s.numel, s.nan, s.posinf, s.neginf, s.zero, s.subnormal, s.fp16_overflow) == (
        10, 1, 1, 1, 2, 1, 1,
    )
    assert (s.min, s.max, s.absmax) == (-2.0, 7.0e4, 7.0e4)
    assert t[7].item() > 0  # 1e-40 is a float32 subnormal, absorbed exactly by the sum:
    assert s.sum == 1.0 - 2.0 + 7.0e4 + 65504.0
    assert s.l2 == math.sqrt(1.0 + 4.0 + 4.9e9 + 65504.0**2)
    assert s.nonfinite == 3
    assert s.hash == hash_reference(t)


def test_hand_computed_int32():
    t = torch.tensor([3, -70000, 0, 65504, 65505, -65505, -65504], dtype=torch.int32)
    (s,) = tensor_stats([t])
    assert (s.numel, s.nan, s.posinf, s.neginf, s.zero, s.subnormal, s.fp16_overflow) == (
        7, 0, 0, 0, 1, 0, 3,
    )
    assert (s.min, s.max, s.absmax) == (-70000.0, 65505.0, 70000.0)
    assert s.sum == float(3 - 70000 + 65504 + 65505 - 65505 - 65504)
    assert s.l2 == math.sqrt(float(9 + 70000**2 + 2 * 65504**2 + 2 * 65505**2))
    assert s.hash == hash_reference(t)


def test_hand_computed_bool():
    (s,) = tensor_stats([torch.tensor([True, False, True, True])])
    assert (s.numel, s.zero, s.nan, s.subnormal, s.fp16_overflow) == (4, 1, 0, 0, 0)
    assert (s.min, s.max, s.absmax, s.sum, s.l2) == (0.0, 1.0, 1.0, 3.0, math.sqrt(3.0))


def test_hand_computed_int64_extremes():
    lo, hi = -(2**63), 2**63 - 1
    t = torch.tensor([lo, hi, 0, 2**53 + 1], dtype=torch.int64)
    (s,) = tensor_stats([t])
    assert (s.zero, s.fp16_overflow) == (1, 3)
    # int64 values enter min/max/sum as float64 (rounded beyond 2^53, as documented).
    assert (s.min, s.max, s.absmax) == (float(lo), float(hi), 2.0**63)
    assert s.hash == hash_reference(t)


def test_subnormal_is_per_own_dtype():
    # 1e-5 is normal in float32 but below fp16's smallest normal 2^-14 ~ 6.1e-5.
    x32 = torch.tensor([1e-5, 2.0**-14, 2.0**-24, -(2.0**-15)], dtype=torch.float32)
    s32, s16 = tensor_stats([x32, x32.half()])
    assert s32.subnormal == 0
    assert s16.subnormal == 3  # 1e-5, 2^-24, -2^-15; 2^-14 is fp16's smallest normal
    xb = torch.tensor([2.0**-126, 2.0**-127, 2.0**-133, 1.0], dtype=torch.bfloat16)
    x64 = torch.tensor([2.0**-1022, 2.0**-1023, 5e-324, 1e-310], dtype=torch.float64)
    sb, s64 = tensor_stats([xb, x64])
    assert (sb.subnormal, s64.subnormal) == (2, 3)
    # Subnormals are finite: they enter min/max/sum with their exact value.
    assert sb.min == 2.0**-133 and s64.min == 5e-324 and s64.sum == math.fsum(x64.tolist())


def test_fp16_overflow_boundaries():
    f32 = torch.tensor([65504.0, -65504.0, 65504.004, -65505.0, 1e38, math.inf, math.nan])
    f16 = torch.tensor([65504.0, -65504.0, math.inf, -math.inf], dtype=torch.float16)
    bf16 = torch.tensor([65280.0, 65536.0, -65536.0], dtype=torch.bfloat16)  # 65504 is not a bf16
    i16 = torch.tensor([32767, -32768], dtype=torch.int16)
    i64 = torch.tensor([65504, -65504, 65505, -65505, -(2**63)], dtype=torch.int64)
    u8 = torch.tensor([255, 0], dtype=torch.uint8)
    got = [s.fp16_overflow for s in tensor_stats([f32, f16, bf16, i16, i64, u8])]
    assert got == [3, 0, 2, 0, 3, 0]  # ±inf and NaN are not overflows; fp16 never overflows


def test_no_finite_element():
    for dtype in FLOAT_DTYPES:
        t = torch.tensor([math.nan, math.inf, -math.inf, math.nan], dtype=dtype)
        (s,) = tensor_stats([t])
        assert (s.numel, s.nan, s.posinf, s.neginf, s.zero) == (4, 2, 1, 1, 0)
        assert s.min is None and s.max is None and s.absmax is None
        assert s.sum == 0.0 and s.l2 == 0.0 and s.nonfinite == 4


def test_one_nan_does_not_hide_the_rest():
    for dtype in FLOAT_DTYPES:
        t = torch.tensor([math.nan, -3.0, 2.0, math.inf, math.nan], dtype=dtype)
        (s,) = tensor_stats([t])
        assert (s.min, s.max, s.absmax, s.sum) == (-3.0, 2.0, 3.0, -1.0)
        assert s.l2 == math.sqrt(13.0)


def test_signed_zero():
    pos, neg = torch.tensor([0.0]), torch.tensor([-0.0])
    sp, sn = tensor_stats([pos, neg])
    assert sp.zero == sn.zero == 1 and sp.subnormal == sn.subnormal == 0
    assert sp.min == sn.min == 0.0 and sn.absmax == 0.0
    assert math.copysign(1.0, sn.absmax) == 1.0  # |x| is never -0
    assert sp.hash != sn.hash  # different bits
    assert (sp.hash, sn.hash) == (hash_reference(pos), hash_reference(neg))


def test_float64_accumulation_overflows_to_inf():
    fmax = torch.finfo(torch.float64).max
    (s,) = tensor_stats([torch.tensor([fmax, fmax, 1.0], dtype=torch.float64)])
    assert (s.max, s.absmax, s.fp16_overflow) == (fmax, fmax, 2)
    assert s.sum == math.inf and s.l2 == math.inf


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 5)])
def test_empty(dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    (s,) = tensor_stats([t])
    assert (s.numel, s.nan, s.posinf, s.neginf, s.zero, s.subnormal, s.fp16_overflow) == (0,) * 7
    assert s.min is None and s.max is None and s.absmax is None
    assert s.sum == 0.0 and s.l2 == 0.0
    assert s.hash == hash_reference(t)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_one_element_and_zero_dim(dtype):
    values = {torch.bool: [0, 1], torch.uint8: [0, 5, 200]}.get(dtype, [-7, 0, 5])
    for v in values:
        t0 = torch.tensor(v, dtype=dtype)  # 0-d
        s0, s1 = tensor_stats([t0, t0.reshape(1, 1, 1)])
        assert_matches_reference(s0, reference_stats(t0), f"0-d {v}")
        assert bitwise_key(s0) == bitwise_key(s1)
        assert s0.min == s0.max == float(v)


# ---------------------------------------------------------------------------------------------
# Every field, every dtype, against the float64 reference


SIZES = [1, 2, 3, 15, 16, 17, 33, 1023, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
@pytest.mark.parametrize("n", SIZES)
def test_reference_random(dtype, n):
    t = random_tensor(dtype, n, seed=1000 * n + ALL_DTYPES.index(dtype))
    s = check_one(t, f"{dtype} n={n}")
    if is_float(dtype) and n >= 1023:
        # The planted values make every class non-empty, so no field is checked only at zero.
        assert s.nan and s.posinf and s.neginf and s.zero and s.subnormal
        assert s.fp16_overflow or dtype == torch.float16


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_reference_unplanted(dtype):
    # Plain random data: the sum tolerance is not swamped by planted extremes.
    for n in (5, 4099, 2 * CHUNK + 3):
        check_one(random_tensor(dtype, n, seed=n, plant=False), f"{dtype} n={n}")


def _clean_base(dtype, n, seed):
    """Finite, nonzero, normal values below 65504 (integers: 1..100): no element in any class."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.ones(n, dtype=dtype)
    if is_float(dtype):
        mag = torch.empty(n, dtype=torch.float64).uniform_(0.5, 100.0, generator=g)
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        return (mag * sign).to(dtype)
    return torch.randint(1, 101, (n,), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_single_special_at_each_boundary(dtype):
    """One special element at a first/last/chunk-boundary index is counted exactly once and moves
    min/max exactly; everything else in the tensor is clean."""
    n = 3 * CHUNK + 5
    base = _clean_base(dtype, n, seed=7)
    (sb,) = tensor_stats([base])
    assert (sb.nan, sb.posinf, sb.neginf, sb.zero, sb.subnormal, sb.fp16_overflow) == (0,) * 6
    if is_float(dtype):
        sub = torch.finfo(dtype).tiny / 2
        cases = {
            "nan": math.nan,
            "posinf": math.inf,
            "neginf": -math.inf,
            "zero": -0.0,
            "subnormal": sub,
        }
        if dtype != torch.float16:
            cases["fp16_overflow"] = -1.0e5
    elif dtype == torch.bool:
        cases = {"zero": 0}
    else:
        cases = {"zero": 0}
        if dtype not in (torch.int8, torch.int16, torch.uint8):
            cases["fp16_overflow"] = -70000
    tensors, expect = [], []
    for p in boundary_positions(n):
        for field, v in cases.items():
            t = base.clone()
            t[p] = v
            tensors.append(t)
            expect.append((p, field, t[p].item()))
    for s, t, (p, field, v) in zip(tensor_stats(tensors), tensors, expect):
        for f in ("nan", "posinf", "neginf", "zero", "subnormal", "fp16_overflow"):
            assert getattr(s, f) == (1 if f == field else 0), f"{field} at {p}: {f}={getattr(s, f)}"
        if field in ("zero", "subnormal", "fp16_overflow"):
            assert s.min == min(sb.min, v), f"{field} at {p}"
        assert s.hash == hash_reference(t), f"{field} at {p}"


# The CPU backend skips the element classes for blocks of 1024 elements that are all "ordinary"
# (zero, or normal with |x| <= 65504; kernels/stats_cpu.cpp, Note [Ordinary elements]).
ORDINARY_MAX = {
    torch.float32: 65504.0,
    torch.float64: 65504.0,
    torch.float16: 65504.0,
    torch.bfloat16: 65280.0,  # the largest bfloat16 <= 65504
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=ids)
def test_ordinary_blocks_and_their_edges(dtype):
    """All-ordinary data, then one element just outside the ordinary range (or NaN/Inf) at the
    start or end of a 1024-element block, at chunk boundaries and in the unvectorised tail."""
    n = 2 * CHUNK + 1024 + 7  # tail of 7 elements after the last 16-lane group
    g = torch.Generator().manual_seed(3)
    fi = torch.finfo(dtype)
    mag = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-4.0, 11.0, generator=g))
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    base = (mag * sign).clamp(-ORDINARY_MAX[dtype], ORDINARY_MAX[dtype]).to(dtype)
    sign_bit = 1 << (8 * base.element_size() - 1)
    top = ORDINARY_MAX[dtype]
    for k, v in enumerate([0.0, -0.0, fi.tiny, -fi.tiny, top, -top]):
        base[5 + 1024 * k] = v  # ordinary edges, each in its own block
    outside = [math.nan, math.inf, -math.inf, fi.tiny / 2, -fi.tiny * fi.eps]
    if dtype != torch.float16:
        outside.append(-torch.tensor(1.0e5).to(dtype).item())  # an fp16 overflow
    positions = [0, 1023, 1024, 2047, CHUNK - 1, CHUNK, CHUNK + 4095, n - 8, n - 7, n - 1]
    tensors = [base]
    for k, p in enumerate(positions):
        t = base.clone()
        t[p] = outside[k % len(outside)]
        tensors.append(t)
    # The neighbours of the ordinary range in the dtype itself: finite, but outside the fast path.
    top_bits = get_bits(torch.tensor([top], dtype=dtype), 0)
    tiny_bits = get_bits(torch.tensor([fi.tiny], dtype=dtype), 0)
    edges = {
        2048: top_bits + 1,  # just above the largest ordinary value
        3 * 1024 + 100: sign_bit | (top_bits + 1),  # and just below its negative
        5 * 1024 + 9: tiny_bits - 1,  # the largest subnormal
    }
    for p, bits in edges.items():
        t = base.clone()
        set_bits(t, p, bits)
        assert t[p].item() > top or t[p].item() < -top or 0 < t[p].item() < fi.tiny
        tensors.append(t)
    stats = tensor_stats(tensors)
    assert (stats[0].nan, stats[0].posinf, stats[0].subnormal, stats[0].fp16_overflow) == (0,) * 4
    assert stats[0].zero >= 2 and stats[0].max == top
    for i, (s, t) in enumerate(zip(stats, tensors)):
        assert_matches_reference(s, reference_stats(t), f"variant {i}")


# ---------------------------------------------------------------------------------------------
# Views: non-contiguous, permuted, > 6 dims, expanded


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
@pytest.mark.parametrize("name", VIEW_NAMES)
def test_views(dtype, name):
    v = make_view(name, dtype, seed=77 + ALL_DTYPES.index(dtype))
    if name in EXPECTED_NDIM:
        assert collapsed_ndim(v) == EXPECTED_NDIM[name]
    if not name.startswith("misaligned"):
        assert not v.is_contiguous()
    s_view, s_copy = tensor_stats([v, v.contiguous()])
    ref = reference_stats(v)
    assert_matches_reference(s_view, ref, name)
    assert_same_stats(s_view, s_copy, ref["abs_sum"], name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32], ids=ids)
def test_neg_view(dtype):
    base = random_tensor(dtype, 3000, seed=5)
    v = torch._neg_view(base.reshape(30, 100).t())
    assert v.is_neg()
    (s,) = tensor_stats([v])
    assert_matches_reference(s, reference_stats(v.resolve_neg()))


def test_as_strided_overlapping_and_storage_offset():
    base = random_tensor(torch.float32, 5000, seed=3)
    v = base.as_strided((400, 300), (7, 1), 11)  # rows overlap
    (s,) = tensor_stats([v])
    assert_matches_reference(s, reference_stats(v))


# ---------------------------------------------------------------------------------------------
# Many tensors in one call


def test_ten_thousand_small_tensors():
    rng = random.Random(0)
    tensors = []
    for i in range(10_000):
        dtype = rng.choice(ALL_DTYPES)
        n = rng.randint(0, 40)
        kind = i % 5
        if kind == 3:
            t = random_tensor(dtype, 2 * n + 1, seed=i)[::2]  # strided
        elif kind == 4 and n > 1:
            t = random_tensor(dtype, 2 * n, seed=i).reshape(2, n).t()  # transposed
        else:
            t = random_tensor(dtype, n, seed=i)
        tensors.append(t)
    stats = tensor_stats(tensors)
    assert len(stats) == len(tensors)
    for i, (s, t) in enumerate(zip(stats, tensors)):
        assert_matches_reference(s, reference_stats(t), f"tensors[{i}] {t.dtype} {tuple(t.shape)}")
    # Batched and one-by-one give identical bits.
    for i in range(0, len(tensors), 97):
        assert bitwise_key(tensor_stats([tensors[i]])[0]) == bitwise_key(stats[i])


def test_mixed_sizes_and_empties_in_one_call():
    """Multi-chunk tensors interleaved with empty ones (repeated chunk-table offsets)."""
    tensors = []
    for k, dtype in enumerate(ALL_DTYPES):
        tensors.append(torch.empty(0, dtype=dtype))
        tensors.append(random_tensor(dtype, 2 * CHUNK + 3 * k + 1, seed=k))
        tensors.append(torch.empty(4, 0, dtype=dtype))
        tensors.append(random_tensor(dtype, 1 + k, seed=100 + k))
    for i, (s, t) in enumerate(zip(tensor_stats(tensors), tensors)):
        assert_matches_reference(s, reference_stats(t), f"tensors[{i}]")


def test_more_than_2_31_one_byte_elements():
    """2^31 + 1000 uint8 (then bool) elements, contiguous and expanded; expected values by hand."""
    period = torch.arange(256, dtype=torch.uint8)
    k = (2**31 + 1000) // 256  # full periods
    full = period.repeat(k + 1)  # (k + 1) * 256 > 2^31 elements, contiguous
    expanded = period.expand(k + 1, 256)  # same logical content, row stride 0
    assert full.numel() > 2**31 and expanded.stride() == (0, 1)
    s_full, s_exp = tensor_stats([full, expanded])
    sq = sum(i * i for i in range(256))
    assert s_full.numel == (k + 1) * 256
    assert (s_full.zero, s_full.fp16_overflow, s_full.subnormal) == (k + 1, 0, 0)
    assert (s_full.min, s_full.max, s_full.absmax) == (0.0, 255.0, 255.0)
    assert s_full.sum == float((k + 1) * 32640)  # integers < 2^53: exact in any order
    assert s_full.l2 == math.sqrt(float((k + 1) * sq))
    # Layout independence beyond 2^31: the strided and the contiguous path agree bit for bit.
    assert bitwise_key(s_exp) == bitwise_key(s_full)

    n = 2**31 + 1000
    v = full[:n]  # the tail holds 0..231
    v[n - 1] = 0  # was 231
    v[2**31 + 7] = 255  # was 7
    (s,) = tensor_stats([v])
    tail = range(232)
    assert s.numel == n and s.zero == k + 1 + 1
    assert s.sum == float(k * 32640 + sum(tail) - 231 + 255 - 7)
    assert s.l2 == math.sqrt(float(k * sq + sum(i * i for i in tail) - 231**2 + 255**2 - 7**2))
    assert (s.min, s.max) == (0.0, 255.0)
    assert s.hash != s_full.hash

    v.bitwise_and_(1)
    (sb,) = tensor_stats([v.view(torch.bool)])
    odd_tail = sum(1 for i in tail if i % 2)
    ones = k * 128 + odd_tail - 1  # 231 -> 0 loses a one; 7 -> 255 stays odd
    assert sb.numel == n and sb.zero == n - ones
    assert (sb.sum, sb.min, sb.max) == (float(ones), 0.0, 1.0)

    ones_1d = torch.ones(1, dtype=torch.uint8).expand(n)  # stride 0, no memory
    (s1,) = tensor_stats([ones_1d])
    assert (s1.numel, s1.zero, s1.sum, s1.min, s1.max) == (n, 0, float(n), 1.0, 1.0)
    assert s1.l2 == math.sqrt(float(n))


# ---------------------------------------------------------------------------------------------
# Hash properties


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_hash_independent_of_layout(dtype):
    x = random_tensor(dtype, 6 * 25 * 11 * 47, seed=11).reshape(6, 25, 11, 47)
    col_major = x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)  # same values, new layout
    chl = x.contiguous(memory_format=torch.channels_last)
    exp_view = x[:, :1].expand(6, 25, 11, 47)
    assert not col_major.is_contiguous() and not chl.is_contiguous()
    assert (storage_bits(col_major) == storage_bits(x)).all()
    stats = tensor_stats([x, col_major, chl, x.reshape(-1), x.reshape(150, 517), exp_view,
                          exp_view.contiguous()])
    for s in stats[1:5]:
        assert_same_stats(s, stats[0], reference_stats(x)["abs_sum"])
    assert stats[5].hash == stats[6].hash and stats[5].hash != stats[0].hash
    assert stats[0].hash == hash_reference(x)


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    set_bits(out, index, get_bits(t, index) ^ (1 << bit))
    return out


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_hash_changes_on_every_single_bit_flip(dtype):
    n = 97
    x = random_tensor(dtype, n, seed=21)
    width_bits = 8 * x.element_size()
    rng = random.Random(ALL_DTYPES.index(dtype))
    flips = set()
    if dtype == torch.bool:
        flips |= {(i, 0) for i in range(n)}  # the only valid bit of a bool
    else:
        flips |= {(rng.randrange(n), rng.randrange(width_bits)) for _ in range(400)}
        flips |= {(i, b) for i in (0, n - 1) for b in range(width_bits)}  # every bit, both ends
    if is_float(dtype):
        x[3] = 0.0
        set_bits(x, 5, nan_bit_patterns(dtype)[1])  # a quiet NaN
        flips |= {(3, width_bits - 1)}  # 0.0 -> -0.0
        nmant = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}[dtype]
        flips |= {(5, b) for b in range(nmant)}  # NaN payloads (and NaN -> Inf for the quiet bit)
        flips |= {(5, width_bits - 1)}  # NaN sign
    flips = sorted(flips)
    variants = [_flip(x, i, b) for i, b in flips]
    stats = tensor_stats([x] + variants)
    hashes = [s.hash for s in stats]
    assert len(set(hashes)) == len(hashes), "two different tensors share a hash"
    for (i, b), v, s in zip(flips, variants, stats[1:]):
        assert s.hash == hash_reference(v), f"flip element {i} bit {b}"
    if is_float(dtype):
        neg_zero = variants[flips.index((3, width_bits - 1))]
        assert neg_zero[3].item() == 0.0 and math.copysign(1.0, neg_zero[3].item()) == -1.0


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_hash_changes_on_swaps_and_permutations(dtype):
    n = 64
    if dtype == torch.bool:
        x = torch.arange(n) % 3 == 0
    else:
        x = random_tensor(dtype, n, seed=31, plant=False)
    bits = [get_bits(x, i) for i in range(n)]
    rng = random.Random(5)
    swapped = []
    for _ in range(200):
        i, j = rng.sample(range(n), 2)
        y = x.clone()
        y[i], y[j] = x[j].clone(), x[i].clone()
        swapped.append((bits[i] != bits[j], y))
    perms = [x[torch.randperm(n, generator=torch.Generator().manual_seed(s))] for s in range(50)]
    perms.append(x.roll(1))
    stats = tensor_stats([x] + [y for _, y in swapped] + perms)
    h0 = stats[0].hash
    for (differ, y), s in zip(swapped, stats[1:]):
        assert (s.hash != h0) == differ  # swapping equal bits leaves the same tensor
        assert s.hash == hash_reference(y)
    for p, s in zip(perms, stats[1 + len(swapped):]):
        same = all(get_bits(p, i) == bits[i] for i in range(n))
        assert (s.hash == h0) == same


def test_repeated_calls_bitwise_equal():
    batch = mixed_batch()
    first = [bitwise_key(s) for s in tensor_stats(batch)]
    for _ in range(3):
        assert [bitwise_key(s) for s in tensor_stats(batch)] == first
    assert [bitwise_key(s) for s in trainsan.tensor_stats_async(batch).result()] == first


def test_thread_count_independence():
    batch = mixed_batch()
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([bitwise_key(s) for s in tensor_stats(batch)])
    finally:
        torch.set_num_threads(saved)
    assert torch.get_num_threads() == saved
    assert results[0] == results[1] == results[2]
