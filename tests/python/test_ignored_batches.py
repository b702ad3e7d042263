"""A loop that ignores the batch its loader yields (issue 37; Note [Ignored batches] in
host/checks/inputs.cpp): the loader yields a new batch every step while the model sees the same
inputs every step — duplicate_batch, an error. Written as the failing loops were: a Lightning-
style training_step that trains on a batch kept from its first call, and a loop that fetches its
loader's batch and then uses another. Full-batch fits, overfit-one-batch loops without a loader,
and a loader over one batch stay silent."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainsan

STEPS = 6


def _setup(n=64, batch=8, shuffle=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    X, y = torch.randn(n, 8), torch.randint(0, 2, (n,))
    loader = DataLoader(TensorDataset(X, y), batch_size=batch, shuffle=shuffle)
    return model, opt, loader, (X[:batch], y[:batch])


def _dup(san):
    return [f for f in san.findings if f.kind == "duplicate_batch"]


class Module:
    """A LightningModule-like object: training_step(batch) is what the trainer calls per batch."""

    def __init__(self, model, bug):
        self.model, self.bug, self.kept = model, bug, None

    def training_step(self, batch):
        x, y = batch
        if self.bug:
            if self.kept is None:
                self.kept = (x, y)
            x, y = self.kept  # BUG: trains on the first batch forever
        return F.cross_entropy(self.model(x), y)


@pytest.mark.parametrize("bug", [False, True], ids=["clean", "kept_batch"])
def test_training_step_on_a_kept_batch(bug):
    model, opt, loader, _ = _setup()
    module = Module(model, bug)
    san = trainsan.attach(model, opt, policy="record")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in loader:  # the trainer's loop
            opt.zero_grad()
            module.training_step(batch).backward()
            opt.step()
    san.close()
    found = _dup(san)
    if not bug:
        assert found == [], san.summary()
    else:
        (f,) = found
        assert f.severity == "error" and f.step == 2, f
        assert "another batch than the one its loader yielded" in f.message


def test_a_loop_that_fetches_and_uses_another_batch():
    model, opt, loader, fixed = _setup()
    san = trainsan.attach(model, opt, policy="raise")
    with pytest.raises(trainsan.TrainingBugError, match="duplicate_batch at step 2"):
        for x, y in loader:
            x, y = fixed  # BUG: a debugging line left in
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    san.close()


def test_full_batch_and_one_batch_loops_are_silent():
    for case in ("full_batch", "loader_of_one_batch", "unshuffled_one_batch_loader"):
        model, opt, _, (x, y) = _setup()
        one = DataLoader(TensorDataset(x, y), batch_size=len(x), shuffle=case == "loader_of_one_batch")
        san = trainsan.attach(model, opt, policy="raise")
        for _ in range(STEPS):
            batches = [(x, y)] if case == "full_batch" else one
            for bx, by in batches:
                opt.zero_grad()
                F.cross_entropy(model(bx), by).backward()
                opt.step()
        san.close()
        assert _dup(san) == [], (case, san.summary())


@pytest.mark.parametrize("case", ["clean", "bug"])
def test_through_the_launcher(case):
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher",
                          "ignored_batch.py")
    r = subprocess.run([sys.executable, "-m", "trainsan", "run", script, "--case", case],
                       capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if case == "clean":
        assert r.returncode == 0 and "done" in r.stdout, r.stderr
        assert "8 steps, no findings" in r.stderr, r.stderr
    else:  # policy raise, the launcher's default
        assert r.returncode != 0 and "done" not in r.stdout, r.stderr
        assert "duplicate_batch at step 2" in r.stderr, r.stderr
