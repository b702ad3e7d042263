"""Resumes (issue 13): model.load_state_dict on the attached model is a resume event, judged at
each optimizer's first step after it (optimizer_reset), and a lossy strict=False load is a
bad_checkpoint (Note [Resume checks] in host/checks/resume.cpp).

Bugs, each found: the optimizer not restored from a checkpoint that holds its state (error), an
optimizer restored with the empty state of a fresh one (error), the scheduler not restored
(a warning, then an error where its warm-up restarts), optimizer state loaded into parameters in
another order (error), strict=False loading
nothing because of a key prefix, strict=False leaving a frozen parameter at its initial value.
Legitimate, silent: a full resume (model, optimizer, scheduler, RNG) in either order, fine-tuning
from pretrained weights with a fresh optimizer, a backbone loaded into a model with a new head
(strict=False). Loads made before attach are judged the same (Note [Load journal] in _journal.py;
test_resume_replay.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import trainsan
from _watched import _watched_loads  # noqa: F401 - autouse: the loads are journaled


def make_model(head=2):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, head))


def make_sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 10))


def train(model, opt, sched=None, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = make_sched(opt)
    train(model, opt, sched, 5)
    path = tmp_path_factory.mktemp("ck") / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "epoch": 5}, path)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    empty = path.parent / "empty_opt.pt"
    torch.save({"model": model.state_dict(), "optimizer": fresh.state_dict(), "epoch": 5}, empty)
    weights = path.parent / "weights.pt"
    torch.save(model.state_dict(), weights)
    return path, empty, weights


def resume(path, load_opt=True, load_sched=True, opt_first=False, attach_first=True):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = make_sched(opt)
    san = trainsan.attach(model, opt, policy="record") if attach_first else None
    ck = torch.load(path)
    if opt_first and load_opt:
        opt.load_state_dict(ck["optimizer"])
    model.load_state_dict(ck["model"] if "model" in ck else ck)
    if load_opt and not opt_first and "optimizer" in ck:
        opt.load_state_dict(ck["optimizer"])
    if load_sched and "scheduler" in ck:
        sched.load_state_dict(ck["scheduler"])
    torch.set_rng_state(ck["rng"]) if "rng" in ck else None
    if san is None:
        san = trainsan.attach(model, opt, policy="record")
    train(model, opt, sched, 2)
    san.close()
    return san


def found(san, kind):
    return [f for f in san.findings if f.kind == kind]


@pytest.mark.parametrize("opt_first", [False, True], ids=["model_first", "optimizer_first"])
def test_full_resume_is_silent(ckpt, opt_first):
    san = resume(ckpt[0], opt_first=opt_first)
    assert san.findings == [], [f.message for f in san.findings]


def test_optimizer_not_restored_is_found(ckpt):
    san = resume(ckpt[0], load_opt=False, load_sched=False)
    (f,) = [f for f in found(san, "optimizer_reset") if f.severity == "error"]
    assert f.step == 0
    assert "holds an optimizer state (the checkpoint is from epoch=5)" in f.message
    assert "optimizer 0 (AdamW) was not restored" in f.message


def test_optimizer_restored_empty_is_found(ckpt):
    san = resume(ckpt[1])
    (f,) = found(san, "optimizer_reset")
    assert f.severity == "error" and "was restored with an empty state" in f.message


def test_scheduler_not_restored_is_a_warning_then_an_error(ckpt):
    san = resume(ckpt[0], load_sched=False)
    f, g = found(san, "optimizer_reset")
    assert f.severity == "warning" and f.step == 0
    assert "scheduler's state at epoch 5" in f.message and "the schedule restarts" in f.message
    # Note [Restarted schedule]: the fresh warm-up takes effect at the scheduler's first step.
    assert (g.severity, g.step) == ("error", 1)
    assert "the learning-rate scheduler LambdaLR of optimizer 0 (AdamW)" in g.message


def test_fine_tuning_from_weights_is_silent(ckpt):
    san = resume(ckpt[2])
    assert san.findings == [], [f.message for f in san.findings]


def test_loads_before_attach_are_judged(ckpt):
    san = resume(ckpt[0], load_opt=False, load_sched=False, attach_first=False)
    (f,) = [f for f in found(san, "optimizer_reset") if f.severity == "error"]
    assert "optimizer 0 (AdamW) was not restored" in f.message
    assert resume(ckpt[0], attach_first=False).findings == []


def test_optimizer_state_in_another_order_is_found(ckpt):
    model = make_model()
    opt = torch.optim.AdamW(list(model.parameters())[::-1], lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    ck = torch.load(ckpt[0])
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    san.close()
    (f,) = found(san, "optimizer_reset")
    assert "gave parameters state of other shapes" in f.message
    assert "exp_avg of parameter 0 (2.bias): [16, 8], the parameter [2]" in f.message


def test_strict_false_backbone_into_new_head_is_silent(ckpt):
    model = make_model(head=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    sd = {k: v for k, v in torch.load(ckpt[2]).items() if not k.startswith("2.")}
    model.load_state_dict(sd, strict=False)
    train(model, opt)
    san.close()
    assert san.findings == [], [f.message for f in san.findings]


def test_strict_false_prefix_and_frozen_drops_are_found(ckpt):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    sd = torch.load(ckpt[2])
    model.load_state_dict({"module." + k: v for k, v in sd.items()}, strict=False)
    for p in model[0].parameters():
        p.requires_grad_(False)
    partial = dict(sd)
    del partial["0.weight"]
    model.load_state_dict(partial, strict=False)
    san.close()
    msgs = [f.message for f in found(san, "bad_checkpoint")]
    assert any("loaded none of 4 keys: they are the model's under the prefix 'module.'" in m
               for m in msgs), msgs
    assert any("dropped 1 parameter(s) that will never train: 0.weight (frozen)" in m
               for m in msgs), msgs


def test_journal_wrappers_stay_installed_across_attach_and_close():
    # Held by watch_loads() (the fixture; Note [Load journal]): an attach and its close leave the
    # wrappers as they are; the watch's close gives torch its own back.
    owners = [(torch, "load"), (torch.nn.Module, "load_state_dict"),
              (torch.optim.Optimizer, "load_state_dict"),
              (torch.optim.lr_scheduler.LambdaLR, "load_state_dict")]
    before = [o.__dict__[n] for o, n in owners]
    assert all(getattr(b, "__wrapped__", None) is not None for b in before)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt):
        assert all(o.__dict__[n] is b for (o, n), b in zip(owners, before))
    assert all(o.__dict__[n] is b for (o, n), b in zip(owners, before))
    with trainsan.watch_loads():  # a second holder: the same wrappers
        assert all(o.__dict__[n] is b for (o, n), b in zip(owners, before))


# -- replayed data and diff ---------------------------------------------------------------------

BATCHES = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(12)]


def steps_on(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_replayed_batches_after_an_in_process_resume_are_found(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    steps_on(model, opt, BATCHES[:3])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    steps_on(model, opt, BATCHES[3:5])
    ck = torch.load(tmp_path / "c.pt")  # roll back to the checkpoint...
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    steps_on(model, opt, BATCHES[:2])  # ...and restart the data from its first batch
    san.close()
    (f,) = [f for f in san.findings if f.kind == "duplicate_batch"]
    assert f.severity == "warning"
    assert "after the resume at step 5, this step's inputs are exactly those of step 0" \
        in f.message


def test_continued_batches_and_full_batch_resumes_are_silent(tmp_path):
    for batches, after in ((BATCHES[:3], BATCHES[3:6]), ([BATCHES[0]] * 3, [BATCHES[0]] * 3)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, policy="record")
        steps_on(model, opt, batches)
        ck = {"model": copy_sd(model), "optimizer": opt.state_dict()}
        model.load_state_dict(ck["model"])
        steps_on(model, opt, after)
        san.close()
        assert not [f for f in san.findings if f.kind == "duplicate_batch"], san.findings


def copy_sd(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_replay_across_processes_with_resume_trace(tmp_path):
    first = tmp_path / "first.jsonl"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record", trace=str(first))
    steps_on(model, opt, BATCHES[:4])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    san.close()
    for batches, replayed in ((BATCHES[:2], True), (BATCHES[4:6], False)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, policy="record", resume_trace=str(first))
        ck = torch.load(tmp_path / "c.pt")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        steps_on(model, opt, batches)
        san.close()
        got = [f for f in san.findings if f.kind == "duplicate_batch"]
        assert bool(got) == replayed, [f.message for f in san.findings]
    model = make_model()
    with pytest.raises(ValueError, match="resume_trace="):
        trainsan.attach(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        resume_trace=str(tmp_path / "missing.jsonl"))


def _traced(tmp_path, name, batches, lr=0.1):
    path = tmp_path / name
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    san = trainsan.attach(model, opt, policy="record", trace=str(path))
    steps_on(model, opt, batches)
    san.close()
    return str(path)


def test_diff_tells_data_from_numerics(tmp_path):
    from trainsan.report import diff

    a = _traced(tmp_path, "a.jsonl", BATCHES[:5])
    b = _traced(tmp_path, "b.jsonl", BATCHES[:2] + [BATCHES[7]] + BATCHES[3:5])
    c = _traced(tmp_path, "c.jsonl", BATCHES[:5], lr=0.2)
    out = diff(a, b)
    assert out.startswith("runs first differ in their data at step 2"), out
    out = diff(a, c)
    assert out.startswith("runs diverge at step 0") and "the inputs agree through" in out, out
    assert diff(a, a).startswith("no difference")


def test_diff_names_targets_that_differ(tmp_path):
    from trainsan.report import diff

    def traced(name, labels):
        path = tmp_path / name
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, policy="record", trace=str(path))
        for i, x in enumerate(BATCHES[:4]):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), labels(i)).backward()
            opt.step()
        san.close()
        return str(path)

    a = traced("a.jsonl", lambda i: torch.tensor([0, 1, 0, 1]))
    b = traced("b.jsonl", lambda i: torch.tensor([0, 1, 0, 1]) if i < 2
               else torch.tensor([1, 0, 1, 0]))
    out = diff(a, b)
    assert out.startswith("runs first differ in their data at step 2: the targets differ"), out


def _cleaned(sd):
    """timm's clean_state_dict: a new dict, 'module.' stripped, the same tensors."""
    import collections

    return collections.OrderedDict((k[7:] if k.startswith("module.") else k, v)
                                   for k, v in sd.items())


@pytest.mark.parametrize("load_opt", [False, True], ids=["optimizer_skipped", "full"])
def test_a_cleaned_copy_of_the_state_dict_is_still_the_checkpoints(ckpt, load_opt):
    """issue 37: the model's state handed over as a copy (timm's train.py, through its task
    wrapper) is still known as the checkpoint's, by its tensors: a skipped optimizer state is
    found, a full resume stays silent."""

    class Task(nn.Module):  # the model inside a task wrapper, attached as the wrapper
        def __init__(self):
            super().__init__()
            self.model = make_model()

        def forward(self, x):
            return self.model(x)

    task = Task()
    opt = torch.optim.AdamW(task.parameters(), lr=1e-3)
    san = trainsan.attach(task, opt, policy="record")
    ck = torch.load(ckpt[0])
    task.model.load_state_dict(_cleaned(ck["model"]))
    if load_opt:
        opt.load_state_dict(ck["optimizer"])
    train(task, opt, None, 2)
    san.close()
    errors = [f for f in found(san, "optimizer_reset") if f.severity == "error"]
    if load_opt:
        assert errors == [], [f.message for f in san.findings]
    else:
        assert [f.step for f in errors] == [0], [f.message for f in san.findings]
        assert "optimizer 0 (AdamW) was not restored" in errors[0].message


def test_a_freed_checkpoints_fingerprint_matches_no_new_dict():
    """A checkpoint's dicts are fingerprinted by id; once it is freed, a new dict may get one of
    its ids (CPython reuses them), with the same size and first key. That dict is not the freed
    checkpoint's: neither one with tensors of its own nor, once every tensor of the checkpoint is
    gone, one without (this made the cleaned-copy test above fail now and then, finding a former
    test's checkpoint, which had no optimizer state, instead of its own)."""
    import weakref

    from trainsan import _journal

    new = {"weight": torch.zeros(2), "bias": torch.zeros(2)}
    plain = {"lr": 0.1}
    gone = torch.ones(2)
    tids = {id(gone): weakref.ref(gone)}
    stale = _journal.CkptInfo()
    stale.has_optimizer_state = True
    saved = list(_journal._loaded)
    try:
        _journal._loaded.append(({_journal._fp(new), _journal._fp(plain)}, tids, stale))
        assert _journal._lookup(new) is None  # its tensors are not the checkpoint's
        assert _journal._lookup(plain) is stale  # the checkpoint may still be alive
        del gone
        assert _journal._lookup(plain) is None  # every tensor of it freed: so is it
    finally:
        _journal._loaded[:] = saved


def test_a_state_dict_of_fresh_tensors_is_not_a_checkpoints(ckpt):
    """The identity match needs the checkpoint's own tensor objects, alive: a state dict of new
    tensors with equal values (a deep copy) is not taken for the checkpoint's."""
    import copy

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    ck = torch.load(ckpt[0])
    model.load_state_dict(copy.deepcopy(ck["model"]))
    train(model, opt, None, 2)
    san.close()
    assert found(san, "optimizer_reset") == [], [f.message for f in san.findings]
