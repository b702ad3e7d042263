"""Time spent inside TrainSan's entries in a steady training step, measured in-process.

A training step enters TrainSan at the model's forward pre-hook (`_on_forward`), the patched
`torch.autograd.backward` (the loss root), the optimizer's step pre- and post-hooks and the
patched `zero_grad`. This wraps each of those entries with a timer, runs `--steps` steady steps
of one of bench_overhead.py's models (after `--warmup` steps) with `trainsan.attach(model, opt,
policy="record")` at the default options, and prints per entry the median time and how often it
ran per step, and their sum: TrainSan's own time per step with its code cold as the step leaves
it (Note [Hot path]), which the step-time ratio of bench_overhead.py hides in this box's noise.
With `--detail` the C++ events and the sanitizer's Python members are timed too (the wrappers
then add a little of their own).

    python3 bench/entry_times.py [--model cnn|mlp|transformer] [--steps 300] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as B  # noqa: E402
import trainsan  # noqa: E402
from trainsan import _hooks, _native, _patches  # noqa: E402
from trainsan import sanitizer as S  # noqa: E402

_pc = time.perf_counter
_times: dict = collections.defaultdict(list)
_on = [False]


def _timed(name: str, fn):
    def call(*args, **kwargs):
        if not _on[0]:
            return fn(*args, **kwargs)
        t0 = _pc()
        try:
            return fn(*args, **kwargs)
        finally:
            _times[name].append(_pc() - t0)

    return call


def _wrap_entries() -> None:
    orig_call = _hooks._Hook.__call__

    def hook_call(self, *args):
        if not _on[0]:
            return orig_call(self, *args)
        t0 = _pc()
        try:
            return orig_call(self, *args)
        finally:
            _times["hook " + self._method].append(_pc() - t0)

    _hooks._Hook.__call__ = hook_call
    _patches.backward_seen = _timed("backward (loss root)", _patches.backward_seen)
    S.Sanitizer._gradients_cleared = _timed("zero_grad", S.Sanitizer._gradients_cleared)


def _wrap_detail(san) -> None:
    for name in _native._HOT_EVENTS:
        setattr(san._ctx.hot, name, _timed("  C++ " + name, getattr(san._ctx.hot, name)))
    for event, calls in san._calls.items():
        san._calls[event] = [
            _timed(f"  member {getattr(c, '__qualname__', type(c).__name__)}", c) for c in calls]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["mlp", "cnn", "transformer"], default="cnn")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--detail", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    make = {"mlp": B.make_mlp, "cnn": B.make_cnn, "transformer": B.TinyTransformer}[args.model]
    model = make()
    opt = B.make_optimizer("sgd", model)
    batches = B.make_batches(args.model, 8, torch.device("cpu"), torch.Generator().manual_seed(0))
    _wrap_entries()
    san = trainsan.attach(model, opt, policy="record")
    if args.detail:
        _wrap_detail(san)
    t_steps = 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            _on[0] = True
            t_steps = _pc()
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        out = model(x)
        B.loss_fn(args.model, out, y).backward()
        opt.step()
    t_steps = (_pc() - t_steps) / args.steps
    _on[0] = False
    san.close()
    hot = "_trainsan_hot" if _native.hot_module() is not None else "torch.classes"
    print(f"{args.model}: {args.steps} steady steps after {args.warmup}, threads "
          f"{args.threads}, per-step events through {hot}; step {t_steps * 1e3:.2f} ms")
    print(f"{'entry':44} {'median us':>10} {'per step':>9}")
    total = 0.0
    for name, ts in sorted(_times.items(), key=lambda kv: (kv[0].startswith(" "), kv[0])):
        med = statistics.median(ts) * 1e6
        per = len(ts) / args.steps
        if not name.startswith(" "):
            total += med * per
        print(f"{name:44} {med:10.1f} {per:9.2f}")
    print(f"{'sum of the entries (median x per step)':44} {total:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
