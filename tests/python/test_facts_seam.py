"""Facts cross the op library by name (Note [Facts by name], host/include/trainsan/facts_dict.h):
the defaults come from the C++ tables, records are flattened and empty lists cross as None, and a
wrong field is an error naming the struct and the field — at the Python call for a name the
table lacks, in C++ for a missing field or a value of another type."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import trainsan  # noqa: F401 - loads the op library
from trainsan import _native


def test_defaults_are_the_cpp_tables():
    d = _native.record("ResumeFacts")
    assert d["moment"] == 0 and d["opt"] == -1 and d["dropped_frozen"] == []
    assert math.isnan(d["lr"])
    p = _native.record("Provenance")
    assert p["forward"] is None and p["fp16_range"] == []
    with pytest.raises(ValueError, match="no facts struct is named 'Resume'"):
        _native.record("Resume")


def test_an_unknown_field_is_named_at_the_call():
    with pytest.raises(TypeError, match="ResumeFacts has no field 'learning_rate'"):
        _native.facts("ResumeFacts", learning_rate=0.1)


def test_records_flatten_and_empty_lists_cross_as_none():
    d = _native.fields({"a": [], "b": [{"x": 1, "y": "s"}, {"x": 2, "y": ""}],
                        "c": ("p", []), "o": {"z": [1]}, "n": None})
    assert d == {"a": None, "b": 2, "b.0.x": 1, "b.0.y": "s", "b.1.x": 2, "b.1.y": "",
                 "c": ("p", None), "o": 1, "o.0.z": [1], "n": None}


def test_cpp_names_the_struct_and_the_field():
    good = _native.facts("CheckpointContents", source="x")
    found, facts = torch.ops.trainsan.check_checkpoint(good)
    assert found == [] and facts["source"] == "x" and facts["nonfinite"] == []
    with pytest.raises(TypeError, match="CheckpointContents.part_ok: expected bool, got str"):
        torch.ops.trainsan.check_checkpoint({**good, "part_ok": "yes"})
    missing = dict(good)
    del missing["part_ok"]
    with pytest.raises(ValueError, match=r"CheckpointContents: missing field 'part_ok' \(bool\)"):
        torch.ops.trainsan.check_checkpoint(missing)
    with pytest.raises(ValueError, match="CheckpointContents: unknown field 'tensor'"):
        torch.ops.trainsan.check_checkpoint({**good, "tensor": 1})
    bad = _native.facts("CheckpointContents", saved_optimizers=[
        {"path": "opt", "params": [], "state": [[("step", "three")]]}])
    with pytest.raises(TypeError, match=r"CheckpointContents.saved_optimizers.0.state\[0\]\[0\]"
                                        r"\[1\]: expected Tensor, got str"):
        torch.ops.trainsan.check_checkpoint(bad)


def test_flattened_records_reach_the_rules():
    w = torch.zeros(4, 3)
    contents = _native.facts(
        "CheckpointContents", source="c", tensors=[("model.w", w)],
        state_dicts=[("model", [("w", w)])],
        model=[{"state": [("w", w)], "trainable": [("w", w)]}],
        saved_optimizers=[{"path": "opt", "params": [],
                           "state": [[("exp_avg", torch.zeros(3, 4))]]}])
    found, facts = torch.ops.trainsan.check_checkpoint(contents)
    assert facts["model_found"] and facts["optimizer_with_state"] == 1
    assert facts["state_mismatched"] == ["exp_avg of parameter 0 (w): [3, 4], the parameter [4, 3]"]
    assert found[0]["kind"] == "bad_checkpoint"
    assert "does not fit its parameters" in found[0]["message"]


# -- the last positional seams: a finding and the handle's construction, by name ----------------


def test_a_finding_crosses_by_the_names_of_the_python_dataclass():
    """trainsan::Finding's table (finding.def) and the Finding dataclass have the same fields in
    the same order: a field added to the table needs its attribute here."""
    assert list(_native.record("Finding")) == [f.name for f in dataclasses.fields(trainsan.Finding)]


def _args(**setup):
    w = torch.zeros(3, requires_grad=True)
    return _native.facts(
        "SanitizerArgs",
        parameters=[_native.record("Parameter", name="w", tensor=w)],
        options=[("policy", "record")], gathers_events=True, **setup)


def test_the_handle_is_built_from_one_dict_and_reports_findings_by_name():
    w = torch.zeros(3, requires_grad=True)
    h = torch.classes.trainsan.Sanitizer(_native.facts(
        "SanitizerArgs",
        parameters=[_native.record("Parameter", name="w", tensor=w)],
        options=[("policy", "record")], gathers_events=True,
        mode_modules=[_native.record("ModuleInfo", name="drop", type="Dropout", params=[0])]))
    reports = list(h.loss(torch.tensor(float("nan")))) + list(h.close())
    assert [f["kind"] for f, _ in reports] == ["nonfinite_loss"]
    (found,) = h.findings()
    assert list(found) == list(_native.record("Finding"))
    f = trainsan.Finding._from_dict(found)
    assert (f.kind, f.step, f.tensor, f.reproduces, f.count) == ("nonfinite_loss", 0, None, None, 1)


def test_a_wrong_handle_dict_is_named():
    with pytest.raises(ValueError, match=r"SanitizerArgs: unknown field 'modules' \(the fields of "
                                         r"SanitizerArgs are parameters, options, mode_modules"):
        torch.classes.trainsan.Sanitizer({**_args(), "modules": None})
    missing = _args()
    del missing["manual"]
    with pytest.raises(ValueError, match=r"SanitizerArgs: missing field 'manual' \(bool\): every "
                                         r"field of the table is required"):
        torch.classes.trainsan.Sanitizer(missing)
    with pytest.raises(TypeError, match="SanitizerArgs.manual: expected bool, got str"):
        torch.classes.trainsan.Sanitizer({**_args(), "manual": "yes"})
    with pytest.raises(TypeError, match="SanitizerArgs.parameters.0.optimizer: expected int, got "
                                        "str"):
        torch.classes.trainsan.Sanitizer({**_args(), "parameters.0.optimizer": "adam"})
    with pytest.raises(TypeError, match="Setup has no field 'modules'"):
        _native.record("Setup", modules=[])
