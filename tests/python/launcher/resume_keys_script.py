"""A training script that checkpoints and resumes into a newer version of its model, written as it
would be without TrainSan (a launcher test script for test_resume_keys.py).

    python resume_keys_script.py --save ckpt.pt [--groups]
    python resume_keys_script.py --resume ckpt.pt [--groups] [--bug rename|reorder]
                                 [--finetune]

--save trains a model of two parallel branches of one shape (`left`, `right`) and a head, and
saves {"model", "optimizer", "epoch"}; --resume restores both before the first forward and trains
on. --groups: AdamW over decay and no-decay parameter groups (as nanoGPT and HF's Trainer build
them), at the save and at the resume. Bugs:
rename — version 2 of the model adds a LayerNorm before the head and calls `head` `classifier`
(same shape), loaded with strict=False with a fresh optimizer (TrainSan: bad_checkpoint naming
classifier.weight);
reorder — the two branches declared in the other order: Adam's moments swap between them by
position, their gradient scales alike (TrainSan: optimizer_reset).
--finetune: the old head replaced by nn.Identity() and a new classifier of the same shape with a
fresh optimizer, loaded with strict=False (legitimate).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--save")
parser.add_argument("--resume")
parser.add_argument("--groups", action="store_true")
parser.add_argument("--finetune", action="store_true")
parser.add_argument("--bug", choices=["rename", "reorder"])
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self, version=1):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        if version == 3:  # the branches declared in the other order
            self.right = nn.Linear(16, 16)
            self.left = nn.Linear(16, 16)
        else:
            self.left = nn.Linear(16, 16)
            self.right = nn.Linear(16, 16)
        if version == 2:
            self.norm = nn.LayerNorm(16)
            self.classifier = nn.Linear(16, 4)
        else:
            self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = torch.relu(self.left(h)) + torch.relu(self.right(h))
        if hasattr(self, "norm"):
            h = self.norm(h)
        for name in ("head", "classifier"):
            if hasattr(self, name):
                h = getattr(self, name)(h)
        return h


def make_optimizer(model, lr=1e-3):
    if not args.groups:
        return torch.optim.AdamW(model.parameters(), lr=lr)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


torch.manual_seed(0)
version = {"rename": 2, "reorder": 3}.get(args.bug, 1)
model = Net(version)
optimizer = make_optimizer(model)

start = 0
if args.resume:
    checkpoint = torch.load(args.resume)
    if args.finetune:
        model.head = nn.Identity()  # a new task head of the same shape, started fresh
        model.classifier = nn.Linear(16, 4)
        model.load_state_dict(checkpoint["model"], strict=False)
        optimizer = make_optimizer(model, lr=1e-4)
    else:
        model.load_state_dict(checkpoint["model"], strict=args.bug != "rename")
        if args.bug != "rename":  # v2's parameters no longer fit the saved optimizer's groups
            optimizer.load_state_dict(checkpoint["optimizer"])
    start = checkpoint["epoch"]
    torch.manual_seed(1000 + start)

for epoch in range(start, start + 6):
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()

if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": start + 6}, args.save)
print("done")
