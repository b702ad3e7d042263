"""The CUDA backend of trainsan.tensor_stats against the CPU backend and the float64/numpy oracles.

Counts, min/max/absmax and hash must equal the CPU backend exactly; sum and l2 within the one
tolerance of stats_reference (relative 1e-12 of the sum's scale). Skipped where no CUDA device is
visible.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

import trainsan
from stats_reference import (
    ALL_DTYPES,
    CHUNK,
    VIEW_NAMES,
    assert_matches_reference,
    assert_same_stats,
    bitwise_key,
    get_bits,
    hash_reference,
    make_view,
    random_tensor,
    reference_stats,
    set_bits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]

tensor_stats = trainsan.tensor_stats


@pytest.fixture(autouse=True, scope="module")
def _needs_cuda_build():
    if not trainsan.cuda_compiled():
        pytest.fail("a CUDA device is visible but this TrainSan build has no CUDA kernels")


def ids(dtype):
    return str(dtype).replace("torch.", "")


def compare(cpu_tensors, gpu_tensors, what="", with_reference=True):
    """One CUDA pass over gpu_tensors against one CPU pass over the same logical tensors and
    (unless with_reference=False, for sizes where the exact Python sums would be slow) against
    the float64 reference."""
    assert all(t.is_cuda for t in gpu_tensors)
    gs = tensor_stats(gpu_tensors)
    cs = tensor_stats(cpu_tensors)
    for i, (g, c, t) in enumerate(zip(gs, cs, cpu_tensors)):
        w = f"{what} [{i}] {t.dtype} {tuple(t.shape)}"
        if with_reference:
            ref = reference_stats(t)
            assert_matches_reference(g, ref, w)
            scale = ref["abs_sum"]
        else:
            d = t.double()
            scale = float(d[torch.isfinite(d)].abs().sum())
        assert_same_stats(g, c, scale, w)
    return gs


SIZES = [0, 1, 2, 3, 15, 16, 17, 31, 1023, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_gpu_equals_cpu_all_sizes(dtype):
    ts = [random_tensor(dtype, n, seed=500 + n) for n in SIZES]
    compare(ts, [t.cuda() for t in ts], str(dtype))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
@pytest.mark.parametrize("name", VIEW_NAMES)
def test_gpu_views(dtype, name):
    seed = 900 + ALL_DTYPES.index(dtype)
    compare([make_view(name, dtype, seed)], [make_view(name, dtype, seed, "cuda")], name)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_gpu_misaligned_starts(dtype):
    """Slices starting at every offset of a 16-byte vector, so the vectorised and the scalar load
    paths both run, across chunk boundaries."""
    base = random_tensor(dtype, 2 * CHUNK + 40, seed=8)
    gbase = base.cuda()
    per_vec = 16 // base.element_size()
    offsets = range(per_vec + 1)
    compare([base[k:] for k in offsets] + [base[k : CHUNK + k + 3] for k in offsets],
            [gbase[k:] for k in offsets] + [gbase[k : CHUNK + k + 3] for k in offsets])


def test_gpu_many_tensors_one_call():
    rng = random.Random(1)
    ts = []
    for i in range(10_000):
        dtype = rng.choice(ALL_DTYPES)
        t = random_tensor(dtype, rng.randint(0, 40), seed=i)
        ts.append(t)
    ts += [random_tensor(d, 2 * CHUNK + 5, seed=k) for k, d in enumerate(ALL_DTYPES)]
    rng.shuffle(ts)
    compare(ts, [t.cuda() for t in ts], "many")


def test_gpu_more_chunks_than_a_block():
    # 305 chunks: the per-tensor combine walks its partials in steps of the block size.
    t = random_tensor(torch.float32, 305 * CHUNK - 11, seed=3)
    (g,) = compare([t], [t.cuda()], with_reference=False)
    assert g.hash == hash_reference(t)


def test_gpu_more_than_2_31_elements():
    n = 2**31 + 1000
    period = torch.arange(256, dtype=torch.uint8, device="cuda")
    g = period.repeat(n // 256 + 1)[:n]
    g[n - 1] = 0
    g[2**31 + 7] = 255
    (sg,) = tensor_stats([g])
    (sc,) = tensor_stats([g.cpu()])
    assert bitwise_key(sg) == bitwise_key(sc)  # integer data: sums are exact on both
    gb = (g & 1).view(torch.bool)
    sb, sbc = tensor_stats([gb]) + tensor_stats([gb.cpu()])
    assert bitwise_key(sb) == bitwise_key(sbc)
    assert sb.numel == n and sb.sum == float(n - sb.zero)


def test_gpu_more_chunks_than_the_grid():
    """2^36 + 5 expanded elements: more chunks (2^20 + 1) than one launch's grid, int64 indices
    far beyond 2^31, no memory. Expected values by hand (integer sums are exact)."""
    n = 2**36 + 5
    t = torch.ones(1, dtype=torch.uint8, device="cuda").expand(n)
    s1, s2 = tensor_stats([t]), tensor_stats([t])
    (s,) = s1
    assert (s.numel, s.zero, s.nan, s.fp16_overflow) == (n, 0, 0, 0)
    assert (s.min, s.max, s.absmax, s.sum) == (1.0, 1.0, 1.0, float(n))
    assert s.l2 == math.sqrt(float(n))
    assert bitwise_key(s2[0]) == bitwise_key(s)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
def test_gpu_hash_bit_flips(dtype):
    x = random_tensor(dtype, 61, seed=4)
    width_bits = 8 * x.element_size()
    rng = random.Random(2)
    flips = sorted({(rng.randrange(61), 0 if dtype == torch.bool else rng.randrange(width_bits))
                    for _ in range(200)})
    variants = []
    for i, b in flips:
        v = x.clone()
        set_bits(v, i, get_bits(x, i) ^ (1 << b))
        variants.append(v)
    gs = tensor_stats([v.cuda() for v in [x] + variants])
    assert len({s.hash for s in gs}) == len(gs)
    for s, v in zip(gs, [x] + variants):
        assert s.hash == hash_reference(v)


def test_gpu_mixed_cpu_and_cuda_list():
    ts = [random_tensor(d, 1000 + 7 * k, seed=k) for k, d in enumerate(ALL_DTYPES)]
    mixed = [t.cuda() if k % 2 else t for k, t in enumerate(ts)]
    got = tensor_stats(mixed)
    for k, (s, t) in enumerate(zip(got, ts)):
        (alone,) = tensor_stats([mixed[k]])
        assert bitwise_key(s) == bitwise_key(alone), f"tensors[{k}]"
        assert_matches_reference(s, reference_stats(t), f"tensors[{k}]")
    pending = trainsan.tensor_stats_async(mixed)
    assert [bitwise_key(s) for s in pending.result()] == [bitwise_key(s) for s in got]


def test_gpu_raw_op_is_packed_on_device_and_one_device_only():
    t = random_tensor(torch.float32, 100, seed=1).cuda()
    ints, floats = torch.ops.trainsan.tensor_stats([t, t[::2]])
    assert ints.is_cuda and floats.is_cuda
    assert tuple(ints.shape) == (2, 8) and tuple(floats.shape) == (2, 5)
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        torch.ops.trainsan.tensor_stats([t, t.cpu()])
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        torch.ops.trainsan.tensor_stats([t.cpu(), t])


def _batch():
    out = [random_tensor(d, 3 * CHUNK + 99, seed=40 + k).cuda() for k, d in enumerate(ALL_DTYPES)]
    out += [make_view("permute_4d", torch.float32, seed=1, device="cuda")]
    out += [make_view("nine_dims_reversed", torch.bfloat16, seed=2, device="cuda")]
    out += [torch.empty(0, device="cuda")]
    return out


def test_gpu_run_twice_bitwise_equal():
    batch = _batch()
    first = [bitwise_key(s) for s in tensor_stats(batch)]
    for _ in range(3):
        assert [bitwise_key(s) for s in tensor_stats(batch)] == first
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        on_side_stream = [bitwise_key(x) for x in tensor_stats(batch)]
    assert on_side_stream == first


def test_gpu_async_does_not_wait_for_the_device():
    batch = _batch()
    want = [bitwise_key(s) for s in tensor_stats(batch)]
    trainsan.tensor_stats_async(batch).result()  # warm the pinned-memory caches
    torch.cuda.synchronize()
    torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU time queued ahead of the pass
    t0 = time.perf_counter()
    pending = trainsan.tensor_stats_async(batch)
    launched_in = time.perf_counter() - t0
    ready_at_once = pending.ready()
    got = [bitwise_key(s) for s in pending.result()]
    assert not ready_at_once, "the results were ready before the queued work ran: it synchronised"
    assert launched_in < 0.5, f"launching took {launched_in:.2f} s"
    assert got == want
    assert pending.ready()


def test_gpu_opcheck():
    ts = [random_tensor(d, 33, seed=k, plant=False).cuda() for k, d in enumerate(ALL_DTYPES)]
    ts += [torch.randn(20, 30, device="cuda").t(), torch.randn(4, requires_grad=True,
                                                                device="cuda")]
    result = torch.library.opcheck(torch.ops.trainsan.tensor_stats.default, (ts,))
    assert result == dict.fromkeys(result, "SUCCESS") and len(result) == 4, result
