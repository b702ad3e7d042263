"""A trainer that resumes by rebuilding its model from the checkpoint, as public trainers do (a
launcher test script).

    python stale_wrapper_script.py [--bug stale_wrapper]

--bug stale_wrapper: the resume rebuilds the model and its optimizer but keeps the loss wrapper
built around the model from before the resume, so every backward trains the old model and the
optimizer steps the new one, which never gets a gradient (TrainSan: missing_grad naming the
wrapper's model).
"""

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--bug", choices=["stale_wrapper"])
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


class LossWrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


class Trainer:
    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.model = Net()
        self.criterion = LossWrapper(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def save(self):
        torch.save({"model": self.model.state_dict()}, self.ckpt)

    def resume(self):
        state = torch.load(self.ckpt)
        self.model = Net()
        self.model.load_state_dict(state["model"])
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        if args.bug != "stale_wrapper":
            self.criterion = LossWrapper(self.model)

    def fit(self, steps):
        for _ in range(steps):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            loss = self.criterion(x, y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


torch.manual_seed(0)
with tempfile.TemporaryDirectory() as tmp:
    trainer = Trainer(os.path.join(tmp, "last.pt"))
    trainer.fit(5)
    trainer.save()
    trainer.resume()
    trainer.fit(10)
print("done")
