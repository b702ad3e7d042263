"""An encoder and a decoder built as separate modules, trained by one optimizer that also holds a
bare tensor (a launcher test script): no single module holds the optimizer's parameters.

    python two_roots_script.py [--bug detached_code]

--bug detached_code: the encoder's output is detached, so the encoder never learns (TrainSan:
missing_grad on the encoder's parameters).
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["detached_code"])
args = parser.parse_args()

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(8, 4), nn.Tanh())
decoder = nn.Linear(4, 8)
offset = torch.zeros(8, requires_grad=True)
optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters(), offset], lr=1e-3)
for step in range(6):
    x = torch.randn(32, 8)
    code = encoder(x)
    if args.bug == "detached_code":
        code = code.detach()
    loss = ((decoder(code) + offset - x) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done")
