"""Note [Hot path] (bindings/csrc/handle.h): what one call into TrainSan's C++ costs where a
training step makes it — right after the model's backward, its code and data cold — through the
handle's torch.classes method and through the _trainsan_hot module, and the same call repeated
at once (warm).

Each step of a small CNN (bench_overhead.py's, batch 64, --threads intra-op threads) is followed
by one measured pair of calls, the bindings taking turns step by step; the call is
`loss_reaches` on a tensor without a graph (the walk returns at once: what is timed is the
binding and the handle lookup). Medians over the steps.

    python3 bench/cold_calls.py [--steps 400] [--threads 2]
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
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hot = _native.hot_module()
    if hot is None:
        print(f"no _trainsan_hot module ({_native.hot_problem}): nothing to compare")
        return 1
    model = B.make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = B.make_batches("cnn", 8, torch.device("cpu"), torch.Generator().manual_seed(0))
    # The calls go to a sanitizer of another (tiny) model, so that the trained loop's own
    # TrainSan work does not warm them up.
    probe = torch.nn.Linear(2, 2)
    san = trainsan.attach(probe, torch.optim.SGD(probe.parameters(), lr=0.1), policy="record")
    handle, hid, x = san._ctx.handle, int(san._ctx.handle.hot_id()), torch.zeros(1)
    calls = {
        "torch.classes": lambda: handle.loss_reaches(x),
        "_trainsan_hot": lambda: hot.loss_reaches(hid, x),
    }
    times: dict = {(name, k): [] for name in calls for k in ("cold", "warm")}
    names = list(calls)
    pc = time.perf_counter_ns
    for i in range(args.steps + 20):
        xb, yb = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        name = names[i % 2]
        call = calls[name]
        t0 = pc()
        call()
        t1 = pc()
        call()
        t2 = pc()
        opt.step()
        if i >= 20:
            times[(name, "cold")].append((t1 - t0) / 1e3)
            times[(name, "warm")].append((t2 - t1) / 1e3)
    san.close()
    print(f"steps {args.steps} ({args.steps // 2} per binding), threads {args.threads}")
    print(f"{'binding':16} {'cold us':>9} {'warm us':>9}")
    for name in names:
        cold = statistics.median(times[(name, "cold")])
        warm = statistics.median(times[(name, "warm")])
        print(f"{name:16} {cold:9.1f} {warm:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
