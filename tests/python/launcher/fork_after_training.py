"""The parent trains, then trains more in processes forked by torch.multiprocessing.start_processes,
then goes on training (a launcher test script): the forked children inherit the parent's
sanitizer, which must not write into the parent's trace.

    python fork_after_training.py [--start-method fork|spawn|forkserver]
"""

import argparse

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def fit(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        optimizer.zero_grad()
        F.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
        optimizer.step()


def worker(index, steps):
    torch.manual_seed(index)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    fit(model, torch.optim.SGD(model.parameters(), lr=0.01), steps, index)
    print(f"worker {index} done", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--start-method", default="fork")
    args = parser.parse_args()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    fit(model, optimizer, 3, 100)
    mp.start_processes(worker, args=(4,), nprocs=2, start_method=args.start_method)
    fit(model, optimizer, 2, 101)
    print("done")
