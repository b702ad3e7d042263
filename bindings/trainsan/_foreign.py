"""Foreign backwards (Note [Foreign backwards], host/checks/gradient_flow.cpp), the Python side: a
backward whose root's graph, walked to its end by the walk of Note [Loss roots] (_patches.py),
reached none of an open sanitizer's parameters but other requires-grad leaves is reported to it
(Sanitizer::foreign_backward). Once a step of that sanitizer looked wrong (foreign_suspected),
what holds those leaves is named — the live nn.Module holding them (of the attached model's
class where one is: the model from before the resume or copy), found with gc, and the variable,
attribute or closure it is reachable under from the frames of the backward's caller — once per
set of leaves: the search costs, so it runs only where a finding is due."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any, Optional

import torch

from . import _native

# sanitizer -> (key of the leaves named, the holder fields)
_named: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# sanitizer -> (key of the leaves told, its optimizers' steps then, whether named)
_told: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_FRAMES = 30  # user frames searched for a name


def report(sanitizers: list, leaves: list, step_counts: Any) -> None:
    """The backward whose graph reached `leaves` (requires-grad tensors) and none of the
    parameters of `sanitizers`: told to each of them — once per set of leaves between two steps
    of its optimizers (`step_counts`: optimizer -> steps so far), as the rule needs one such
    backward since the step and the latest one's facts. Never raises."""
    try:
        key = (len(leaves), id(leaves[0]), id(leaves[-1]))
        for san in sanitizers:
            if san.closed:
                continue
            handle = san.handle
            steps = sum(step_counts.get(o, 0) for o in san.optimizers)
            suspected = handle.foreign_suspected()
            told = _told.get(san)
            if told is not None and told[:2] == (key, steps) and told[2] >= suspected:
                continue
            named = {}
            if suspected:
                done = _named.get(san)
                if done is None or done[0] != key:
                    try:
                        done = (key, holder(leaves, type(san.model)))
                    except Exception:  # noqa: BLE001 - the facts without a name
                        done = (key, {})
                    _named[san] = done
                named = done[1]
            handle.foreign_backward(_native.facts(
                "ForeignBackward", leaves=len(leaves),
                elements=sum(int(t.numel()) for t in leaves), **named))
            _told[san] = (key, steps, suspected)
    except Exception:  # noqa: BLE001 - never break the user's backward
        pass


def holder(leaves: list, model_type: type = type(None)) -> dict:
    """ForeignBackward's holder, holder_type and holder_params for the parameters among `leaves`:
    the live module holding most of them (all, usually), and of those the one of the attached
    model's class (the model from before the resume or copy), else the smallest, else the
    outermost (a wrapper, a Net and its Sequential may hold the same parameters), named by _name;
    {} when no module holds any."""
    ids = {id(t) for t in leaves if isinstance(t, torch.nn.Parameter)}
    if not ids:
        return {}
    best: Optional[torch.nn.Module] = None
    best_key: tuple = ()
    module = torch.nn.Module
    for obj in gc.get_objects():
        if not issubclass(type(obj), module):  # not isinstance: no object's __class__ is asked
            continue
        try:
            own = {id(p) for p in obj.parameters()}
        except Exception:  # noqa: BLE001 - a half-built module
            continue
        cover = len(ids & own)
        if not cover:
            continue
        key = (cover, type(obj) is model_type, -len(own))
        if best is None or key > best_key or (key == best_key and _inside(best, obj)):
            best, best_key = obj, key
    if best is None:
        return {}
    best_size = -best_key[2]
    return {"holder": _name(best) or "a live module",
            "holder_type": type(best).__name__, "holder_params": best_size}


def _inside(inner: torch.nn.Module, outer: torch.nn.Module) -> bool:
    return inner is not outer and any(m is inner for m in outer.modules())


def _user_frames():
    f = sys._getframe(1)
    n = 0
    while f is not None and n < _FRAMES:
        path = os.path.abspath(f.f_code.co_filename)
        if not (path.startswith(_PACKAGE) or path.startswith(_TORCH)):
            n += 1
            yield f
        f = f.f_back


def _within(value: Any, target: torch.nn.Module) -> Optional[str]:
    """The path of `target` inside `value` ("" for itself): a module, an object's attribute (one
    level), or a function's closure variable."""
    if value is target:
        return ""
    if isinstance(value, torch.nn.Module):
        for path, sub in value.named_modules():
            if sub is target:
                return path
        return None
    code, closure = getattr(value, "__code__", None), getattr(value, "__closure__", None)
    if code is not None and closure:
        for name, cell in zip(code.co_freevars, closure):
            try:
                inner = cell.cell_contents
            except ValueError:
                continue
            found = _within(inner, target) if isinstance(inner, torch.nn.Module) else None
            if found is not None:
                return f"<closure {name}>" + (f".{found}" if found else "")
        return None
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(value, type):
        for attr, inner in list(attrs.items())[:200]:
            if isinstance(inner, torch.nn.Module):
                found = _within(inner, target)
                if found is not None:
                    return attr + (f".{found}" if found else "")
    return None


def _name(target: torch.nn.Module) -> str:
    """The shortest name `target` is reachable under from the user's frames ("criterion.model",
    "self.loss_fn.model", "loss_fn (its closure's model)"), else its parent module's class and
    attribute ("LossWrapper.model"); "" when neither is found."""
    names = []
    for f in _user_frames():
        for scope in (f.f_locals, f.f_globals):
            for var, value in list(scope.items()):
                if var.startswith("__") or isinstance(value, (int, float, str, bytes)):
                    continue
                try:
                    path = _within(value, target)
                except Exception:  # noqa: BLE001 - an object that does not like being looked at
                    continue
                if path is None:
                    continue
                if path.startswith("<closure "):
                    inner = path[len("<closure "):]
                    free, _, rest = inner.partition(">")
                    names.append(f"{var} (its closure's {free}{rest})")
                else:
                    names.append(f"{var}.{path}" if path else var)
    if names:
        return min(names, key=len)
    for obj in gc.get_referrers(target):
        if not isinstance(obj, dict):
            continue
        for parent in gc.get_referrers(obj):
            if isinstance(parent, torch.nn.Module) and getattr(parent, "_modules", None) is obj:
                for attr, sub in obj.items():
                    if sub is target:
                        return f"{type(parent).__name__}.{attr}"
    return ""
