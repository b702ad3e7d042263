"""A small transformer trained with activation checkpointing (a launcher test script): each block
runs under torch.utils.checkpoint, imported by name as training scripts do.

    python checkpointed_script.py [--steps N] [--reentrant] [--bug rng]

--bug rng: the blocks are checkpointed with preserve_rng_state=False, so the backward recomputes
them with other dropout masks than the forward applied (TrainSan: nondeterminism naming the
block, the RNG not preserved).
"""

import argparse

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--reentrant", action="store_true")
parser.add_argument("--bug", choices=["rng"])
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, d: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=args.reentrant,
                           preserve_rng_state=args.bug != "rng")
        return self.head(h).mean(dim=1)


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(args.steps):
    x, y = torch.randn(4, 6, 8), torch.randn(4, 1)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done")
