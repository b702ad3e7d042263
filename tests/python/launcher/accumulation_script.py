"""Gradient accumulation over a DataLoader (a launcher test script): the optimizer steps after
every `--every` micro-batches and at each epoch's last batch, the loss divided by `--every`.

    python accumulation_script.py [--every N] [--batches N] [--epochs N]

Run under ``python -m trainsan run --accumulation-steps 4``: ``--every 4`` keeps the declared
window (clean), ``--every 3`` does not (accumulation_mismatch).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(8 * args.batches, 6)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.epochs):
        for i, (xb, yb) in enumerate(loader):
            loss = F.mse_loss(model(xb), yb) / args.every
            loss.backward()
            if (i + 1) % args.every == 0 or i + 1 == len(loader):
                opt.step()
                opt.zero_grad()
    print("done")


if __name__ == "__main__":
    main()
