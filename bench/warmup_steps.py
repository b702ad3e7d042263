"""The first steps after attach against a steady step (issue 23: a warm-up step costs at most 2x a
steady step).

For each model of bench_overhead.py: a plain copy runs --settle steps, then each repetition
attaches TrainSan (defaults, policy record) to a fresh copy, times its first --first steps one by
one, then --settle more steps; the table gives, per step index, the median over repetitions of the
step time divided by the median steady TrainSan step of the same repetition, and the plain step's
median for reference. The first step after attach also pays the attach itself (hooks, snapshots)
and torch's own first-call costs, which the plain copy paid during its settling steps; both are
in the figures.

    python3 bench/warmup_steps.py [--models mlp,cnn,transformer] [--first 14] [--reps 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as bo  # noqa: E402
import trainsan  # noqa: E402


def step(kind, model, opt, batch):
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = bo.loss_fn(kind, model(x), y)
    loss.backward()
    opt.step()


def timed(kind, model, opt, batches, n, start):
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        step(kind, model, opt, batches[(start + i) % len(batches)])
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--first", type=int, default=14, help="steps timed one by one after attach")
    ap.add_argument("--settle", type=int, default=30, help="steady steps (plain, and after)")
    ap.add_argument("--reps", type=int, default=3, help="fresh attaches per model")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                    help="an attach option (repeatable), e.g. --opt audit_first_steps=0")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {}
    for kv in args.opt:
        k, _, v = kv.partition("=")
        options[k] = int(v) if v.lstrip("-").isdigit() else (None if v == "None" else v)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), trainsan options "
          f"{options or 'defaults'}")
    worst_all = 0.0
    for kind in [m.strip() for m in args.models.split(",") if m.strip()]:
        desc, make = bo.MODELS[kind]
        base = make()
        batches = bo.make_batches(kind, 8, torch.device("cpu"), gen)
        plain = copy.deepcopy(base)
        popt = bo.make_optimizer("sgd", plain)
        timed(kind, plain, popt, batches, 5, 0)
        plain_med = statistics.median(timed(kind, plain, popt, batches, args.settle, 5))
        per_step = [[] for _ in range(args.first)]
        steady_meds = []
        for rep in range(args.reps):
            model = copy.deepcopy(base)
            opt = bo.make_optimizer("sgd", model)
            timed(kind, model, opt, batches, 3, 0)  # torch's own first calls, before attach
            with trainsan.attach(model, opt, policy="record", **options):
                first = timed(kind, model, opt, batches, args.first, rep)
                steady = statistics.median(timed(kind, model, opt, batches, args.settle, 0))
            steady_meds.append(steady)
            for i, t in enumerate(first):
                per_step[i].append(t / steady)
        steady = statistics.median(steady_meds)
        ratios = [statistics.median(r) for r in per_step]
        worst = max(ratios)
        worst_all = max(worst_all, worst)
        print(f"\n{kind}: {desc}")
        print(f"  plain step {plain_med * 1e3:.2f} ms, steady TrainSan step {steady * 1e3:.2f} ms "
              f"({steady / plain_med:.3f}x plain)")
        print("  step after attach: " + " ".join(f"{i}:{r:.2f}" for i, r in enumerate(ratios)))
        print(f"  worst first step / steady step: {worst:.2f}x (goal <= 2x)")
    print(f"\nworst over the models: {worst_all:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
