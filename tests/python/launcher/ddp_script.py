"""DistributedDataParallel on CPU with gloo, as started by torchrun (a launcher test script).

    torchrun --standalone --nproc-per-node 2 ddp_script.py [--steps N]
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
