"""The kind and option tables: written once in C++ (kinds.def, options.def), read by Python;
unknown or unimplemented checks and dead options are errors (issue 7)."""

import json

import pytest
import torch

import trainsan
from trainsan import _native

# docs/architecture.md ("Public contracts"; the kinds: docs/kinds.md): the kinds implemented today
# and their severities.
IMPLEMENTED = {
    "nonfinite_loss": "error",
    "nonfinite_grad": "error",
    "nonfinite_param": "error",
    "nonfinite_activation": "error",
    "grad_explosion": "warning",
    "grad_vanishing": "warning",
    "missing_grad": "error",
    "stale_grad": "error",
    "skipped_step": "error",
    "accumulation_mismatch": "error",
    "param_not_in_optimizer": "error",
    "update_outside_step": "error",
    "update_ratio": "warning",
    "no_grad_leak": "error",
    "eval_mode": "warning",
    "broadcast": "error",
    "label_range": "error",
    "label_dtype": "error",
    "batch_mismatch": "error",
    "target_leak": "error",
    "probs_as_logits": "error",
    "duplicate_batch": "warning",
    "fp16_overflow": "warning",
    "amp_scale_collapse": "error",
    "update_underflow": "warning",
    "low_precision_loss": "warning",
    "bad_checkpoint": "error",
    "optimizer_reset": "error",
    "nondeterminism": "error",
    "inplace_before_backward": "error",
    "bad_custom_grad": "error",
    "loss_spike": "warning",
    "trivial_loss": "warning",
    "empty_loss": "warning",
    "rank_desync": "error",
}
UNIMPLEMENTED: list = []  # every kind of the design (docs/architecture.md) has a row


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_kinds_are_the_cpp_table():
    names, severities, on, families, rules = torch.ops.trainsan.kinds()
    assert trainsan.KINDS == dict(zip(names, severities))
    assert list(trainsan.KINDS) == list(names)  # the table's order
    assert trainsan.KINDS == IMPLEMENTED
    for kind in UNIMPLEMENTED:
        assert kind not in trainsan.KINDS
    default_on = dict(zip(names, on))
    assert [k for k, v in default_on.items() if not v] == [
        "nonfinite_activation", "update_outside_step"
    ]
    assert len(set(names)) == len(names)
    assert all(families) and all(rules)


def test_options_are_the_cpp_table():
    names = torch.ops.trainsan.options()[0]
    assert list(trainsan.OPTIONS) == list(names)
    o = trainsan.OPTIONS
    # Defaults as the README documents them.
    assert o["grad_explosion_factor"] == 50.0 and isinstance(o["grad_explosion_factor"], float)
    assert o["grad_explosion_warmup"] == 5 and isinstance(o["grad_explosion_warmup"], int)
    assert o["grad_vanishing_ratio"] == 1e-12
    assert o["update_ratio_low"] == 1e-8 and o["update_ratio_high"] == 1.0
    assert o["max_accumulation"] == 64
    assert o["trace_every"] == 1 and o["trace_topk"] == 8
    assert o["sync"] is False and o["track_updates"] is True and o["fingerprints"] is False
    assert o["policy"] == "raise" and o["trace"] == "" and o["trace_tensors"] == "all"
    assert o["audit_first_steps"] == 10 and o["audit_every"] == 100
    assert "fp16_overflow_fraction" not in o  # dead option removed


def test_options_dataclass_has_the_table_defaults():
    opts = trainsan.Options()
    assert dataclasses_asdict(opts) == trainsan.OPTIONS
    assert trainsan.Options(grad_explosion_factor=10.0).grad_explosion_factor == 10.0


def dataclasses_asdict(o):
    import dataclasses

    return dataclasses.asdict(o)


def test_dead_option_is_a_type_error():
    model, opt = _setup()
    with pytest.raises(TypeError, match="fp16_overflow_fraction"):
        trainsan.attach(model, opt, fp16_overflow_fraction=0.1)


def test_every_design_kind_is_implemented():
    # Every kind of the design (docs/architecture.md) has a row (issue 13 added the last ones).
    assert UNIMPLEMENTED == []
    for kind in ("nondeterminism", "bad_checkpoint", "optimizer_reset", "amp_scale_collapse",
                 "update_underflow", "low_precision_loss", "rank_desync"):
        assert kind in trainsan.KINDS


def test_misspelt_check_is_an_error_even_when_switched_off():
    model, opt = _setup()
    with pytest.raises(ValueError, match="stale_gard"):
        trainsan.attach(model, opt, checks={"stale_gard": False})


def test_unknown_check_is_rejected_by_cpp_too():
    """The op library's own validation, below the Python attach() check."""
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="unknown check 'nondeterministic'"):
        torch.classes.trainsan.Sanitizer(_native.facts(
            "SanitizerArgs", parameters=[_native.record("Parameter", name="p", tensor=p)],
            options=[("check.nondeterministic", "true")]))


def test_trace_header_options_cover_both_tables(tmp_path):
    path = tmp_path / "t.jsonl"
    model, opt = _setup()
    with trainsan.attach(model, opt, trace=path, grad_explosion_factor=20.0,
                         checks={"nonfinite_activation": True, "stale_grad": False}):
        pass
    head = json.loads(path.read_text().splitlines()[0])
    assert head["type"] == "header"
    opts = head["options"]
    assert set(trainsan.OPTIONS) <= set(opts)
    assert set(opts) - set(trainsan.OPTIONS) == {"checks"}
    assert opts["grad_explosion_factor"] == 20.0
    assert opts["policy"] == "raise" and opts["trace"] == str(path)
    checks = opts["checks"]
    assert set(checks) == set(IMPLEMENTED)
    assert checks["nonfinite_activation"] is True and checks["stale_grad"] is False
    assert checks["update_outside_step"] is False and checks["grad_explosion"] is True
