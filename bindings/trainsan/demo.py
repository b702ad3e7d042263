"""Demo: train a small MLP on scikit-learn's bundled digits and print tensor statistics."""

from __future__ import annotations

import argparse

import torch

import trainsan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainsan demo")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        for i in range(0, len(x), 128):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i : i + 128]), y[i : i + 128])
            loss.backward()
            opt.step()
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    grads = [p.grad for p in params]
    for n, s in zip(names + [n + ".grad" for n in names], trainsan.tensor_stats(params + grads)):
        print(f"{n:16s} numel={s.numel:6d} nan={s.nan} l2={s.l2:.4f} absmax={s.absmax:.4f} "
              f"hash={s.hash:016x}")
    return 0
