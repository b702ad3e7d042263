"""report and diff over the per-rank traces of one distributed run (run.rankN.jsonl, as the
launcher writes them under torchrun): read together."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import trainsan
from trainsan.__main__ import main
from trainsan.report import TraceError, diff_runs, rank_traces, report_many


def _run(path, bug=False, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with trainsan.attach(model, opt, trace=str(path), policy="record", fingerprints=True):
        for i in range(4):
            x = torch.randn(16, 4, generator=g)
            if bug and i == 2:
                x[0, 0] = float("nan")
            opt.zero_grad()
            F.mse_loss(model(x), torch.randn(16, 1, generator=g)).backward()
            opt.step()


def test_rank_traces_are_found_in_rank_order(tmp_path):
    for r in (0, 1, 10, 2):
        _run(tmp_path / f"run.rank{r}.jsonl")
    found = rank_traces(str(tmp_path / "run.jsonl"))
    assert [p.rsplit("/", 1)[1] for p in found] == [
        "run.rank0.jsonl", "run.rank1.jsonl", "run.rank2.jsonl", "run.rank10.jsonl"]
    assert rank_traces(str(tmp_path / "run.rank1.jsonl")) == [str(tmp_path / "run.rank1.jsonl")]
    with pytest.raises(TraceError, match=r"nor per-rank traces"):
        rank_traces(str(tmp_path / "other.jsonl"))


def test_report_reads_the_ranks_together(tmp_path, capsys):
    _run(tmp_path / "run.rank0.jsonl")
    _run(tmp_path / "run.rank1.jsonl", bug=True)
    text = report_many(rank_traces(str(tmp_path / "run.jsonl")))
    assert "2 traces read together" in text
    assert "run.rank1.jsonl: 4 steps" in text and "first error: nonfinite" in text
    assert "nonfinite_loss: only in run.rank1.jsonl" in text
    assert main(["report", str(tmp_path / "run.jsonl")]) == 0
    assert "only in run.rank1.jsonl" in capsys.readouterr().out


def test_diff_compares_rank_by_rank(tmp_path, capsys):
    for r in (0, 1):
        _run(tmp_path / f"a.rank{r}.jsonl")
        _run(tmp_path / f"b.rank{r}.jsonl", seed=r)  # rank 1 of b starts from other weights
    out = diff_runs(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    lines = out.splitlines()
    assert lines[0].startswith("rank 0: no difference")
    assert lines[1].startswith("rank 1: runs diverge at step 0")
    _run(tmp_path / "c.rank0.jsonl")
    with pytest.raises(TraceError, match="same number of ranks"):
        diff_runs(str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl"))
    assert main(["diff", str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")]) == 2
    assert "same number of ranks" in capsys.readouterr().err
