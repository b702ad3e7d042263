"""Keyword-only model calls (issue 37): HF Trainer, skorch and trl call model(**batch). The
launcher attaches inside the first such call, from a process-wide forward pre-hook that gets the
positional arguments only; the call's keyword arguments are read from its frame (_pairing.
_call_kwargs), so the first step's inputs are fingerprinted too."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import trainsan

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher", "kwargs_only.py")


def test_launcher_fingerprints_the_first_keyword_only_call():
    r = subprocess.run([sys.executable, "-m", "trainsan", "run", SCRIPT, "--steps", "4"],
                       capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "4 steps, no findings" in r.stderr, r.stderr
    assert "4 training forward(s)" in r.stderr and "inputs at 4 step(s)" in r.stderr, r.stderr


def test_training_forward_takes_keyword_inputs():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    try:
        for _ in range(2):
            x = torch.randn(2, 3)
            opt.zero_grad()
            san.training_forward(input=x)  # reported by hand, keyword only
            model.forward(x).sum().backward()  # .forward: no hook of its own
            opt.step()
        assert san.coverage()["inputs_fingerprinted"] == 2, san.summary()
    finally:
        san.close()
