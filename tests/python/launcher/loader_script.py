"""Training from a DataLoader with worker processes, the script guarded by
`if __name__ == "__main__":` (a launcher test script). The dataset, the batch type and the collate
function are defined here, so the workers (spawned: they re-import this file as __mp_main__) and
the parent exchange objects of this module.

    python loader_script.py [--epochs N] [--workers N] [--context fork] [--bug nan_sample]

--bug nan_sample: one sample of the dataset holds NaN features (TrainSan: nonfinite_loss).
"""

import argparse
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Batch(NamedTuple):
    features: torch.Tensor
    label: torch.Tensor


class Blobs(Dataset):
    """Two Gaussian blobs; sample `bad` (if any) has NaN features."""

    def __init__(self, n: int, bad: int = -1):
        g = torch.Generator().manual_seed(1)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.features = torch.randn(n, 4, generator=g) + 2.0 * self.labels[:, None]
        if bad >= 0:
            self.features[bad] = float("nan")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return Batch(self.features[i], self.labels[i])


def collate(samples):
    return Batch(torch.stack([s.features for s in samples]),
                 torch.stack([s.label for s in samples]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context", choices=["spawn", "fork"], default="spawn",
                        help="the workers' start method")
    parser.add_argument("--bug", choices=["nan_sample"])
    args = parser.parse_args()

    torch.manual_seed(0)
    data = Blobs(256, bad=100 if args.bug == "nan_sample" else -1)
    loader = DataLoader(data, batch_size=32, shuffle=False, collate_fn=collate,
                        num_workers=args.workers, multiprocessing_context=args.context,
                        persistent_workers=args.workers > 0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(args.epochs):
        for batch in loader:
            assert isinstance(batch, Batch), type(batch)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(batch.features), batch.label)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
    print("done")


if __name__ == "__main__":
    main()
