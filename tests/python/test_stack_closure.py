"""Closure-driven steps: the forward and backward run inside ``optimizer.step(closure)``, as
Lightning's automatic optimization does every step (Note [Closure steps] in
bindings/trainsan/_hooks.py). Each scenario runs twice, as a plain loop and as a closure loop
with the same data, and must give the same findings; clean loops must be silent."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan

STEPS = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS, 32, 10, generator=g)
    return x, x[..., :3].sum(-1, keepdim=True) + 0.1 * torch.randn(STEPS, 32, 1, generator=g)


def _scenario(name, step, model):
    """(x, y, loss_fn, zero) of step `step` under the planted bug `name`."""
    X, Y = _data()
    x, y = X[step], Y[step]
    zero = True
    loss_fn = F.mse_loss
    if name == "broadcast":
        y = y.squeeze(-1)  # [N, 1] against [N]
    elif name == "frozen_inputs" and step >= 3:
        x, y = X[2], Y[2]  # the loader got stuck after the data had changed
    elif name == "no_zero_grad":
        zero = step == 0
    elif name == "nan_input" and step == 4:
        x = x.clone()
        x[3, 1] = float("nan")
    elif name == "eval_mode":
        model.eval()
    elif name == "detached_body":
        loss_fn = lambda out, t: F.mse_loss(out, t)  # noqa: E731
    return x, y, loss_fn, zero


def _run(name, closure_style, opt_cls=torch.optim.SGD):
    torch.manual_seed(0)
    model = Net()
    if name == "detached_body":
        model.body.register_forward_hook(lambda m, a, out: out.detach())
    opt = opt_cls(model.parameters(), lr=0.05)
    with torch.no_grad():
        pass
    with pytest.warns(UserWarning) if name == "broadcast" else _nullcontext():
        with trainsan.attach(model, opt, policy="record") as san:
            for step in range(STEPS):
                x, y, loss_fn, zero = _scenario(name, step, model)

                def closure():
                    if zero:
                        opt.zero_grad()
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    return loss

                if closure_style:
                    opt.step(closure)
                else:
                    closure()
                    opt.step()
    return san


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _kinds(san, severity=None):
    return sorted({f.kind for f in san.findings if severity is None or f.severity == severity})


def test_clean_closure_loop_is_silent_and_every_forward_is_seen():
    san = _run("clean", closure_style=True)
    assert _kinds(san, "error") == [], san.summary()
    c = san.coverage()
    assert c["training_forwards"] == STEPS and san.step == STEPS
    assert c["losses_checked"] == STEPS and c["audited_forwards"] > 0
    assert "duplicate_batch" not in c["unchecked"] and "broadcast" not in c["unchecked"]


BUGS = {
    "broadcast": "broadcast",
    "frozen_inputs": "duplicate_batch",
    "no_zero_grad": "stale_grad",
    "nan_input": "nonfinite_loss",
    "eval_mode": "eval_mode",
    "detached_body": "missing_grad",
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_closure_loop_finds_what_the_plain_loop_finds(name):
    plain = _run(name, closure_style=False)
    closure = _run(name, closure_style=True)
    assert BUGS[name] in _kinds(plain), plain.summary()
    assert _kinds(closure) == _kinds(plain), closure.summary() + "\n---\n" + plain.summary()
    first = {f.kind: f.step for f in plain.findings}
    assert {f.kind: f.step for f in closure.findings} == first


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.LBFGS])
def test_closure_loops_of_several_optimizers_are_clean(opt_cls):
    san = _run("clean", closure_style=True, opt_cls=opt_cls)
    assert _kinds(san, "error") == [], san.summary()
    assert san.step == STEPS


def test_lbfgs_line_search_evaluations_stay_inside_the_step():
    # LBFGS evaluates its closure many times per step: from its second step on the step begins
    # before the closure (Note [Closure steps]), so the forwards seen are those of step 0 only.
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=20)
    x = torch.randn(64, 4)
    y = x @ torch.randn(4, 1)
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(5):

            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    assert _kinds(san, "error") == [], san.summary()
    assert san.coverage()["training_forwards"] == 1
