"""Precision headroom (Note [Precision headroom] in bindings/trainsan/precision.py): the range
counts against real casts (torch's float16, bfloat16, float8_e4m3fn and float8_e5m2
conversions, round-to-nearest-even) on random inputs with NaN, ±Inf, subnormals, values at and
next to every boundary, empty and large tensors; hand-computed float64 cases; the trace records on
sampled steps; `python -m trainsan precision` and the report's summary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan
from trainsan.precision import FORMATS, range_record, range_rows

CASTS = {"float16": torch.float16, "bfloat16": torch.bfloat16,
         "float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def reference(x: torch.Tensor) -> dict:
    """Per format [to zero, subnormal, overflow] of the finite nonzero values, by casting."""
    a = x.detach().float().abs()
    fin = torch.isfinite(a)
    a = torch.where(fin, a, torch.zeros(()))
    nz = a > 0
    amax = a.max() if a.numel() else torch.zeros(())
    out = {"nonfinite": int((~fin).sum()), "nonzero": int(nz.sum()), "amax": float(amax)}
    for name, (fmax, _, normal, _, scaled) in FORMATS.items():
        y = a * (fmax / amax if float(amax) > 0 else torch.ones(())).float() if scaled else a
        c = y.to(CASTS[name]).float()
        over = (torch.isinf(c) | torch.isnan(c)) & nz
        zero = (c == 0) & nz
        subn = (c > 0) & (c < normal) & nz
        out[name] = [int(zero.sum()), int(subn.sum()), int(over.sum())]
    return out


def boundary_values() -> torch.Tensor:
    vals = []
    for _, ovf, normal, zero, _ in FORMATS.values():
        for v in (ovf, normal, zero, normal - zero, zero * 2, ovf / 2):
            t = torch.tensor(v, dtype=torch.float32)
            vals += [t, torch.nextafter(t, torch.tensor(0.0)),
                     torch.nextafter(t, torch.tensor(float("inf")))]
    return torch.stack(vals)


def check(x: torch.Tensor) -> None:
    (row,) = range_rows([x])
    rec = range_record(0, "weight", "x", x.dtype, row)
    ref = reference(x)
    assert rec["numel"] == x.numel()
    assert rec["nonfinite"] == ref["nonfinite"]
    assert rec["nonzero"] == ref["nonzero"]
    assert rec["amax"] == pytest.approx(ref["amax"], rel=0, abs=0)
    for name in FORMATS:
        assert rec[name] == ref[name], (name, rec[name], ref[name])


@pytest.mark.parametrize("seed", range(6))
def test_counts_equal_real_casts_on_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    n = 5000
    # Magnitudes spread over the whole float32 exponent range, with signs.
    e = torch.randint(-149, 128, (n,), generator=g).float()
    x = torch.ldexp(1.0 + torch.rand(n, generator=g), e) * torch.where(
        torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([x, boundary_values(), -boundary_values(),
                   torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"),
                                 1e-45, 3.4e38])])
    x = x[torch.randperm(x.numel(), generator=g)]
    check(x)
    check(x * 1e-3)  # FP8 amax scaling with another amax
    check(torch.randn(64, 64, generator=g) * 10.0 ** (seed - 3))  # ordinary weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_counts_of_half_tensors(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1000, generator=g) * torch.logspace(-8, 4, 1000)).to(dtype)
    x[::97] = float("nan")
    check(x)


def test_empty_all_zero_and_nonfinite_only():
    check(torch.empty(0))
    check(torch.zeros(10))
    check(torch.tensor([float("nan"), float("inf")]))


def test_float64_hand_computed():
    # float64 values judged without a detour through float32: 65519.99999 rounds to 65504 in
    # fp16 (not overflow), 65520 overflows; 2**-25 rounds to 0, 2**-25 * (1 + 2**-40) does not.
    x = torch.tensor([65519.99999, 65520.0, 2.0 ** -25, 2.0 ** -25 * (1 + 2.0 ** -40), 1.0],
                     dtype=torch.float64)
    (row,) = range_rows([x])
    rec = range_record(3, "grad", "x", x.dtype, row)
    assert rec["float16"] == [1, 1, 1]
    assert rec["dtype"] == "float64" and rec["step"] == 3 and rec["what"] == "grad"


def test_large_tensor_counts_exactly():
    x = torch.full((3_000_000,), 1e-6)
    x[:1000] = 7e4
    (row,) = range_rows([x])
    rec = range_record(0, "weight", "x", x.dtype, row)
    assert rec["float16"] == [0, 2_999_000, 1000]


def _train(tmp_path, steps, **opts):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "run.jsonl"
    san = trainsan.attach(model, opt, policy="record", trace=str(path), **opts)
    x = torch.randn(32, 8)
    y = torch.randint(0, 2, (32,))
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
    san.close()
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def test_trace_records_on_sampled_steps(tmp_path):
    _, recs = _train(tmp_path, steps=7, headroom_every=3)
    ranges = [r for r in recs if r["type"] == "range"]
    assert sorted({r["step"] for r in ranges}) == [0, 3, 6]
    at0 = {(r["what"], r["tensor"]) for r in ranges if r["step"] == 0}
    assert ("weight", "0.weight") in at0 and ("grad", "2.bias") in at0
    assert ("output", "0") in at0 and ("output", "2") in at0
    out0 = next(r for r in ranges if r["what"] == "output" and r["tensor"] == "0")
    assert out0["dtype"] == "bfloat16" and out0["numel"] == 32 * 16


def test_no_records_without_a_trace_or_when_off(tmp_path):
    _, recs = _train(tmp_path, steps=3, headroom_every=0)
    assert not [r for r in recs if r["type"] == "range"]


def test_precision_cli_and_report(tmp_path):
    path, _ = _train(tmp_path, steps=2)
    env = dict(__import__("os").environ)
    out = subprocess.run([sys.executable, "-m", "trainsan", "precision", str(path)],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert "precision headroom of" in out and "weight  0.weight" in out
    assert "safe: float16" in out
    rep = subprocess.run([sys.executable, "-m", "trainsan", "report", str(path)],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert "precision headroom (" in rep
    empty = tmp_path / "e.jsonl"
    _train(tmp_path, steps=1)  # rewrites run.jsonl; an empty trace for the error path:
    empty.write_text(path.read_text().splitlines()[0] + "\n")
    bad = subprocess.run([sys.executable, "-m", "trainsan", "precision", str(empty)],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "holds no precision-headroom records" in bad.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counts_equal_the_cpu_loop():
    g = torch.Generator().manual_seed(11)
    e = torch.randint(-149, 128, (20000,), generator=g).float()
    x = torch.ldexp(1.0 + torch.rand(20000, generator=g), e)
    x = torch.cat([x, boundary_values(), torch.tensor([float("nan"), float("inf"), 0.0])])
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = x.to(dt)
        assert range_rows([t.cuda()]) == range_rows([t])


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="dense floating-point tensor"):
        torch.ops.trainsan.range_histogram(torch.arange(3), [1.0])
    with pytest.raises(ValueError, match="ascending"):
        torch.ops.trainsan.range_histogram(torch.ones(3), [2.0, 1.0])
