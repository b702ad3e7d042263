"""``trainsan.attach`` and ``trainsan.attached``: attach()'s arguments checked, the Sanitizer
made and registered as its model's (the registry, _patches._attached, is read by the compiled
call's entry too: Note [Compiled regions] in _compile.py)."""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterable, Optional, Union

import torch

from . import _compile
from ._optimizer_like import inner_torch_optimizer, optimizer_like
from ._patches import _attached, attached_to
from ._tables import KINDS, OPTIONS
from .sanitizer import Sanitizer

__all__ = ["attach", "attached"]


def _unwrap_optimizer(o: Any) -> Any:
    """The torch optimizer inside a wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer, fastai's OptimWrapper: anything with an ``.optimizer`` attribute, or a
    torch optimizer in ``.opt``, that is not itself a working torch optimizer). A real Optimizer subclass that wraps another (Lookahead) is kept: its own
    step is the update."""
    for _ in range(8):
        if isinstance(o, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in o.__dict__:
            return o
        inner = getattr(o, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(o, "_optimizer", None)
        if inner is None:
            inner = inner_torch_optimizer(o)  # fastai's OptimWrapper: .opt
        if inner is None or inner is o:
            return o
        o = inner
    return o


def attached(model: torch.nn.Module) -> Optional[Sanitizer]:
    """The open sanitizer attached to `model` (through attach()), or None."""
    ctx = attached_to(_compile.unwrap_compiled(model))
    return None if ctx is None else ctx.sanitizer()


def attach(
    model: torch.nn.Module,
    optimizer: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None] = None,
    *,
    policy: Optional[str] = None,
    trace: Union[str, os.PathLike, None] = None,
    checks: Optional[dict] = None,
    **options: Any,
) -> Sanitizer:
    """Attach TrainSan to a model and its optimizer(s); the training loop stays unchanged.

    Parameters
    ----------
    model : torch.nn.Module
        The module whose forward is the training forward.
    optimizer : torch.optim.Optimizer or list of them, optional
        Omit it for loops that update parameters by hand; steps are then delimited by training
        forwards (the README lists the checks that need an optimizer).
    policy : {"raise", "warn", "record"}, optional
        Default ``OPTIONS["policy"]`` (``"raise"``). ``"raise"`` raises :class:`TrainingBugError` at the first error-severity finding,
        ``"warn"`` emits :class:`TrainingBugWarning`, ``"record"`` only records.
    trace : path, optional
        JSON Lines trace (header, step records, findings, summary), flushed every step.
    checks : dict, optional
        ``{kind: bool}`` to switch checks off, or the opt-in ones (``nonfinite_activation``) on.
    **options
        Thresholds and switches of :data:`OPTIONS` (``sync``, ``track_updates``,
        ``trace_every``, ``grad_explosion_factor``, ...).

    Returns
    -------
    Sanitizer
        Use as a context manager, or call :meth:`Sanitizer.close`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"trainsan.attach: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    # attach(torch.compile(model)): watch the module inside (its parameter names, no "_orig_mod.");
    # its forward is reported at the compiled call's entry (Note [Compiled regions]).
    model = _compile.unwrap_compiled(model)
    if optimizer is None:
        opts: list = []
    elif isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "param_groups"):
        opts = [optimizer]
    else:
        try:
            opts = list(optimizer)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                "trainsan.attach: optimizer must be a torch.optim.Optimizer or a list of them, or "
                "an optimizer-like object (a class with a step() method and param_groups, a list "
                f"of dicts each holding 'params'), got {type(optimizer).__name__}"
            ) from None
    opts = [_unwrap_optimizer(o) for o in opts]
    for k, o in enumerate(opts):
        if optimizer_like(o):  # Note [Optimizer-like objects] (fastai's Optimizer)
            if not any(len(g["params"]) for g in o.param_groups):
                raise ValueError(f"trainsan.attach: optimizer[{k}] has no parameters")
            continue
        if not isinstance(o, torch.optim.Optimizer) or "_optimizer_step_pre_hooks" not in o.__dict__:
            if isinstance(o, torch.optim.Optimizer):
                raise TypeError(
                    f"trainsan.attach: optimizer[{k}] ({type(o).__name__}) is a torch optimizer "
                    "whose __init__ did not call torch.optim.Optimizer.__init__, so it has no step "
                    "hooks; pass the torch optimizer it wraps"
                )
            raise TypeError(
                f"trainsan.attach: optimizer[{k}] must be a torch.optim.Optimizer (or a wrapper "
                "holding one in .optimizer), or an optimizer-like object (a class with a step() "
                "method and param_groups, a list of dicts each holding 'params'), got "
                f"{type(o).__name__}"
            )
        if not any(len(g["params"]) for g in o.param_groups):
            raise ValueError(f"trainsan.attach: optimizer[{k}] has no parameters")
    if policy is None:
        policy = OPTIONS["policy"]
    if not isinstance(policy, str):
        raise ValueError(f"trainsan.attach: policy must be a string, got {type(policy).__name__}")
    unknown = sorted(set(options) - (set(OPTIONS) - {"policy", "trace"}))
    if unknown:
        raise TypeError(
            f"trainsan.attach: unknown option(s) {', '.join(unknown)}; valid options: "
            + ", ".join(sorted(set(OPTIONS) - {"policy", "trace"}))
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    # Note [Placeholder parameters] (_facts.py): beside materialised ones they are left out.
    if meta and len(meta) == sum(1 for _ in model.parameters()):
        raise ValueError(
            f"trainsan.attach: {len(meta)} parameter(s) of the model are on the meta device "
            f"(not materialised; e.g. {meta[0]!r}); attach after model.to_empty(device=...) and "
            "loading the weights, so TrainSan watches the real parameters"
        )
    checks = dict(checks or {})
    bad = sorted(set(checks) - set(KINDS))
    if bad:
        raise ValueError(
            f"trainsan.attach: unknown check(s) {', '.join(bad)} (not a finding kind TrainSan "
            "implements); valid kinds: "
            + ", ".join(sorted(KINDS))
        )
    if attached_to(model) is not None:
        raise RuntimeError(
            "trainsan.attach: this model already has a sanitizer attached; close() it first "
            "(or use `with trainsan.attach(...) as san:`)"
        )
    san = Sanitizer(model, opts, policy, trace, checks, options)
    _attached[model] = weakref.ref(san._ctx)  # Note [Context]
    _compile.wrap_compiled_call(model)  # model.compile() before attach (Note [Compiled regions])
    return san
