"""Attach order (Note [Attach order]): the notes TrainSan writes when the model's parameters were
replaced around attach; the re-binding itself is Sanitizer._rebind."""

from __future__ import annotations

import os
import sys

import torch


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
#   update nothing the model uses; the first step of such an optimizer whose backward reached
#   the model is param_not_in_optimizer, one error about the model (Note [Optimizers holding
#   none], host/checks/gradient_flow.cpp). Otherwise the C++ side judges the model as one without
#   an optimizer (have_optimizer: missing_grad and the mode rules say nothing).
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
        "optimizer's steps leave unchanged (param_not_in_optimizer at its first step)"),
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
