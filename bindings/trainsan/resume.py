"""Resumes (optimizer_reset; bad_checkpoint of a lossy load): the facts of Note [Resume checks]
in host/checks/resume.cpp, gathered from torch.load, Module.load_state_dict,
Optimizer.load_state_dict and LRScheduler.load_state_dict, wrapped while any sanitizer is open.

What a torch.load returned is remembered by the identity of the dicts inside it (id, size and
first key: nothing is kept alive), so that a model.load_state_dict(ckpt["model"]) on an attached
model knows what else that checkpoint held: an optimizer state, a scheduler state, a counter.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch

from . import _native
from ._findings import TrainingBugError
from ._patches import Patch, _open_sanitizers
from .checkpoint import state_mismatches

_PROGRESS_KEYS = ("epoch", "step", "global_step", "iteration", "iter", "steps", "epochs")
_REMEMBERED = 8  # torch.load results remembered


@dataclasses.dataclass
class CkptInfo:
    has_optimizer_state: bool = False  # a non-empty optimizer state
    progress: str = ""  # "epoch=3, step=1200"
    scheduler_epoch: int = 0
    lr: float = math.nan  # the scheduler's (or optimizer's) last learning rate


_loaded: list = []  # [(fingerprints of the dicts in it, CkptInfo)], newest last


def _fp(d: Mapping) -> tuple:
    return (id(d), len(d), next(iter(d), None))


def _remember(obj: Any) -> None:
    if not isinstance(obj, Mapping):
        return
    info = CkptInfo()
    fps = set()
    progress = []

    def walk(o: Any, depth: int) -> None:
        if depth > 3 or not isinstance(o, Mapping):
            return
        fps.add(_fp(o))
        if "state" in o and "param_groups" in o:
            if o.get("state"):
                info.has_optimizer_state = True
            groups = o.get("param_groups") or []
            if groups and math.isnan(info.lr) and isinstance(groups[0].get("lr"), (int, float)):
                info.lr = float(groups[0]["lr"])
        if "last_epoch" in o and ("base_lrs" in o or "_last_lr" in o):
            le = o.get("last_epoch")
            if isinstance(le, int) and le > info.scheduler_epoch:
                info.scheduler_epoch = le
            last = o.get("_last_lr")
            if isinstance(last, (list, tuple)) and last and isinstance(last[0], (int, float)):
                info.lr = float(last[0])
        for k, v in o.items():
            if depth == 0 and k in _PROGRESS_KEYS and isinstance(v, int) and not isinstance(
                    v, bool) and v > 0:
                progress.append(f"{k}={v}")
            walk(v, depth + 1)

    walk(obj, 0)
    info.progress = ", ".join(progress)
    _loaded.append((fps, info))
    del _loaded[:-_REMEMBERED]


def _lookup(sd: Any) -> Optional[CkptInfo]:
    if not isinstance(sd, Mapping):
        return None
    fp = _fp(sd)
    for fps, info in reversed(_loaded):
        if fp in fps:
            return info
    return None


def _owners(module: torch.nn.Module) -> list:
    """Open sanitizers whose model is `module`, inside it, or holds it."""
    out = []
    for san in list(_open_sanitizers):
        if san._closed or getattr(san, "_resume", None) is None:
            continue
        m = san._model
        if module is m or any(x is module for x in m.modules()) or any(
                x is m for x in module.modules()):
            out.append(san)
    return out


def _guard(fn, *args) -> None:
    try:
        fn(*args)
    except TrainingBugError:
        raise
    except Exception as exc:  # noqa: BLE001 - never fail the user's load over this
        import warnings

        warnings.warn(f"trainsan: the resume check failed ({type(exc).__name__}: {exc}); "
                      "the load went through unchecked", stacklevel=3)


def _patches() -> list:
    orig_load = torch.load
    orig_module = torch.nn.Module.load_state_dict
    orig_optim = torch.optim.Optimizer.load_state_dict
    # Every scheduler class of torch.optim.lr_scheduler with its own load_state_dict: most restore
    # by updating their __dict__ without LRScheduler.load_state_dict (LambdaLR, CyclicLR,
    # ReduceLROnPlateau, ...).
    sched_owners = [c for c in vars(torch.optim.lr_scheduler).values()
                    if isinstance(c, type) and "load_state_dict" in c.__dict__
                    and not issubclass(c, torch.optim.Optimizer)
                    and c.__module__ == torch.optim.lr_scheduler.__name__]

    def load(*args, **kwargs):
        obj = orig_load(*args, **kwargs)
        _guard(_remember, obj)
        return obj

    def module_load(self, state_dict, strict=True, assign=False):
        result = orig_module(self, state_dict, strict, assign)
        for san in _owners(self):
            _guard(san._resume.model_loaded, self, state_dict, strict, result)
        return result

    def optim_load(self, state_dict):
        out = orig_optim(self, state_dict)
        for san in list(_open_sanitizers):
            if not san._closed and getattr(san, "_resume", None) is not None:
                _guard(san._resume.optimizer_loaded, self)
        return out

    def sched_wrapper(orig):
        def sched_load(self, state_dict):
            out = orig(self, state_dict)
            for san in list(_open_sanitizers):
                if not san._closed and getattr(san, "_resume", None) is not None:
                    _guard(san._resume.scheduler_loaded, self)
            return out

        sched_load.__wrapped__ = orig  # type: ignore[attr-defined]
        return sched_load

    for f, o in ((load, orig_load), (module_load, orig_module), (optim_load, orig_optim)):
        f.__wrapped__ = o  # type: ignore[attr-defined]
    return [(torch, "load", load), (torch.nn.Module, "load_state_dict", module_load),
            (torch.optim.Optimizer, "load_state_dict", optim_load)] + [
        (c, "load_state_dict", sched_wrapper(c.__dict__["load_state_dict"])) for c in sched_owners]


resume_patch = Patch(_patches)

def _stateful(opt: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps state across steps (plain SGD does not)."""
    if type(opt) is torch.optim.SGD:
        return any(g.get("momentum", 0) for g in opt.param_groups)
    return True


class ResumeWatch:
    """The resume facts of one sanitizer (Note [Resume checks])."""

    def __init__(self, san) -> None:
        self._ref = weakref.ref(san)
        self._pending: dict = {}  # optimizer index -> CkptInfo (or None) of the model's load
        self._restored: set = set()  # optimizer indices restored while attached
        self._sched_restored: set = set()

    def _san(self):
        san = self._ref()
        return None if san is None or san._closed else san

    def _index(self, opt) -> Optional[int]:
        san = self._san()
        if san is None:
            return None
        for k, o in enumerate(san._optimizers):
            if o is opt:
                return k
        return None

    def _send(self, **facts) -> None:
        """A resume event: trainsan::ResumeFacts by field name (resume_facts.def)."""
        san = self._san()
        if san is not None:
            san._apply(san._handle.resume(_native.facts("ResumeFacts", **facts)))

    def model_loaded(self, module, state_dict, strict: bool, result) -> None:
        san = self._san()
        if san is None:
            return
        info = _lookup(state_dict)
        self._pending = {k: info for k in range(len(san._optimizers))}
        if strict or result is None:
            self._send(moment=0)  # the resume event (Note [Replayed data])
            return
        missing = list(getattr(result, "missing_keys", []))
        unexpected = list(getattr(result, "unexpected_keys", []))
        prefix, matched = _prefix(missing, unexpected)
        optimized = {id(p) for o in san._optimizers for g in o.param_groups for p in g["params"]}
        params = dict(module.named_parameters())
        frozen = [k for k in missing if k in params and not params[k].requires_grad]
        unopt = [k for k in missing if k in params and params[k].requires_grad
                 and san._optimizers and id(params[k]) not in optimized]
        self._send(moment=0, prefix=prefix, prefix_keys=matched, dropped_frozen=frozen,
                   dropped_unoptimized=unopt)

    def optimizer_loaded(self, opt) -> None:
        k = self._index(opt)
        if k is None:
            return
        self._restored.add(k)
        san = self._san()
        names = {id(p): n for n, p in san._model.named_parameters()}
        bad = state_mismatches(opt, names)
        if bad:
            self._send(moment=1, opt=k, optimizer_type=type(opt).__name__, state_mismatched=bad)

    def scheduler_loaded(self, sched) -> None:
        k = self._index(getattr(sched, "optimizer", None))
        if k is not None:
            self._sched_restored.add(k)

    def first_step(self, k: int) -> None:
        """Before optimizer k's first step after the model was loaded."""
        if k not in self._pending:
            return
        info = self._pending.pop(k)
        san = self._san()
        if san is None or info is None:
            return
        opt = san._optimizers[k]
        with_state = sum(1 for g in opt.param_groups for p in g["params"] if opt.state.get(p))
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        lr = float(lr) if isinstance(lr, (int, float)) else math.nan
        sched_ok = k in self._sched_restored
        self._send(moment=2, opt=k, optimizer_type=type(opt).__name__, progress=info.progress,
                   optimizer_with_state=with_state, scheduler_epoch=info.scheduler_epoch,
                   checkpoint_has_optimizer_state=info.has_optimizer_state,
                   optimizer_restored=k in self._restored, stateful=_stateful(opt),
                   scheduler_restored=sched_ok, lr=lr, checkpoint_lr=info.lr)


def _prefix(missing: list, unexpected: list) -> tuple:
    """(prefix, keys): the keys of the state dict are the model's under a prefix added or
    removed (DDP's 'module.', a wrapper's 'model.'); ("", 0) when not."""
    if not missing or not unexpected:
        return "", 0
    miss = set(missing)
    for u in unexpected[:8]:
        for m in missing:
            if u != m and u.endswith(m):
                p = u[: len(u) - len(m)]
                n = sum(1 for x in unexpected if x.startswith(p) and x[len(p):] in miss)
                if n >= max(1, len(missing) // 2):
                    return p, n
            if u != m and m.endswith(u):
                p = m[: len(m) - len(u)]
                unexp = set(unexpected)
                n = sum(1 for x in missing if x.startswith(p) and x[len(p):] in unexp)
                if n >= max(1, len(missing) // 2):
                    return p, n
    return "", 0
