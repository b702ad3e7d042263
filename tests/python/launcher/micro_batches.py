"""Gradient accumulation over micro-batches, written as a plain loop would be (a launcher test
script; Note [Micro-batches cleared] in host/grad_tracker.cpp).

    python micro_batches.py --case clean|bug [--micro 2] [--steps 6]

clean: zero_grad() once per optimizer step, the micro-batches' gradients add up.
bug: zero_grad() before every micro-batch, so each step uses only the last one's gradient.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["clean", "bug"], required=True)
parser.add_argument("--micro", type=int, default=2)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(args.steps * args.micro)]

for step in range(args.steps):
    if args.case == "clean":
        optimizer.zero_grad()
    for j in range(args.micro):
        if args.case == "bug":
            optimizer.zero_grad()  # BUG: clears the previous micro-batches' gradients
        x, y = data[step * args.micro + j]
        loss = F.cross_entropy(model(x), y) / args.micro
        loss.backward()
    optimizer.step()
print("done")
