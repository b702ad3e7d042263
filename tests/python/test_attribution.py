"""Re-run attribution (issue 22, opt-in rerun_on_error=N; Note [Re-run attribution]): a NaN or
a spike that the batch carries reproduces when its step is re-run (and leaves a poison_batch
record a resumed run can skip); one a flaky forward or backward made once does not; the answer is
in the finding before the policy acts; bounded; off, nothing is kept and nothing changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan
from trainsan.attribution import Attribution, batch_fingerprint

NAN = float("nan")


class Net(nn.Module):
    def __init__(self, dropout: float = 0.2, norm: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def batches(n: int, poison: int = -1) -> list:
    """Classification batches; batch `poison` holds a NaN."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        if i == poison:
            x[3, 5] = NAN
        out.append((x, y))
    return out


def regression(n: int, spike: int) -> list:
    """Regression batches; the targets of batch `spike` are on another scale (a loss spike)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        t = torch.randn(16, 3, generator=g) * (1e3 if i == spike else 1.0)
        out.append((x, t))
    return out


def train(data, model=None, lr=0.05, loss_fn=F.cross_entropy, **options):
    torch.manual_seed(0)
    model = model or Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with trainsan.attach(model, opt, **options) as san:
        for x, y in data:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    return san, model


def finding(san, kind):
    found = [f for f in san.findings if f.kind == kind]
    assert found, [f.message for f in san.findings]
    return found[0]


def records(path, type_):
    with open(path, encoding="utf-8") as fh:
        return [r for r in map(json.loads, fh) if r["type"] == type_]


def test_poison_batch_reproduces_and_a_resumed_run_skips_it(tmp_path):
    trace = str(tmp_path / "run1.jsonl")
    data = batches(8, poison=3)
    san, _ = train(data, policy="record", rerun_on_error=3, trace=trace)
    f = finding(san, "nonfinite_loss")
    assert f.step == 3
    assert f.reproduces is True, f.message
    assert "re-run: reproduces (a data or code fault: look at this batch" in f.message
    # The step's nonfinite_grad gets the same re-run's answer, without a second re-run.
    g = finding(san, "nonfinite_grad")
    assert g.reproduces is True and "the re-run of this step for its nonfinite_loss" in g.message
    poison = records(trace, "poison_batch")
    assert len(poison) == 1
    p = poison[0]
    assert (p["rank"], p["step"], p["kind"]) == (0, 3, "nonfinite_loss")
    fp, tensors = batch_fingerprint((data[3][0],))
    assert p["fingerprint"] == fp and p["tensors"] == tensors and len(fp) == 16
    att = records(trace, "rerun_attribution")
    assert [(r["kind"], r["reproduces"], r["rerun"]) for r in att][:1] == [
        ("nonfinite_loss", True, True)]
    summary = records(trace, "summary")[-1]
    assert any(u.get("reproduces") is True for u in summary["unique_findings"])

    # The resumed run, told to skip them, trains clean on the other batches.
    seen = []
    with pytest.warns(trainsan.TrainingBugWarning, match="skipped batch 3"):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with trainsan.attach(model, opt, trace=str(tmp_path / "run2.jsonl")) as san2:
            for x, y in trainsan.skip_poison(data, trace):
                seen.append(x)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    assert len(seen) == 7 and not any(torch.isnan(x).any() for x in seen)
    assert san2.findings == []


def test_skip_poison_reads_the_trace_when_called(tmp_path):
    trace = str(tmp_path / "run1.jsonl")
    data = batches(6, poison=2)
    train(data, policy="record", rerun_on_error=1, trace=trace)
    assert len(trainsan.poison_batches(trace)) == 1
    it = trainsan.skip_poison(data, trace)
    os.remove(trace)  # what a new attach writing the same path does to it
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert len(list(it)) == 5
    # Through `inputs`: the model is called with a transformed batch.
    shifted = [(x + 1.0, y) for x, y in data]
    san, _ = train(shifted, policy="record", rerun_on_error=1, trace=trace)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        kept = list(trainsan.skip_poison(data, trace, inputs=lambda b: (b[0] + 1.0,)))
        assert len(kept) == 5
        assert len(list(trainsan.skip_poison(data, trace))) == 6  # not what the model saw


class FlakyOnce:
    """A forward hook that puts a NaN into the output of its `at`-th call only (a transient
    fault); `fail_after`: it raises on the call after that (a re-run that cannot run)."""

    def __init__(self, at: int, fail_after: bool = False):
        self.calls, self.at, self.fail_after = 0, at, fail_after

    def __call__(self, module, args, out):
        self.calls += 1
        if self.fail_after and self.calls == self.at + 1:
            raise RuntimeError("device lost")
        if self.calls == self.at:
            out = out.clone()
            out[0, 0] = NAN
            return out
        return None


def test_transient_fault_does_not_reproduce(tmp_path):
    trace = str(tmp_path / "t.jsonl")
    model = Net()
    model.fc1.register_forward_hook(FlakyOnce(at=4))  # step 3's forward
    san, _ = train(batches(8), model=model, policy="record", rerun_on_error=3, trace=trace)
    f = finding(san, "nonfinite_loss")
    assert f.step == 3
    assert f.reproduces is False, f.message
    assert "does not reproduce (a transient numerical or hardware fault" in f.message
    assert "finite where the step's held NaN/Inf" in f.message
    assert records(trace, "poison_batch") == []


def test_a_rerun_that_raises_is_reported_not_raised():
    model = Net()
    model.fc1.register_forward_hook(FlakyOnce(at=4, fail_after=True))
    san, _ = train(batches(8), model=model, policy="record", rerun_on_error=3)
    f = finding(san, "nonfinite_loss")
    assert f.reproduces is None
    assert "could not re-run this step: RuntimeError: device lost" in f.message


def test_transient_nan_in_the_backward_does_not_reproduce():
    """nonfinite_grad of a loop that skips the step when its gradients are not finite (the
    gradients are cleared unused: judged before any update); a gradient hook makes the NaN once."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    results = {}
    for flaky in (True, False):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        san = trainsan.attach(model, opt, policy="record", rerun_on_error=3)
        for i, (x, y) in enumerate(batches(6, poison=-1 if flaky else 2)):
            opt.zero_grad()
            out = model(x)
            if flaky and i == 2:
                out.register_hook(lambda g: torch.full_like(g, NAN))
            # The NaN batch: a finite loss (nan_to_num), gradients 0 * NaN.
            loss = F.cross_entropy(out if flaky else out.nan_to_num(), y)
            loss.backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
        san.close()
        results[flaky] = finding(san, "nonfinite_grad")
    assert results[True].reproduces is False, results[True].message
    assert "gives gradients that are finite" in results[True].message
    assert results[False].reproduces is True, results[False].message
    assert "hold NaN/Inf again" in results[False].message


def test_spike_reproduces_with_dropout_and_batchnorm_and_training_is_unchanged(tmp_path):
    """A batch on another scale spikes the loss: the re-run, from the saved RNG state (dropout
    masks) and buffers (BatchNorm statistics), gives the step's outputs again. The run trains bit
    for bit as with the option off."""
    data = regression(20, spike=15)

    def fresh():
        torch.manual_seed(7)
        return Net(norm=True)

    on, m_on = train(data, model=fresh(), lr=0.01, loss_fn=F.mse_loss, policy="record",
                     rerun_on_error=3, trace=str(tmp_path / "s.jsonl"))
    off, m_off = train(data, model=fresh(), lr=0.01, loss_fn=F.mse_loss, policy="record")
    f = finding(on, "loss_spike")
    assert f.step == 15
    assert f.reproduces is True, f.message
    assert "equal the step's" in f.message
    assert finding(off, "loss_spike").reproduces is None
    for (n, a), (_, b) in zip(m_on.state_dict().items(), m_off.state_dict().items()):
        assert torch.equal(a, b), n
    assert records(str(tmp_path / "s.jsonl"), "poison_batch")[0]["kind"] == "loss_spike"


def test_policy_raise_carries_the_answer():
    with pytest.raises(trainsan.TrainingBugError) as e:
        train(batches(6, poison=2), rerun_on_error=3)
    assert e.value.finding.kind == "nonfinite_loss"
    assert e.value.finding.reproduces is True
    assert "re-run: reproduces" in str(e.value)


def test_policy_warn_carries_the_answer():
    model = Net()
    model.fc1.register_forward_hook(FlakyOnce(at=3))
    with pytest.warns(trainsan.TrainingBugWarning, match="re-run: does not reproduce"):
        san, _ = train(batches(5), model=model, policy="warn", rerun_on_error=3)
    assert finding(san, "nonfinite_loss").reproduces is False


def test_bounded_by_the_budget():
    # A spike re-run at step 15 spends the one re-run: the NaN batch at 17 is not re-run.
    data = regression(20, spike=15)
    data[17][0][0, 0] = NAN
    san, _ = train(data, model=Net(norm=True), lr=0.01, loss_fn=F.mse_loss, policy="record",
                   rerun_on_error=1)
    assert finding(san, "loss_spike").reproduces is True
    f = finding(san, "nonfinite_loss")
    assert f.reproduces is None
    assert "not re-run: the 1 re-run(s) rerun_on_error allows went to earlier findings" in f.message


def test_off_keeps_nothing_and_changes_no_message():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = trainsan.attach(model, opt, policy="record")
    assert not any(isinstance(p, Attribution) for p in san._ctx.parts)
    assert len(model._forward_hooks) == 0
    for x, y in batches(5, poison=2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    san.close()
    f = finding(san, "nonfinite_loss")
    assert f.reproduces is None and "re-run" not in f.message
    # On, its hook goes at close.
    on, m = train(batches(3), policy="record", rerun_on_error=2)
    assert len(m._forward_hooks) == 0


def test_through_the_launcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(0)
        for i in range(6):
            x = torch.randn(16, 8, generator=g)
            y = torch.randint(0, 3, (16,), generator=g)
            if i == 2:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    """))
    trace = tmp_path / "l.jsonl"
    r = subprocess.run([sys.executable, "-m", "trainsan", "run", "--policy", "record",
                        "--rerun-on-error", "2", "--trace", str(trace), str(script)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert "re-run: reproduces" in r.stderr, r.stderr
    poison = records(str(trace), "poison_batch")
    assert [(p["step"], p["kind"]) for p in poison] == [(2, "nonfinite_loss")]
