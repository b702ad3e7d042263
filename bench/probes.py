"""One-question probes of TrainSan's own cost, one subcommand each (until issue 36 each was a
script of its own, named in the figures of bench/RESULTS.md):

- ``cold_calls`` (Note [Hot path]): one call into TrainSan's C++ right after a CNN's backward
  (code and data cold) and again at once (warm), through the handle's torch.classes method and
  through the ``_trainsan_hot`` module;
- ``cold_events`` (Note [Reused host rows]): the per-step events, and a few torch calls for
  reference, each timed right after a 64 MiB write (code and data cold);
- ``entry_times``: TrainSan's own time per steady step, in-process, entry by entry;
- ``warmup_steps`` (issue 23): the first steps after attach against a steady step;
- ``small_pass`` (issue 23): whether a small statistics pass wakes the thread pool.

    python3 bench/probes.py PROBE [its options]       # python3 bench/probes.py PROBE --help

The models, batches and loss are bench_overhead.py's.
"""

from __future__ import annotations

import argparse
import collections
import copy
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


# -- cold_calls ---------------------------------------------------------------------------------


def cold_calls(args) -> int:
    """Note [Hot path] (bindings/csrc/handle.h): what one call into TrainSan's C++ costs where a
    training step makes it, right after the model's backward, its code and data cold, through
    the handle's torch.classes method and through the _trainsan_hot module, and the same call
    repeated at once (warm).

    Each step of a small CNN (bench_overhead.py's, batch 64, --threads intra-op threads) is
    followed by one measured pair of calls, the bindings taking turns step by step; the call is
    `loss_reaches` on a tensor without a graph (the walk returns at once: what is timed is the
    binding and the handle lookup). Medians over the steps."""
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


# -- cold_events --------------------------------------------------------------------------------


def cold_events(args) -> int:
    """What TrainSan's per-step events cost with their code and data cold, as a training step
    leaves them (Note [Hot path], Note [Reused host rows]), against a few torch calls as
    references.

    An MLP (bench_overhead.py's) is attached with the default options and trained a few steps;
    then each call below is timed `--calls` times, each time right after writing a 64 MiB tensor
    (which evicts the caches as a step's own work does), and its median is printed in
    microseconds:

        nothing         the timer and the eviction's tail (the floor)
        loss            the loss event (the loss read, its checks)
        loss_reaches    the loss-root walk
        cleared         the zero_grad event (gradients_cleared)
        torch.empty     torch.empty((1, 8), dtype=torch.long): one dispatcher call and allocation
        detach          loss.detach()
        item            loss.item()"""
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


# -- entry_times --------------------------------------------------------------------------------

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
    from trainsan import _hooks, _patches
    from trainsan import sanitizer as S

    orig_call = _hooks._Hook.__call__

    def hook_call(self, *args):
        if not _on[0]:
            return orig_call(self, *args)
        method = self._ref()  # the sanitizer's bound method, held weakly
        name = "hook " + (method.__name__ if method is not None else "(gone)")
        t0 = _pc()
        try:
            return orig_call(self, *args)
        finally:
            _times[name].append(_pc() - t0)

    _hooks._Hook.__call__ = hook_call
    _patches.backward_seen = _timed("backward (loss root)", _patches.backward_seen)
    S.Sanitizer._gradients_cleared = _timed("zero_grad", S.Sanitizer._gradients_cleared)


def _wrap_detail(san) -> None:
    for name in _native._HOT_EVENTS:
        setattr(san._ctx.hot, name, _timed("  C++ " + name, getattr(san._ctx.hot, name)))
    for event, calls in san._calls.items():
        san._calls[event] = [
            _timed(f"  member {getattr(c, '__qualname__', type(c).__name__)}", c) for c in calls]


def entry_times(args) -> int:
    """Time spent inside TrainSan's entries in a steady training step, measured in-process.

    A training step enters TrainSan at the model's forward pre-hook (`_on_forward`), the patched
    `torch.autograd.backward` (the loss root), the optimizer's step pre- and post-hooks and the
    patched `zero_grad`. This wraps each of those entries with a timer, runs `--steps` steady
    steps of one of bench_overhead.py's models (after `--warmup` steps) with
    `trainsan.attach(model, opt, policy="record")` at the default options, and prints per entry
    the median time and how often it ran per step, and their sum: TrainSan's own time per step
    with its code cold as the step leaves it (Note [Hot path]), which the step-time ratio of
    bench_overhead.py hides in this box's noise. With `--detail` the C++ events and the
    sanitizer's Python members are timed too (the wrappers then add a little of their own);
    `TRAINSAN_HOT=0` for the torch.classes binding."""
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


# -- warmup_steps -------------------------------------------------------------------------------


def _step(kind, model, opt, batch):
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = B.loss_fn(kind, model(x), y)
    loss.backward()
    opt.step()


def _timed_steps(kind, model, opt, batches, n, start):
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        _step(kind, model, opt, batches[(start + i) % len(batches)])
        out.append(time.perf_counter() - t0)
    return out


def warmup_steps(args) -> int:
    """The first steps after attach against a steady step (issue 23: a warm-up step costs at
    most 2x a steady step).

    For each model of bench_overhead.py: a plain copy runs --settle steps, then each repetition
    attaches TrainSan (defaults, policy record) to a fresh copy, times its first --first steps
    one by one, then --settle more steps; the table gives, per step index, the median over
    repetitions of the step time divided by the median steady TrainSan step of the same
    repetition, and the plain step's median for reference. The first step after attach also pays
    the attach itself (hooks, snapshots) and torch's own first-call costs, which the plain copy
    paid during its settling steps; both are in the figures."""
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
        desc, make = B.MODELS[kind]
        base = make()
        batches = B.make_batches(kind, 8, torch.device("cpu"), gen)
        plain = copy.deepcopy(base)
        popt = B.make_optimizer("sgd", plain)
        _timed_steps(kind, plain, popt, batches, 5, 0)
        plain_med = statistics.median(_timed_steps(kind, plain, popt, batches, args.settle, 5))
        per_step = [[] for _ in range(args.first)]
        steady_meds = []
        for rep in range(args.reps):
            model = copy.deepcopy(base)
            opt = B.make_optimizer("sgd", model)
            _timed_steps(kind, model, opt, batches, 3, 0)  # torch's own first calls, before attach
            with trainsan.attach(model, opt, policy="record", **options):
                first = _timed_steps(kind, model, opt, batches, args.first, rep)
                steady = statistics.median(_timed_steps(kind, model, opt, batches, args.settle,
                                                        0))
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


# -- small_pass ---------------------------------------------------------------------------------


def small_pass(args) -> int:
    """A small statistics pass (5 tensors of 5 elements) and a large one (4 x 2^18) through
    trainsan.tensor_stats with 2 threads, median us per pass: whether a small pass wakes the
    thread pool (issue 23). Run it alone, then with other processes on the cores."""
    torch.set_num_threads(2)
    ts = [torch.randn(5) for _ in range(5)]
    for _ in range(200):
        trainsan.tensor_stats(ts)
    rs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            trainsan.tensor_stats(ts)
        rs.append((time.perf_counter() - t0) / 2000 * 1e6)
    big = [torch.randn(1 << 18) for _ in range(4)]
    rb = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            trainsan.tensor_stats(big)
        rb.append((time.perf_counter() - t0) / 50 * 1e6)
    print(f"5x5 elements: {statistics.median(rs):.1f} us/pass; 4x2^18: "
          f"{statistics.median(rb):.0f} us/pass")
    return 0


# -- the command line ---------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    sub = ap.add_subparsers(dest="probe", required=True, metavar="PROBE")

    def probe(fn, what):
        p = sub.add_parser(fn.__name__, help=what, description=fn.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(run=fn)
        return p

    p = probe(cold_calls, "a C++ call right after backward, cold and warm, per binding")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p = probe(cold_events, "the per-step events after a 64 MiB write")
    p.add_argument("--calls", type=int, default=600)
    p.add_argument("--threads", type=int, default=2)
    p = probe(entry_times, "TrainSan's time per steady step, entry by entry")
    p.add_argument("--model", choices=["mlp", "cnn", "transformer"], default="cnn")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--detail", action="store_true")
    p = probe(warmup_steps, "the first steps after attach against a steady step")
    p.add_argument("--models", default="mlp,cnn,transformer")
    p.add_argument("--first", type=int, default=14, help="steps timed one by one after attach")
    p.add_argument("--settle", type=int, default=30, help="steady steps (plain, and after)")
    p.add_argument("--reps", type=int, default=3, help="fresh attaches per model")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                   help="an attach option (repeatable), e.g. --opt audit_first_steps=0")
    probe(small_pass, "a small pass against a large one: does it wake the thread pool")
    args = ap.parse_args(argv)
    if args.probe == "cold_events" and args.calls < 1:
        ap.error(f"--calls must be at least 1, got {args.calls}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
