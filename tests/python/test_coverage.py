"""Coverage (what was checked) and the overhead budget's sampling of update statistics."""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan


def _loop(san_kwargs: dict, steps: int, direct_forward: bool = False, trace=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = trainsan.attach(model, opt, policy="record", trace=trace, **san_kwargs)
    for _ in range(steps):
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        opt.zero_grad()
        # Calling .forward directly runs no module hook: the forward-based checks see nothing.
        out = model.forward(x) if direct_forward else model(x)
        loss = san.watch_loss(F.cross_entropy(out, y))
        loss.backward()
        opt.step()
    return san


def test_a_plain_loop_is_fully_covered(tmp_path):
    trace = tmp_path / "run.jsonl"
    san = _loop({}, steps=5, trace=trace)
    c = san.coverage()
    san.close()
    assert c["steps_checked"] == 5
    assert c["training_forwards"] == 5
    assert c["losses_checked"] == 5
    assert c["inputs_fingerprinted"] == 5
    assert c["audited_forwards"] == 5 and c["ops_audited"] >= 5
    assert c["unchecked"] == {}
    assert "checked: 5 step(s)" in san.summary() and "not checked" not in san.summary()
    summary = json.loads(trace.read_text().splitlines()[-1])
    assert summary["type"] == "summary"
    assert summary["coverage"]["steps_checked"] == 5
    assert summary["coverage"]["unchecked"] == {}


def test_a_loop_the_hooks_never_see_says_so():
    san = _loop({}, steps=4, direct_forward=True)
    c = san.coverage()
    san.close()
    assert c["steps_checked"] == 4 and c["training_forwards"] == 0
    for kind in ("eval_mode", "duplicate_batch", "broadcast", "label_range", "batch_mismatch"):
        assert "forward hook never fired" in c["unchecked"][kind], kind
    assert "not checked: duplicate_batch: no training forward was seen" in san.summary()


def test_switched_off_checks_are_not_listed_as_unchecked():
    san = _loop({"checks": {"duplicate_batch": False}}, steps=2, direct_forward=True)
    assert "duplicate_batch" not in san.coverage()["unchecked"]
    san.close()


def test_no_loss_watched_is_reported():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        c = san.coverage()
    if c["losses_checked"] == 0:  # no automatic loss watching in this build
        assert "no loss was watched" in c["unchecked"]["nonfinite_loss"]
    else:
        assert "nonfinite_loss" not in c["unchecked"]


def test_no_budget_means_update_statistics_every_step(tmp_path):
    trace = tmp_path / "run.jsonl"
    san = _loop({"overhead_budget": None}, steps=30, trace=trace)
    c = san.coverage()
    san.close()
    assert c["update_steps"] == 30 and c["update_period"] == 1
    steps = [json.loads(l) for l in trace.read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step"]
    assert len(steps) == 30 and all(r["update_stats"] for r in steps)


def test_the_budget_samples_update_statistics_and_the_trace_says_where(tmp_path):
    # A tiny model: TrainSan's pass is a large share of its step, so after the warm-up the budget
    # samples the update statistics. Which steps get them depends on measured times; the trace
    # and the coverage must agree, and the warm-up steps always have them.
    trace = tmp_path / "run.jsonl"
    san = _loop({"overhead_budget": 0.01, "overhead_warmup": 5}, steps=60, trace=trace)
    c = san.coverage()
    san.close()
    steps = [json.loads(l) for l in trace.read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step"]
    flags = [r["update_stats"] for r in steps]
    assert all(flags[:5])
    assert sum(flags) == c["update_steps"]
    assert c["update_steps"] < 60 and c["update_period"] > 1
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["options"]["overhead_budget"] == 0.01


def test_update_checks_still_fire_under_the_budget():
    # An optimizer that never changes the weights: the "changed no parameter" rule needs update
    # statistics, which the warm-up steps always have.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2)).backward()
            opt.step()
    assert any(f.kind == "skipped_step" for f in san.findings)


def test_every_count_of_the_table_reaches_python_and_the_trace(tmp_path):
    """host/include/trainsan/coverage.def is the one list of the counts: coverage() and the trace
    summary hold each (the hand-written copies had dropped discards_checked)."""
    import os
    import re
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "host/include/trainsan/coverage.def"), encoding="utf-8") as fh:
        names = re.findall(r"^TRAINSAN_COVERAGE_COUNT\((\w+),", fh.read(), re.M)
    assert len(names) >= 17 and "discards_checked" in names
    trace = tmp_path / "t.jsonl"
    san = _loop({}, 3, trace=trace)
    cov = san.coverage()
    san.close()
    summary = [json.loads(x) for x in trace.read_text().splitlines()][-1]
    assert summary["type"] == "summary"
    for n in names:
        assert isinstance(cov[n], int), n
        assert summary["coverage"][n] == cov[n] or n.startswith("trace_"), n
