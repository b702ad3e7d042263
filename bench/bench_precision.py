"""Cost of overflow provenance (Note [Overflow provenance], host/checks/precision.cpp) per step.

The overhead benchmark's models (bench/bench_overhead.py) train under autocast (bfloat16 on the
CPU, float16 with a GradScaler on CUDA), each contender with its own copy of the model (same
initial weights) and optimizer, interleaved in rounds of ``--block`` steps (the order rotating
each round):

- ``plain``: nothing attached;
- ``no-prov``: TrainSan with provenance off (``provenance_every=0, provenance_rearm=0``) — the
  baseline the provenance cost is measured against;
- ``default``: TrainSan at default options (module outputs flagged every 20th step);
- ``every``: ``provenance_every=1`` (every step flagged: the cost of one armed step);
- ``anomaly``: ``no-prov`` under ``torch.autograd.set_detect_anomaly(True)``, the tool that
  names a backward op today.

Armed steps are one in ``provenance_every``, so a median would not see them: the table gives
the **mean** step time over the timed steps (after ``--warmup`` untimed ones), and the cost of
each contender against ``no-prov``. Goal (issue 12): ``default`` within 3% of ``no-prov``.

    python3 bench/bench_precision.py [--steps N] [--block N] [--models mlp,cnn,transformer]
                                     [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as B  # noqa: E402
import trainsan  # noqa: E402

GOAL = 0.03
CONTENDERS = ("plain", "no-prov", "default", "every", "anomaly")
OFF = {"provenance_every": 0, "provenance_rearm": 0}


def run(args) -> dict:
    device = torch.device(args.device)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    results = {}
    for kind in args.models:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]().to(device)
        batches = B.make_batches(kind, 4, device, torch.Generator().manual_seed(1))
        cs = {}
        for name in CONTENDERS:
            m = copy.deepcopy(base)
            opt = B.make_optimizer("adamw", m)
            opts = {"plain": None, "no-prov": OFF, "default": {}, "every": {"provenance_every": 1},
                    "anomaly": OFF}[name]
            san = None if opts is None else trainsan.attach(m, opt, policy="record", **opts)
            scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" else None
            cs[name] = (m, opt, san, scaler)
        times = {n: [] for n in CONTENDERS}
        order = list(CONTENDERS)
        rounds = max(1, args.steps // args.block)
        for r in range(rounds + 1):  # round 0: warm-up
            order = order[1:] + order[:1]
            for name in order:
                m, opt, san, scaler = cs[name]
                ctx = (torch.autograd.set_detect_anomaly(True) if name == "anomaly"
                       else contextlib.nullcontext())
                with ctx:
                    for i in range(args.block):
                        x, y = batches[i % len(batches)]
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        t = time.perf_counter()
                        opt.zero_grad()
                        with torch.autocast(device.type, dtype=amp_dtype):
                            loss = B.loss_fn(kind, m(x), y)
                        if scaler is not None:
                            scaler.scale(loss).backward()
                            scaler.step(opt)
                            scaler.update()
                        else:
                            loss.backward()
                            opt.step()
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        if r > 0:
                            times[name].append(time.perf_counter() - t)
        errors = []
        for name, (m, opt, san, _) in cs.items():
            if san is not None:
                san.close()
                errors += [(name, f.kind) for f in san.findings if f.severity == "error"]
        results[kind] = dict(mean={n: statistics.fmean(v) for n, v in times.items()},
                             steps=len(times["plain"]), errors=errors)
    return results


def table(res: dict, device: str) -> str:
    lines = [f"overflow provenance, {device}, AdamW under autocast (mean step ms; cost vs no-prov)",
             f"{'model':<12} {'plain':>8} {'no-prov':>8} {'default':>8} {'cost':>7} "
             f"{'every':>8} {'cost':>7} {'anomaly':>8} {'cost':>7}"]
    for kind, r in res.items():
        md = r["mean"]
        base = md["no-prov"]

        def cost(n):
            return f"{(md[n] - base) / base * 100:>6.1f}%"

        lines.append(f"{kind:<12} {md['plain'] * 1e3:>8.2f} {base * 1e3:>8.2f} "
                     f"{md['default'] * 1e3:>8.2f} {cost('default')} {md['every'] * 1e3:>8.2f} "
                     f"{cost('every')} {md['anomaly'] * 1e3:>8.2f} {cost('anomaly')}")
    for kind, r in res.items():
        md = r["mean"]
        c = (md["default"] - md["no-prov"]) / md["no-prov"]
        lines.append(f"goal {kind}: default provenance {c * 100:.2f}% of the step (<= "
                     f"{GOAL * 100:.0f}%: {'met' if c <= GOAL else 'NOT met'}); error findings: "
                     f"{len(r['errors'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="timed steps per contender and model")
    ap.add_argument("--block", type=int, default=10, help="steps per contender per round")
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_precision: no CUDA device; nothing measured")
        return 0
    warnings.simplefilter("ignore")
    t0 = time.time()
    res = run(args)
    print(table(res, args.device))
    print(f"({time.time() - t0:.0f} s; {torch.__version__}, {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
