"""Loads the native op library (``libtrainsan_ops.so``) into ``torch.ops.trainsan``, and turns
facts into the dicts its bindings take by field name.

The library is looked up, in order, at ``$TRAINSAN_LIBRARY`` and next to this file. It links
torch's own libraries, so ``import torch`` must come first (it does, below).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

_LIB_NAME = "libtrainsan_ops.so"
_loaded_from: str | None = None


def _candidates() -> list[Path]:
    env = os.environ.get("TRAINSAN_LIBRARY")
    paths = [Path(env)] if env else []
    paths.append(Path(__file__).resolve().parent / _LIB_NAME)
    return paths


def load() -> str:
    """Load the op library once and return the path it was loaded from."""
    global _loaded_from
    if _loaded_from is not None:
        return _loaded_from
    tried = []
    for path in _candidates():
        if not path.is_file():
            tried.append(f"{path} (missing)")
            continue
        try:
            torch.ops.load_library(str(path))
        except OSError as exc:  # ABI or torch-version mismatch, missing CUDA runtime, ...
            raise ImportError(
                f"trainsan: could not load its native library {path}: {exc}\n"
                f"It was built against another torch than the one imported "
                f"({torch.__version__}, {torch.__file__})? Rebuild it with "
                f"`pip install --no-build-isolation .` in this environment."
            ) from exc
        _loaded_from = str(path)
        return _loaded_from
    raise ImportError(
        "trainsan: its native library was not found; tried: "
        + "; ".join(tried)
        + ". Install the package with `pip install --no-build-isolation .` from the TrainSan "
        "checkout, or point $TRAINSAN_LIBRARY at a built libtrainsan_ops.so."
    )


# -- the hot path (Note [Hot path], bindings/csrc/handle.h) -------------------------------------

_HOT_EVENTS = ("forward", "loss", "loss_reaches", "step_begin", "step_end", "gradients_cleared")
_hot: list = []  # [module or None], once looked up
hot_problem: Optional[str] = None  # why the module is not used (None: it is, or not looked up)


_DRIVERS = ("measure_custom_grad", "ReplicaEngine", "rerun", "RerunRecord")
_ext: list = []  # [(module or None, why not)], once looked up


def _extension() -> tuple:
    """(the _trainsan_hot module next to the loaded op library or None, why it is None)."""
    if _ext:
        return _ext[0]
    import importlib.machinery
    import importlib.util

    mod, problem = None, None
    where = Path(load()).resolve().parent
    found = [where / f"_trainsan_hot{sfx}" for sfx in importlib.machinery.EXTENSION_SUFFIXES]
    found = [f for f in found if f.is_file()]
    if not found:
        problem = f"no _trainsan_hot module for this Python next to {where}"
    else:
        try:
            spec = importlib.util.spec_from_file_location("_trainsan_hot", found[0])
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            missing = [n for n in _HOT_EVENTS + _DRIVERS if not hasattr(mod, n)]
            if missing:
                raise ImportError(f"it lacks {', '.join(missing)} (built from another "
                                  f"TrainSan?)")
        except Exception as exc:  # noqa: BLE001 - said by hot_problem / drivers_problem()
            problem = f"{found[0]} did not load ({type(exc).__name__}: {exc})"
            mod = None
    _ext.append((mod, problem))
    return _ext[0]


def hot_module() -> Any:
    """The _trainsan_hot extension module next to the loaded op library, or None: not built for
    this Python, failed to load, or $TRAINSAN_HOT=0 (hot_problem says which)."""
    global hot_problem
    if _hot:
        return _hot[0]
    mod = None
    if os.environ.get("TRAINSAN_HOT", "1") == "0":
        hot_problem = "TRAINSAN_HOT=0"
    else:
        mod, hot_problem = _extension()
    _hot.append(mod)
    return mod


def drivers() -> Any:
    """The C++ drivers that run Python callables (Note [One orchestration], bindings/csrc/hot.cpp):
    the _trainsan_hot module whatever $TRAINSAN_HOT says, or None (drivers_problem() says why);
    the checks built on them are then off, with a note."""
    return _extension()[0]


def drivers_problem() -> Optional[str]:
    return _extension()[1]


class HotEvents:
    """The per-step events of a sanitizer handle (Note [Hot path]): the _trainsan_hot module's
    functions bound to the handle's id, with the signatures of the handle's methods of the same
    names; the handle's own methods where the module is not there."""

    __slots__ = _HOT_EVENTS

    def __init__(self, handle: Any) -> None:
        mod = hot_module()
        hid = 0
        if mod is not None:
            try:
                hid = int(handle.hot_id())
            except Exception:  # noqa: BLE001 - a handle without an id: its own methods serve
                mod = None
        for name in _HOT_EVENTS:
            fn = (functools.partial(getattr(mod, name), hid) if mod is not None
                  else getattr(handle, name))
            setattr(self, name, fn)


# -- facts by name (Note [Facts by name], host/include/trainsan/facts_dict.h) -------------------


def _is_record(v: Any) -> bool:
    return isinstance(v, Mapping) or (dataclasses.is_dataclass(v) and not isinstance(v, type))


def _items(obj: Any):
    if isinstance(obj, Mapping):
        return obj.items()
    return ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))


def _value(v: Any) -> Any:
    """A list for Dict(str, Any): None when empty (TorchScript cannot type an empty list), its
    elements likewise."""
    if isinstance(v, (list, tuple)):
        if not v:
            return None
        out = [_value(x) for x in v]
        return tuple(out) if isinstance(v, tuple) else out
    return v


def fields(obj: Any, prefix: str = "", out: Optional[dict] = None) -> dict:
    """A facts struct (a dict or dataclass, records nested in it) as the op library takes it: one
    flat dict by field name; a record or list of records as its count under its name and record
    k's fields under "<name>.<k>.<field>"; an empty list as None."""
    out = {} if out is None else out
    for name, v in _items(obj):
        key = prefix + str(name)
        if _is_record(v):
            v = [v]
        if isinstance(v, (list, tuple)) and v and all(_is_record(x) for x in v):
            out[key] = len(v)
            for k, x in enumerate(v):
                fields(x, f"{key}.{k}.", out)
        else:
            out[key] = _value(v)
    return out


@functools.lru_cache(maxsize=None)
def _defaults(struct: str) -> dict:
    load()
    return dict(torch.ops.trainsan.facts_defaults(struct))


def record(struct: str, **values: Any) -> dict:
    """The C++ facts struct `struct` ("ResumeFacts") as a dict: its defaults, with `values`."""
    out = dict(_defaults(struct))
    unknown = sorted(set(values) - set(out))
    if unknown:
        raise TypeError(f"{struct} has no field {', '.join(map(repr, unknown))} (its fields: "
                        f"{', '.join(out)})")
    out.update(values)
    return out


def facts(struct: str, **values: Any) -> dict:
    """fields(record(struct, **values)): what a binding taking facts by name is given."""
    return fields(record(struct, **values))
