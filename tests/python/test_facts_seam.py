"""Facts cross the op library by name (Note [Facts by name], host/include/trainsan/facts_dict.h):
the defaults come from the C++ tables, records are flattened and empty lists cross as None, and a
wrong field is an error naming the struct and the field — at the Python call for a name the
table lacks, in C++ for a missing field or a value of another type."""

from __future__ import annotations

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
    flat, facts = torch.ops.trainsan.check_checkpoint(good)
    assert flat == [] and facts["source"] == "x" and facts["nonfinite"] == []
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
    flat, facts = torch.ops.trainsan.check_checkpoint(contents)
    assert facts["model_found"] and facts["optimizer_with_state"] == 1
    assert facts["state_mismatched"] == ["exp_avg of parameter 0 (w): [3, 4], the parameter [4, 3]"]
    assert flat[0] == "bad_checkpoint" and "does not fit its parameters" in flat[3]
