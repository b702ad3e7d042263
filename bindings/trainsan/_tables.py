"""The finding kinds and the options, as the native op library's tables give them
(host/include/trainsan/kinds.def and options.def): read once, at import."""

from __future__ import annotations

import dataclasses
import numbers
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


_TYPE_TEXT = {str: "a str (or a path)", int: "an int", float: "a number (or None, read as 0)",
              bool: "a bool"}


def _has_type(v: Any, want: type) -> bool:
    if want is bool:
        return isinstance(v, bool)
    if want is int:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if want is float:
        return v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool))
    return isinstance(v, (str, os.PathLike))


def option_str(name: str, v: Any) -> str:
    """Option `name`'s value as the C++ option table parses it (its range is checked there); a
    value of another type than the option's is a TypeError naming it."""
    want = type(OPTIONS[name])
    if not _has_type(v, want):
        raise TypeError(f"trainsan: option {name} takes {_TYPE_TEXT[want]}, got {v!r} "
                        f"({type(v).__name__})")
    if v is None:
        return "0"  # overhead_budget=None, grad_explosion_limit=None: none
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(float(v)) if want is float else str(int(v)) if want is int else os.fspath(v)


def option_strings(options: dict, policy: str, trace: Any, checks: dict) -> dict:
    """attach()'s options, policy, trace and checks as the C++ sanitizer takes them; a value of
    the wrong type (an option's, or a check's that is not a bool) is a TypeError naming it."""
    opts = {k: option_str(k, v) for k, v in options.items()}
    opts["policy"] = policy
    if trace:
        opts["trace"] = os.fspath(trace)
    for kind, on in checks.items():
        if not isinstance(on, bool):
            raise TypeError(f"trainsan: checks[{kind!r}] must be True or False, got {on!r} "
                            f"({type(on).__name__})")
        opts["check." + kind] = "true" if on else "false"
    return opts


def check_options(options: dict, policy: str, trace: Any, checks: dict) -> None:
    """What attach() would refuse of these options (a TypeError or ValueError naming the option),
    without attaching: the launcher checks its flags before the script runs."""
    torch.ops.trainsan.check_options(option_strings(options, policy, trace, checks))
