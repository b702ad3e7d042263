"""Optimizer-like objects (Note [Optimizer-like objects]): an object that is not a
torch.optim.Optimizer but holds parameter groups and steps them (fastai's Optimizer, an optimizer
written the same way), given the step hooks of a torch optimizer for as long as a sanitizer
watches it.

Note [Optimizer-like objects]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
TrainSan learns of a step through torch.optim.Optimizer's step hooks and of a clearing through
Optimizer.zero_grad (Note [Patches]). An optimizer that does not derive from it — fastai's
``Optimizer`` (a Learner's default), a hand-written one — has neither, so a sanitizer used to see
no optimizer at all: manual mode, every rule that needs an optimizer silently off. Such an object
is *optimizer-like* when its class defines a callable ``step`` and its ``param_groups`` is a list
of mappings each holding ``"params"`` (fastai builds it from its ``param_lists`` and ``hypers``:
the learning rate is each group's ``"lr"``) — what TrainSan reads of a torch optimizer, with
``state`` (a dict keyed by parameter) where it has one.

While a sanitizer watches one (attach(model, opt), or the launcher's pairing, which looks for
them where the script built no torch optimizer: Note [Launcher pairing]), ``adopt`` gives the
object — its instance, never its class — what a torch optimizer has: ``register_step_pre_hook``
and ``register_step_post_hook``, a ``step`` that calls those hooks around the class's own step
(the hooks of this object only: torch's process-wide optimizer hooks, which other libraries may
register expecting a torch Optimizer, are not called, except the load journal's, which is
TrainSan's), and a ``zero_grad`` that tells the sanitizers watching it before clearing. The last
``release`` deletes those instance attributes again (an attribute the object had of its own is
put back), so the object is as it was. A wrapper of an optimizer-like object (fastai's
OptimWrapper holds a torch optimizer in ``.opt``) is looked through where what it wraps is a
torch optimizer."""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import _journal, _patches

_ATTRS = ("step", "zero_grad", "register_step_pre_hook", "register_step_post_hook",
          "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
_MISSING = object()
_adopted: dict = {}  # id(obj) -> [obj, holds, {attribute: its own value before, or _MISSING}]


def optimizer_like(o: Any) -> bool:
    """Whether `o` is an optimizer-like object (Note [Optimizer-like objects])."""
    if isinstance(o, (torch.optim.Optimizer, torch.nn.Module)) or isinstance(o, type):
        return False
    if not callable(getattr(type(o), "step", None)) or not isinstance(
            getattr(o, "__dict__", None), dict):
        return False  # (its hooks live in the instance's __dict__)
    try:
        groups = o.param_groups
    except Exception:  # noqa: BLE001 - a property that fails: not one
        return False
    return isinstance(groups, (list, tuple)) and bool(groups) and all(
        isinstance(g, Mapping) and "params" in g for g in groups)


def inner_torch_optimizer(o: Any) -> Any:
    """The torch optimizer an optimizer-like wrapper holds in ``.opt`` (fastai's OptimWrapper),
    or None."""
    inner = o.__dict__.get("opt") if hasattr(o, "__dict__") else None
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def adopt(o: Any) -> None:
    """Give `o` a torch optimizer's step hooks and zero_grad report (once per holder)."""
    entry = _adopted.get(id(o))
    if entry is not None and entry[0] is o:
        entry[1] += 1
        return
    own = vars(o)
    saved = {a: own.get(a, _MISSING) for a in _ATTRS}
    cls_step, cls_zero = type(o).step, getattr(type(o), "zero_grad", None)
    pre: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
    post: "collections.OrderedDict[int, Any]" = collections.OrderedDict()

    @functools.wraps(cls_step)
    def step(*args, **kwargs):
        _journal._on_any_step(o, args, kwargs)  # a load this step judges stops waiting
        for hook in list(pre.values()):
            result = hook(o, args, kwargs)
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result
        out = cls_step(o, *args, **kwargs)
        for hook in list(post.values()):
            hook(o, args, kwargs)
        return out

    def register_step_pre_hook(hook) -> RemovableHandle:
        handle = RemovableHandle(pre)
        pre[handle.id] = hook
        return handle

    def register_step_post_hook(hook) -> RemovableHandle:
        handle = RemovableHandle(post)
        post[handle.id] = hook
        return handle

    own.update(step=step, register_step_pre_hook=register_step_pre_hook,
               register_step_post_hook=register_step_post_hook,
               _optimizer_step_pre_hooks=pre, _optimizer_step_post_hooks=post)
    if callable(cls_zero):
        @functools.wraps(cls_zero)
        def zero_grad(*args, **kwargs):
            _patches.clearing(o)
            return cls_zero(o, *args, **kwargs)

        own["zero_grad"] = zero_grad
    _adopted[id(o)] = [o, 1, saved]


def release(o: Any) -> None:
    """One holder fewer; the last puts the object back as it was."""
    entry = _adopted.get(id(o))
    if entry is None or entry[0] is not o:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _adopted[id(o)]
    own = vars(o)
    for a, v in entry[2].items():
        if v is _MISSING:
            own.pop(a, None)
        else:
            own[a] = v


def _candidate_type(t: type) -> bool:
    return callable(getattr(t, "step", None)) and not issubclass(
        t, (torch.optim.Optimizer, torch.nn.Module, type))


def holding(ids: set) -> list:
    """The optimizer-like objects alive that hold some of the parameters `ids` (found through the
    garbage collector: the launcher's pairing, where the script built no torch optimizer), fastai's
    OptimWrapper looked through to the torch optimizer it wraps (that one is found by its
    __init__ anyway)."""
    import gc

    kinds: dict = {}  # type -> whether its instances may be optimizer-like
    out = []
    for o in gc.get_objects():
        t = type(o)
        ok = kinds.get(t)
        if ok is None:
            ok = kinds[t] = _candidate_type(t)
        if not ok or inner_torch_optimizer(o) is not None or not optimizer_like(o):
            continue
        try:
            if any(id(p) in ids for g in o.param_groups for p in g["params"]):
                out.append(o)
        except Exception:  # noqa: BLE001 - a group that cannot be read: not one to pair
            continue
    return out
