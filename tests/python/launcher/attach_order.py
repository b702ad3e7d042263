"""A loop whose model's parameters are replaced (load_state_dict(assign=True)) at an awkward
moment, written as it would be without TrainSan (a launcher test script; Note [Attach order]).

    python attach_order.py --case clean|optimizer_before|probe_before [--steps N]

clean: the weights are loaded (assign=True) first, then the optimizer is built: the right order.
optimizer_before: a first phase trains; the optimizer of the second phase is built on the
  parameters of the first, then the weights are loaded with assign=True, which replaces the
  parameters: that optimizer holds none of the model's (the launcher pairs it with the model at
  its first step: an optimizer holding none of the model's parameters at attach).
probe_before: one training-mode forward with gradients (a shape probe) before the weights are
  loaded with assign=True: the launcher attached at the probe, so the parameters it watches are
  replaced after attach (found at the first step); the optimizer, built before, is stale too.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["clean", "optimizer_before", "probe_before"],
                    required=True)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
weights = {k: v.clone() for k, v in model.state_dict().items()}  # a checkpoint, say
inputs, labels = torch.randn(256, 16), torch.randint(0, 4, (256,))


def train(optimizer, steps):
    for step in range(steps):
        idx = torch.randint(0, 256, (32,))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs[idx]), labels[idx])
        loss.backward()
        optimizer.step()
    print(f"loss {loss.item():.4f}", flush=True)


if args.case == "clean":
    model.load_state_dict(weights, assign=True)
    train(torch.optim.SGD(model.parameters(), lr=0.05), args.steps)
elif args.case == "optimizer_before":
    train(torch.optim.SGD(model.parameters(), lr=0.05), 2)  # phase 1
    phase2 = torch.optim.SGD(model.parameters(), lr=0.01)  # BUG: built before the load
    model.load_state_dict(weights, assign=True)  # replaces the parameters
    train(phase2, args.steps)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # BUG: built before the load
    assert model(inputs[:2]).shape == (2, 4)  # a probe, with gradients, in train mode
    model.load_state_dict(weights, assign=True)  # replaces the parameters
    train(optimizer, args.steps)
print("done")
