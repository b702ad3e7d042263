"""A training script that checkpoints and resumes, written as it would be without TrainSan (a
launcher test script).

    python resume_script.py --save ckpt.pt [--steps N]
    python resume_script.py --resume ckpt.pt [--steps N] [--bug forget_optimizer]

--save trains N steps and saves model, optimizer, scheduler and the epoch; --resume restores them
(torch.load, then load_state_dict of each) before the first forward and trains N more.
--bug forget_optimizer: the optimizer state is not restored (TrainSan: optimizer_reset).
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--save")
parser.add_argument("--resume")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--bug", choices=["forget_optimizer"])
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
inputs, labels = torch.randn(512, 16), torch.randint(0, 4, (512,))

start = 0
if args.resume:
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    if args.bug != "forget_optimizer":
        optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    start = checkpoint["epoch"]
    torch.manual_seed(1000 + start)  # other batches than the first run's

for epoch in range(start, start + args.steps):
    idx = torch.randint(0, 512, (32,))
    optimizer.zero_grad()
    loss = F.cross_entropy(model(inputs[idx]), labels[idx])
    loss.backward()
    optimizer.step()
    scheduler.step()

if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": start + args.steps}, args.save)
print("done")
