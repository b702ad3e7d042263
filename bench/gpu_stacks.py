"""The real stacks on one GPU (bench/gpu_check.sh, phase stacks-gpu): DDP over a single-rank NCCL
process group (gradient_as_bucket_view), FSDP2 with world size 1, torch.compile (inductor) of a
CUDA model. Each stack runs a clean loop (no error finding allowed) and planted bugs (the kind
named must be found at error severity); prints a table, exits with the number of mismatches.
The CPU (gloo, 2 processes) versions of these are tests/python/test_stack_*.py.

Usage: python bench/gpu_stacks.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings

import torch
import torch.nn.functional as F


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _loop(model, opt, steps, bug, attach_to=None):
    import trainsan

    dev = torch.device("cuda")
    san = trainsan.attach(attach_to or model, opt, policy="record", sync=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    try:
        for step in range(steps):
            if bug != "no_zero_grad" or step == 0:
                opt.zero_grad()
            x = torch.randn(32, 64, generator=g).to(dev)
            y = x[:, :1].clone()
            if bug == "nan_input" and step == 2:
                x[0, 0] = float("nan")
            if bug == "broadcast":
                y = y.squeeze(-1)
            F.mse_loss(model(x), y).backward()
            opt.step()
    finally:
        san.close()
    return sorted({f.kind for f in san.findings if f.severity == "error"})


def ddp(bug, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net().cuda()
    model = DDP(net, gradient_as_bucket_view=True)
    return _loop(model, torch.optim.SGD(model.parameters(), lr=0.01), steps, bug)


def fsdp2(bug, steps):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net().cuda()
    fully_shard(net.fc1)
    fully_shard(net)
    return _loop(net, torch.optim.AdamW(net.parameters(), lr=1e-3), steps, bug)


def compiled(bug, steps):
    torch.manual_seed(0)
    net = Net().cuda()
    cnet = torch.compile(net, fullgraph=True)
    return _loop(cnet, torch.optim.AdamW(net.parameters(), lr=1e-3), steps, bug, attach_to=net)


CASES = [
    ("ddp-nccl bucket_view", ddp, None, None),
    ("ddp-nccl bucket_view", ddp, "no_zero_grad", "stale_grad"),
    ("ddp-nccl bucket_view", ddp, "broadcast", "broadcast"),
    ("fsdp2 world 1", fsdp2, None, None),
    ("fsdp2 world 1", fsdp2, "nan_input", "nonfinite_loss"),
    ("fsdp2 world 1", fsdp2, "no_zero_grad", "stale_grad"),
    ("compile inductor fullgraph", compiled, None, None),
    ("compile inductor fullgraph", compiled, "nan_input", "nonfinite_loss"),
    ("compile inductor fullgraph", compiled, "no_zero_grad", "stale_grad"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_stacks: no CUDA device visible; nothing to run")
        return 0
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    warnings.simplefilter("ignore")
    bad = 0
    print(f"{'stack':28} {'bug':14} {'expected':16} {'errors found':40} {'s':>6}  result")
    for stack, fn, bug, want in CASES:
        t0 = time.perf_counter()
        try:
            found = fn(bug, args.steps)
            ok = (not found) if want is None else (want in found)
            shown = ",".join(found) or "-"
        except Exception as e:  # noqa: BLE001 - a crash is a result here
            ok, shown = False, f"EXCEPTION {type(e).__name__}: {str(e)[:60]}"
        bad += not ok
        print(
            f"{stack:28} {bug or 'clean':14} {want or 'no error':16} {shown:40} "
            f"{time.perf_counter() - t0:6.1f}  {'ok' if ok else 'MISMATCH'}"
        )
    dist.destroy_process_group()
    return bad


if __name__ == "__main__":
    sys.exit(main())
