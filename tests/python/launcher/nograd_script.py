"""A supervised loop whose training forward may run under torch.no_grad() (a launcher test
script).

    python nograd_script.py [--steps N] [--bug no_grad_forward]

--bug no_grad_forward: the training forward runs under torch.no_grad(), so loss.backward() fails
with torch's "does not require grad" error (TrainSan: no_grad_leak, naming the forward first).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--bug", choices=["no_grad_forward"])
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
inputs, labels = torch.randn(128, 8), torch.randint(0, 3, (128,))


def forward(x):
    if args.bug == "no_grad_forward":
        with torch.no_grad():
            return model(x)
    return model(x)


for step in range(args.steps):
    idx = torch.randint(0, 128, (32,))
    optimizer.zero_grad()
    loss = F.cross_entropy(forward(inputs[idx]), labels[idx])
    loss.backward()
    optimizer.step()
print("done")
