"""A loop that fetches its loader's batch and trains on another one (a launcher test script;
Note [Ignored batches] in host/checks/inputs.cpp).

    python ignored_batch.py --case clean|bug
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["clean", "bug"], required=True)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
X, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
loader = DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True)
sample = next(iter(loader))  # a batch to look at
for xb, yb in loader:
    if args.case == "bug":
        xb, yb = sample  # BUG: a debugging line left in
    optimizer.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    optimizer.step()
print("done")
