"""Cost of one precision-headroom step (Note [Precision headroom], bindings/trainsan/precision.py).

The overhead benchmark's MLP and transformer train under bf16 autocast with a trace, provenance
off, three contenders each with its own model copy: ``off`` (headroom_every=0), ``every``
(headroom_every=1: every step records the range counts of every weight, gradient and module
output) and ``off`` again (the spread between the two ``off`` runs is the noise). Medians of 20
timed steps after 5 untimed ones; the cost of a sampled step is every - off, amortised over
headroom_every (default 200) steps.

    python3 bench/bench_headroom.py
"""

import copy
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as B  # noqa: E402
import trainsan  # noqa: E402


def main() -> int:
    tmp = tempfile.mkdtemp()
    for kind in ["mlp", "transformer"]:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]()
        batches = B.make_batches(kind, 4, torch.device("cpu"), torch.Generator().manual_seed(1))
        res = {}
        for name, he in [("off", 0), ("every", 1), ("off again", 0)]:
            m = copy.deepcopy(base)
            opt = B.make_optimizer("adamw", m)
            san = trainsan.attach(m, opt, policy="record", trace=os.path.join(tmp, "t.jsonl"),
                                  headroom_every=he, provenance_every=0, provenance_rearm=0)
            ts = []
            for i in range(25):
                x, y = batches[i % 4]
                t = time.perf_counter()
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = B.loss_fn(kind, m(x), y)
                loss.backward()
                opt.step()
                if i >= 5:
                    ts.append(time.perf_counter() - t)
            san.close()
            res[name] = statistics.median(ts) * 1e3
        off = min(res["off"], res["off again"])
        extra = res["every"] - off
        print(f"{kind:<12} off {res['off']:.2f} ms, every {res['every']:.2f} ms, off again "
              f"{res['off again']:.2f} ms: a headroom step costs {extra:.1f} ms = "
              f"{extra / off:.2f} steps; amortised over 200 steps {extra / off / 200 * 100:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
