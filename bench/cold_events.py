"""What TrainSan's per-step events cost with their code and data cold, as a training step leaves
them (Note [Hot path], Note [Reused host rows]), against a few torch calls as references.

An MLP (bench_overhead.py's) is attached with the default options and trained a few steps; then
each call below is timed `--calls` times, each time right after writing a 64 MiB tensor (which
evicts the caches as a step's own work does), and its median is printed in microseconds:

    nothing         the timer and the eviction's tail (the floor)
    loss            the loss event (the loss read, its checks)
    loss_reaches    the loss-root walk
    cleared         the zero_grad event (gradients_cleared)
    torch.empty     torch.empty((1, 8), dtype=torch.long): one dispatcher call and allocation
    detach          loss.detach()
    item            loss.item()

    python3 bench/cold_events.py [--calls 600] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as B  # noqa: E402
import trainsan  # noqa: E402
from trainsan import _native  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.calls < 1:
        ap.error(f"--calls must be at least 1, got {args.calls}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = B.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(5):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        loss = F.cross_entropy(model(x), y)
        hot = san._ctx.hot
        via = "_trainsan_hot" if _native.hot_module() is not None else "torch.classes"
        big = torch.randn(16 << 20)

        def cold(fn) -> float:
            ts = []
            for _ in range(args.calls):
                big.add_(1.0)
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e6

        rows = [
            ("nothing", lambda: None),
            ("loss", lambda: hot.loss(loss)),
            ("loss_reaches", lambda: hot.loss_reaches(loss)),
            ("cleared", lambda: hot.gradients_cleared(0)),
            ("torch.empty", lambda: torch.empty((1, 8), dtype=torch.long)),
            ("detach", lambda: loss.detach()),
            ("item", lambda: loss.item()),
        ]
        print(f"cold calls (after a 64 MiB write), median of {args.calls}, "
              f"{args.threads} threads, events through {via}")
        for name, fn in rows:
            print(f"  {name:<14} {cold(fn):7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
