"""Loads made before attach are judged (issue 20; Note [Load journal] in _journal.py).

From `import trainsan` on, every torch.load and load_state_dict is journaled, and a sanitizer
replays the loads of its model, its optimizers and their schedulers at attach: an attach after
the resume — the launcher's, at the model's first training forward, or an explicit one — judges
it as an attach before it would. Each bug has a clean twin that stays silent:

* the optimizer state forgotten (optimizer_reset, error) / model, optimizer and scheduler restored;
* the scheduler forgotten (optimizer_reset, warning: as with an attach before the loads);
* the same two through ``python -m trainsan run``;
* a load of another model before attach does not reach the attached model;
* a run that trained past its resume before attach is not judged again, and a sanitizer that
  replaces another before the first step (the launcher's re-attach) still knows of the resume.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainsan
from _watched import _watched_loads  # noqa: F401 - autouse: the loads are journaled
from _launch import run_script
from trainsan import _journal as journal_mod


HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launcher", "resume_script.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 5, seed=0)
    path = tmp_path_factory.mktemp("replay") / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": 5}, path)
    return path


def resume(path, *, optimizer_too=True, scheduler_too=True, attach="after"):
    """A resume as example scripts write it; `attach`: "before" the loads or "after" them."""
    model, optimizer, scheduler = build()
    san = trainsan.attach(model, optimizer, policy="record") if attach == "before" else None
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    if optimizer_too:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if scheduler_too:
        scheduler.load_state_dict(checkpoint["scheduler"])
    if san is None:
        san = trainsan.attach(model, optimizer, policy="record")
    train(model, optimizer, scheduler, 3, seed=checkpoint["epoch"])
    san.close()
    return san


def findings(san):
    return [(f.kind, f.severity, f.step, f.message) for f in san.findings]


def test_forgotten_optimizer_found_after_attach(checkpoint):
    san = resume(checkpoint, optimizer_too=False)
    (f,) = [f for f in san.findings if f.kind == "optimizer_reset"]
    assert f.severity == "error" and f.step == 0
    assert "holds an optimizer state (the checkpoint is from epoch=5)" in f.message
    assert "optimizer 0 (AdamW) was not restored" in f.message
    assert findings(san) == findings(resume(checkpoint, optimizer_too=False, attach="before"))


def test_full_restore_silent_after_attach(checkpoint):
    san = resume(checkpoint)
    assert san.findings == [], findings(san)


def test_forgotten_scheduler_as_with_an_early_attach(checkpoint):
    late = resume(checkpoint, scheduler_too=False)
    early = resume(checkpoint, scheduler_too=False, attach="before")
    (f,) = late.findings
    assert f.kind == "optimizer_reset" and f.severity == "warning"
    assert "scheduler's state at epoch 5" in f.message and "the schedule restarts" in f.message
    assert findings(late) == findings(early)


def test_strict_false_prefix_before_attach_found(checkpoint):
    model, optimizer, scheduler = build()
    state = torch.load(checkpoint)["model"]
    model.load_state_dict({"module." + k: v for k, v in state.items()}, strict=False)
    san = trainsan.attach(model, optimizer, policy="record")
    san.close()
    (f,) = san.findings
    assert f.kind == "bad_checkpoint" and "under the prefix 'module.'" in f.message


def test_replayed_error_under_raise_stops_at_attach(checkpoint):
    model, optimizer, scheduler = build()
    state = torch.load(checkpoint)["model"]
    model.load_state_dict({"module." + k: v for k, v in state.items()}, strict=False)
    with pytest.raises(trainsan.TrainingBugError) as exc:
        trainsan.attach(model, optimizer, policy="raise")
    assert exc.value.finding.kind == "bad_checkpoint"
    assert trainsan.attached(model) is None  # closed: nothing left attached
    with trainsan.attach(model, optimizer, policy="record") as san:  # attaches again
        pass
    assert [f.kind for f in san.findings] == ["bad_checkpoint"]  # each sanitizer's own finding


def test_load_of_another_model_does_not_reach_the_attached_one(checkpoint):
    teacher, teacher_opt, teacher_sched = build()
    checkpoint_ = torch.load(checkpoint)
    teacher.load_state_dict(checkpoint_["model"])  # a full checkpoint, into another model
    teacher_opt.load_state_dict(checkpoint_["optimizer"])
    model, optimizer, scheduler = build()  # trained from scratch: its optimizer is fresh
    san = trainsan.attach(model, optimizer, policy="record")
    train(model, optimizer, scheduler, 3, seed=7)
    san.close()
    assert san.findings == [], findings(san)


def test_trained_past_the_resume_before_attach_not_judged(checkpoint):
    model, optimizer, scheduler = build()
    model.load_state_dict(torch.load(checkpoint)["model"])  # the optimizer forgotten...
    train(model, optimizer, scheduler, 2, seed=5)  # ...but the run trained past it unattached
    san = trainsan.attach(model, optimizer, policy="record")
    train(model, optimizer, scheduler, 2, seed=6)
    san.close()
    assert san.findings == [], findings(san)


def test_replacing_sanitizer_judges_the_resume_once(checkpoint):
    model, optimizer, scheduler = build()
    model.load_state_dict(torch.load(checkpoint)["model"])  # the optimizer forgotten
    first = trainsan.attach(model, optimizer, policy="record")
    first.close()  # replaced before its first step (as the launcher re-attaches)
    second = trainsan.attach(model, optimizer, policy="record")
    train(model, optimizer, scheduler, 2, seed=5)
    second.close()
    third = trainsan.attach(model, optimizer, policy="record")  # after the judged step
    train(model, optimizer, scheduler, 2, seed=6)
    third.close()
    assert first.findings == []
    assert [(f.kind, f.severity) for f in second.findings] == [("optimizer_reset", "error")]
    assert third.findings == [], findings(third)


def test_loader_state_is_journaled(checkpoint):
    class ResumableSampler(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n, self.start = n, 0

        def __iter__(self):
            return iter(range(self.start, self.n))

        def __len__(self):
            return self.n - self.start

        def state_dict(self):
            return {"start": self.start}

        def load_state_dict(self, state):
            self.start = state["start"]

    sampler = ResumableSampler(10)
    torch.load(checkpoint)  # the checkpoint, then the loader restored from it
    sampler.load_state_dict({"start": 4})
    assert sampler.start == 4
    last = journal_mod._journal[-1]
    assert last.kind == "loader" and last.ref() is sampler and not last.waiting


# -- through the launcher --------------------------------------------------------------------------

def _run(*args, launcher=True):
    return run_script(*args, launcher=launcher, env=ENV)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launched")
    ckpt = str(tmp / "run.pt")
    r = _run(SCRIPT, "--save", ckpt, launcher=False)
    assert r.returncode == 0, r.stderr
    runs = {}
    for name, bug in (("forgot", ["--bug", "forget_optimizer"]), ("clean", [])):
        trace = str(tmp / f"{name}.jsonl")
        r = _run("--trace", trace, SCRIPT, "--resume", ckpt, *bug)
        with open(trace, encoding="utf-8") as fh:
            runs[name] = (r, [json.loads(line) for line in fh if line.strip()])
    return runs


def test_launcher_finds_the_forgotten_optimizer(launched):
    r, records = launched["forgot"]
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout
    assert "[error] optimizer_reset at step 0" in r.stderr, r.stderr
    found = [x for x in records if x["type"] == "finding"]
    assert [(x["kind"], x["step"]) for x in found] == [("optimizer_reset", 0)], found
    assert "optimizer 0 (AdamW) was not restored" in found[0]["message"]


def test_launcher_full_restore_silent(launched):
    r, records = launched["clean"]
    assert r.returncode == 0, r.stderr
    assert "no findings" in r.stderr, r.stderr
    assert not [x for x in records if x["type"] == "finding"]
