"""TensorBoard export of a trace (trainsan/tensorboard.py): read back with TensorBoard's own
event reader and compared with the trace's records."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import trainsan

pytest.importorskip("tensorboard", reason="tensorboard is not installed (scripts/install_deps.sh)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from trainsan.report import TraceError  # noqa: E402
from trainsan.tensorboard import export, export_many  # noqa: E402


def _trace(path, bug=False, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, trace=str(path), policy="record", trace_every=1):
        for i in range(steps):
            x = torch.randn(16, 4)
            if bug and i == 3:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.mse_loss(model(x), torch.randn(16, 1)).backward()
            opt.step()
    return [json.loads(line) for line in path.read_text().splitlines()]


def _events(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_scalars_equal_the_trace(tmp_path):
    recs = _trace(tmp_path / "run.jsonl", bug=True)
    counts = export(str(tmp_path / "run.jsonl"), str(tmp_path / "tb"))
    steps = [r for r in recs if r["type"] == "step"]
    assert counts["steps"] == len(steps) == 5
    acc = _events(tmp_path / "tb")
    tags = set(acc.Tags()["scalars"])
    assert {"global/grad_norm", "global/update_ratio", "grad_norm/0.weight",
            "update_ratio/2.bias", "nonfinite_grad/0.weight", "trainsan/overhead_ms"} <= tags
    got = {e.step: e.value for e in acc.Scalars("global/grad_norm")}
    for r in steps:
        g = r["global"]["grad_norm"]
        if g == g:  # a NaN norm is written as NaN
            assert got[r["step"]] == pytest.approx(g, rel=1e-6)
    ratio = {e.step: e.value for e in acc.Scalars("update_ratio/0.weight")}
    t0 = steps[0]["tensors"]["0.weight"]
    assert ratio[0] == pytest.approx(t0["update"]["l2"] / t0["param"]["l2"], rel=1e-6)
    # The NaN planted at step 3 shows in the per-tensor count and as a finding text.
    nf = {e.step: e.value for e in acc.Scalars("nonfinite_grad/0.weight")}
    assert nf[3] > 0 and nf[0] == 0
    texts = acc.Tags()["tensors"]
    assert any("findings" in t for t in texts) and any("header" in t for t in texts)
    assert counts["findings"] == sum(r["type"] == "finding" for r in recs) > 0


def test_several_traces_get_a_subdirectory_each(tmp_path):
    _trace(tmp_path / "run.rank0.jsonl")
    _trace(tmp_path / "run.rank1.jsonl")
    out = export_many([str(tmp_path / "run.rank0.jsonl"), str(tmp_path / "run.rank1.jsonl")],
                      str(tmp_path / "tb"))
    assert "run.rank0" in out and "run.rank1" in out
    for r in ("run.rank0", "run.rank1"):
        assert "global/grad_norm" in _events(tmp_path / "tb" / r).Tags()["scalars"]


def test_bad_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type":"step"}\n')
    with pytest.raises(TraceError, match="starts with a header"):
        export(str(bad), str(tmp_path / "tb"))
    with pytest.raises(TraceError, match="does not exist"):
        export(str(tmp_path / "missing.jsonl"), str(tmp_path / "tb"))


def test_command_line(tmp_path, capsys):
    from trainsan.__main__ import main

    _trace(tmp_path / "run.jsonl")
    assert main(["tensorboard", str(tmp_path / "run.jsonl"), "--logdir", str(tmp_path / "tb")]) == 0
    assert "5 step records" in capsys.readouterr().out
    assert "global/grad_norm" in _events(tmp_path / "tb").Tags()["scalars"]
    assert main(["tensorboard", str(tmp_path / "nope.jsonl"), "--logdir", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
