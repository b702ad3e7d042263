"""Hogwild training: a model in shared memory, trained by processes started with
multiprocessing.Process, each with its own optimizer, as in the PyTorch Hogwild example (a launcher
test script).

    python hogwild.py [--processes N] [--steps N] [--start-method spawn] [--bug detach]

--bug detach: the first layer's output is detached, so that layer gets no gradient (TrainSan:
missing_grad).
"""

import argparse

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, detach: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 3)
        self.detach = detach

    def forward(self, x):
        h = F.relu(self.fc1(x))
        if self.detach:
            h = h.detach()
        return self.fc2(h)


def train(rank, model, steps):
    torch.manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    model.train()
    for _ in range(steps):
        x = torch.randn(32, 10)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"process {rank}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--start-method", choices=["fork", "spawn", "forkserver"])
    parser.add_argument("--bug", choices=["detach"])
    args = parser.parse_args()
    if args.start_method:
        mp.set_start_method(args.start_method)

    torch.manual_seed(0)
    model = Net(detach=args.bug == "detach")
    model.share_memory()  # gradients are allocated individually in each process
    processes = []
    for rank in range(args.processes):
        p = mp.Process(target=train, args=(rank, model, args.steps))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    with torch.no_grad():
        model.eval()
        x = torch.randn(256, 10)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        print(f"test accuracy {(model(x).argmax(1) == y).float().mean().item():.2f}")
