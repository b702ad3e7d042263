"""Manual mode and module modes (issue 37; Note [Manual-mode steps] in host/sanitizer.cpp, Note
[Op audit] in host/audit/observer.cpp, Note [Manual mode's model] in _pairing.py):
* without an optimizer, every grad-enabled forward after a backward ends a step, in train or eval
  mode (a model trained in eval mode had no steps at all);
* the op audits run on grad-enabled forwards of a sampled step whatever the module's mode (a
  model trained in eval mode was never audited);
* a manual-mode step at which no update was applied (a micro-batch of gradient accumulation) gets
  no update judgement: update_ratio no longer warns "0 for 3 steps" on a clean accumulation, and
  still does on a learning rate of 0.
Each through attach() and through `python -m trainsan run`, with clean twins silent."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

import trainsan  # noqa: E402
from _launch import run_script  # noqa: E402

BATCHES = 48


def _data(n=BATCHES, batch=8, dim=10):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, dim, generator=g), torch.randn(batch, generator=g))
            for _ in range(n)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


def _hand_sgd(model, lr, through_data=False):
    with torch.no_grad():
        for p in model.parameters():
            if through_data:
                p.data.add_(p.grad, alpha=-lr)
            else:
                p.add_(p.grad, alpha=-lr)
            p.grad = None


# -- (b) manual mode counts every grad-enabled forward ---------------------------------------------

def _manual_loop(model, eval_mode: bool, validate: bool):
    if eval_mode:
        model.eval()  # trained in eval mode (no module here depends on it)
    for k, (x, y) in enumerate(_data()):
        loss = F.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        _hand_sgd(model, 0.01)
        if validate and k % 12 == 11:
            model.eval()
            model(x)  # validation without no_grad: a grad-enabled forward no backward follows
            if not eval_mode:
                model.train()


@pytest.mark.parametrize("eval_mode, validate", [(True, False), (False, True), (True, True)])
def test_manual_mode_counts_a_step_per_batch_in_any_mode(eval_mode, validate):
    model = _model()
    san = trainsan.attach(model, policy="record")
    _manual_loop(model, eval_mode, validate)
    cov = san.coverage()
    san.close()
    # A step ends at the next grad-enabled forward: all but the last batch's, which the
    # validation forward after it (k = 47) ends where there is one; the other validation forwards
    # end the step their batch began, and the next batch's forward then ends none.
    assert cov["steps_checked"] == (BATCHES if validate else BATCHES - 1), cov
    assert san.findings == [], san.summary()


# -- (c) the audits run on grad-enabled forwards in eval mode --------------------------------------

AUDIT = {"audit_first_steps": 2, "audit_every": 5}
AUDIT_STEPS = 12  # audited: 0, 1, 5, 10


def _eval_mode_loop(model, opt, broadcast_from: int):
    model.eval()
    for step, (x, y) in enumerate(_data(AUDIT_STEPS)):
        out = model(x)  # [8, 1]
        target = y if step >= broadcast_from else y[:, None]  # BUG from then: [8] against [8, 1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own broadcasting warning
            loss = F.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("broadcast_from", [5, AUDIT_STEPS])
def test_a_model_trained_in_eval_mode_is_audited(broadcast_from):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    san = trainsan.attach(model, opt, policy="record", **AUDIT)
    _eval_mode_loop(model, opt, broadcast_from)
    cov = san.coverage()
    san.close()
    assert cov["audited_forwards"] == 4, cov  # steps 0, 1, 5 and 10
    # (a model trained in eval mode is eval_mode's warning, whatever else it does)
    found = [(f.kind, f.step) for f in san.findings if f.kind != "eval_mode"]
    if broadcast_from < AUDIT_STEPS:
        assert ("broadcast", 5) in found, san.summary()  # the first audited step with the bug
    else:
        assert found == [], san.summary()


# -- (d) no update judgement on a manual-mode step that applied no update ---------------------------

def _accumulating_loop(model, lr, through_data=False, every=4):
    # As Keras's train_step orders it: forward, clear the gradients (here: at the first
    # micro-batch of a window), backward, update (here: at the last); the gradients are still
    # there at the next forward, where the step ends.
    for k, (x, y) in enumerate(_data()):
        out = model(x).squeeze(1)
        if k % every == 0:
            model.zero_grad()
        (F.mse_loss(out, y) / every).backward()
        if k % every == every - 1:
            with torch.no_grad():
                for p in model.parameters():
                    (p.data if through_data else p).add_(p.grad, alpha=-lr)


@pytest.mark.parametrize("lr, through_data, kinds", [
    (0.05, False, set()),             # clean: updates at one batch in 4
    (0.05, True, set()),              # clean, through .data (no version moves; the values do)
    (0.0, False, {"update_ratio"}),   # BUG: a learning rate of 0 (in place: versions move)
])
def test_manual_accumulation_judges_only_the_steps_with_an_update(lr, through_data, kinds):
    model = _model()
    san = trainsan.attach(model, policy="record", overhead_budget=0.0)  # every step measured
    _accumulating_loop(model, lr, through_data)
    san.close()
    assert {f.kind for f in san.findings} == kinds, san.summary()


def test_fastai_gradient_accumulation_in_manual_mode_is_silent():
    """fastai's GradientAccumulation with the model attached without its optimizer (manual mode:
    an optimizer the sanitizer cannot see): the micro-batches apply no update."""
    pytest.importorskip("fastai", reason="fastai is not installed (scripts/install_deps.sh)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastai.callback.core import Callback
        from fastai.callback.progress import ProgressCallback
        from fastai.callback.training import GradientAccumulation
        from fastai.data.core import DataLoaders
        from fastai.learner import Learner
    from torch.utils.data import DataLoader, TensorDataset

    class Sanitize(Callback):
        order = -100

        def before_fit(self):
            self.learn.san = trainsan.attach(self.model, policy="record", overhead_budget=0.0)

        def after_fit(self):
            self.learn.san.close()

    torch.manual_seed(0)
    X = torch.randn(192, 10)
    y = (X[:, 0] > 0).long()
    dls = DataLoaders(DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True),
                      DataLoader(TensorDataset(X[:32], y[:32]), batch_size=16))
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(),
                    cbs=[Sanitize(), GradientAccumulation(32)])
    learn.remove_cb(ProgressCallback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn.fit(2, 1e-2)
    assert learn.san.findings == [], learn.san.summary()
    assert learn.san.coverage()["update_steps"] > 0, learn.san.summary()


# -- the same through the launcher -------------------------------------------------------------

PROGRAM = textwrap.dedent('''
    import sys, warnings
    import torch, torch.nn as nn, torch.nn.functional as F

    case = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 10, generator=g), torch.randn(8, generator=g)) for _ in range(48)]

    def hand_sgd(lr):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
                p.grad = None

    if case in ("eval", "eval_validate"):
        model.eval()  # trained in eval mode from the start (no optimizer)
        for k, (x, y) in enumerate(data):
            F.mse_loss(model(x).squeeze(1), y).backward()
            hand_sgd(0.01)
            if case == "eval_validate" and k % 12 == 11:
                model(x)  # validation without no_grad
    elif case in ("accumulate", "accumulate_lr0"):
        lr = 0.0 if case == "accumulate_lr0" else 0.05
        for k, (x, y) in enumerate(data):
            out = model(x).squeeze(1)
            if k % 4 == 0:
                model.zero_grad()
            (F.mse_loss(out, y) / 4).backward()
            if k % 4 == 3:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-lr)
    elif case == "temperature":  # a learnable temperature held by no module, trained by hand
        temperature = nn.Parameter(torch.ones(1))
        for x, y in data:
            F.mse_loss(model(x).squeeze(1) / temperature, y).backward()
            hand_sgd(0.01)
            with torch.no_grad():
                temperature.sub_(0.01 * temperature.grad)
                temperature.grad = None
    else:  # audit, audit_bug: an optimizer, the model in eval mode, a broadcast from step 5
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model.eval()
        for step, (x, y) in enumerate(data[:12]):
            out = model(x)
            target = y if case == "audit_bug" and step >= 5 else y[:, None]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss = F.mse_loss(out, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
''')


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("manual")
    path = root / "train.py"
    path.write_text(PROGRAM)
    out = {}
    for case in ("eval", "eval_validate", "accumulate", "accumulate_lr0", "audit", "audit_bug",
                 "temperature"):
        trace = root / f"{case}.jsonl"
        extra = (["--audit-first-steps", "2", "--audit-every", "5"] if case.startswith("audit")
                 else ["--overhead-budget", "0"])
        proc = run_script("--trace", str(trace), *extra, str(path), case)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        recs = [json.loads(line) for line in trace.read_text().splitlines()]
        out[case] = (proc.stderr, recs)
    return out


def _kinds(recs) -> set:
    return {r["kind"] for r in recs if r.get("type") == "finding"}


def _summary(recs) -> dict:
    return next(r for r in recs if r.get("type") == "summary")


@pytest.mark.parametrize("case", ["eval", "eval_validate"])
def test_launcher_attaches_a_model_trained_in_eval_mode_by_hand(launched, case):
    err, recs = launched[case]
    assert "Sequential with no optimizer (manual mode)" in err, err
    assert not _kinds(recs), err
    # attached at the first backward (no call in train mode): the steps of batches 2..48, and
    # of the last batch where a validation forward follows it
    assert _summary(recs)["steps"] == BATCHES - (case == "eval"), _summary(recs)


def test_launcher_manual_accumulation(launched):
    err, recs = launched["accumulate"]
    assert not _kinds(recs), err
    err, recs = launched["accumulate_lr0"]
    assert _kinds(recs) == {"update_ratio"}, err


def test_launcher_audits_a_model_in_eval_mode(launched):
    err, recs = launched["audit"]
    assert _kinds(recs) == {"eval_mode"}, err  # (eval_mode's own warning)
    assert "not checked: broadcast" not in err, err
    err, recs = launched["audit_bug"]
    found = [(r["kind"], r["step"]) for r in recs if r.get("type") == "finding"]
    assert ("broadcast", 5) in found, err


def test_launcher_names_a_trained_parameter_it_does_not_watch(launched):
    """Note [Manual mode's model]: the closing lines name what a backward trained that no
    sanitizer watches (the model's own parameters are watched: no such line for them)."""
    err, recs = launched["temperature"]
    assert ("trainsan run: 1 parameter(s) that a backward reached are in no attached model: not "
            "checked (temperature)") in err, err
    assert recs[0]["num_params"] == 4, recs[0]
    err, _ = launched["eval"]
    assert "in no attached model" not in err, err
