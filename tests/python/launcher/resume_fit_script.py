"""A training script that checkpoints, resumes and fine-tunes, written as it would be without
TrainSan (a launcher test script for test_resume_fit.py).

    python resume_fit_script.py --save ckpt.pt
    python resume_fit_script.py --resume ckpt.pt [--finetune] [--bug BUG]

A model of numeric features in raw units and normalised text features, each projected by a
Linear of one shape. --save trains and saves model, optimizer, warm-up scheduler and the epoch;
--resume restores them before the first forward and trains on. --finetune: a new head and a new
optimizer and scheduler, the pretraining's left unloaded (legitimate). Bugs (optimizer_reset):
reorder — the projections registered in the other order (a refactor), the optimizer state
restored by position; forget_optimizer — optimizer.load_state_dict not called;
scheduler_after — the scheduler built after optimizer.load_state_dict and not restored.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--save")
parser.add_argument("--resume")
parser.add_argument("--finetune", action="store_true")
parser.add_argument("--bug", choices=["reorder", "forget_optimizer", "scheduler_after"])
args = parser.parse_args()


class Fusion(nn.Module):
    def __init__(self, refactored=False):
        super().__init__()
        if refactored:
            self.text_proj = nn.Linear(16, 32)
            self.numeric_proj = nn.Linear(16, 32)
        else:
            self.numeric_proj = nn.Linear(16, 32)
            self.text_proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, numeric, text):
        return self.head(torch.relu(self.numeric_proj(numeric) + self.text_proj(text)))


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: min(1.0, (e + 1) / 10))


torch.manual_seed(0)
model = Fusion(refactored=args.bug == "reorder")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = warmup(optimizer)
classes = 4

start = 0
if args.resume:
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    start = checkpoint["epoch"]
    if args.finetune:
        model.head = nn.Linear(32, 2)
        classes = 2
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scheduler = warmup(optimizer)
    else:
        if args.bug != "forget_optimizer":
            optimizer.load_state_dict(checkpoint["optimizer"])
        if args.bug == "scheduler_after":
            scheduler = warmup(optimizer)
        else:
            scheduler.load_state_dict(checkpoint["scheduler"])
    torch.manual_seed(1000 + start)

for epoch in range(start, start + 6):
    numeric, text = torch.randn(32, 16) * 1000, torch.randn(32, 16)
    labels = torch.randint(0, classes, (32,))
    optimizer.zero_grad()
    F.cross_entropy(model(numeric, text), labels).backward()
    optimizer.step()
    scheduler.step()

if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": start + 6}, args.save)
print("done")
