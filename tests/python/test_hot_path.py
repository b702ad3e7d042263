"""Note [Hot path] (bindings/csrc/handle.h): the per-step events go through the _trainsan_hot
pybind11 module where it was built, through the torch.classes methods otherwise; both call the
same C++ functions, so a loop gets the same findings either way."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import trainsan
from trainsan import _native

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zoo  # noqa: E402


@pytest.fixture
def classes_path(monkeypatch):
    """Sanitizers attached inside use the torch.classes methods."""
    _native.hot_module()  # looked up once, as the package does
    monkeypatch.setattr(_native, "_hot", [None])


def _built_module() -> list:
    import importlib.machinery

    where = Path(_native.load()).resolve().parent
    return [where / f"_trainsan_hot{s}" for s in importlib.machinery.EXTENSION_SUFFIXES
            if (where / f"_trainsan_hot{s}").is_file()]


def test_module_loads_where_it_was_built():
    if not _built_module():
        pytest.skip(f"_trainsan_hot was not built for this Python ({_native.hot_problem or ''}); "
                    "the torch.classes methods serve")
    if os.environ.get("TRAINSAN_HOT") == "0":
        pytest.skip("TRAINSAN_HOT=0")
    mod = _native.hot_module()
    assert mod is not None, _native.hot_problem
    m = nn.Linear(3, 1)
    san = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="record")
    try:
        assert san._ctx.hot.forward.func is mod.forward  # a partial over the module's function
    finally:
        san.close()


def test_classes_path_is_the_handles_methods(classes_path):
    m = nn.Linear(3, 1)
    san = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="record")
    try:
        for name in _native._HOT_EVENTS:
            assert isinstance(getattr(san._ctx.hot, name), torch.ScriptMethod), name
    finally:
        san.close()


def _signature(results) -> list:
    return [(r.case.name, r.status, sorted((f.sanitizer, f.kind, f.step, f.tensor, f.count)
                                           for f in r.findings)) for r in results]



def _one_per_kind() -> list:
    """The first zoo case of every finding kind, and the first five clean loops."""
    seen, out, clean = set(), [], 0
    for c in zoo.CASES:
        if c.kind is None:
            if clean < 5:
                out.append(c)
                clean += 1
        elif c.kind not in seen:
            seen.add(c.kind)
            out.append(c)
    return out


_SAMPLE = _one_per_kind()


def test_same_findings_on_both_paths(monkeypatch):
    if _native.hot_module() is None:
        pytest.skip(f"no _trainsan_hot ({_native.hot_problem}): one path only")
    hot = _signature(zoo.run_all(_SAMPLE))
    monkeypatch.setattr(_native, "_hot", [None])
    classes = _signature(zoo.run_all(_SAMPLE))
    assert len(hot) == len(_SAMPLE) >= 30
    assert hot == classes


@pytest.mark.parametrize("path", ["hot", "classes"])
def test_errors_are_the_same_python_exceptions(path, monkeypatch):
    if path == "hot" and _native.hot_module() is None:
        pytest.skip(f"no _trainsan_hot ({_native.hot_problem})")
    if path == "classes":
        _native.hot_module()
        monkeypatch.setattr(_native, "_hot", [None])
    m = nn.Linear(3, 1)
    # A loss the statistics pass cannot read (float8; Note [Dtypes the pass reads]): the C++
    # check's error, as torch raises it for the torch.classes method (policy "raise": under
    # "record" it would be told as a warning, Note [Faults]).
    strict = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="raise")
    try:
        with pytest.raises((RuntimeError, TypeError, ValueError)) as err:
            strict._ctx.hot.loss(torch.tensor([1.0]).to(torch.float8_e4m3fn))
        assert "float8" in str(err.value).lower() and "dtype" in str(err.value).lower()
    finally:
        strict.close()
    san = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="record")
    try:
        # A NaN loss is reported through either path.
        out = m(torch.randn(4, 3)).sum() * float("nan")
        san.watch_loss(out)
        assert any(f.kind == "nonfinite_loss" for f in san.findings)
    finally:
        san.close()


def test_a_released_handle_is_an_error_not_a_crash():
    mod = _native.hot_module()
    if mod is None:
        pytest.skip(f"no _trainsan_hot ({_native.hot_problem})")
    with pytest.raises(Exception, match="is gone"):
        mod.step_begin(10**12, 0, True)


# Note [One orchestration] (bindings/csrc/hot.cpp): the drivers that run Python callables are in
# the module whatever TRAINSAN_HOT says; without the module, the checks built on them are off and
# a note says so (no second implementation in Python).
def test_the_drivers_do_not_follow_trainsan_hot(monkeypatch):
    if _native.drivers() is None:
        pytest.skip(f"no _trainsan_hot ({_native.drivers_problem()})")
    monkeypatch.setattr(_native, "_hot", [None])
    assert _native.hot_module() is None
    assert _native.drivers() is not None


def test_without_the_module_bad_custom_grad_is_off_with_a_note(monkeypatch):
    monkeypatch.setattr(_native, "_ext", [(None, "not built (test)")])
    monkeypatch.setattr(_native, "_hot", [None])
    m = nn.Linear(3, 1)
    san = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="record")
    try:
        notes = san.coverage().get("notes", [])
        assert any("bad_custom_grad is not checked" in n and "not built (test)" in n
                   for n in notes), notes
    finally:
        san.close()


def test_without_the_module_rank_desync_is_off_with_a_note(monkeypatch):
    # The replicas' schedule of collectives is trainsan::ReplicaEngine (Note [Replica
    # comparison]): a distributed run without the module compares nothing and says so.
    from trainsan import _parts

    monkeypatch.setattr(_native, "_ext", [(None, "not built (test)")])
    monkeypatch.setattr(_native, "_hot", [None])
    monkeypatch.setattr(_parts, "replicas_active", lambda: True)
    m = nn.Linear(3, 1)
    san = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="record")
    try:
        notes = san.coverage().get("notes", [])
        assert any("rank_desync is not checked" in n and "not built (test)" in n
                   for n in notes), notes
    finally:
        san.close()


def test_a_replica_comparison_that_cannot_be_set_up_is_off_with_a_note(monkeypatch):
    # Its machinery failing (here: no process group behind replicas_active) never fails attach.
    from trainsan import _parts

    if _native.drivers() is None:
        pytest.skip(f"no _trainsan_hot ({_native.drivers_problem()})")
    monkeypatch.setattr(_parts, "replicas_active", lambda: True)
    m = nn.Linear(3, 1)
    with pytest.warns(UserWarning, match="rank_desync is not checked"):
        san = trainsan.attach(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="record")
    try:
        notes = san.coverage().get("notes", [])
        assert any("its comparison could not be set up" in n for n in notes), notes
    finally:
        san.close()


def test_without_the_module_the_step_reruns_are_off_with_a_note(monkeypatch):
    monkeypatch.setattr(_native, "_ext", [(None, "not built (test)")])
    monkeypatch.setattr(_native, "_hot", [None])
    m = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    san = trainsan.attach(m, opt, policy="record", rerun_every=1)
    try:
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(8, 3)).sum().backward()
            opt.step()
        notes = san.coverage().get("notes", [])
        assert any("step re-runs (rerun_every) are not checked" in n and "not built (test)" in n
                   for n in notes), notes
        assert not [f for f in san.findings if f.kind == "nondeterminism"]
    finally:
        san.close()
