"""Step-integrity rules that must hold on real loops (issue 8), from Python:

* a tensor the step left unchanged is named per tensor; group learning rates of 0, frozen and
  zero-gradient tensors, fp16 weights and underflowing updates are not;
* all-zero gradients as backward() left them (a fully masked batch, then clipped) are not a
  skipped step, and no message claims a zero_grad() the loop never called;
* label_range on a CPU with policy "raise" raises TrainingBugError before the op, without sync;
  close() never reports a finding already raised or printed, and leaving a ``with`` block by an
  exception never masks it;
* attached inside optimizer.step(closure): the rest of that step is not a skipped step.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)


def batch(dtype=torch.float32):
    x = torch.randn(16, 8, dtype=dtype)
    return x, x[:, :1] * 0.5


def train(model, opt, steps=4, before_step=None, dtype=torch.float32, **attach):
    san = trainsan.attach(model, opt, policy="record", **attach)
    for _ in range(steps):
        x, y = batch(dtype)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if before_step is not None:
            before_step()
        opt.step()
    san.close()
    return san


def skipped(san):
    return [f for f in san.findings if f.kind == "skipped_step"]


# ---------------------------------------------------------------------------------------------
# A tensor the step left unchanged


class DropLast(torch.optim.SGD):
    """SGD that forgets the last tensor of each group."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        for g in self.param_groups:
            for p in g["params"][:-1]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


def test_a_tensor_the_optimizer_ignores_is_named():
    model = mlp()
    san = train(model, DropLast(model.parameters(), lr=0.05))
    fs = skipped(san)
    assert [f.tensor for f in fs] == ["2.bias"], [f.message for f in san.findings]
    f = fs[0]
    assert f.severity == "error" and f.step == 0 and f.count == 4
    assert "changed other parameters but not one element of 2.bias" in f.message
    assert "learning rate is 0.05" in f.message and f.value > 0


def test_learning_rate_as_a_tensor_and_per_group():
    model = mlp()
    opt = DropLast([{"params": list(model.parameters())[:2], "lr": torch.tensor(0.05)},
                    {"params": list(model.parameters())[2:], "lr": 0.05}])
    fs = skipped(train(model, opt))
    assert sorted(f.tensor for f in fs) == ["0.bias", "2.bias"], [f.message for f in fs]


@pytest.mark.parametrize("setup", ["group_lr_zero", "frozen", "zero_grad", "fp16"])
def test_legitimately_unchanged_tensors_are_silent(setup):
    dtype = torch.float16 if setup == "fp16" else torch.float32
    model = mlp(dtype)
    ps = list(model.parameters())
    before = None
    if setup == "group_lr_zero":
        opt = torch.optim.SGD([{"params": ps[:2], "lr": 0.0}, {"params": ps[2:], "lr": 0.05}])
    elif setup == "frozen":
        ps[0].requires_grad_(False)
        opt = torch.optim.SGD(ps, lr=0.05)
    elif setup == "zero_grad":
        opt = torch.optim.SGD(ps, lr=0.05)

        def before():
            ps[1].grad.zero_()  # e.g. a masked unit; no weight decay: nothing to do
    else:
        # fp16 weights: an update below half an ulp rounds away (update_underflow's business)
        opt = torch.optim.SGD(ps, lr=1e-6)
    san = train(model, opt, before_step=before, dtype=dtype)
    assert not [f for f in skipped(san) if f.tensor], [f.message for f in san.findings]


# ---------------------------------------------------------------------------------------------
# All-zero gradients


def masked_loop(model, opt, masked_steps, steps=6, set_to_none=True, zero_after_backward=False):
    san = trainsan.attach(model, opt, policy="record")
    for step in range(steps):
        x, y = batch()
        mask = torch.zeros(16, 1) if step in masked_steps else torch.ones(16, 1)
        opt.zero_grad(set_to_none=set_to_none)
        per = (model(x) - y) ** 2
        ((per * mask).sum() / mask.sum().clamp(min=1)).backward()
        if zero_after_backward:
            opt.zero_grad(set_to_none=False)  # the bug
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    san.close()
    return san


@pytest.mark.parametrize("masked", [(0,), (2,), (2, 3, 4, 5)])
def test_all_zero_gradients_from_backward_are_not_a_skipped_step(masked):
    model = mlp()
    san = masked_loop(model, torch.optim.SGD(model.parameters(), lr=0.05), set(masked))
    assert not skipped(san), [f.message for f in san.findings]
    assert not any("zero_grad" in f.message for f in san.errors())


def test_gradients_zeroed_in_place_after_backward_are_found_without_claiming_zero_grad():
    model = mlp()
    san = masked_loop(model, torch.optim.SGD(model.parameters(), lr=0.05), set(),
                      set_to_none=False, zero_after_backward=True)
    fs = skipped(san)
    assert fs and fs[0].step <= 1, [f.message for f in san.findings]  # probed after step 0
    assert "were nonzero as backward() left them and zero at optimizer.step()" in fs[0].message


# ---------------------------------------------------------------------------------------------
# label_range on a CPU with policy "raise"; close() and __exit__


ONE_BASED = torch.tensor([1, 2, 3, 4, 5, 5, 1, 2])


def classifier():
    torch.manual_seed(0)
    return nn.Linear(8, 5)


@pytest.mark.parametrize("use_with", [False, True])
def test_cpu_label_range_raises_before_the_op_without_sync(use_with):
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="raise")  # sync False (default)
    with pytest.raises(trainsan.TrainingBugError) as e:  # not torch's IndexError
        if use_with:
            with san:
                F.cross_entropy(model(torch.randn(8, 8)), ONE_BASED)
        else:
            F.cross_entropy(model(torch.randn(8, 8)), ONE_BASED)
    assert e.value.finding.kind == "label_range" and e.value.finding.step == 0
    san.close()  # the finding was raised already: not again
    assert [f.kind for f in san.findings] == ["label_range"]


def test_close_does_not_raise_a_finding_printed_when_the_op_failed(capfd):
    # No guard on this path (a direct ATen call): the observer records the finding and prints
    # it, torch raises its own error; close() must not raise the same finding again.
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="raise")
    out = model(torch.randn(8, 8))
    with pytest.raises((IndexError, RuntimeError)) as e:
        torch.ops.aten.cross_entropy_loss(out, ONE_BASED)
    assert not isinstance(e.value, trainsan.TrainingBugError)
    assert "label_range" in capfd.readouterr().err
    san.close()  # printed already: not raised again
    assert [f.kind for f in san.findings] == ["label_range"]


def test_leaving_a_with_block_by_an_exception_never_masks_it():
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(KeyError, match="the user's own"):
        with trainsan.attach(model, opt, policy="raise"):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 8)), torch.zeros(8, dtype=torch.long)).backward()
            opt.zero_grad()  # a skipped step, found at close: must not replace the KeyError
            raise KeyError("the user's own")


def test_close_reports_a_new_finding_once():
    model = classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 8)), torch.zeros(8, dtype=torch.long)).backward()
            opt.zero_grad(set_to_none=True)  # the bug: cleared before the step
            opt.step()
        san.close()
        san.close()
    msgs = [str(x.message) for x in w if issubclass(x.category, trainsan.TrainingBugWarning)]
    assert len(msgs) == len(set(msgs)), msgs


# ---------------------------------------------------------------------------------------------
# Attached in the middle of a step


@pytest.mark.parametrize("attach_at", [1, 2, 3])
def test_attached_inside_lbfgs_step_closure(attach_at):
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    x, y = batch()
    calls = {"n": 0}
    box = {}

    def closure():
        calls["n"] += 1
        if calls["n"] == attach_at:
            box["san"] = trainsan.attach(model, opt, policy="raise", max_accumulation=2)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    san = box["san"]
    san.close()
    assert not san.errors(), [f.message for f in san.findings]
    assert san.step == 3


def test_unmatched_post_hook_is_a_partial_step():
    # Attached where no frame shows the step (e.g. from another thread's callback): the step's
    # post-hook comes without a pre-hook, and that step is not judged.
    model = mlp()
    opt = DropLast(model.parameters(), lr=0.05)
    x, y = batch()
    box = {}

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        box["san"] = trainsan.attach(model, opt, policy="record")
        return loss

    import trainsan.sanitizer as ts

    real = ts._steps_in_flight
    ts._steps_in_flight = lambda opts: []  # no frame found
    try:
        opt.step(closure)
    finally:
        ts._steps_in_flight = real
    san = box["san"]
    assert not san.findings, [f.message for f in san.findings]
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()  # a whole step now: the ignored tensor is found
    san.close()
    assert [f.tensor for f in skipped(san)] == ["2.bias"]
    assert math.isfinite(san.findings[0].value)
