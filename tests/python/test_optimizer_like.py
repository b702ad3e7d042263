"""Optimizer-like objects (issue 37; Note [Optimizer-like objects] in _optimizer_like.py): an
optimizer that does not derive from torch.optim.Optimizer but holds param_groups and steps them
gets the same step hooks and rules as a torch one, through attach() and through the launcher, and
is put back as it was at close.

The optimizer here is written the way fastai writes its own (fastai/optimizer.py: parameter lists
and hyper-parameter dicts, a param_groups property built from them, a per-parameter state dict, an
SGD-with-momentum step, zero_grad zeroing in place); test_fastai.py runs the real one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainsan

STEPS = 8


class ListOptimizer:
    """An optimizer the way fastai writes one: not a torch.optim.Optimizer."""

    def __init__(self, params, lr=0.05, mom=0.9):
        self.param_lists = [list(params)]
        self.hypers = [{"lr": lr, "mom": mom}]
        self.state = defaultdict(dict)

    @property
    def param_groups(self):
        return [{"params": pl, **hp} for pl, hp in zip(self.param_lists, self.hypers)]

    def zero_grad(self):
        for pl in self.param_lists:
            for p in pl:
                if p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def step(self, closure=None):
        for pl, hp in zip(self.param_lists, self.hypers):
            for p in pl:
                if p.grad is None:
                    continue
                st = self.state[p]
                buf = st.get("grad_avg")
                buf = p.grad.clone() if buf is None else buf.mul_(hp["mom"]).add_(p.grad)
                st["grad_avg"] = buf
                p.data.add_(buf, alpha=-hp["lr"])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 3))


def _train(model, opt, bug=None, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        if bug == "eval":
            model.eval()  # BUG: a callback left the model in eval mode
        if bug != "no_zero":
            opt.zero_grad()  # BUG (no_zero): never cleared
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if bug == "clear_before_step":
            opt.zero_grad()  # BUG: clears the gradients before the step uses them
        opt.step()


def _kinds(san):
    return {f.kind for f in san.findings if f.severity == "error"}, {f.kind for f in san.findings}


def test_recognised_and_put_back():
    from trainsan._optimizer_like import optimizer_like

    model = _model()
    opt = ListOptimizer(model.parameters())
    assert optimizer_like(opt)
    assert not optimizer_like(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not optimizer_like(model) and not optimizer_like(ListOptimizer)
    before = dict(vars(opt))
    san = trainsan.attach(model, opt, policy="record")
    assert {"step", "zero_grad", "register_step_pre_hook"} <= set(vars(opt))
    _train(model, opt)
    san.close()
    assert vars(opt) == before  # nothing of TrainSan's left on the instance
    assert san.findings == [], san.summary()
    cov = san.coverage()
    assert cov["steps_checked"] == STEPS and cov["update_steps"] > 0, cov
    assert "optimizer_reset" not in cov["unchecked"] and "skipped_step" not in cov["unchecked"]


def test_an_attribute_of_its_own_is_put_back():
    model = _model()
    opt = ListOptimizer(model.parameters())
    own_step = opt.step  # a bound method stored on the instance (a wrapper's doing)
    opt.step = own_step
    san = trainsan.attach(model, opt, policy="record")
    assert opt.step is not own_step
    san.close()
    assert opt.step is own_step


@pytest.mark.parametrize("bug, kind", [("eval", "eval_mode"), ("no_zero", "stale_grad"),
                                       ("clear_before_step", "skipped_step")])
def test_bugs_are_found_as_with_a_torch_optimizer(bug, kind):
    found = {}
    for make in (ListOptimizer, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)):
        model = _model()
        opt = make(model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            san = trainsan.attach(model, opt, policy="record")
            _train(model, opt, bug=bug)
            san.close()
        found[type(opt).__name__] = {(f.kind, f.severity) for f in san.findings}
    assert kind in {k for k, _ in found["ListOptimizer"]}, found
    # The same errors, and the same finding for the bug (its zero_grad zeroes in place, as
    # fastai's does, where torch's sets None: other warnings may differ).
    assert {f for f in found["ListOptimizer"] if f[1] == "error" or f[0] == kind} == {
        f for f in found["SGD"] if f[1] == "error" or f[0] == kind}, found


def test_raise_raises_from_its_step():
    model = _model()
    opt = ListOptimizer(model.parameters())
    san = trainsan.attach(model, opt)  # policy "raise"
    with pytest.raises(trainsan.TrainingBugError, match="stale_grad"):
        _train(model, opt, bug="no_zero")
    san.close()
    assert "step" not in vars(opt)


def test_not_optimizer_like_is_a_clear_type_error():
    model = _model()

    class NoGroups:
        def step(self):
            pass

    for given in (NoGroups(), [NoGroups()]):
        with pytest.raises(TypeError, match=r"optimizer-like object \(a class with a step\(\)"):
            trainsan.attach(model, given)


SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, {here!r})
    from test_optimizer_like import ListOptimizer, _model, _train

    model = _model()
    opt = ListOptimizer(model.parameters())
    _train(model, opt, bug=sys.argv[1] if len(sys.argv) > 1 else None)
    print("done", "step" in vars(opt))
''')


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    path = tmp_path_factory.mktemp("like") / "loop.py"
    path.write_text(SCRIPT.format(here=os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = {}
    for case in ("clean", "eval"):
        out[case] = subprocess.run(
            [sys.executable, "-m", "trainsan", "run", "--policy", "record", str(path)]
            + ([case] if case != "clean" else []),
            capture_output=True, text=True, timeout=180, env=env)
    return out


def test_launcher_pairs_it_and_the_clean_run_is_silent(launched):
    r = launched["clean"]
    assert r.returncode == 0 and "done True" in r.stdout, r.stderr
    assert "Sequential with ListOptimizer" in r.stderr, r.stderr
    assert f"{STEPS} steps, no findings" in r.stderr, r.stderr


def test_launcher_finds_the_model_left_in_eval_mode(launched):
    # Never called in train mode: without the optimizer the launcher attached nothing.
    r = launched["eval"]
    assert r.returncode == 0, r.stderr
    assert "Sequential with ListOptimizer" in r.stderr and "eval_mode" in r.stderr, r.stderr
