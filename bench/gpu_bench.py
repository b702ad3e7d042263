"""GPU benchmark of TrainSan's fused statistics pass.

For bfloat16 and float32, 2 GiB spread over 300 tensors of log-uniform sizes (separate
allocations, as a model's parameters are), it times with CUDA events (warm-up, then the median of
N runs):

  trainsan op      torch.ops.trainsan.tensor_stats: the fused pass, results left on the device
                   (one call between the events; and 10 back to back, per call: the device time
                   once the host launch overlaps the previous pass)
  trainsan.tensor_stats  the Python API end to end: pass, copy to the host, TensorStats objects
  copy_ (tensors)  dst.copy_(src) per tensor: device-to-device copy of the same bytes
  copy_ (flat)     one copy_ of a single buffer of the same size: the copy bandwidth reference
  _foreach_norm    torch._foreach_norm alone (L2 norms only)
  torch ops        the thirteen statistics with torch ops, one tensor at a time (see
                   `torch_stats`), checked against trainsan before it is timed

GB/s counts the bytes of the tensors once per run (a copy also writes them: its read+write rate is
twice the figure shown). "% copy" is against `copy_ (flat)`; "trainsan x" is how many times faster
the trainsan op is than the row.

Run (no GPU: prints a message and exits 0):
    TRAINSAN_LIBRARY=build/gpu/bindings/libtrainsan_ops.so PYTHONPATH=bindings \\
        python3 bench/gpu_bench.py [--gib 2] [--tensors 300] [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

# Note [Hash] of kernels/stats.cuh in int64 torch ops: int64 products and sums wrap mod 2^64 like
# uint64, and a logical right shift is the arithmetic one with the copied sign bits cleared.
_INDEX_MUL = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xFF51AFD7ED558CCD - (1 << 64)
_MIX2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_LOW31 = (1 << 31) - 1
_M64 = (1 << 64) - 1


def _mix64_(h: torch.Tensor) -> torch.Tensor:
    h ^= (h >> 33) & _LOW31
    h *= _MIX1
    h ^= (h >> 33) & _LOW31
    h *= _MIX2
    h ^= (h >> 33) & _LOW31
    return h


def _mix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    x ^= x >> 33
    return x


_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
         torch.float16: (torch.int16, 0xFFFF), torch.float64: (torch.int64, None)}


def _torch_stats_one(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The thirteen statistics of one float tensor with torch ops, as trainsan packs them.

    Returns int64 [nan, posinf, neginf, zero, subnormal, fp16_overflow, hash-sum S] and float64
    [min, max, absmax, sum, sumsq], all on the device: masks with ``where`` (no data-dependent
    shapes, so no synchronisation per tensor); 16-bit tensors are widened to float32 (exact) so
    that the thresholds are compared exactly; sums in float64; S = sum_i mix64(b_i + i*K) mod 2^64
    over the element bits b_i, as Note [Hash] defines it.
    """
    x = t.float() if t.element_size() == 2 else t
    tiny = torch.finfo(t.dtype).tiny
    fin = torch.isfinite(x)
    xf = torch.where(fin, x, 0.0)
    a = xf.abs()
    view, mask = _BITS[t.dtype]
    h = t.contiguous().view(-1).view(view).to(torch.int64)
    if mask is not None:
        h &= mask
    h += torch.arange(t.numel(), device=t.device, dtype=torch.int64) * _INDEX_MUL
    ints = torch.stack([
        torch.isnan(x).sum(), torch.isposinf(x).sum(), torch.isneginf(x).sum(), (x == 0).sum(),
        ((a < tiny) & (a > 0)).sum(), (a > 65504).sum(), _mix64_(h).sum(),
    ])
    xd = xf.double().view(-1)
    floats = torch.stack([
        torch.where(fin, x, math.inf).min().double(), torch.where(fin, x, -math.inf).max().double(),
        a.max().double(), xd.sum(), torch.dot(xd, xd),
    ])
    return ints, floats


def torch_stats(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All tensors, one at a time; results stacked on the device ([N, 7] int64, [N, 5] float64)."""
    rows = [_torch_stats_one(t) for t in tensors]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def verify(tensors: list[torch.Tensor]) -> str:
    """trainsan against torch_stats: counts, hash, min/max/absmax exact; sums within rounding."""
    ti, tf = (x.cpu() for x in torch.ops.trainsan.tensor_stats(tensors))
    ri, rf = (x.cpu() for x in torch_stats(tensors))
    worst = 0.0
    for k, t in enumerate(tensors):
        n = t.numel()
        want = [n] + ri[k, :6].tolist() + [_mix64((int(ri[k, 6]) & _M64) ^ n)]
        got = ti[k].tolist()
        got[7] &= _M64
        if got != want:
            raise AssertionError(f"tensor {k}: trainsan ints {got} != torch ops {want}")
        finite = n - want[1] - want[2] - want[3]
        mn, mx, amx, s, ss = rf[k].tolist()
        ref = [mn, mx, amx] if finite else [math.nan] * 3
        for j in range(3):
            g = float(tf[k, j])
            if not (g == ref[j] or (math.isnan(g) and math.isnan(ref[j]))):
                raise AssertionError(f"tensor {k}: column {j}: trainsan {g} != torch ops {ref[j]}")
        l2 = math.sqrt(ss)
        tol = 1e-13 * n * math.sqrt(n) * l2
        for g, r in ((float(tf[k, 3]), s), (float(tf[k, 4]), l2)):
            if abs(g - r) > tol:
                raise AssertionError(f"tensor {k}: sum/l2 trainsan {g} != torch ops {r}")
            if r:
                worst = max(worst, abs(g - r) / abs(r))
    return f"ok ({len(tensors)} tensors; largest relative sum/l2 difference {worst:.1e})"


def make_tensors(
    dtype: torch.dtype, total_bytes: int, count: int, seed: int, device: str = "cuda"
) -> list[torch.Tensor]:
    """`count` tensors of log-uniform sizes (3 decades) adding up to total_bytes, N(0,1) values,
    with a NaN, an Inf, a subnormal and a value beyond fp16 range in a few of them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.rand(count, generator=g, dtype=torch.float64) * math.log(1000.0))
    total = total_bytes // torch.empty((), dtype=dtype).element_size()
    sizes = (w / w.sum() * total).floor().to(torch.int64).clamp_(min=1)
    sizes[-1] += total - int(sizes.sum())
    torch.manual_seed(seed)
    out = []
    for k, n in enumerate(sizes.tolist()):
        t = torch.randn(n, device=device, dtype=dtype)
        if k % 50 == 7:
            t[0] = math.nan
            t[-1] = math.inf
            t[n // 2] = torch.finfo(dtype).tiny / 4  # subnormal (0 in formats without)
            t[n // 3] = -70000.0
        out.append(t)
    return out


def time_gpu(fn, warmup: int, iters: int, back_to_back: int = 1) -> float:
    """Median milliseconds per call of `fn` between CUDA events on the current stream.

    With back_to_back > 1 the events enclose that many calls (host work of one call overlaps the
    device work of the previous): the steady-state device time per call.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return statistics.median(times)


def time_wall(fn, warmup: int, iters: int) -> float:
    """Median wall-clock milliseconds of a synchronous `fn`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_dtype(dtype: torch.dtype, args) -> dict:
    import trainsan

    tensors = make_tensors(dtype, int(args.gib * (1 << 30)), args.tensors, seed=1)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result = {"dtype": str(dtype).replace("torch.", ""), "bytes": nbytes, "tensors": len(tensors)}
    if not args.skip_torch_ops:
        result["verify"] = verify(tensors)
    rows = {}
    op = torch.ops.trainsan.tensor_stats
    rows["trainsan op"] = time_gpu(lambda: op(tensors), args.warmup, args.iters)
    rows["trainsan op, 10 in a row"] = time_gpu(lambda: op(tensors), 1, args.iters, back_to_back=10)
    rows["trainsan.tensor_stats"] = time_wall(
        lambda: trainsan.tensor_stats(tensors), args.warmup, args.iters)
    dst = [torch.empty_like(t) for t in tensors]

    def copy_tensors():
        for d, s in zip(dst, tensors):
            d.copy_(s)

    rows["copy_ (tensors)"] = time_gpu(copy_tensors, args.warmup, args.iters)
    del dst
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    rows["copy_ (flat)"] = time_gpu(lambda: flat_dst.copy_(flat_src), args.warmup, args.iters)
    del flat_src, flat_dst
    rows["_foreach_norm"] = time_gpu(lambda: torch._foreach_norm(tensors), args.warmup, args.iters)
    if not args.skip_torch_ops:
        rows["torch ops"] = time_gpu(lambda: torch_stats(tensors), 1, args.torch_ops_iters)
    result["ms"] = rows
    del tensors
    torch.cuda.empty_cache()
    return result


def print_table(res: dict) -> None:
    nbytes = res["bytes"]
    rows = res["ms"]
    copy_gbs = nbytes / rows["copy_ (flat)"] / 1e6
    ours = rows["trainsan op"]
    print(f"\n{res['dtype']}: {nbytes / 2**30:.2f} GiB in {res['tensors']} tensors"
          + (f"; verify: {res['verify']}" if "verify" in res else ""))
    print(f"  {'contender':<26} {'ms':>9} {'GB/s':>9} {'% copy':>7} {'trainsan x':>10}")
    for name, ms in rows.items():
        gbs = nbytes / ms / 1e6
        print(f"  {name:<26} {ms:9.3f} {gbs:9.1f} {100 * gbs / copy_gbs:6.0f}% {ms / ours:9.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB per dtype (default 2)")
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--torch-ops-iters", type=int, default=5)
    p.add_argument("--skip-torch-ops", action="store_true", help="no torch-ops baseline or check")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--self-test", action="store_true",
                   help="no timing: check the torch-ops baseline against trainsan on small CPU "
                   "tensors (runs without a GPU)")
    args = p.parse_args()

    if args.self_test:
        import trainsan  # noqa: F401  (loads the op library)

        for name in args.dtypes.split(","):
            dtype = getattr(torch, name.strip())
            tensors = make_tensors(dtype, 16 << 20, 30, seed=1, device="cpu")
            print(f"gpu_bench self-test {name.strip()} on CPU: {verify(tensors)}")
        return 0

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device visible (torch.cuda.is_available() is False); nothing to "
              "measure, skipping.")
        return 0
    try:
        import trainsan
    except ImportError as exc:
        print(f"gpu_bench: cannot import trainsan: {exc}\n"
              "Set TRAINSAN_LIBRARY=<build>/bindings/libtrainsan_ops.so and PYTHONPATH=bindings.",
              file=sys.stderr)
        return 1
    if not trainsan.cuda_compiled():
        print("gpu_bench: this trainsan build has no CUDA kernels (TRAINSAN_WITH_CUDA was off)",
              file=sys.stderr)
        return 1
    print(f"gpu_bench: {torch.cuda.get_device_name()}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}), trainsan from {trainsan._native.load()}")
    results = []
    for name in args.dtypes.split(","):
        res = bench_dtype(getattr(torch, name.strip()), args)
        print_table(res)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
