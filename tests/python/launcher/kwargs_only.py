"""A model called with keyword arguments only, as HF Trainer, skorch and trl call it
(model(**batch)); a launcher test script (test_kwargs_inputs.py).

    python kwargs_only.py [--steps N]
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids=None, labels=None):
        return F.cross_entropy(self.head(input_ids), labels)


torch.manual_seed(0)
model = Classifier()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(args.steps):
    batch = {"input_ids": torch.randn(4, 8), "labels": torch.randint(0, 2, (4,))}
    optimizer.zero_grad()
    model(**batch).backward()
    optimizer.step()
print("done")
