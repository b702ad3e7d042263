"""DistributedDataParallel on CPU with gloo, its ranks started by torch.multiprocessing.spawn as in
the PyTorch DDP tutorial (a launcher test script).

    python spawn_ddp.py [--world N] [--steps N] [--bug nan_input]

--bug nan_input: rank 1's input batch holds a NaN at step 2 (TrainSan: nonfinite_loss there).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(rank, world_size, port, steps, bug):
    setup(rank, world_size, port)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        if bug == "nan_input" and rank == 1 and step == 2:
            x[3, 5] = float("nan")
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bug", choices=["nan_input"])
    args = parser.parse_args()
    mp.spawn(train, args=(args.world, free_port(), args.steps, args.bug), nprocs=args.world)
    print("done")
