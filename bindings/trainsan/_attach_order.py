"""Attach order (Note [Attach order]): the notes TrainSan writes when the model's parameters were
replaced around attach, and the re-binding of a sanitizer to the parameters the model holds now."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
import weakref

import torch

from . import _compile, _patches
from ._findings import Finding, TrainingBugWarning, merge_findings
from ._patches import _attached, attached_to

# Note [Attach order]
# ~~~~~~~~~~~~~~~~~~~
# TrainSan watches the parameter objects the model holds when attach() runs, so the order is:
# replace the parameters (a wrapper, fully_shard, distribute_module, to_empty,
# load_state_dict(assign=True)), build the optimizer, attach. Two preconditions say when it was
# not: at attach, an optimizer that holds none of the model's parameters (built before they were
# replaced); at the first step (ParamsLive), attached parameters the model no longer holds
# (replaced after attach). Under policy "raise" each is an error (ValueError from attach,
# RuntimeError from the first step). Under "warn" and "record" TrainSan's own preconditions never
# raise into the script:
# * An optimizer holding none of the parameters: attach goes on, and a note says why its steps
#   update nothing the model uses. No finding does: with no parameter in any optimizer the C++
#   side judges the model as one without an optimizer (have_optimizer: param_not_in_optimizer,
#   missing_grad and the mode rules say nothing; update_ratio may warn of updates of 0).
# * Parameters replaced after attach: the sanitizer re-binds (_rebind) at that first step to the
#   model as it is now, with the same optimizers, policy, options, checks and trace path: what it
#   installed is released quietly (the C++ side's reports at close are not applied) and built
#   anew. That step is then in flight for the new hooks, as for an attach inside a step
#   (step_in_flight: the step rules do not judge it; its gradients arrived before the new hooks);
#   the checks go on from the next step. The trace restarts (the C++ side opens it anew, header
#   included); its first records after the header are the notes so far, then the re-binding's,
#   which lists the findings made before it. Those findings stay in `findings` (merged by kind
#   and tensor with the new ones) and their counts in coverage(). The model stays registered as
#   attached (attached(model) is the same object).
# A note is a trace record {"type": "note", "about": ..., "step": ..., "message": ...}, listed by
# summary() and coverage()["notes"], and under "warn" a TrainingBugWarning.
_GOES_ON = {
    "optimizer_holds_none": (
        "; TrainSan goes on (policy {policy}) watching the model's parameters, which this "
        "optimizer's steps leave unchanged (no finding says so: the step rules that need an "
        "optimizer see none holding them)"),
    "parameters_replaced": (
        "; TrainSan re-binds to the model's current parameters at this step (policy {policy}) "
        "and goes on checking from the next step; the trace restarts here"),
}
# coverage() counts that add up across a re-binding (the others are the new binding's).
_ADDITIVE = ("steps_checked", "update_steps", "training_forwards", "other_forwards",
             "losses_checked", "inputs_fingerprinted", "audited_forwards", "ops_audited")


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside trainsan and torch (for a warning)."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tdir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    f, level = sys._getframe(2), 2  # the caller of the function that asks
    while f is not None and f.f_code.co_filename.startswith((pkg, tdir)):
        f, level = f.f_back, level + 1
    return level


def rebind(san, message: str) -> None:
    """Re-bind the sanitizer `san` to the model's current parameters (Note [Attach order]): what
    it installed is released quietly and built anew; findings and counts carry over."""
    registered = attached_to(san._model) is san
    old, old_hot = san._handle, san._hot
    counts = dict(old.coverage()[0])
    san._closed = True
    _patches.unregister(san)
    for part in san._parts:
        try:
            part.close()
        except Exception:  # noqa: BLE001 - quiet: what is left is built anew
            pass
    try:
        old.close()  # its reports are not applied; its summary record is overwritten
    except Exception:  # noqa: BLE001
        pass
    san._binding += 1
    try:
        san._build()
    except Exception as exc:  # noqa: BLE001 - never raise into the script under warn/record
        san._closed = True
        _patches.unregister(san)
        for part in san._parts:
            try:
                part.close()
            except Exception:  # noqa: BLE001
                pass
        if san._handle is not old:
            try:
                san._handle.close()
            except Exception:  # noqa: BLE001
                pass
        san._handle, san._hot = old, old_hot  # what it found stays readable
        warnings.warn(f"{message}; re-binding to the model's current parameters failed "
                      f"({type(exc).__name__}: {exc}): this sanitizer checks nothing more",
                      TrainingBugWarning, stacklevel=_user_stacklevel())
        return
    before = [Finding._from_tuple(t) for t in old.findings()]
    san._before = merge_findings(san._before, before)
    for key in _ADDITIVE:
        if key in counts:
            san._counts_before[key] = san._counts_before.get(key, 0) + int(counts[key])
    if registered:
        _attached[san._model] = weakref.ref(san)
        _compile.wrap_compiled_call(san._model)
    extra = {"findings_before": [dataclasses.asdict(f) for f in before]} if before else {}
    san._note("parameters_replaced",
               message + _GOES_ON["parameters_replaced"].format(policy=san._policy), **extra)
