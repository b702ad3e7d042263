"""bad_checkpoint: checkpoints checked where they are made (torch.save while a sanitizer is
attached: before the file is written) and where they are found (``python -m trainsan check``,
:func:`check_checkpoint`). Here the saved object is walked into (key, tensor) lists and optimizer
states; the facts (NaN/Inf, keys, shapes and dtypes against the model, the optimizer state against
its parameters) are built in C++ (trainsan::checkpoint_facts, host/checks/checkpoint_facts.cpp)
and judged and worded by host/checks/checkpoint.cpp (Note [Checkpoint checks]).

Reading a file never runs its code: ``torch.load(weights_only=True)``; a checkpoint that needs
arbitrary code to load is reported as such, not loaded.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pickle
import sys
from collections.abc import Mapping
from typing import Any, Optional

import torch

from . import _native
from ._findings import Finding

_MAX_DEPTH = 5
_SHOWN = 40  # tensors listed by the report's table


class CheckpointError(ValueError):
    """A checkpoint that cannot be read at all (missing, truncated, not a torch file)."""


def _unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _walk(obj: Any, prefix: str, depth: int, tensors: list, dicts: list, optims: list,
          scalars: list, modules: list) -> None:
    """Every tensor (path, tensor), tensor dict (path, dict), optimizer state dict (path, dict),
    top-level scalar (path, value) and module in `obj`."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, torch.Tensor):
        tensors.append((prefix, obj))
        return
    if isinstance(obj, torch.nn.Module):
        modules.append((prefix, obj))
        sd = obj.state_dict()
        dicts.append((prefix, sd))
        for k, v in sd.items():
            tensors.append((f"{prefix}.{k}" if prefix else k, v))
        return
    if isinstance(obj, torch.optim.Optimizer):
        obj = obj.state_dict()
    if isinstance(obj, Mapping):
        if "state" in obj and "param_groups" in obj:
            optims.append((prefix, obj))
        vals = list(obj.values())
        if vals and all(isinstance(k, str) for k in obj) and all(
                isinstance(v, torch.Tensor) for v in vals):
            dicts.append((prefix, obj))
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if depth == 0 and isinstance(v, (int, float)) and not isinstance(v, bool):
                scalars.append((path, v))
            _walk(v, path, depth + 1, tensors, dicts, optims, scalars, modules)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, f"{prefix}.{i}" if prefix else str(i), depth + 1, tensors, dicts, optims,
                  scalars, modules)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _named(d: Mapping) -> list:
    """A state dict's (key, tensor) pairs; None for a value that is no tensor."""
    return [(str(k), v if isinstance(v, torch.Tensor) else None) for k, v in d.items()]


def _state(st: Any) -> list:
    """A parameter's optimizer state as (key, tensor) pairs: a number (the "step" counter) as a
    0-dim tensor, any other value as None."""
    out = []
    for k, v in (st or {}).items():
        if isinstance(v, (int, float)) and abs(v) < 2**63:
            v = torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
        out.append((str(k), v if isinstance(v, torch.Tensor) else None))
    return out


def _model(m: torch.nn.Module) -> dict:
    return {"state": _named(m.state_dict()),
            "trainable": [(n, p) for n, p in m.named_parameters() if p.requires_grad]}


def _optimizer(opt: torch.optim.Optimizer, names: dict) -> dict:
    """A live optimizer's parameters (named as in the model) and state, by position."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"path": "", "params": [(names.get(id(p), "?"), p) for p in params],
            "state": [_state(opt.state.get(p)) for p in params]}


def _names(model: Optional[torch.nn.Module]) -> dict:
    return {} if model is None else {
        id(p): n for n, p in _unwrap_model(model).named_parameters()}


@dataclasses.dataclass
class Gathered:
    """A checkpoint object as the C++ check takes it (``contents``: trainsan::CheckpointContents
    by field name, host/include/trainsan/checkpoint_contents.def), and what only the report
    shows of it."""

    contents: dict
    tensors: list = dataclasses.field(default_factory=list)  # (path, tensor)
    scalars: list = dataclasses.field(default_factory=list)  # top-level numbers (epoch=3)
    optimizer_keys: list = dataclasses.field(default_factory=list)

    def fields(self) -> dict:
        return _native.fields(self.contents)


def gather(obj: Any, source: str, model: Optional[torch.nn.Module] = None,
           optimizers: Optional[list] = None, part_ok: bool = False) -> Gathered:
    """The tensors of a checkpoint object and what it is checked against (Note [Checkpoint
    checks]); `part_ok`: a state dict covering less than half of the model is a part of it (a
    save while attached), not judged."""
    tensors, dicts, optims, scalars, modules = [], [], [], [], []
    _walk(obj, "", 0, tensors, dicts, optims, scalars, modules)
    saved = []
    for _, od in optims:
        state = od.get("state") or {}
        ids = [pid for g in od.get("param_groups", []) for pid in g.get("params", [])]
        saved.append([_state(state.get(pid)) for pid in ids])
    variants = []
    if model is not None:
        variants.append(_model(model))
        if _unwrap_model(model) is not model:
            variants.append(_model(_unwrap_model(model)))
    names = _names(model)
    contents = _native.record(
        "CheckpointContents", source=source, tensors=tensors,
        state_dicts=[(path, _named(sd)) for path, sd in dicts],
        saved_optimizers=[{"path": path, "params": [], "state": st}
                          for (path, _), st in zip(optims, saved)],
        model=variants, optimizers=[_optimizer(o, names) for o in optimizers or []],
        part_ok=part_ok)
    return Gathered(contents, tensors, scalars, [path for path, _ in optims])


def state_mismatches(opt: torch.optim.Optimizer, names: dict) -> list:
    """Per parameter of `opt` whose per-element state (exp_avg, momentum_buffer, ...) has another
    shape than the parameter (trainsan::state_mismatches): "exp_avg of parameter 3 (fc.weight):
    [4, 8], the parameter [8, 4]". `names`: id(parameter) -> its name."""
    return list(torch.ops.trainsan.state_mismatches(_native.fields(_optimizer(opt, names))))


def holds_model(obj, model: torch.nn.Module) -> bool:
    """Whether a saved object holds the model, or tensors sharing its parameters' storage (its
    state_dict(), or one of its wrapper's)."""
    ptrs = set()
    for p in model.parameters():
        try:
            ptrs.add(p.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001 - a parameter without storage (meta, some subclasses)
            pass
    ptrs.discard(0)
    mods = {id(m) for m in model.modules()}

    def walk(o, depth: int) -> bool:
        if depth > 4:
            return False
        if isinstance(o, torch.nn.Module):
            return id(o) in mods or any(id(m) in mods for m in o.modules())
        if isinstance(o, torch.Tensor):
            try:
                return o.untyped_storage().data_ptr() in ptrs
            except Exception:  # noqa: BLE001
                return False
        if isinstance(o, dict):
            return any(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return any(walk(v, depth + 1) for v in o)
        return False

    return walk(obj, 0)


# -- the standalone check ---------------------------------------------------------------------


@dataclasses.dataclass
class CheckpointReport:
    """What :func:`check_checkpoint` found: ``findings`` (``bad_checkpoint``), and what the
    checkpoint holds (``facts``: trainsan::CheckpointFacts by field name). ``ok`` is True when no
    finding is an error; ``str(report)`` prints both."""

    source: str
    findings: list
    facts: dict
    gathered: Optional[Gathered] = None

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def __str__(self) -> str:
        f, g = self.facts, self.gathered or Gathered({})
        lines = [f"checkpoint {self.source}"]
        if f["load_error"]:
            lines.append("  not loaded (weights_only=True refused it)")
        else:
            bad = {x["key"]: x["count"] for x in f["nonfinite"]}
            rows = [(k, _shape(t), _dtype(t), bad.get(k, 0)) for k, t in g.tensors]
            lines.append(f"  {len(rows)} tensors, {sum(t.numel() for _, t in g.tensors):,} values")
            if f["have_model"]:
                where = f"under '{f['model_key']}'" if f["model_key"] else "at the top level"
                lines.append(f"  model state: {where}" if f["model_found"]
                             else "  model state: not found")
            if f["have_optimizer_state"]:
                lines.append(f"  optimizer state ({', '.join(repr(k) for k in g.optimizer_keys)}"
                             f"): {f['optimizer_with_state']} of {f['optimizer_params']} "
                             "parameters with state")
            else:
                lines.append("  optimizer state: none (weights only)")
            if g.scalars:
                lines.append("  values: " + ", ".join(f"{k}={v}" for k, v in g.scalars[:12]))
            width = min(60, max((len(k) for k, _, _, _ in rows), default=3))
            for key, shape, dtype, n in rows[:_SHOWN]:
                lines.append(f"    {key:<{width}} {shape:<16} {dtype:<9}"
                             + (f" {n} NaN/Inf" if n else ""))
            if len(rows) > _SHOWN:
                lines.append(f"    ... and {len(rows) - _SHOWN} more tensors")
        if self.findings:
            lines += [f"  [{x.severity}] {x.message}" for x in self.findings]
        else:
            lines.append("  no findings")
        return "\n".join(lines)


def _load(path: str) -> tuple:
    """(object or None, load error): weights_only, on the CPU."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True), ""
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        why = next((ln.strip() for ln in first if "Unsupported global" in ln
                    or "unsupported" in ln.lower()), first[0] if first else "")
        return None, why[:300]
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise CheckpointError(
            f"{path} cannot be read as a torch checkpoint ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): truncated (a save that did not "
            "finish), or not written by torch.save") from None


def check_checkpoint(obj_or_path: Any, model: Optional[torch.nn.Module] = None,
                     optimizer: Optional[torch.optim.Optimizer] = None) -> CheckpointReport:
    """Check a checkpoint — a path (read with ``weights_only=True``, never running its code) or
    an object about to be saved — for NaN/Inf, for whether it matches ``model`` (names, shapes,
    dtypes; DDP's ``module.`` prefix) and for optimizer state that would not resume the run
    (empty or partial against ``optimizer``, bound to parameters of other shapes)."""
    if isinstance(obj_or_path, (str, os.PathLike)):
        source = os.fspath(obj_or_path)
        obj, err = _load(source)
    else:
        source, obj, err = "the object", obj_or_path, ""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_checkpoint: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"check_checkpoint: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    g = Gathered(_native.record("CheckpointContents", source=source, load_error=err)) if err \
        else gather(obj, source, model, [optimizer] if optimizer is not None else [])
    found, facts = torch.ops.trainsan.check_checkpoint(g.fields())
    findings = [Finding._from_dict(d) for d in found]
    return CheckpointReport(source=source, findings=findings, facts=dict(facts), gathered=g)


def load_factory(spec: str) -> torch.nn.Module:
    """`module:factory` or `path/to/file.py:factory` -> factory()."""
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: expected module:factory or file.py:factory")
    mod_name, fn = spec.rsplit(":", 1)
    if mod_name.endswith(".py"):
        loader = importlib.util.spec_from_file_location("_trainsan_model", mod_name)
        if loader is None or loader.loader is None:
            raise ValueError(f"--model: cannot load {mod_name}")
        mod = importlib.util.module_from_spec(loader)
        sys.modules["_trainsan_model"] = mod
        loader.loader.exec_module(mod)
    else:
        mod = importlib.import_module(mod_name)
    model = getattr(mod, fn)()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec}: {fn}() returned {type(model).__name__}, not a module")
    return model


def main(argv: list) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m trainsan check",
        description="Check a checkpoint: NaN/Inf, structure against a model, optimizer state. "
        "Exit status 0 when clean, 1 on an error finding, 2 when the file cannot be read.")
    ap.add_argument("checkpoint")
    ap.add_argument("--model", help="module:factory (or file.py:factory) building the model to "
                    "check it against")
    args = ap.parse_args(argv)
    try:
        model = load_factory(args.model) if args.model else None
        rep = check_checkpoint(args.checkpoint, model=model)
    except (CheckpointError, ValueError, ImportError, AttributeError) as exc:
        print(f"trainsan check: {exc}", file=sys.stderr)
        return 2
    print(rep)
    return 0 if rep.ok else 1
