"""Overhead of two builds of TrainSan, measured in one run: bench_overhead.py alternately against
each build (A, B, A, B, ...), each a separate process (two builds of the op library cannot share
one), and the per-model medians of the rounds side by side.

A build is a directory holding the ``trainsan`` package with its ``libtrainsan_ops.so`` (an
installed copy, e.g. ``$(python -c 'import trainsan, os; print(os.path.dirname(trainsan.__file__))')/..``),
or ``bindings:LIB`` for a source tree and a built op library.

    python bench/compare_overhead.py --a /tmp/prev --b bindings:build/dev/bindings/libtrainsan_ops.so \
        --rounds 3 -- --steps 60 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def env_for(build: str) -> dict:
    env = dict(os.environ)
    path, _, lib = build.partition(":")
    env["PYTHONPATH"] = os.path.abspath(path)
    if lib:
        env["TRAINSAN_LIBRARY"] = os.path.abspath(lib)
    else:
        env.pop("TRAINSAN_LIBRARY", None)
    return env


def run_once(build: str, extra: list) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.join(HERE, "bench_overhead.py"), "--no-anomaly", "--json", out]
    r = subprocess.run(cmd + extra, env=env_for(build), cwd=tempfile.gettempdir(),
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"compare_overhead: bench_overhead.py failed for {build}:\n{r.stderr[-2000:]}")
    with open(out, encoding="utf-8") as fh:
        data = json.load(fh)
    os.unlink(out)
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="baseline build (e.g. the previous commit)")
    ap.add_argument("--b", required=True, help="build under test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("extra", nargs="*", help="arguments for bench_overhead.py (after --)")
    args = ap.parse_args()
    per = {"a": [], "b": []}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for side in ("a", "b"):
            print(f"round {r + 1}/{args.rounds}: {side} ...", file=sys.stderr, flush=True)
            per[side].append(run_once(getattr(args, side), args.extra))
    models = [res["model"] for res in per["a"][0]["results"]]

    def figures(side: str, model: str, key: str) -> float:
        vals = []
        for data in per[side]:
            for res in data["results"]:
                if res["model"] == model:
                    vals.append(res["contenders"]["trainsan"][key])
        return statistics.median(vals)

    print(f"A = {args.a}\nB = {args.b}\n{args.rounds} rounds, A and B alternating; "
          f"medians over rounds of bench_overhead.py {' '.join(args.extra)}")
    print(f"{'model':12} {'A x plain':>10} {'B x plain':>10} {'A own ms':>9} {'B own ms':>9}"
          f" {'B/A own':>8}")
    for m in models:
        ra, rb = figures("a", m, "paired_ratio"), figures("b", m, "paired_ratio")
        oa, ob = figures("a", m, "own_ms"), figures("b", m, "own_ms")
        print(f"{m:12} {ra:10.3f} {rb:10.3f} {oa:9.2f} {ob:9.2f} {ob / oa if oa else float('nan'):8.2f}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
