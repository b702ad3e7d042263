"""The sanitizer's API: hooks, policies, the trace, bad arguments, and that it never changes
the training it watches."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import trainsan


def _setup(seed=0, opt_cls=torch.optim.SGD, **opt_kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(12, 3)
    )
    opt = opt_cls(model.parameters(), **(opt_kw or {"lr": 0.1}))
    return model, opt


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train(model, opt, steps, san=None, zero=True):
    for i in range(steps):
        x, y = _batch(i)
        if zero:
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if san is not None:
            san.watch_loss(loss)
        loss.backward()
        opt.step()


def test_clean_loop_has_no_findings(tmp_path):
    model, opt = _setup()
    with trainsan.attach(model, opt, trace=tmp_path / "t.jsonl") as san:
        _train(model, opt, 6, san)
    assert san.findings == []
    assert san.step == 6
    assert "no findings" in san.summary()


def test_sanitizer_does_not_change_training():
    """Bit-identical parameters with and without the sanitizer (Adam, 8 steps)."""
    m1, o1 = _setup(opt_cls=torch.optim.Adam, lr=1e-2)
    _train(m1, o1, 8)
    m2, o2 = _setup(opt_cls=torch.optim.Adam, lr=1e-2)
    with trainsan.attach(m2, o2, policy="record") as san:
        _train(m2, o2, 8, san)
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(a.grad, b.grad), n


def test_raise_stops_at_the_step_of_the_bug():
    model, opt = _setup()
    san = trainsan.attach(model, opt, policy="raise")
    with pytest.raises(trainsan.TrainingBugError) as info:
        _train(model, opt, 5, zero=False)  # zero_grad() never called
    f = info.value.finding
    assert isinstance(info.value, RuntimeError)
    assert f.kind == "stale_grad" and f.step == 1 and f.severity == "error"
    assert f.tensor in dict(model.named_parameters())
    assert "zero_grad" in f.message and "step 1" in f.message
    # Raised from the user's own call: optimizer.step() inside _train.
    frames = [fr.name for fr in info.traceback]
    assert "_train" in frames
    san.close()


def test_warn_policy_emits_training_bug_warning():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="warn") as san:
        with pytest.warns(trainsan.TrainingBugWarning, match="stale_grad"):
            _train(model, opt, 3, zero=False)
    assert {f.kind for f in san.findings} == {"stale_grad"}


def test_repeated_finding_is_reported_once_then_counted():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record") as san:
        _train(model, opt, 6, zero=False)
    stale = [f for f in san.findings if f.kind == "stale_grad"]
    assert len(stale) == len(list(model.parameters()))  # one per tensor
    assert all(f.count == 5 and f.step == 1 and f.last_step == 5 for f in stale)
    assert "x5" in san.summary()


def test_close_removes_every_hook():
    model, opt = _setup()
    orig_scaler_step = torch.amp.GradScaler.step
    san = trainsan.attach(model, opt, policy="record")
    assert san._ctx.handle.hooks_installed()
    assert len(model._forward_pre_hooks) == 1
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    assert torch.amp.GradScaler.step is not orig_scaler_step
    san.close()
    assert not san._ctx.handle.hooks_installed()
    assert len(model._forward_pre_hooks) == 0
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    assert torch.amp.GradScaler.step is orig_scaler_step
    _train(model, opt, 4, zero=False)  # a bug after close goes unseen, and nothing crashes
    assert san.findings == []
    san.close()  # idempotent


def test_attaching_twice_is_an_error_until_closed():
    model, opt = _setup()
    san = trainsan.attach(model, opt)
    with pytest.raises(RuntimeError, match="already has a sanitizer"):
        trainsan.attach(model, opt)
    san.close()
    trainsan.attach(model, opt).close()


def test_bad_arguments_give_clear_errors(tmp_path):
    model, opt = _setup()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        trainsan.attach("not a model", opt)
    with pytest.raises(TypeError, match="Optimizer"):
        trainsan.attach(model, 42)
    with pytest.raises(TypeError, match=r"optimizer\[1\]"):
        trainsan.attach(model, [opt, "adam"])
    empty = torch.optim.SGD(model.parameters(), lr=0.1)
    empty.param_groups[0]["params"] = []
    with pytest.raises(ValueError, match="no parameters"):
        trainsan.attach(model, empty)
    with pytest.raises(TypeError, match="unknown option.*grad_exploshun"):
        trainsan.attach(model, opt, grad_exploshun=3)
    with pytest.raises(ValueError, match="unknown check"):
        trainsan.attach(model, opt, checks={"nan_everywhere": True})
    with pytest.raises(ValueError, match="policy"):
        trainsan.attach(model, opt, policy="explode")
    with pytest.raises(TypeError, match="grad_explosion_factor takes a number"):
        trainsan.attach(model, opt, grad_explosion_factor="big")
    with pytest.raises(ValueError, match="trace file"):
        trainsan.attach(model, opt, trace=tmp_path / "no" / "such" / "dir" / "t.jsonl")
    with pytest.raises(ValueError, match="no parameters"):
        trainsan.attach(torch.nn.ReLU())
    with trainsan.attach(model, opt) as san:
        with pytest.raises(TypeError, match="watch_loss"):
            san.watch_loss(1.5)


def test_trace_is_json_lines_with_header_steps_findings_summary(tmp_path):
    path = tmp_path / "run.jsonl"
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record", trace=path, trace_every=2) as san:
        _train(model, opt, 5, zero=False)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    head = lines[0]
    assert head["type"] == "header"
    for key in ("trainsan", "torch", "cuda", "device", "argv", "seed",
                "deterministic_algorithms", "git_commit"):
        assert key in head
    steps = [line for line in lines if line["type"] == "step"]
    assert [s["step"] for s in steps] == [0, 2, 4]
    for s in steps:
        assert s["overhead_ms"] >= 0
        assert set(s["tensors"]) == {n for n, _ in model.named_parameters()}
        t = s["tensors"]["0.weight"]
        assert t["grad"]["numel"] == 72 and t["param"]["numel"] == 72
        assert "update" in t
    findings = [line for line in lines if line["type"] == "finding"]
    assert {f["kind"] for f in findings} == {"stale_grad"}
    assert len(findings) == len(san.findings)
    assert lines[-1]["type"] == "summary"
    assert lines[-1]["findings"]["stale_grad"] == sum(f.count for f in san.findings)
    assert lines[-1]["steps"] == 5


def test_trace_global_and_topk(tmp_path):
    model, opt = _setup()
    with trainsan.attach(model, opt, trace=tmp_path / "g.jsonl", trace_tensors="global"):
        _train(model, opt, 2)
    recs = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["type"] == "step"]
    assert len(steps) == 2
    assert all("tensors" not in s and "grad_norm" in s["global"] for s in steps)
    model, opt = _setup()
    with trainsan.attach(model, opt, trace=tmp_path / "k.jsonl", trace_tensors="topk",
                         trace_topk=2):
        _train(model, opt, 2)
    recs = [json.loads(x) for x in (tmp_path / "k.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["type"] == "step"]
    assert len(steps) == 2 and all(len(s["tensors"]) == 2 for s in steps)


def test_fingerprints_only_when_asked_or_traced(tmp_path):
    model, opt = _setup()
    with trainsan.attach(model, opt) as san:
        _train(model, opt, 1)
        assert all(s.hash == 0 for s in san.last_stats().values())
    model, opt = _setup()
    with trainsan.attach(model, opt, trace=tmp_path / "t.jsonl", trace_every=2) as san:
        _train(model, opt, 1)
        assert san.last_stats()["0.weight"].hash == trainsan.tensor_stats([model[0].weight])[0].hash
        _train(model, opt, 1)  # step 1 is not traced
        assert san.last_stats()["0.weight"].hash == 0


def test_last_stats_match_tensor_stats():
    model, opt = _setup()
    with trainsan.attach(model, opt, fingerprints=True) as san:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _train(model, opt, 1)
        st = san.last_stats()
    for n, p in model.named_parameters():
        (ref,) = trainsan.tensor_stats([p])
        assert st[n] == ref
        (gref,) = trainsan.tensor_stats([p.grad])
        assert st[n + ".grad"] == gref
        delta = (p.detach().double() - before[n].double())
        assert st[n + ".update"].l2 == pytest.approx(delta.norm().item(), rel=1e-12, abs=1e-300)
        assert st[n + ".update"].numel - st[n + ".update"].zero == int((delta != 0).sum())


def test_watch_loss_nonfinite_raises_at_once():
    model, opt = _setup()
    with trainsan.attach(model, opt) as san:
        x, y = _batch(0)
        loss = F.cross_entropy(model(x), y) * float("inf")
        with pytest.raises(trainsan.TrainingBugError, match="nonfinite_loss"):
            san.watch_loss(loss)


def test_checks_can_be_switched_off():
    model, opt = _setup()
    with trainsan.attach(model, opt, checks={"stale_grad": False}) as san:
        _train(model, opt, 4, zero=False)
    assert san.findings == []


def test_frozen_and_manual_loops_are_clean():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with trainsan.attach(model) as san:
        for i in range(5):
            x, y = _batch(i)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    assert [f for f in san.findings if f.severity == "error"] == []


def test_manual_loop_without_zeroing_is_stale():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with trainsan.attach(model, policy="record") as san:
        for i in range(6):
            x, y = _batch(i)
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    kinds = {f.kind for f in san.findings}
    assert "stale_grad" in kinds
    assert min(f.step for f in san.findings if f.kind == "stale_grad") <= 3


def test_warnings_do_not_raise_under_raise_policy():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="raise") as san:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for i in range(5):
                # batches 0, 1, 2, then 2 again (the data stops advancing): a warning, not an error
                x, _ = _batch(min(i, 2))
                y = torch.zeros(16, dtype=torch.long)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
    assert {f.kind for f in san.findings} == {"duplicate_batch"}


def _traced_run(path, seed):
    model, opt = _setup(seed=seed)
    with trainsan.attach(model, opt, trace=path):
        _train(model, opt, 3)


def test_cli_report_and_diff(tmp_path):
    import subprocess
    import sys

    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    _traced_run(a, 0)
    _traced_run(b, 0)
    _traced_run(c, 1)
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "trainsan", *map(str, args)], capture_output=True, text=True
    )
    r = run("report", a)
    assert r.returncode == 0 and "3 step records" in r.stdout and "no findings" in r.stdout
    r = run("diff", a, b)
    assert r.returncode == 0 and "no difference in 3 common steps" in r.stdout
    r = run("diff", a, c)
    assert r.returncode == 0 and "diverge at step 0" in r.stdout
    r = run("report", tmp_path / "missing.jsonl")
    assert r.returncode == 2 and "does not exist" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "header"}\nnot json\n')
    r = run("report", bad)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr


# --- nonfinite_activation (issue 7: now a C++ check, deduplicated, counted and traced) ----------


def _nan_weight_model():
    """Linear -> ReLU -> Linear whose first weight holds one NaN: every module output is NaN."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_nonfinite_activation_repeats_are_counted_and_traced(tmp_path):
    path = tmp_path / "act.jsonl"
    model, opt = _nan_weight_model()
    with trainsan.attach(model, opt, policy="record", trace=path,
                         checks={"nonfinite_activation": True}) as san:
        _train(model, opt, 3)
    act = [f for f in san.findings if f.kind == "nonfinite_activation"]
    tensors = [f.tensor for f in act]
    # One finding per module whose output goes non-finite (each leaf here), never a duplicate.
    assert sorted(tensors) == ["0", "1", "2"]
    first = next(f for f in act if f.tensor == "0")
    assert first.count == 3 and first.step == 0 and first.last_step == 2
    assert first.severity == "error"
    assert first.message.startswith(
        "nonfinite_activation at step 0: the output of 0 (Linear) holds 16 NaN and 0 ±Inf values"
    )
    assert all(f.count == 3 for f in act)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    traced = [r for r in lines if r["type"] == "finding" and r["kind"] == "nonfinite_activation"]
    assert sorted(r["tensor"] for r in traced) == ["0", "1", "2"]
    assert lines[-1]["type"] == "summary"
    assert lines[-1]["findings"]["nonfinite_activation"] == 9
    unique = [u for u in lines[-1]["unique_findings"] if u["kind"] == "nonfinite_activation"]
    assert {u["tensor"]: u["count"] for u in unique} == {"0": 3, "1": 3, "2": 3}
    assert all(u["first_step"] == 0 and u["last_step"] == 2 for u in unique)


def test_nonfinite_activation_is_off_by_default():
    model, opt = _nan_weight_model()
    with trainsan.attach(model, opt, policy="record") as san:
        _train(model, opt, 2)
    assert "nonfinite_activation" not in {f.kind for f in san.findings}
    assert "nonfinite_grad" in {f.kind for f in san.findings}  # the NaN is there


def test_nonfinite_activation_raises_from_the_forward():
    model, opt = _nan_weight_model()
    x, _ = _batch(0)
    with trainsan.attach(model, opt, checks={"nonfinite_activation": True}):
        with pytest.raises(trainsan.TrainingBugError) as info:
            model(x)
    f = info.value.finding
    assert f.kind == "nonfinite_activation" and f.tensor == "0" and f.step == 0
    # Raised inside the module call (the forward hook), before the loss exists.
    assert "_call_impl" in {fr.name for fr in info.traceback}


def test_nonfinite_activation_message_is_unchanged():
    """The message the Python check produced before it moved into C++ (step, module, counts)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record",
                         checks={"nonfinite_activation": True}) as san:
        for step in range(3):
            if step == 2:  # two clean steps, then NaN and +Inf weights: 4 NaN and 4 Inf outputs
                with torch.no_grad():
                    model[0].weight.copy_(torch.tensor(
                        [[float("nan"), 0.0], [float("inf"), 0.0], [1.0, 1.0]]))
                    model[0].bias.zero_()
            opt.zero_grad()
            model(torch.ones(4, 2)).sum().backward()
            opt.step()
    act = [f for f in san.findings if f.kind == "nonfinite_activation"]
    assert act, san.summary()
    f = act[0]
    step, name, typ, nan, inf = 2, "0", "Linear", 4, 4
    assert f.message == (
        f"nonfinite_activation at step {step}: the output of {name} ({typ}) holds {nan} NaN and "
        f"{inf} ±Inf values — the first module whose output is non-finite is where to look"
    )
    assert f.tensor == "0" and f.step == 2 and f.value == 8.0
