"""Helpers for users' own tests of their training code.

:func:`assert_resume_equivalent` checks that a checkpoint resumes a run: N steps straight and K
steps + save + load into a fresh run + N-K steps must give the same weights, bit for bit, at every
step after the resume.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch

from .stats import tensor_stats

__all__ = ["assert_resume_equivalent"]


def _need(run: Any, name: str) -> Callable:
    fn = getattr(run, name, None)
    if not callable(fn):
        raise TypeError(f"assert_resume_equivalent: make_run() must return an object with "
                        f"model, step(i), state_dict() and load_state_dict(state); "
                        f"{type(run).__name__} has no {name}()")
    return fn


def _fingerprints(model: torch.nn.Module) -> dict:
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    stats = tensor_stats([t for _, t in named]) if named else []
    return {n: s.hash for (n, _), s in zip(named, stats)}


def _model(run: Any) -> torch.nn.Module:
    m = getattr(run, "model", None)
    if not isinstance(m, torch.nn.Module):
        raise TypeError("assert_resume_equivalent: make_run() must return an object whose "
                        f"`model` is a torch.nn.Module (got {type(m).__name__})")
    return m


def assert_resume_equivalent(make_run: Callable[[], Any], steps: int, at: int,
                             weights_only: bool = True) -> str:
    """Train ``steps`` steps straight, then ``at`` steps, save, load into a fresh run and train
    the remaining ``steps - at``; the weights after every step from ``at`` on must be bitwise
    equal (64-bit fingerprints of every parameter).

    ``make_run()`` builds a fresh run — seeding what it uses (``torch.manual_seed``) as a new
    process would — and returns an object with ``model``, ``step(i)`` (train step ``i``: fetch
    its batch and step), ``state_dict()`` (everything a checkpoint of yours holds: model,
    optimizer, scheduler, RNG and data position) and ``load_state_dict(state)``. The state goes
    through ``torch.save`` and ``torch.load(weights_only=weights_only)``, as a real resume does.

    Raises AssertionError naming the first step and tensor that differ; returns a one-line
    summary when the two are equal.
    """
    if not isinstance(steps, int) or not isinstance(at, int) or not 0 < at < steps:
        raise ValueError(f"assert_resume_equivalent: need integers 0 < at < steps, got "
                         f"steps={steps!r}, at={at!r}")
    straight = make_run()
    model = _model(straight)
    step = _need(straight, "step")
    expected = []
    for i in range(steps):
        step(i)
        expected.append(_fingerprints(model))

    first = make_run()
    _need(first, "state_dict")
    for i in range(at):
        _need(first, "step")(i)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    try:
        state = torch.load(buf, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - say what the checkpoint needs
        raise AssertionError(
            f"the state_dict() of the run does not load with torch.load(weights_only="
            f"{weights_only}): {str(exc).splitlines()[0]} — keep checkpoints to tensors and plain "
            "values (or pass weights_only=False)") from None
    resumed = make_run()
    rmodel = _model(resumed)
    _need(resumed, "load_state_dict")(state)
    got = _fingerprints(rmodel)
    if got != expected[at - 1]:
        name = next(n for n in expected[at - 1] if got.get(n) != expected[at - 1][n])
        raise AssertionError(
            f"the resumed run's weights differ from the saved ones before any step: {name} — "
            "load_state_dict() does not restore the model")
    for i in range(at, steps):
        _need(resumed, "step")(i)
        got = _fingerprints(rmodel)
        if got != expected[i]:
            diff = [n for n in expected[i] if got.get(n) != expected[i][n]]
            raise AssertionError(
                f"the resumed run first differs from the straight one at step {i} (the "
                f"{'first' if i == at else str(i - at + 1) + '-th'} step after the resume at "
                f"{at}): {diff[0]}" + (f" and {len(diff) - 1} other tensor(s)" if len(diff) > 1
                                       else "") +
                " — something the step depends on was not saved or not restored: optimizer "
                "state, scheduler, RNG state (dropout, augmentation), the data position")
    return (f"resume at step {at} of {steps}: weights bitwise equal to the straight run at every "
            f"step ({len(expected[0])} tensors)")
