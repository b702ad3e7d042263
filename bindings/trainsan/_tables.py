"""The finding kinds and the options, as the native op library's tables give them
(host/include/trainsan/kinds.def and options.def): read once, at import."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from . import _native

_native.load()


def _kind_table() -> dict:
    names, severities, _on, _families, _rules = torch.ops.trainsan.kinds()
    return dict(zip(names, severities))


def _option_table() -> dict:
    names, types, defaults, _choices, _docs = torch.ops.trainsan.options()
    parse = {
        "str": str,
        "int": int,
        "float": float,
        "bool": lambda v: v == "true",
    }
    return {n: parse[t](d) for n, t, d in zip(names, types, defaults)}


#: The finding kinds TrainSan implements and their severities, from the C++ table
#: (host/include/trainsan/kinds.def).
KINDS: dict = _kind_table()

#: Every option with its default, from the C++ table (host/include/trainsan/options.def);
#: ``policy`` and ``trace`` are :func:`attach`'s own arguments, the rest its keyword options.
OPTIONS: dict = _option_table()

#: The options as a dataclass (``trainsan.Options()`` holds the defaults), generated from the
#: same table.
Options = dataclasses.make_dataclass(
    "Options", [(n, type(v), dataclasses.field(default=v)) for n, v in OPTIONS.items()]
)
Options.__doc__ = "TrainSan's options and their defaults (the README documents each rule)."

KIND_ON = dict(zip(*(torch.ops.trainsan.kinds()[k] for k in (0, 2))))  # kind -> on by default
ACTIONS = ("none", "warn", "raise")  # trainsan::Action, as the op library returns it


def enabled(kind: str, checks: dict) -> bool:
    """Whether `kind` is checked, given attach()'s ``checks`` (else its default)."""
    return bool(checks.get(kind, KIND_ON[kind]))


def option_str(v: Any) -> str:
    """An option's value as the C++ option table parses it."""
    if v is None:
        return "0"  # overhead_budget=None, grad_explosion_limit=None: none
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def option_strings(options: dict, policy: str, trace: Any, checks: dict) -> dict:
    """attach()'s options, policy, trace and checks as the C++ sanitizer takes them."""
    opts = {k: option_str(v) for k, v in options.items()}
    opts["policy"] = policy
    if trace:
        opts["trace"] = os.fspath(trace)
    for kind, on in checks.items():
        opts["check." + kind] = option_str(bool(on))
    return opts
