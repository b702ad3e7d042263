"""Cost of the op audits (broadcast, label_range, batch_mismatch) on CPU training loops.

The models, batches and loss of bench_overhead.py (MLP, CNN, transformer); each step is
zero_grad / forward / loss / backward / optimizer.step with TrainSan attached (policy "record").

1. Audited step. One sanitizer with ``audit_first_steps=0, audit_every=2``: even steps are
   audited, odd ones not, on the same model and optimizer. The overhead of an audited step is
   the median over steps of (audited step - mean of its two unaudited neighbours), which cancels
   drift and placement effects; "observer" is the callback's own time (in
   ``san.overhead_seconds``), the rest is ATen's RecordFunction boxing every op's inputs.
2. Steady state at the default sampling (one audited step in ``audit_every`` = 100), against the
   sanitizer without audits (``checks={kind: False}``): derived as (audited-step overhead) / 100
   + the per-step bookkeeping of an unaudited step; and measured, as the difference of mean step
   times of two model copies (``default`` and ``off``) stepped alternately, next to the same
   difference between two identical ``off`` copies (the noise floor of that measurement).
3. Per-op cost of the observer: a forward of 2000 small elementwise ops, audited vs not.

    python3 bench/bench_audit.py [--steps N] [--models mlp,cnn,transformer] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trainsan  # noqa: E402
from bench_overhead import MODELS, loss_fn, make_batches, make_optimizer  # noqa: E402

AUDIT_KINDS = ("broadcast", "label_range", "label_dtype", "batch_mismatch")
OFF = {"checks": {k: False for k in AUDIT_KINDS}}


class Loop:
    """A model copy, its optimizer and sanitizer; step() returns (seconds, own seconds)."""

    def __init__(self, kind, base, batches, optimizer, **options):
        self.kind, self.batches = kind, batches
        self.model = copy.deepcopy(base)
        self.opt = make_optimizer(optimizer, self.model)
        self.san = trainsan.attach(self.model, self.opt, policy="record", **options)
        self.i = 0

    def step(self):
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        own0 = self.san.overhead_seconds
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss_fn(self.kind, self.model(x), y).backward()
        self.opt.step()
        return time.perf_counter() - t0, self.san.overhead_seconds - own0

    def close(self):
        self.san.close()
        return [(f.kind, f.count) for f in self.san.findings]


def audited_step(kind, base, batches, args):
    loop = Loop(kind, base, batches, args.optimizer, audit_first_steps=0, audit_every=2)
    for _ in range(args.warmup):
        loop.step()
    if loop.san.step % 2:
        loop.step()  # start on an audited (even) step
    ts, own = [], []
    for _ in range(2 * args.steps + 1):
        t, o = loop.step()
        ts.append(t)
        own.append(o)
    findings = loop.close()
    diffs = [ts[i] - (ts[i - 1] + ts[i + 1]) / 2 for i in range(2, len(ts) - 1, 2)]
    own_diffs = [own[i] - (own[i - 1] + own[i + 1]) / 2 for i in range(2, len(own) - 1, 2)]
    unaudited = statistics.median(ts[1::2])
    return {
        "step_ms": unaudited * 1e3,
        "audited_overhead_ms": statistics.median(diffs) * 1e3,
        "audited_overhead_pct": 100 * statistics.median(diffs) / unaudited,
        "observer_ms": statistics.median(own_diffs) * 1e3,
        "findings": findings,
    }


def steady_state(kind, base, batches, args):
    loops = {"off": Loop(kind, base, batches, args.optimizer, **OFF),
             "off_again": Loop(kind, base, batches, args.optimizer, **OFF),
             "default": Loop(kind, base, batches, args.optimizer)}
    for loop in loops.values():
        for _ in range(max(args.warmup, trainsan.OPTIONS["audit_first_steps"])):
            loop.step()
    times = {n: [] for n in loops}
    names = list(loops)
    for k in range(args.steps):
        for j in range(len(names)):  # one step each, the order rotating
            n = names[(k + j) % len(names)]
            times[n].append(loops[n].step()[0])
    findings = {n: loop.close() for n, loop in loops.items()}
    mean = {n: statistics.fmean(v) for n, v in times.items()}
    return {
        "measured_ms": (mean["default"] - mean["off"]) * 1e3,
        "measured_pct": 100 * (mean["default"] - mean["off"]) / mean["off"],
        "noise_floor_pct": 100 * (mean["off_again"] - mean["off"]) / mean["off"],
        "audited_steps": sum(1 for s in range(args.warmup, args.warmup + args.steps)
                             if s % trainsan.OPTIONS["audit_every"] == 0),
        "findings": findings,
    }


class ManyOps(nn.Module):
    def __init__(self, n=2000):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.n = n

    def forward(self, x):
        h = x * self.w
        for _ in range(self.n // 2):
            h = h * 1.0001 + self.w
        return h


def per_op(args):
    """Forward + backward of 2000 small elementwise ops, audited (even steps) or not (odd)."""
    model = ManyOps()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    san = trainsan.attach(model, opt, policy="record", audit_first_steps=0, audit_every=2)
    x = torch.randn(4, 8)
    ts = []
    for _ in range(2 * 60 + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        ts.append(time.perf_counter() - t0)
    san.close()
    ts = ts[20:]  # after warm-up, starting at an audited (even) step
    diffs = [ts[i] - (ts[i - 1] + ts[i + 1]) / 2 for i in range(2, len(ts) - 1, 2)]
    ops = model.n + 1  # forward ops audited (backward is not)
    return {"us_per_op": statistics.median(diffs) / ops * 1e6,
            "step_ms": statistics.median(ts[1::2]) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"{args.steps} timed steps per measurement, audit_every="
          f"{trainsan.OPTIONS['audit_every']}")
    torch.manual_seed(0)
    po = per_op(args)
    print(f"\nobserver per op (2000 elementwise ops): {po['us_per_op']:.2f} us per audited op "
          f"(unaudited step {po['step_ms']:.1f} ms)")
    results = {"per_op": po, "models": []}
    period = trainsan.OPTIONS["audit_every"]
    for kind in args.models.split(","):
        desc, factory = MODELS[kind]
        torch.manual_seed(0)
        base = factory()
        batches = make_batches(kind, 8, torch.device("cpu"), torch.Generator().manual_seed(1))
        a = audited_step(kind, base, batches, args)
        s = steady_state(kind, base, batches, args)
        derived_pct = a["audited_overhead_pct"] / period
        r = {"model": kind, "desc": desc, "audited": a, "steady": s,
             "steady_derived_pct": derived_pct}
        results["models"].append(r)
        print(f"\n{kind}: {desc}")
        print(f"  step (unaudited)            {a['step_ms']:8.2f} ms")
        print(f"  audited step overhead       {a['audited_overhead_ms']:+8.3f} ms "
              f"({a['audited_overhead_pct']:+.2f}%), of which the observer's own "
              f"{a['observer_ms']:.3f} ms")
        print(f"  steady state, derived       {derived_pct:+.4f}% (audited-step overhead / "
              f"{period})")
        print(f"  steady state, measured      {s['measured_pct']:+.2f}% "
              f"({s['measured_ms']:+.3f} ms; A/A noise floor {s['noise_floor_pct']:+.2f}%; "
              f"{s['audited_steps']} audited steps among {args.steps})")
        print(f"  findings: {a['findings']} {s['findings']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
