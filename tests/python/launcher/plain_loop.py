"""A plain training loop, written as it would be without TrainSan (a launcher test script).

    python plain_loop.py [--steps N] [--sleep S] [--bug no_zero_grad]

--bug no_zero_grad: optimizer.zero_grad() is never called (TrainSan: stale_grad).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each step")
parser.add_argument("--bug", choices=["no_zero_grad"])
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
inputs, labels = torch.randn(512, 16), torch.randint(0, 4, (512,))

for step in range(args.steps):
    idx = torch.randint(0, 512, (32,))
    if args.bug != "no_zero_grad":
        optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs[idx]), labels[idx])
    loss.backward()
    optimizer.step()
    if step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
    time.sleep(args.sleep)
print("done")
