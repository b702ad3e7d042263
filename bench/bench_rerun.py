"""Cost of the nondeterminism re-runs (rerun_every; Note [Re-run determinism]).

The overhead benchmark's MLP and transformer, AdamW, contenders with their own model copies,
interleaved in rounds: ``off`` (rerun_every=0, the default), ``every`` (rerun_every=1: every step
re-run twice) and ``off`` again (their spread is the noise). Medians; the cost of a sampled step
is every - off, to be divided by N for rerun_every=N.

    python3 bench/bench_rerun.py
"""

import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as B  # noqa: E402
import trainsan  # noqa: E402


def main() -> int:
    for kind in ["mlp", "transformer"]:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]()
        batches = B.make_batches(kind, 4, torch.device("cpu"), torch.Generator().manual_seed(1))
        names = [("off", 0), ("every", 1), ("off again", 0)]
        cs = {}
        for name, n in names:
            m = copy.deepcopy(base)
            opt = B.make_optimizer("adamw", m)
            cs[name] = (m, opt, trainsan.attach(m, opt, policy="record", rerun_every=n))
        times = {n: [] for n, _ in names}
        for r in range(7):
            for name, _ in names:
                m, opt, _ = cs[name]
                for i in range(5):
                    x, y = batches[i % 4]
                    t = time.perf_counter()
                    opt.zero_grad()
                    B.loss_fn(kind, m(x), y).backward()
                    opt.step()
                    if r > 0:
                        times[name].append(time.perf_counter() - t)
        for name, _ in names:
            cs[name][2].close()
        md = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        off = min(md["off"], md["off again"])
        print(f"{kind:<12} off {md['off']:.2f} ms, every {md['every']:.2f} ms, off again "
              f"{md['off again']:.2f} ms: a re-run step costs {md['every'] / off:.2f}x the step "
              f"(+{(md['every'] - off) / off * 100:.0f}%; rerun_every=100: "
              f"{(md['every'] - off) / off:.2f}% per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
