"""The bug zoo (zoo.py) as tests: every buggy loop must produce its finding kind within
zoo.WINDOW steps of the bug's onset; every clean loop must produce no error-severity finding.

A failure prints the case's findings. bench/zoo_score.py prints the same results as a table.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zoo  # noqa: E402

# Kinds the zoo must cover, each with at least two distinct buggy loops.
REQUIRED_KINDS = [
    "nonfinite_loss",
    "nonfinite_grad",
    "nonfinite_param",
    "grad_explosion",
    "grad_vanishing",
    "missing_grad",
    "stale_grad",
    "skipped_step",
    "accumulation_mismatch",
    "param_not_in_optimizer",
    "update_ratio",
    "no_grad_leak",
    "eval_mode",
    "duplicate_batch",
    "target_leak",
    "probs_as_logits",
    "loss_spike",
    "trivial_loss",
    "empty_loss",
    "inplace_before_backward",
    "bad_custom_grad",
    "amp_scale_collapse",
    "update_underflow",
    "low_precision_loss",
    "bad_checkpoint",
    "optimizer_reset",
    "nondeterminism",
]

ZOO_TIME_LIMIT_S = 180.0

_results: dict = {}  # case name -> zoo.Result, shared by the tests of one session


def result_of(case: zoo.Case) -> zoo.Result:
    if case.name not in _results:
        _results[case.name] = zoo.run_case(case)
    return _results[case.name]


def test_zoo_covers_every_kind():
    for kind in REQUIRED_KINDS:
        cases = [c for c in zoo.BUGGY if c.kind == kind]
        assert len(cases) >= 2, f"{kind}: {len(cases)} buggy loop(s), need at least 2"
        assert len({c.model for c in cases}) >= 2, f"{kind}: all loops use the same model type"
        assert len({c.optimizer for c in cases}) >= 2, f"{kind}: all loops use the same optimizer"
    assert len(zoo.CLEAN) >= 8
    for c in zoo.BUGGY:
        assert c.onset is not None and c.onset >= 0, c.name


def test_whole_zoo_runs_in_time():
    t0 = time.perf_counter()
    results = zoo.run_all()
    elapsed = time.perf_counter() - t0
    for r in results:
        _results[r.case.name] = r
    slowest = sorted(results, key=lambda r: -r.seconds)[:3]
    print(f"zoo: {len(results)} cases in {elapsed:.1f}s; slowest: "
          + ", ".join(f"{r.case.name} {r.seconds:.2f}s" for r in slowest))
    assert elapsed < ZOO_TIME_LIMIT_S, f"the zoo took {elapsed:.1f}s (limit {ZOO_TIME_LIMIT_S}s)"


@pytest.mark.parametrize("case", zoo.BUGGY, ids=lambda c: c.name)
def test_bug_is_detected(case: zoo.Case):
    r = result_of(case)
    assert r.exception is None, "the loop crashed:\n" + r.report()
    assert r.status == "detected", (
        f"expected {case.kind} at step {case.onset}..{case.onset + zoo.WINDOW}; got {r.status}\n"
        + r.report()
    )


@pytest.mark.parametrize("case", zoo.CLEAN, ids=lambda c: c.name)
def test_clean_loop_has_no_error(case: zoo.Case):
    r = result_of(case)
    assert r.exception is None, "the loop crashed:\n" + r.report()
    assert not r.errors(), "error findings on a correct loop:\n" + r.report()
