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
