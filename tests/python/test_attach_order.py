"""The attach order's preconditions under each policy (Note [Attach order] in sanitizer.py).

TrainSan watches the parameter objects the model holds at attach(), so the order is: replace the
parameters (a wrapper, ``fully_shard``, ``to_empty``, ``load_state_dict(assign=True)``), build the
optimizer, attach. Two preconditions say when it was not:

* (a) at attach, an optimizer that holds none of the model's parameters (built before they were
  replaced);
* (b) at the first step, attached parameters the model no longer holds (replaced after attach).

Under ``"raise"`` each is an error (ValueError from attach, RuntimeError from the first step).
Under ``"warn"`` and ``"record"`` they never raise into the script: (a) is a note (a trace record,
``summary()``, ``coverage()["notes"]``; a TrainingBugWarning under warn), and for (b) the
sanitizer re-binds to the model's current parameters and goes on checking, which the planted bugs
after the re-binding show (a NaN, a missing ``zero_grad``). Each case has its clean twin (the
right order), which is silent. Also with FSDP2 (one CPU process in a gloo group; the two-rank
stories are test_stack_fsdp.py's) and through the launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import _dist
import trainsan

STEPS = 6
NAN_STEP = 4
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")
NONFINITE = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _replace(model):
    """load_state_dict(assign=True): the same values in new Parameter objects."""
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _repoint(opt, model):
    """The optimizer's groups rebuilt in place on the model's current parameters (what building
    the optimizer after the replacement amounts to for the optimizer attached before it)."""
    opt.param_groups[0]["params"] = list(model.parameters())


def _train(model, opt, steps=STEPS, nan_at=None, zero_grad=True):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")  # BUG (planted): one bad sample
        if zero_grad:
            opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _records(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _notes(path):
    return [r for r in _records(path) if r["type"] == "note"]


def _assert_silent(san, trace=None):
    assert san.findings == [], san.summary()
    assert "notes" not in san.coverage() and "note:" not in san.summary()
    if trace is not None:
        assert _notes(trace) == []


# -- (a) an optimizer that holds none of the model's parameters, at attach -----------------------


def test_a_clean_twin_is_silent(tmp_path):
    model = _model()
    _replace(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built after the replacement
    trace = tmp_path / "run.jsonl"
    with trainsan.attach(model, opt, policy="record", trace=trace) as san:
        _train(model, opt)
    assert san.step == STEPS
    _assert_silent(san, trace)


def test_a_raise_is_todays_value_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _replace(model)
    with pytest.raises(ValueError, match=r"optimizer\[0\] holds none of the model's parameters"):
        trainsan.attach(model, opt)  # policy "raise", the default
    assert trainsan.attached(model) is None


def test_a_record_attaches_and_notes_it(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # BUG: built before the replacement
    _replace(model)
    trace = tmp_path / "run.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # record: no warning either
        san = trainsan.attach(model, opt, policy="record", trace=trace)
        _train(model, opt)
        san.close()
    assert san.step == STEPS and san.coverage()["steps_checked"] == STEPS
    # The cause is a note at attach, and a recorded error at the first step (issue 37: under
    # record a finding, not only a note; Note [Optimizers holding none], gradient_flow.cpp): one
    # about the model, naming how many of its parameters no optimizer trains.
    errs = [f for f in san.findings if f.severity == "error"]
    assert [(f.kind, f.tensor, f.step) for f in errs] == [
        ("param_not_in_optimizer", None, 0)], san.summary()
    assert errs[0].value == len(NAMES) and "hold none of the model's parameters" in (
        errs[0].message)
    (note,) = san.coverage()["notes"]
    assert "optimizer[0] holds none of the model's parameters" in note
    assert "TrainSan goes on (policy record)" in note
    assert "note: trainsan.attach: optimizer[0] holds none" in san.summary()
    recs = _records(trace)
    assert recs[0]["type"] == "header" and recs[1]["type"] == "note"
    assert recs[1]["about"] == "optimizer_holds_none" and recs[1]["message"] == note
    assert recs[-1]["type"] == "summary" and recs[-1]["steps"] == STEPS
    # python -m trainsan report shows it.
    from trainsan.report import report

    assert "note at step 0: trainsan.attach: optimizer[0]" in report(str(trace))


def test_a_warn_warns_at_attach():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _replace(model)
    with pytest.warns(trainsan.TrainingBugWarning, match="holds none of the model's param") as w:
        san = trainsan.attach(model, opt, policy="warn")
    assert w[0].filename == __file__  # at the attach() line of the script
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(model, opt)
        san.close()
    assert san.step == STEPS and len(san.coverage()["notes"]) == 1


# -- (b) parameters replaced after attach, found at the first step -------------------------------


def test_b_clean_twin_is_silent(tmp_path):
    model = _model()
    _replace(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = tmp_path / "run.jsonl"
    with trainsan.attach(model, opt, policy="record", trace=trace) as san:
        _train(model, opt, nan_at=None)
    _assert_silent(san, trace)


def test_b_raise_is_todays_runtime_error():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt)
    _replace(model)
    _repoint(opt, model)
    with pytest.raises(RuntimeError, match=r"no longer the model's.*replaced after attach\(\)"
                                           r".*attach\s+last"):
        _train(model, opt, steps=1)
    san.close()


@pytest.mark.parametrize("bug", [None, "nan", "no_zero_grad"])
def test_b_record_rebinds_and_goes_on_checking(tmp_path, bug):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = tmp_path / "run.jsonl"
    san = trainsan.attach(model, opt, policy="record", trace=trace)
    _replace(model)
    _repoint(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # record: no warning
        _train(model, opt, nan_at=NAN_STEP if bug == "nan" else None,
               zero_grad=bug != "no_zero_grad")
        san.close()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # trained
    # Still the model's sanitizer, now watching its current parameters.
    assert san._ctx.param_ids == {id(p) for p in model.parameters()}
    assert san.step == STEPS and san.coverage()["steps_checked"] == STEPS
    (note,) = san.coverage()["notes"]
    assert "no longer the model's" in note and "re-binds" in note
    recs = _records(trace)
    # The trace restarted at the re-binding: one header, the note right after it, the summary.
    assert [r["type"] for r in recs].count("header") == 1 and recs[0]["type"] == "header"
    assert recs[1]["type"] == "note" and recs[1]["about"] == "parameters_replaced"
    assert recs[1]["step"] == 0 and recs[-1]["type"] == "summary"
    if bug is None:
        assert san.findings == [], san.summary()
    elif bug == "nan":
        errs = [f for f in san.findings if f.severity == "error"]
        assert errs and min(f.step for f in errs) == NAN_STEP, san.summary()
        assert {f.kind for f in errs} <= set(NONFINITE)
        grads = {f.tensor for f in errs if f.kind == "nonfinite_grad" and f.step == NAN_STEP}
        assert grads == set(NAMES), san.summary()  # the model's names, read from the new ones
        assert any(f.kind == "nonfinite_loss" and f.step == NAN_STEP for f in errs)
        assert {r["kind"] for r in recs if r["type"] == "finding"} >= {"nonfinite_grad"}
    else:
        # The re-bound step 0 was in flight; step 1's backward adds onto step 0's gradient.
        stale = {f.tensor: f.step for f in san.findings if f.kind == "stale_grad"}
        assert stale == {n: 1 for n in NAMES}, san.summary()


def test_b_record_with_the_stale_optimizer_notes_both(tmp_path):
    """The optimizer attached before the replacement, left as it was (what fully_shard after
    attach does to an optimizer built before it): re-bound, that optimizer holds none of the
    parameters: both notes, and a NaN later is still found in the model's parameters."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = tmp_path / "run.jsonl"
    san = trainsan.attach(model, opt, policy="record", trace=trace)
    _replace(model)
    _train(model, opt, nan_at=NAN_STEP)
    san.close()
    assert [n["about"] for n in _notes(trace)] == ["optimizer_holds_none", "parameters_replaced"]
    assert len(san.coverage()["notes"]) == 2
    # The stale optimizer is an error at the first step after the re-binding (issue 37), the
    # NaN's at its step.
    stale = [f for f in san.findings if f.kind == "param_not_in_optimizer"]
    assert [(f.tensor, f.step) for f in stale] == [(None, 1)], san.summary()
    errs = [f for f in san.findings if f.severity == "error" and f.kind != stale[0].kind]
    assert errs and min(f.step for f in errs) == NAN_STEP, san.summary()
    assert {f.tensor for f in errs if f.kind == "nonfinite_grad"} == set(NAMES)


def test_b_warn_warns_at_the_first_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="warn")
    _replace(model)
    _repoint(opt, model)
    with pytest.warns(trainsan.TrainingBugWarning, match="no longer the model's") as w:
        _train(model, opt, steps=1)
    assert any("re-binds" in str(x.message) for x in w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more: the rest of the run is clean
        _train(model, opt, steps=STEPS - 1)
        san.close()
    assert san.findings == [] and san.step == STEPS


def test_b_rebind_keeps_findings_made_before_it_and_the_registry(tmp_path):
    """A finding of the old binding (the op audit's broadcast in the first step's forward) stays
    in `findings`, merged with the new binding's, and is listed in the re-binding's note;
    attached(model) is the same sanitizer throughout, and close() removes every hook."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = tmp_path / "run.jsonl"
    san = trainsan.attach(model, opt, policy="record", trace=trace)
    _replace(model)
    _repoint(opt, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own broadcast warning
        for _ in range(4):
            opt.zero_grad()
            # BUG (planted): output [8, 1] against target [8] broadcasts to [8, 8].
            F.mse_loss(model(torch.randn(8, 6)), torch.randn(8)).backward()
            opt.step()
    assert trainsan.attached(model) is san
    san.close()
    assert trainsan.attached(model) is None
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    (f,) = san.findings
    assert f.kind == "broadcast" and f.step == 0 and f.count == 4, san.summary()
    (note,) = _notes(trace)
    assert [b["kind"] for b in note["findings_before"]] == ["broadcast"], note


def test_b_record_inside_a_closure_step():
    """optimizer.step(closure): the first step begins after its closure ran (Note [Closure
    steps]); the re-binding happens there, and the step is in flight for the new hooks."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    _replace(model)
    _repoint(opt, model)
    for i in range(STEPS):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        if i == NAN_STEP:
            x[0, 0] = float("nan")

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    san.close()
    errs = [f for f in san.findings if f.severity == "error"]
    assert errs and min(f.step for f in errs) == NAN_STEP, san.summary()
    assert {f.tensor for f in errs if f.kind == "nonfinite_grad"} == set(NAMES)


def test_b_a_rebinding_that_fails_warns_and_the_run_goes_on(monkeypatch):
    """TrainSan's own failure while re-binding never raises into the script either: a warning,
    and the sanitizer stops (its hooks removed, what it found still readable)."""
    from trainsan import sanitizer

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    _replace(model)

    def broken(_model):
        raise OSError("boom")

    monkeypatch.setattr(sanitizer, "_header_extra", broken)
    with pytest.warns(trainsan.TrainingBugWarning, match=r"re-binding .* failed \(OSError: boom"):
        _train(model, opt)
    assert san.closed and trainsan.attached(model) is None
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(model._forward_pre_hooks) == 0
    assert san.coverage()["training_forwards"] == 1  # the first step's, before the re-binding
    san.close()


# -- FSDP2: one process in a gloo group ----------------------------------------------------------


FSDP_SCENARIOS = ("clean", "optimizer_before", "attach_before", "attach_before_nan")


def _fsdp_runs(rank: int, world_size: int) -> dict:
    """Every scenario, one after another in one process (spawning is the expensive part)."""
    return {scenario: _fsdp_run(rank, scenario) for scenario in FSDP_SCENARIOS}


def _fsdp_run(rank: int, scenario: str) -> dict:
    import trainsan
    from torch.distributed.fsdp import fully_shard

    from test_stack_fsdp import MLP, _fsdp_batch, _summary

    torch.manual_seed(0)
    model = MLP(out=1)
    if scenario != "clean":
        opt = torch.optim.SGD(model.parameters(), lr=0.05)  # BUG: built before fully_shard
    notes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if scenario.startswith("attach_before"):
            san = trainsan.attach(model, opt, policy="record")  # BUG: before fully_shard too
        for m in (model.fc1, model.fc2, model):
            fully_shard(m)
        if scenario == "clean":
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if not scenario.startswith("attach_before"):
            san = trainsan.attach(model, opt, policy="record")
        try:
            for step in range(5):
                opt.zero_grad()
                x, y = _fsdp_batch(rank, step)
                if scenario.endswith("_nan") and step == 3:
                    x[0, 0] = float("nan")  # BUG (planted)
                F.mse_loss(model(x), y).backward()
                opt.step()
        finally:
            san.close()
        notes = san.coverage().get("notes", [])
    return dict(_summary(san), notes=notes)


@pytest.fixture(scope="module")
def fsdp_results():
    if _dist.skip_reason() is not None:
        pytest.skip(_dist.skip_reason())
    return _dist.run(_fsdp_runs, 1, timeout=150)[0]


def test_fsdp_clean_twin_is_silent(fsdp_results):
    r = fsdp_results["clean"]
    assert r["findings"] == [] and r["notes"] == [] and r["steps_checked"] == 5, r


def test_fsdp_optimizer_before_fully_shard_record_goes_on(fsdp_results):
    r = fsdp_results["optimizer_before"]
    assert r["steps"] == 5 and r["steps_checked"] == 5, r
    (note,) = r["notes"]
    assert "sharded DTensors" in note and "fully_shard" in note, note
    # Recorded as an error too (issue 37), at the first step; the model's only error.
    assert [(f["kind"], f["step"]) for f in r["findings"] if f["severity"] == "error"] == [
        ("param_not_in_optimizer", 0)], r


def test_fsdp_attach_before_fully_shard_record_rebinds(fsdp_results):
    for scenario in ("attach_before", "attach_before_nan"):
        r = fsdp_results[scenario]
        assert r["steps"] == 5 and r["steps_checked"] == 5, r
        assert any("no longer the model's" in n and "re-binds" in n for n in r["notes"]), r
        # Re-bound to the sharded parameters: the last step read every one's gradient shard.
        assert r["grads_read"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], r
    # The optimizer was built before fully_shard too: after the re-binding it holds none of the
    # sharded parameters, an error at the first step after it (issue 37; it was silent).
    for scenario in ("attach_before", "attach_before_nan"):
        stale = [(f["kind"], f["tensor"], f["step"]) for f in fsdp_results[scenario]["findings"]
                 if f["kind"] == "param_not_in_optimizer"]
        assert stale == [("param_not_in_optimizer", None, 1)], fsdp_results[scenario]
    assert [f for f in fsdp_results["attach_before"]["findings"] if f["severity"] == "error"
            ] == [f for f in fsdp_results["attach_before"]["findings"]
                  if f["kind"] == "param_not_in_optimizer"], fsdp_results["attach_before"]
    errs = [f for f in fsdp_results["attach_before_nan"]["findings"]
            if f["severity"] == "error" and f["kind"] != "param_not_in_optimizer"]
    assert errs and min(f["step"] for f in errs) == 3, errs
    assert {f["tensor"] for f in errs if f["kind"] == "nonfinite_grad"} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}, errs


# -- through the launcher --------------------------------------------------------------------------


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher", "attach_order.py")


def _launch(case, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *flags, SCRIPT, "--case", case],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def launched():
    from concurrent.futures import ThreadPoolExecutor

    runs = {"clean": ("clean", "--policy", "record"),
            "a_record": ("optimizer_before", "--policy", "record"),
            "b_record": ("probe_before", "--policy", "record"),
            "b_raise": ("probe_before",)}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(_launch, *v) for k, v in runs.items()}
        return {k: f.result() for k, f in futures.items()}


def test_launcher_clean_twin_is_silent(launched):
    r = launched["clean"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "6 steps, no findings" in r.stderr and "note:" not in r.stderr, r.stderr


def test_launcher_optimizer_before_record_completes(launched):
    r = launched["a_record"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr and "could not attach" not in r.stderr, r.stderr
    assert "note: trainsan.attach: optimizer[0] holds none of the model's parameters" in r.stderr
    assert "param_not_in_optimizer" in r.stderr, r.stderr  # and recorded as an error (issue 37)


def test_launcher_probe_before_record_rebinds_and_completes(launched):
    r = launched["b_record"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "6 steps" in r.stderr and "re-binds to the model's current parameters" in r.stderr


def test_launcher_probe_before_raise_is_todays_error(launched):
    r = launched["b_raise"]
    assert r.returncode == 1, r.stderr
    assert "RuntimeError: trainsan: 4 of the 4 parameters attached are no longer the model's" in (
        r.stderr)
