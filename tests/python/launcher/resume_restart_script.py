"""A training script with an HF-style schedule (linear warm-up, then linear decay, stepped per
batch) over a shuffled DataLoader, that checkpoints at an epoch boundary and resumes, written as it
would be without TrainSan (a launcher test script).

    python resume_restart_script.py --save ckpt.pt
    python resume_restart_script.py --resume ckpt.pt [--bug forget_scheduler|forget_rng]
                                    [--twin seed_per_epoch|last_epoch]

Like the HF and timm scripts, it seeds once at the top (`set_seed`). --save trains two epochs of 8
batches and saves model, optimizer, scheduler, epoch, step and the RNG state; --resume restores all
of them before the first forward and trains one more epoch.
--bug forget_scheduler: the scheduler is rebuilt, not restored (TrainSan: optimizer_reset, a
warning at the first step, an error at the next, where the warm-up restarts).
--bug forget_rng: the RNG state is not restored (TrainSan: duplicate_batch, a warning: the loader
draws the first epoch's order again).
--twin seed_per_epoch: with --bug forget_rng, the loop seeds each epoch with seed + epoch (silent).
--twin last_epoch: with --bug forget_scheduler, the scheduler is rebuilt at the checkpoint's step
(LambdaLR(..., last_epoch=step - 1): silent).
"""

import argparse
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--save")
parser.add_argument("--resume")
parser.add_argument("--bug", choices=["forget_scheduler", "forget_rng"])
parser.add_argument("--twin", choices=["seed_per_epoch", "last_epoch"])
args = parser.parse_args()

SEED, WARMUP, TOTAL = 42, 4, 64


def set_seed(seed):  # transformers.set_seed, accelerate.utils.set_seed
    random.seed(seed)
    torch.manual_seed(seed)


def linear_schedule(optimizer, last_epoch=-1):  # transformers.get_linear_schedule_with_warmup
    def lr_lambda(step):
        if step < WARMUP:
            return step / max(1, WARMUP)
        return max(0.0, (TOTAL - step) / max(1, TOTAL - WARMUP))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch)


set_seed(SEED)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
loader = DataLoader(data, batch_size=8, shuffle=True)

scheduler = linear_schedule(optimizer)  # built with the optimizer, before the loads (HF Trainer)
epoch, step, epochs = 0, 0, 2
if args.resume:
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    epoch, step = checkpoint["epoch"], checkpoint["step"]
    epochs = epoch + 1
    if args.twin == "last_epoch":
        scheduler = linear_schedule(optimizer, last_epoch=step - 1)  # rebuilt where it was
    elif args.bug != "forget_scheduler":
        scheduler.load_state_dict(checkpoint["lr_scheduler"])
    if args.bug != "forget_rng":
        torch.set_rng_state(checkpoint["rng"])

while epoch < epochs:
    if args.twin == "seed_per_epoch":
        torch.manual_seed(SEED + epoch)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        step += 1
    epoch += 1

if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "lr_scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                "rng": torch.get_rng_state()}, args.save)
print("done")
