"""bad_checkpoint: checkpoints checked where they are made (torch.save while a sanitizer is
attached: before the file is written) and where they are found (``python -m trainsan check``,
:func:`check_checkpoint`). The facts are gathered here, the rules and their wording are
host/checks/checkpoint.cpp (Note [Checkpoint checks]).

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

from ._findings import Finding
from .stats import tensor_stats

_MAX_DEPTH = 5
# Optimizer state entries shaped like their parameter (torch.optim's Adam/AdamW/NAdam/RAdam/Adamax,
# SGD, RMSprop, Adagrad, Adadelta, ASGD, Rprop; Lion-style ones): only these are compared with
# their parameter's shape — other state (Adafactor's factored row/column variances, 8-bit
# optimizers' quantisation blocks) legitimately has other shapes.
_PER_ELEMENT = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                "grad_avg", "sum", "acc_delta", "ax", "prev", "step_size", "exp_inf", "mu_product"}
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


def _nonfinite(tensors: list) -> dict:
    """path -> non-finite count of the floating tensors (one fused statistics pass)."""
    floats = [(p, t) for p, t in tensors
              if t.is_floating_point() and t.layout == torch.strided and not t.is_meta]
    out = {}
    if floats:
        for (p, t), s in zip(floats, tensor_stats([t.detach() for _, t in floats])):
            out[p] = s.nan + s.posinf + s.neginf
    return out


@dataclasses.dataclass
class _Facts:
    source: str
    load_error: str = ""
    nonfinite: list = dataclasses.field(default_factory=list)  # (key, count, numel)
    have_model: bool = False
    model_found: bool = False
    model_key: str = ""
    model_keys: int = 0
    missing_trainable: list = dataclasses.field(default_factory=list)
    missing_other: list = dataclasses.field(default_factory=list)
    unexpected: list = dataclasses.field(default_factory=list)
    mismatched: list = dataclasses.field(default_factory=list)
    ddp_prefix: bool = False
    have_optimizer_state: bool = False
    optimizer_params: int = 0
    optimizer_with_state: int = 0
    live_with_state: int = -1
    state_mismatched: list = dataclasses.field(default_factory=list)
    step_saved: int = -1
    step_live: int = -1
    # For the report only:
    tensors: list = dataclasses.field(default_factory=list)  # (key, shape, dtype, nonfinite)
    values: int = 0  # elements of all its tensors
    scalars: list = dataclasses.field(default_factory=list)
    optimizer_keys: list = dataclasses.field(default_factory=list)

    def args(self) -> tuple:
        keys = [k for k, _, _ in self.nonfinite]
        counts = [v for _, c, n in self.nonfinite for v in (c, n)]
        return (self.source, self.load_error, keys, counts, self.have_model, self.model_found,
                self.model_key, self.model_keys, self.missing_trainable, self.missing_other,
                self.unexpected, self.mismatched, self.ddp_prefix, self.have_optimizer_state,
                self.optimizer_params, self.optimizer_with_state, self.live_with_state,
                self.state_mismatched, self.step_saved, self.step_live)


def _compare_model(f: _Facts, dicts: list, model: torch.nn.Module, part_ok: bool) -> None:
    variants = [model.state_dict()]
    if _unwrap_model(model) is not model:
        variants.append(_unwrap_model(model).state_dict())
    best = None  # (overlap, path, sd, expected, names)
    for expected in variants:
        for path, sd in dicts:
            overlap = len(set(sd) & set(expected))
            if best is None or overlap > best[0]:
                best = (overlap, path, sd, expected)
    f.have_model = True
    f.model_keys = len(variants[-1])
    if best is None or best[0] == 0:
        if part_ok:
            f.have_model = False
            return
        for path, sd in dicts:
            stripped = {k[len("module."):] for k in sd if k.startswith("module.")}
            if stripped and len(stripped) == len(sd) and stripped & set(variants[-1]):
                f.model_found, f.model_key, f.ddp_prefix = True, path, True
                return
        return
    overlap, path, sd, expected = best
    if part_ok and overlap < len(expected) / 2:
        f.have_model = False  # a part of the model (a submodule's state): not judged as the model
        return
    f.model_found, f.model_key = True, path
    root = model if expected is variants[0] else _unwrap_model(model)
    trainable = {n for n, p in root.named_parameters() if p.requires_grad}
    for k, v in expected.items():
        if k not in sd:
            (f.missing_trainable if k in trainable else f.missing_other).append(k)
        elif isinstance(sd[k], torch.Tensor) and (
                tuple(sd[k].shape) != tuple(v.shape) or sd[k].dtype != v.dtype):
            f.mismatched.append(f"{k}: {_shape(sd[k])} {_dtype(sd[k])} in the checkpoint, "
                                f"{_shape(v)} {_dtype(v)} in the model")
    f.unexpected = [k for k in sd if k not in expected]


def state_mismatches(params: list, states: list, names: dict) -> list:
    """Per parameter (by position) whose per-element optimizer state (_PER_ELEMENT) has another
    shape than the parameter: "exp_avg of parameter 3 (fc.weight): [4, 8], the parameter [8, 4]"
    (the first such entry of each). `states[i]` is the state of `params[i]` (None: none)."""
    out = []
    for pos, (p, st) in enumerate(zip(params, states)):
        for key, v in (st or {}).items():
            if key in _PER_ELEMENT and isinstance(v, torch.Tensor) and v.shape != p.shape:
                out.append(f"{key} of parameter {pos} ({names.get(id(p), '?')}): {_shape(v)}, "
                           f"the parameter {_shape(p)}")
                break
    return out


def _step_of(state: Any) -> int:
    """A parameter's optimizer "step" counter (tensor or number); -1 where it has none."""
    s = state.get("step") if isinstance(state, Mapping) else None
    try:
        return int(s.item()) if isinstance(s, torch.Tensor) and s.numel() == 1 else (
            int(s) if isinstance(s, (int, float)) else -1)
    except (ValueError, OverflowError):  # a NaN or Inf counter: the non-finite scan reports it
        return -1


def _compare_optimizers(f: _Facts, optims: list, live: list, model) -> None:
    f.have_optimizer_state = True
    if live:
        f.live_with_state = sum(
            sum(1 for g in o.param_groups for p in g["params"] if o.state.get(p)) for o in live)
        f.step_live = max((_step_of(st) for o in live for st in o.state.values()), default=-1)
        f.step_saved = max((_step_of(st) for _, od in optims
                            for st in (od.get("state") or {}).values()), default=-1)
    names = {}
    if model is not None:
        names = {id(p): n for n, p in _unwrap_model(model).named_parameters()}
    for i, (path, od) in enumerate(optims):
        f.optimizer_keys.append(path)
        ids = [pid for g in od.get("param_groups", []) for pid in g.get("params", [])]
        state = od.get("state", {})
        f.optimizer_params += len(ids)
        f.optimizer_with_state += sum(1 for pid in ids if state.get(pid))
        # The parameters these positions bind to: the live optimizer's, or the model's in order.
        if i < len(live):
            params = [p for g in live[i].param_groups for p in g["params"]]
        elif model is not None and len(optims) == 1:
            params = [p for p in _unwrap_model(model).parameters() if p.requires_grad]
        else:
            continue
        if len(params) != len(ids):
            f.state_mismatched.append(
                f"{path or 'the optimizer'} holds {len(ids)} parameters, the optimizer it "
                f"belongs to {len(params)}")
            continue
        f.state_mismatched += state_mismatches(params, [state.get(pid) for pid in ids], names)


def gather(obj: Any, source: str, model: Optional[torch.nn.Module] = None,
           optimizers: Optional[list] = None, part_ok: bool = False) -> _Facts:
    """The facts of a checkpoint object (Note [Checkpoint checks]); `part_ok`: a state dict
    covering less than half of the model is a part of it (a save while attached), not judged."""
    tensors, dicts, optims, scalars, modules = [], [], [], [], []
    _walk(obj, "", 0, tensors, dicts, optims, scalars, modules)
    f = _Facts(source=source, scalars=scalars)
    bad = _nonfinite(tensors)
    for path, t in tensors:
        n = bad.get(path, 0)
        f.tensors.append((path, _shape(t), _dtype(t), n))
        f.values += t.numel()
        if n:
            f.nonfinite.append((path, n, t.numel()))
    if model is not None:
        _compare_model(f, dicts, model, part_ok)
    if optims:
        _compare_optimizers(f, optims, list(optimizers or []), model)
    return f


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
    checkpoint holds. ``ok`` is True when no finding is an error; ``str(report)`` prints both."""

    source: str
    findings: list
    facts: Any

    @property
    def ok(self) -> bool:
        return not any(f.severity == "error" for f in self.findings)

    def __str__(self) -> str:
        f = self.facts
        lines = [f"checkpoint {self.source}"]
        if f.load_error:
            lines.append("  not loaded (weights_only=True refused it)")
        else:
            lines.append(f"  {len(f.tensors)} tensors, {f.values:,} values")
            if f.have_model:
                where = f"under '{f.model_key}'" if f.model_key else "at the top level"
                lines.append(f"  model state: {where}" if f.model_found
                             else "  model state: not found")
            if f.have_optimizer_state:
                lines.append(f"  optimizer state ({', '.join(repr(k) for k in f.optimizer_keys)}"
                             f"): {f.optimizer_with_state} of {f.optimizer_params} parameters "
                             "with state")
            else:
                lines.append("  optimizer state: none (weights only)")
            if f.scalars:
                lines.append("  values: " + ", ".join(f"{k}={v}" for k, v in f.scalars[:12]))
            width = min(60, max((len(k) for k, _, _, _ in f.tensors), default=3))
            for key, shape, dtype, n in f.tensors[:_SHOWN]:
                lines.append(f"    {key:<{width}} {shape:<16} {dtype:<9}"
                             + (f" {n} NaN/Inf" if n else ""))
            if len(f.tensors) > _SHOWN:
                lines.append(f"    ... and {len(f.tensors) - _SHOWN} more tensors")
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
    facts = _Facts(source=source, load_error=err) if err else gather(
        obj, source, model, [optimizer] if optimizer is not None else [])
    flat = torch.ops.trainsan.judge_checkpoint(*facts.args())
    findings = [Finding(kind=flat[i], step=0, severity=flat[i + 1], tensor=flat[i + 2] or None,
                        message=flat[i + 3]) for i in range(0, len(flat), 4)]
    return CheckpointReport(source=source, findings=findings, facts=facts)


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
