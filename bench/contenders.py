"""The per-feature contender sets of bench_overhead.py: ``--contenders SET``.

Each set measures what one feature of TrainSan costs on bench_overhead.py's models, batches, loss
and optimizers, against its own baseline (TrainSan with that feature off), with its own method
and its own table (until issue 36 each was a script of its own, named in the figures of
bench/RESULTS.md):

- ``audit`` (was bench_audit.py): the op audits (broadcast, label_range, batch_mismatch): an
  audited step, the steady state at the default sampling, the observer's cost per op; CPU;
- ``desync`` (was bench_desync.py): ``rank_desync`` per step under DDP, 2 gloo processes (or
  both on one GPU with ``--device cuda``), against the step and Megatron-style SHA-1 hashing;
- ``precision`` (was bench_precision.py): overflow provenance per step under autocast (bf16 on
  the CPU, fp16 with a GradScaler on CUDA); mean step times;
- ``headroom`` (was bench_headroom.py): one precision-headroom step (``headroom_every=1``
  against off) under bf16 autocast; CPU;
- ``rerun`` (was bench_rerun.py): the nondeterminism re-runs (``rerun_every=1`` against off);
  CPU.

    python3 bench/bench_overhead.py --contenders audit [--steps N] [--models ...] [--json PATH]

bench_overhead.py's ``--models``, ``--steps``, ``--warmup``, ``--block``, ``--optimizer``,
``--device``, ``--threads``, ``--malloc`` and ``--json`` apply where the set uses them; left out,
each takes the set's own default (``DEFAULTS``: those of the old script, so that the commands
recorded in RESULTS.md measure the same; the allocator is glibc's own, as it was), and
``--quick`` takes ``QUICK``'s few steps.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn

import bench_overhead as B

SETS = B.SETS
# Each set's defaults (the old script's) and its devices.
DEFAULTS = {
    "audit": dict(models="mlp,cnn,transformer", steps=200, warmup=12, optimizer="sgd"),
    "desync": dict(models="mlp,cnn,transformer", steps=40, block=5, optimizer="adamw"),
    "precision": dict(models="mlp,cnn,transformer", steps=100, block=10, optimizer="adamw"),
    "headroom": dict(models="mlp,transformer", steps=20, warmup=5, optimizer="adamw"),
    "rerun": dict(models="mlp,transformer", steps=30, block=5, optimizer="adamw"),
}
QUICK = {"audit": dict(steps=10, warmup=2), "desync": dict(steps=5), "precision": dict(steps=10),
         "headroom": dict(steps=3, warmup=1), "rerun": dict(steps=5)}
DEVICES = {"audit": ("cpu",), "desync": ("cpu", "cuda"), "precision": ("cpu", "cuda"),
           "headroom": ("cpu",), "rerun": ("cpu",)}


def run_set(name: str, args) -> int:
    """Runs contender set `name` with bench_overhead.py's parsed `args` (None: the set's
    default); returns the exit status."""
    for k, v in {**DEFAULTS[name], **(QUICK[name] if args.quick else {})}.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in B.MODELS]
    if unknown:
        print(f"bench_overhead: --models: unknown {', '.join(unknown)} (choose from "
              f"{', '.join(B.MODELS)})", file=sys.stderr)
        return 2
    if args.device not in DEVICES[name]:
        print(f"bench_overhead --contenders {name}: runs on {' and '.join(DEVICES[name])} only; "
              "nothing measured")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_overhead --contenders {name}: no CUDA device; nothing measured")
        return 0
    B.set_malloc(args.malloc or "default")
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"audit": audit, "desync": desync, "precision": precision, "headroom": headroom,
            "rerun": rerun}[name](args)


def _write_json(path, data) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


# -- audit: the op audits (broadcast, label_range, batch_mismatch) ------------------------------
#
# 1. Audited step. One sanitizer with ``audit_first_steps=0, audit_every=2``: even steps are
#    audited, odd ones not, on the same model and optimizer. The overhead of an audited step is
#    the median over steps of (audited step - mean of its two unaudited neighbours), which
#    cancels drift and placement effects; "observer" is the callback's own time (in
#    ``san.overhead_seconds``), the rest is ATen's RecordFunction boxing every op's inputs.
# 2. Steady state at the default sampling (one audited step in ``audit_every`` = 100), against
#    the sanitizer without audits (``checks={kind: False}``): derived as (audited-step overhead)
#    / 100 + the per-step bookkeeping of an unaudited step; and measured, as the difference of
#    mean step times of two model copies (``default`` and ``off``) stepped alternately, next to
#    the same difference between two identical ``off`` copies (the noise floor of that
#    measurement).
# 3. Per-op cost of the observer: a forward of 2000 small elementwise ops, audited vs not.

AUDIT_KINDS = ("broadcast", "label_range", "label_dtype", "batch_mismatch")
AUDIT_OFF = {"checks": {k: False for k in AUDIT_KINDS}}


class _Loop:
    """A model copy, its optimizer and sanitizer; step() returns (seconds, own seconds)."""

    def __init__(self, kind, base, batches, optimizer, **options):
        self.kind, self.batches = kind, batches
        self.model = copy.deepcopy(base)
        self.opt = B.make_optimizer(optimizer, self.model)
        self.san = B._trainsan().attach(self.model, self.opt, policy="record", **options)
        self.i = 0

    def step(self):
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        own0 = self.san.overhead_seconds
        t0 = time.perf_counter()
        self.opt.zero_grad()
        B.loss_fn(self.kind, self.model(x), y).backward()
        self.opt.step()
        return time.perf_counter() - t0, self.san.overhead_seconds - own0

    def close(self):
        self.san.close()
        return [(f.kind, f.count) for f in self.san.findings]


def _audited_step(kind, base, batches, args):
    loop = _Loop(kind, base, batches, args.optimizer, audit_first_steps=0, audit_every=2)
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


def _steady_state(kind, base, batches, args):
    trainsan = B._trainsan()
    loops = {"off": _Loop(kind, base, batches, args.optimizer, **AUDIT_OFF),
             "off_again": _Loop(kind, base, batches, args.optimizer, **AUDIT_OFF),
             "default": _Loop(kind, base, batches, args.optimizer)}
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


class _ManyOps(nn.Module):
    def __init__(self, n=2000):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.n = n

    def forward(self, x):
        h = x * self.w
        for _ in range(self.n // 2):
            h = h * 1.0001 + self.w
        return h


def _per_op(args):
    """Forward + backward of 2000 small elementwise ops, audited (even steps) or not (odd)."""
    model = _ManyOps()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    san = B._trainsan().attach(model, opt, policy="record", audit_first_steps=0, audit_every=2)
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


def audit(args) -> int:
    trainsan = B._trainsan()
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"{args.steps} timed steps per measurement, audit_every="
          f"{trainsan.OPTIONS['audit_every']}")
    torch.manual_seed(0)
    po = _per_op(args)
    print(f"\nobserver per op (2000 elementwise ops): {po['us_per_op']:.2f} us per audited op "
          f"(unaudited step {po['step_ms']:.1f} ms)")
    results = {"per_op": po, "models": []}
    period = trainsan.OPTIONS["audit_every"]
    for kind in args.models:
        desc, factory = B.MODELS[kind]
        torch.manual_seed(0)
        base = factory()
        batches = B.make_batches(kind, 8, torch.device("cpu"), torch.Generator().manual_seed(1))
        a = _audited_step(kind, base, batches, args)
        s = _steady_state(kind, base, batches, args)
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
    _write_json(args.json, results)
    return 0


# -- desync: rank_desync per step under DDP ----------------------------------------------------
#
# Two processes in one gloo group (loopback; CPU, or with --device cuda both on the one GPU), each
# training the models under DistributedDataParallel. Per model, five contenders, each with its
# own copy of the model (same initial weights), DDP wrapper and optimizer, run interleaved in
# rounds of --block steps (the order rotating each round, so load hits all alike), after one
# untimed round; medians over the timed steps:
#
# - plain: nothing attached;
# - no-desync: trainsan.attach(..., checks={"rank_desync": False}), the baseline the check's cost
#   is measured against;
# - desync: trainsan.attach(...) at default options (rank_desync every step);
# - floor: no-desync plus, after every step, a bare asynchronous all-reduce(MAX) of a zero
#   payload as wide as the check's ([row, ~row]: 2 x (6 + 6 per parameter) int64) on a separate
#   gloo group, waited for one step later: the transport alone, the floor of any check made of
#   one collective per step;
# - sha1: no-desync plus, after every step, what Megatron-LM's
#   check_param_hashes_across_dp_replicas does: SHA-1 of every parameter's bytes on the CPU and
#   an all_gather_object of the digests across the data-parallel group.
#
# Cost of the check = median(desync) - median(no-desync), as a fraction of median(no-desync);
# the SHA-1 cost likewise; "x cheaper" is their ratio. Goals (issue 11): <= 3% of the step on
# the CPU, <= 1% on the GPU, >= 100x cheaper than SHA-1 hashing.

DESYNC_GOAL_CPU = 0.03
DESYNC_GOAL_GPU = 0.01
DESYNC_GOAL_VS_SHA1 = 100.0
DESYNC_CONTENDERS = ("plain", "no-desync", "desync", "floor", "sha1")


def _sha1_check(model, group=None) -> None:
    import torch.distributed as dist

    digests = []
    for p in model.parameters():
        digests.append(hashlib.sha1(p.detach().cpu().contiguous().view(torch.uint8).numpy())
                       .digest())
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, digests, group=group)
    if any(d != out[0] for d in out):
        raise RuntimeError("replicas differ")


def _desync_rank(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    trainsan = B._trainsan()
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    device = torch.device(args.device)
    floor_group = dist.new_group(backend="gloo")
    floor_opts = dist.AllreduceOptions()
    floor_opts.reduceOp = dist.ReduceOp.MAX
    results = {}
    for kind in args.models:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]().to(device)
        gen = torch.Generator().manual_seed(100 + rank)
        batches = B.make_batches(kind, 4, device, gen)
        cs = {}
        for name in DESYNC_CONTENDERS:
            m = DDP(copy.deepcopy(base))
            opt = B.make_optimizer(args.optimizer, m)
            san = None
            if name != "plain":
                checks = {"rank_desync": name == "desync"}  # floor, sha1: as no-desync
                san = trainsan.attach(m, opt, policy="record", checks=checks)
            cs[name] = (m, opt, san)
        times = {n: [] for n in DESYNC_CONTENDERS}
        width = 2 * (6 + 6 * len(list(base.parameters())))
        floor_works = []
        order = list(DESYNC_CONTENDERS)
        rounds = max(1, args.steps // args.block)
        for r in range(rounds + 1):  # round 0: warm-up
            order = order[1:] + order[:1]
            for name in order:
                m, opt, san = cs[name]
                for i in range(args.block):
                    x, y = batches[i % len(batches)]
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    opt.zero_grad()
                    B.loss_fn(kind, m(x), y).backward()
                    opt.step()
                    if name == "sha1":
                        _sha1_check(m)
                    elif name == "floor":
                        payload = torch.zeros(width, dtype=torch.int64)
                        floor_works.append(floor_group.allreduce([payload], floor_opts))
                        while len(floor_works) > 1:
                            floor_works.pop(0).wait()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if r > 0:
                        times[name].append(time.perf_counter() - t)
        for w in floor_works:
            w.wait()
        findings = []
        for name, (m, opt, san) in cs.items():
            if san is not None:
                san.close()
                findings += [f.kind for f in san.findings if f.severity == "error"]
        results[kind] = dict(
            params=sum(p.numel() for p in base.parameters()),
            tensors=len(list(base.parameters())),
            median={n: statistics.median(v) for n, v in times.items()},
            steps=len(times["plain"]),
            errors=findings,
        )
    dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, results))


def _desync_table(res: dict, device: str) -> str:
    lines = [f"rank_desync cost per step, 2 gloo processes, {device} (medians; ratios vs "
             "no-desync)",
             f"{'model':<12} {'params':>9} {'plain ms':>9} {'no-desync':>10} {'desync':>9} "
             f"{'check':>8} {'floor':>8} {'floor cost':>10} {'sha1':>9} {'sha1 cost':>10} "
             f"{'x cheaper':>10}"]
    for kind, r in res.items():
        md = r["median"]
        base = md["no-desync"]
        check = md["desync"] - base
        sha = md["sha1"] - base
        cheaper = sha / check if check > 0 else float("inf")
        lines.append(
            f"{kind:<12} {r['params'] / 1e6:>8.2f}M {md['plain'] * 1e3:>9.2f} "
            f"{base * 1e3:>10.2f} {md['desync'] * 1e3:>9.2f} {check / base * 100:>7.2f}% "
            f"{md['floor'] * 1e3:>8.2f} {(md['floor'] - base) / base * 100:>9.2f}% "
            f"{md['sha1'] * 1e3:>9.2f} {sha / base * 100:>9.1f}% {cheaper:>10.1f}")
    return "\n".join(lines)


def _desync_goals(res: dict, device: str) -> list:
    goal = DESYNC_GOAL_GPU if device == "cuda" else DESYNC_GOAL_CPU
    out = []
    for kind, r in res.items():
        md = r["median"]
        base = md["no-desync"]
        check = (md["desync"] - base) / base
        sha = md["sha1"] - base
        vs = sha / (md["desync"] - base) if md["desync"] > base else float("inf")
        out.append(f"goal {kind}: check {check * 100:.2f}% of the step (<= {goal * 100:.0f}%: "
                   f"{'met' if check <= goal else 'NOT met'}); {vs:.1f}x cheaper than SHA-1 "
                   f"(>= {DESYNC_GOAL_VS_SHA1:.0f}x: "
                   f"{'met' if vs >= DESYNC_GOAL_VS_SHA1 else 'NOT met'}); "
                   f"error findings: {len(r['errors'])}")
    return out


def desync(args) -> int:
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = [ctx.Process(target=_desync_rank, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, res = queue.get(timeout=1800)
            got[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    res = got[0]
    print(_desync_table(res, args.device))
    for line in _desync_goals(res, args.device):
        print(line)
    print(f"({time.time() - t0:.0f} s; rank 0's figures; "
          f"{torch.__version__}, {os.cpu_count()} CPUs)")
    _write_json(args.json, dict(device=args.device, ranks=got))
    return 0


# -- precision: overflow provenance under autocast ---------------------------------------------
#
# The models train under autocast (bfloat16 on the CPU, float16 with a GradScaler on CUDA), each
# contender with its own copy of the model (same initial weights) and optimizer, interleaved in
# rounds of --block steps (the order rotating each round) after one untimed round:
#
# - plain: nothing attached;
# - no-prov: TrainSan with provenance off (provenance_every=0, provenance_rearm=0), the baseline
#   the provenance cost is measured against;
# - default: TrainSan at default options (module outputs flagged every 20th step);
# - every: provenance_every=1 (every step flagged: the cost of one armed step);
# - anomaly: no-prov under torch.autograd.set_detect_anomaly(True), the tool that names a
#   backward op today.
#
# Armed steps are one in provenance_every, so a median would not see them: the table gives the
# mean step time over the timed steps, and the cost of each contender against no-prov. Goal
# (issue 12): default within 3% of no-prov.

PRECISION_GOAL = 0.03
PRECISION_CONTENDERS = ("plain", "no-prov", "default", "every", "anomaly")
PROVENANCE_OFF = {"provenance_every": 0, "provenance_rearm": 0}


def _precision_run(args) -> dict:
    trainsan = B._trainsan()
    device = torch.device(args.device)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    results = {}
    for kind in args.models:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]().to(device)
        batches = B.make_batches(kind, 4, device, torch.Generator().manual_seed(1))
        cs = {}
        for name in PRECISION_CONTENDERS:
            m = copy.deepcopy(base)
            opt = B.make_optimizer(args.optimizer, m)
            opts = {"plain": None, "no-prov": PROVENANCE_OFF, "default": {},
                    "every": {"provenance_every": 1}, "anomaly": PROVENANCE_OFF}[name]
            san = None if opts is None else trainsan.attach(m, opt, policy="record", **opts)
            scaler = torch.amp.GradScaler("cuda") if device.type == "cuda" else None
            cs[name] = (m, opt, san, scaler)
        times = {n: [] for n in PRECISION_CONTENDERS}
        order = list(PRECISION_CONTENDERS)
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


_OPT_NAMES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


def _precision_table(res: dict, device: str, optimizer: str) -> str:
    lines = [f"overflow provenance, {device}, {_OPT_NAMES.get(optimizer, optimizer)} under "
             "autocast (mean step ms; cost vs no-prov)",
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
                     f"{PRECISION_GOAL * 100:.0f}%: {'met' if c <= PRECISION_GOAL else 'NOT met'});"
                     f" error findings: {len(r['errors'])}")
    return "\n".join(lines)


def precision(args) -> int:
    warnings.simplefilter("ignore")
    t0 = time.time()
    res = _precision_run(args)
    print(_precision_table(res, args.device, args.optimizer))
    print(f"({time.time() - t0:.0f} s; {torch.__version__}, {os.cpu_count()} CPUs)")
    _write_json(args.json, dict(device=args.device, results=res))
    return 0


# -- headroom: one precision-headroom step (Note [Precision headroom]) --------------------------
#
# The models train under bf16 autocast with a trace, provenance off, three contenders each with
# its own model copy, one after the other: off (headroom_every=0), every (headroom_every=1: every
# step records the range counts of every weight, gradient and module output) and off again (the
# spread between the two off runs is the noise). Medians of --steps timed steps (20) after
# --warmup untimed ones (5); the cost of a sampled step is every - off, amortised over
# headroom_every (default 200) steps.


def headroom(args) -> int:
    trainsan = B._trainsan()
    tmp = tempfile.mkdtemp()
    for kind in args.models:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]()
        batches = B.make_batches(kind, 4, torch.device("cpu"), torch.Generator().manual_seed(1))
        res = {}
        for name, he in [("off", 0), ("every", 1), ("off again", 0)]:
            m = copy.deepcopy(base)
            opt = B.make_optimizer(args.optimizer, m)
            san = trainsan.attach(m, opt, policy="record", trace=os.path.join(tmp, "t.jsonl"),
                                  headroom_every=he, provenance_every=0, provenance_rearm=0)
            ts = []
            for i in range(args.warmup + args.steps):
                x, y = batches[i % 4]
                t = time.perf_counter()
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = B.loss_fn(kind, m(x), y)
                loss.backward()
                opt.step()
                if i >= args.warmup:
                    ts.append(time.perf_counter() - t)
            san.close()
            res[name] = statistics.median(ts) * 1e3
        off = min(res["off"], res["off again"])
        extra = res["every"] - off
        print(f"{kind:<12} off {res['off']:.2f} ms, every {res['every']:.2f} ms, off again "
              f"{res['off again']:.2f} ms: a headroom step costs {extra:.1f} ms = "
              f"{extra / off:.2f} steps; amortised over 200 steps {extra / off / 200 * 100:.2f}%")
    return 0


# -- rerun: the nondeterminism re-runs (Note [Re-run determinism]) ------------------------------
#
# Contenders with their own model copies, interleaved in rounds of --block steps after one
# untimed round: off (rerun_every=0, the default), every (rerun_every=1: every step re-run twice)
# and off again (their spread is the noise). Medians; the cost of a sampled step is every - off,
# to be divided by N for rerun_every=N.


def rerun(args) -> int:
    trainsan = B._trainsan()
    for kind in args.models:
        torch.manual_seed(0)
        base = B.MODELS[kind][1]()
        batches = B.make_batches(kind, 4, torch.device("cpu"), torch.Generator().manual_seed(1))
        names = [("off", 0), ("every", 1), ("off again", 0)]
        cs = {}
        for name, n in names:
            m = copy.deepcopy(base)
            opt = B.make_optimizer(args.optimizer, m)
            cs[name] = (m, opt, trainsan.attach(m, opt, policy="record", rerun_every=n))
        times = {n: [] for n, _ in names}
        for r in range(max(1, args.steps // args.block) + 1):  # round 0: warm-up
            for name, _ in names:
                m, opt, _ = cs[name]
                for i in range(args.block):
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
