"""Demo: train an MLP on scikit-learn's bundled handwritten digits with TrainSan on.

``python -m trainsan demo`` trains cleanly and ends with a summary (no findings);
``--bug NAME`` plants one bug and shows TrainSan's finding, its message and the line it came
from; ``--list-bugs`` lists the bugs. Nothing is downloaded: the digits ship with scikit-learn.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import torch
import torch.nn.functional as F

import trainsan

BUGS = {
    "stale_grad": "optimizer.zero_grad() is never called",
    "skipped_step": "optimizer.step() is forgotten (zero_grad and backward still run)",
    "missing_grad": "the hidden layer's output is .detach()ed, so the first layer never learns",
    "param_not_in_optimizer": "a layer is added to the model after the optimizer was built",
    "nonfinite_loss": "the loss takes log() of a probability that underflows to 0",
    "nonfinite_grad": "a sqrt of a value that reaches 0 puts Inf into the gradients",
    "no_grad_leak": "an extra forward under torch.no_grad() in train mode (a 'feature' call): "
                    "its Dropout runs as in training (a warning)",
    "eval_mode": "model.eval() for validation, model.train() forgotten afterwards",
    "duplicate_batch": "the loop re-reads the first batch: next(iter(loader)) inside the loop",
    "grad_explosion": "the loss is multiplied by 1e6 from the third epoch on",
    "update_ratio": "the learning rate is 10 instead of 0.1 (updates as large as the weights)",
    "broadcast": "a regulariser compares logsumexp [N,1] with a target [N]: an [N,N] loss",
}


class Net(torch.nn.Module):
    def __init__(self, bug: str | None):
        super().__init__()
        self.bug = bug
        self.fc1 = torch.nn.Linear(64, 128)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        h = self.drop(F.relu(self.fc1(x)))
        if self.bug == "missing_grad":
            h = h.detach()
        if self.bug == "nonfinite_grad":
            h = torch.sqrt(h)  # d/dh sqrt(h) is Inf where ReLU gave 0
        out = self.fc2(h)
        if hasattr(self, "extra"):
            out = out + self.extra(out)
        return out


def _batches(x, y, batch, bug):
    n = len(x)
    g = torch.Generator().manual_seed(len(x))
    perm = torch.randperm(n, generator=g)
    if bug == "duplicate_batch":
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
        for _ in range(0, n - batch + 1, batch):
            yield next(iter(loader))  # the bug: a fresh iterator, so always its first batch
        return
    for i in range(0, n - batch + 1, batch):
        idx = perm[i : i + batch]
        yield x[idx], y[idx]


def train(bug: str | None, epochs: int, trace: str) -> trainsan.Sanitizer:
    from sklearn.datasets import load_digits

    xs, ys = load_digits(return_X_y=True)
    x = torch.tensor(xs, dtype=torch.float32) / 16.0
    y = torch.tensor(ys)
    n_val = 297
    xv, yv, xt, yt = x[:n_val], y[:n_val], x[n_val:], y[n_val:]
    torch.manual_seed(0)
    model = Net(bug)
    lr = 10.0 if bug == "update_ratio" else 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if bug == "param_not_in_optimizer":
        model.extra = torch.nn.Linear(10, 10)
    san = trainsan.attach(model, opt, policy="raise", trace=trace)
    print(f"training a {sum(p.numel() for p in model.parameters())}-parameter MLP on "
          f"{len(xt)} digits (validation {n_val}), {epochs} epochs, trace -> {trace}")
    model.train()
    for epoch in range(epochs):
        total, count = 0.0, 0
        for xb, yb in _batches(xt, yt, 64, bug):
            if bug != "stale_grad":
                opt.zero_grad()
            if bug == "no_grad_leak":
                with torch.no_grad():
                    model(xb)  # "feature" call left in the training path
            logits = model(xb)
            if bug == "nonfinite_loss":
                loss = -(torch.softmax(logits * 1e4, 1).log() * F.one_hot(yb, 10)).sum(1).mean()
            else:
                loss = F.cross_entropy(logits, yb)
            if bug == "broadcast":
                lse = torch.logsumexp(logits, 1, keepdim=True)  # [N, 1]
                loss = loss + 0.01 * F.mse_loss(lse, torch.zeros(len(yb)))  # target [N]
            if bug == "grad_explosion" and epoch >= 2:
                loss = loss * 1e6
            san.watch_loss(loss)
            loss.backward()
            if bug != "skipped_step":
                opt.step()
            total += loss.item() * len(xb)
            count += len(xb)
        model.eval()
        with torch.no_grad():
            acc = (model(xv).argmax(1) == yv).float().mean().item()
        if bug != "eval_mode":
            model.train()
        print(f"epoch {epoch + 1}/{epochs}: train loss {total / count:.4f}, "
              f"validation accuracy {acc:.3f}, steps {san.step}")
    san.close()
    return san


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainsan demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bug", choices=sorted(BUGS), help="plant one bug (see --list-bugs)")
    p.add_argument("--list-bugs", action="store_true", help="list the bugs --bug can plant")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--trace", default=os.path.join(tempfile.gettempdir(), "trainsan_demo.jsonl"))
    args = p.parse_args(argv)
    if args.list_bugs:
        for name, what in BUGS.items():
            print(f"{name:24s} {what}")
        return 0
    print(f"trainsan {trainsan.__version__} on torch {torch.__version__} "
          f"(CUDA kernels compiled: {trainsan.cuda_compiled()})")
    try:
        san = train(args.bug, args.epochs, args.trace)
    except trainsan.TrainingBugError as e:
        f = e.finding
        frames = [fr for fr in traceback.extract_tb(e.__traceback__)
                  if fr.filename == __file__ and fr.name == "train"]
        print("\nTrainSan stopped the run:")
        print(f"  kind:     {f.kind} ({f.severity})")
        print(f"  step:     {f.step}")
        print(f"  tensor:   {f.tensor or '-'}")
        print(f"  message:  {f.message}")
        if frames:
            fr = frames[-1]
            print(f"  raised in the training loop at {os.path.basename(fr.filename)}:{fr.lineno}:"
                  f" {fr.line}")
        print(f"  trace:    {args.trace}")
        return 0 if args.bug else 1
    print()
    print(san.summary())
    errors = [f for f in san.findings if f.severity == "error"]
    if args.bug and not san.findings:
        print(f"the planted bug {args.bug} was NOT detected", file=sys.stderr)
        return 1
    return 1 if errors and not args.bug else 0


if __name__ == "__main__":
    sys.exit(main())
