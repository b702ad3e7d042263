"""A training script that checkpoints mid-epoch and resumes, written as it would be without
TrainSan (a launcher test script).

    python resume_data_script.py --save ckpt.pt [--steps N]
    python resume_data_script.py --resume ckpt.pt [--steps N] [--bug restart|refactor]

--save trains N steps over a shuffled DataLoader of 8 batches a pass and saves model, optimizer,
epoch and step, and the RNG state the epoch in progress shuffled from; --resume restores them
(torch.load, then load_state_dict of each, torch.set_rng_state) before the first forward and
trains N more, skipping the batches of the epoch the checkpoint had trained (itertools.islice).
--bug restart: the loader restarts at the epoch's first batch (TrainSan: duplicate_batch).
--bug refactor: the model's blocks were renamed since the checkpoint, loaded with strict=False
(TrainSan: bad_checkpoint naming the layers left at their initialisation).
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--save")
parser.add_argument("--resume")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--bug", choices=["restart", "refactor"])
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.proj(x))


class Net(nn.Module):
    def __init__(self, refactored=False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        blocks = nn.ModuleList([Block(), Block()])
        if refactored:
            self.layers = blocks  # renamed from `blocks` since the checkpoint
        else:
            self.blocks = blocks
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in getattr(self, "layers", None) or self.blocks:
            h = b(h)
        return self.head(h)


torch.manual_seed(0)
model = Net(refactored=args.bug == "refactor")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
loader = DataLoader(data, batch_size=8, shuffle=True)

epoch, step = 0, 0
if args.resume:
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"], strict=args.bug != "refactor")
    optimizer.load_state_dict(checkpoint["optimizer"])
    epoch, step = checkpoint["epoch"], checkpoint["step"]
    torch.set_rng_state(checkpoint["rng"])

end = step + args.steps
while step < end:
    rng = torch.get_rng_state()  # what this epoch's shuffle draws from
    skip = 0 if args.bug == "restart" else step % len(loader)
    for x, y in itertools.islice(loader, skip, None):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        step += 1
        if step == end:
            break
    else:
        epoch += 1

if args.save:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch, "step": step,
                "rng": rng if step % len(loader) else torch.get_rng_state()}, args.save)
print("done")
