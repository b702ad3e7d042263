"""A training loop without an optimizer: the parameters are updated by hand through p.data (a
launcher test script).

    python manual_loop.py [--steps N] [--bug no_zero_grad]

--bug no_zero_grad: the gradients are never cleared after the update (TrainSan: stale_grad).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--bug", choices=["no_zero_grad"])
args = parser.parse_args()

torch.manual_seed(0)
model = Regressor()
w_true = torch.randn(8, 1)
for step in range(args.steps):
    x = torch.randn(64, 8)
    y = x @ w_true + 0.1 * torch.randn(64, 1)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        p.data -= args.lr * p.grad
        if args.bug != "no_zero_grad":
            p.grad = None
    if step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
print("done")
