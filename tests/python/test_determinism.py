"""nondeterminism (issue 13, opt-in rerun_every=N): a deterministic loop is silent and its
training is unchanged; planted CPU nondeterminism is found and located — an unseeded generator
inside a module (forward), a non-deterministic backward (a custom Function whose gradient draws
its own noise), state that changes between calls (a module counter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import trainsan

_noise = torch.Generator().manual_seed(123)  # a generator the run never re-seeds


class Unseeded(nn.Module):
    """Adds noise from its own generator: a re-run with the global RNG restored differs."""

    def forward(self, x):
        return x + torch.randn(x.shape, generator=_noise) * 1e-3


class Counter(nn.Module):
    """Scales by a call counter: state that changes at every call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (1.0 + 1e-3 * self.calls)


class _NoisyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + torch.randn(g.shape, generator=_noise) * 1e-6


class NoisyBackward(nn.Module):
    def forward(self, x):
        return _NoisyGrad.apply(x)


class LazyCentre(nn.Module):
    """Passes its first input through and remembers its mean; later calls subtract it: state
    set by the first call (a lazy init, a cache)."""

    def __init__(self):
        super().__init__()
        self.centre = None

    def forward(self, x):
        if self.centre is None:
            self.centre = x.detach().mean()
            return x
        return x - self.centre


def make(mid=None):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.3), mid or nn.Identity(), nn.ReLU(),
                         nn.BatchNorm1d(12), nn.Linear(12, 2))


def run(model, attach=True, steps=4, **opts):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    san = trainsan.attach(model, opt, policy="record", rerun_every=2, **opts) if attach else None
    for i in range(steps):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    if san is not None:
        san.close()
    return san, [t.detach().clone() for t in model.state_dict().values()]


def test_deterministic_loop_is_silent_and_unchanged():
    san, with_check = run(make())
    assert [f for f in san.findings if f.kind == "nondeterminism"] == []
    _, without = run(make(), attach=False)
    for a, b in zip(with_check, without):  # weights and BatchNorm buffers bit for bit
        assert torch.equal(a, b)


def test_unseeded_generator_is_located_in_the_forward():
    san, _ = run(make(Unseeded()))
    (f,) = [f for f in san.findings if f.kind == "nondeterminism"]
    assert f.step == 0 and f.tensor == "2"
    assert "forward twice on the same batch" in f.message and "(Unseeded)" in f.message


def test_nondeterministic_backward_is_located():
    san, _ = run(make(NoisyBackward()))
    (f,) = [f for f in san.findings if f.kind == "nondeterminism"]
    assert "backward twice from the same output gradient" in f.message
    assert f.tensor == "0.bias"  # the first parameter its noisy gradient reaches


def test_state_changing_between_calls_is_named():
    san, _ = run(make(LazyCentre()))
    (f,) = [f for f in san.findings if f.kind == "nondeterminism"]
    assert "agree with each other but not with the step's own forward" in f.message
    assert f.tensor == "2" and "(LazyCentre)" in f.message
    san, _ = run(make(Counter()))
    (f,) = [f for f in san.findings if f.kind == "nondeterminism"]
    assert "state the module changes at every call" in f.message and "(Counter)" in f.message


def test_off_by_default_and_accumulation_not_rerun():
    torch.manual_seed(1)
    model = make(Unseeded())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")  # rerun_every=0
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
    san.close()
    assert not [f for f in san.findings if f.kind == "nondeterminism"]
    model = make(Unseeded())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record", rerun_every=1)
    for _ in range(2):
        opt.zero_grad()
        for _ in range(2):  # two micro-batches: the step's gradients are not one backward's
            model(torch.randn(8, 6)).sum().backward()
        opt.step()
    san.close()
    assert not [f for f in san.findings if f.kind == "nondeterminism"]


def test_header_records_what_reconstructs_a_run(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    model = make()
    path = tmp_path / "t.jsonl"
    trainsan.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), trace=str(path)).close()
    head = json.loads(path.read_text().splitlines()[0])
    assert any(p.startswith("torch==") for p in head["packages"])
    assert len(head["packages_sha256"]) == 64
    assert head["backends"]["cudnn_benchmark"] in (True, False)
    assert head["backends"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert head["numeric_env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_autocast_forward_is_rerun_under_its_autocast():
    """The re-runs run before the optimizer step, outside the loop's autocast block: their
    forward enters the regions the step's forward ran in (Note [One re-run recorder]), or the
    re-runs would agree with each other and not with the step's own bfloat16 forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    san = trainsan.attach(model, opt, policy="record", rerun_every=1)
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        loss.backward()
        opt.step()
    san.close()
    assert not [f for f in san.findings if f.kind == "nondeterminism"]
