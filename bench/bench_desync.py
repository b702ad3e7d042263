"""Cost of the rank_desync check per step, against the step, and against Megatron-style hashing.

Two processes in one gloo group (loopback; CPU, or with ``--device cuda`` both on the one GPU),
each training the overhead benchmark's models (bench/bench_overhead.py) under
DistributedDataParallel. Per model, four contenders, each with its own copy of the model (same
initial weights), DDP wrapper and optimizer, run interleaved in rounds of ``--block`` steps (the
order rotating each round, so load hits all alike); the table gives medians over the timed
steps:

- ``plain``: nothing attached;
- ``no-desync``: ``trainsan.attach(..., checks={"rank_desync": False})`` — the baseline the
  check's cost is measured against;
- ``desync``: ``trainsan.attach(...)`` at default options (rank_desync every step);
- ``floor``: ``no-desync`` plus, after every step, a bare asynchronous all-reduce(MAX) of a
  zero payload as wide as the check's (``[row, ~row]``: 2 x (6 + 6 per parameter) int64) on a
  separate gloo group, waited for one step later — the transport alone, the floor of any check
  made of one collective per step;
- ``sha1``: ``no-desync`` plus, after every step, what Megatron-LM's
  ``check_param_hashes_across_dp_replicas`` does: SHA-1 of every parameter's bytes on the CPU and
  an ``all_gather_object`` of the digests across the data-parallel group.

Cost of the check = median(desync) - median(no-desync), as a fraction of median(no-desync); the
SHA-1 cost likewise; "x cheaper" is their ratio. Goals (issue 11): <= 3% of the step on the
CPU, <= 1% on the GPU, >= 100x cheaper than SHA-1 hashing.

    python3 bench/bench_desync.py [--steps N] [--block N] [--models mlp,cnn,transformer]
                                  [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import os
import socket
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GOAL_CPU = 0.03
GOAL_GPU = 0.01
GOAL_VS_SHA1 = 100.0
CONTENDERS = ("plain", "no-desync", "desync", "floor", "sha1")


def _sha1_check(model, group=None) -> None:
    import torch.distributed as dist

    digests = []
    for p in model.parameters():
        digests.append(hashlib.sha1(p.detach().cpu().contiguous().view(torch.uint8).numpy()).digest())
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, digests, group=group)
    if any(d != out[0] for d in out):
        raise RuntimeError("replicas differ")


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bench_overhead as B
    import trainsan

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
        for name in CONTENDERS:
            m = DDP(copy.deepcopy(base))
            opt = B.make_optimizer("adamw", m)
            san = None
            if name != "plain":
                checks = {"rank_desync": name == "desync"}  # floor, sha1: as no-desync
                san = trainsan.attach(m, opt, policy="record", checks=checks)
            cs[name] = (m, opt, san)
        times = {n: [] for n in CONTENDERS}
        width = 2 * (6 + 6 * len(list(base.parameters())))
        floor_works = []
        order = list(CONTENDERS)
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


def _table(res: dict, device: str) -> str:
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


def _goals(res: dict, device: str) -> list:
    goal = GOAL_GPU if device == "cuda" else GOAL_CPU
    out = []
    for kind, r in res.items():
        md = r["median"]
        base = md["no-desync"]
        check = (md["desync"] - base) / base
        sha = md["sha1"] - base
        vs = sha / (md["desync"] - base) if md["desync"] > base else float("inf")
        out.append(f"goal {kind}: check {check * 100:.2f}% of the step (<= {goal * 100:.0f}%: "
                   f"{'met' if check <= goal else 'NOT met'}); {vs:.1f}x cheaper than SHA-1 "
                   f"(>= {GOAL_VS_SHA1:.0f}x: {'met' if vs >= GOAL_VS_SHA1 else 'NOT met'}); "
                   f"error findings: {len(r['errors'])}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per contender and model")
    ap.add_argument("--block", type=int, default=5, help="steps per contender per round")
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_desync: no CUDA device; nothing measured")
        return 0
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, args, queue)) for r in range(2)]
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
    print(_table(res, args.device))
    for line in _goals(res, args.device):
        print(line)
    print(f"({time.time() - t0:.0f} s; rank 0's figures; "
          f"{torch.__version__}, {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, ranks=got), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
