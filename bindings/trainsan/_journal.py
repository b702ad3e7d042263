"""The load journal (Note [Load journal]): torch.load, Module.load_state_dict,
Optimizer.load_state_dict, the schedulers' and the data loaders' load_state_dict, wrapped while the
journal is held (the launcher, trainsan.watch_loads(), an attached sanitizer: Note [Patches]), and
every load written to one process-wide journal: handed at once to the open sanitizers it concerns
(their resume.ResumeWatch) and replayed to a sanitizer attached after it.

What a torch.load returned is remembered by the identity of the dicts inside it (id, size and
first key: nothing is kept alive), so that a model.load_state_dict(ckpt["model"]) knows what else
that checkpoint held: an optimizer state, a scheduler state, a counter.

This module is process-wide state only; what one sanitizer makes of the loads (the resume facts it
sends) is resume.py's."""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch

from . import _position, _resume_fit, _seeds
from ._findings import TrainingBugError
from ._patches import _loader_patch, open_sanitizers
from ._registry import Patch

_PROGRESS_KEYS = ("epoch", "step", "global_step", "iteration", "iter", "steps", "epochs")
_REMEMBERED = 8  # torch.load results remembered


@dataclasses.dataclass
class CkptInfo:
    has_optimizer_state: bool = False  # a non-empty optimizer state
    progress: str = ""  # "epoch=3, step=1200"
    scheduler_epoch: int = 0
    lr: float = math.nan  # the scheduler's (or optimizer's) last learning rate
    optimizers: list = dataclasses.field(default_factory=list)  # _resume_fit.signature of each
    # Note [Data position]: its counters, a loader's state in it, the DataLoader iterators before
    epoch: int = -1
    step: int = -1
    step_key: str = ""
    loader_key: str = ""
    iters_before: int = 0
    rng_clock: int = 0  # the generator settings seen before it (Note [Replayed order])


# [(fingerprints of the dicts in it, ids of the tensors of its state dicts, CkptInfo)], newest
# last. A state dict handed to load_state_dict may be a copy of the checkpoint's (timm's
# clean_state_dict strips 'module.' into a new dict; a rename loop): the same tensor objects
# under other keys, found by the tensors' identity (Note [Load journal]).
_loaded: list = []


def _fp(d: Mapping) -> tuple:
    return (id(d), len(d), next(iter(d), None))


def _tensors(d: Mapping, n: int = 4) -> list:
    """The first `n` tensor values of a state dict (none for another mapping)."""
    out = []
    for v in d.values():
        if isinstance(v, torch.Tensor):
            out.append(v)
            if len(out) == n:
                break
    return out


def _remember(obj: Any) -> None:
    if not isinstance(obj, Mapping):
        return
    info = CkptInfo()
    fps = set()
    tids: dict = {}  # id -> weakref: a tensor freed since cannot be matched by a reused id
    progress = []

    def walk(o: Any, depth: int) -> None:
        if depth > 3 or not isinstance(o, Mapping):
            return
        fps.add(_fp(o))
        for t in _tensors(o):
            tids[id(t)] = weakref.ref(t)
        if "state" in o and "param_groups" in o:
            if o.get("state"):
                info.has_optimizer_state = True
            sig = _resume_fit.signature(o)
            if sig is not None:
                info.optimizers.append(sig)
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
            if depth == 0 and isinstance(v, (list, tuple)):
                # A list of optimizer states (Lightning's "optimizer_states"): found by identity
                # for Note [Optimizer slots by name], and nothing else.
                fps.update(_fp(x) for x in v[:16] if isinstance(x, Mapping) and "state" in x)

    walk(obj, 0)
    info.progress = ", ".join(progress)
    info.epoch, info.step, info.step_key, info.loader_key = _position.counters(obj)
    info.iters_before = _position.serial()
    info.rng_clock = _seeds.clock()
    _loaded.append((fps, tids, info))
    del _loaded[:-_REMEMBERED]


def _lookup(sd: Any) -> Optional[CkptInfo]:
    """The checkpoint `sd` comes from. A fingerprint holds an id, which Python hands out again
    once its dict is freed: a fingerprint is only taken for a checkpoint still alive, and a dict
    with tensors only where its first tensors are the checkpoint's (the same objects: weak
    references, so a freed tensor's id matches nothing). Else a new dict of a later checkpoint
    whose id, size and first key fell on a freed one's was taken for it (its CkptInfo: another
    run's optimizer state, or none)."""
    if not isinstance(sd, Mapping):
        return None
    fp = _fp(sd)
    ts = _tensors(sd)
    for fps, tids, info in reversed(_loaded):
        if fp in fps and (_theirs(ts, tids) if ts else _alive(tids)):
            return info
    # A copy of one of its state dicts: all of the copy's first tensors are the checkpoint's.
    for _, tids, info in reversed(_loaded) if ts else ():
        if _theirs(ts, tids):
            return info
    return None


def _theirs(ts: list, tids: dict) -> bool:
    """Whether the tensors `ts` are all among a checkpoint's own (tids: id -> weakref)."""
    return all(id(t) in tids and tids[id(t)]() is t for t in ts)


def _alive(tids: dict) -> bool:
    """Whether a checkpoint may still be alive: one of its tensors is (or it had none)."""
    return not tids or any(r() is not None for r in tids.values())


def _related(module: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether a load into `module` is a load of `model`: it is the model, inside it, or holds
    it."""
    return module is model or any(x is module for x in model.modules()) or any(
        x is model for x in module.modules())


def _owners(module: torch.nn.Module) -> list:
    """Open sanitizers whose model is `module`, inside it, or holds it."""
    return [san for san in _watching() if _related(module, san.model)]


def _watching() -> list:
    return [ctx for ctx in open_sanitizers() if ctx.resume is not None]


def _guard(fn, *args, what: str = "the load went through unchecked") -> None:
    try:
        fn(*args)
    except TrainingBugError:
        raise
    except Exception as exc:  # noqa: BLE001 - never fail the user's load over this
        import warnings

        warnings.warn(f"trainsan: the resume check failed ({type(exc).__name__}: {exc}); {what}",
                      stacklevel=3)


# Note [Load journal]
# ~~~~~~~~~~~~~~~~~~~
# A resume is usually restored before the first forward, so before `python -m trainsan run`
# attaches (at the model's first training forward) and before most explicit attach() calls.
# While the journal is held (the "load_journal" row of Note [Patches]: by the launcher from the
# script's first line, by trainsan.watch_loads(), by every attached sanitizer), torch.load,
# Module.load_state_dict, Optimizer.load_state_dict, the schedulers' load_state_dict and the
# load_state_dict of DataLoader and Sampler subclasses that define one (torchdata's
# StatefulDataLoader and StatefulDistributedSampler, a custom sampler) are wrapped, and every
# load is written to a process-wide journal: the last
# _JOURNALED loads, in order, each holding only a weak reference to what was loaded and what the
# load needs later — a model load keeps the CkptInfo of the torch.load it came from (looked up
# at the load: by the state dict's identity, or, for a copy of it — timm's clean_state_dict, a
# rename loop — by the identity of its first tensors, the checkpoint's own and alive; an id is
# reused once its object is freed, so a fingerprint counts only where that holds too), the strict
# flag, the missing/unexpected key names and weak references to the
# parameters it wrote (a fine-tune's new head is none of them: Note [Resume checks]); never a
# tensor or a state dict. The journal is the single source of the resume events: a load made
# while sanitizers are open is journaled and handed at once to those it concerns (as before:
# their ResumeWatch), and a Sanitizer, once built, replays the journaled loads that concern it,
# in order: a model load of its model (the module is the model, inside it, or holds it), loads
# of its optimizers and of their schedulers. Its first steps then judge them as if it had been
# attached before the loads; a load of another model or optimizer does not reach it.
#
# A load is replayed while it still waits for its judgement: until a step of an optimizer that
# holds parameters of the loaded module (a model load), or of the loaded optimizer (an optimizer
# or scheduler load). A global optimizer step pre-hook, installed while some journaled load
# waits, marks them (an optimizer that holds none of a module's parameters is remembered, so a
# model that never trains — a teacher, a reference — costs a dictionary lookup a step). So a
# sanitizer attached after the run trained past its resume replays nothing (its first step is
# not the one after the load), and one that replaces another before the first step (the launcher
# closes a model's sanitizer and attaches it anew when a new optimizer of it appears) still knows
# the model was resumed: the first never judged the load, the second does, once. The facts given
# at the load itself are then given to both (a strict=False load's bad_checkpoint, an optimizer
# state in another order), each sanitizer's own finding.
#
# Replayed, a strict model load gives no load event of its own (moment 0, Note [Replayed data]):
# the inputs check of a sanitizer attached after the load holds no batch trained before it, so
# it has nothing to compare with (a run resumed with resume_trace= is seeded at attach anyway).
# A strict=False load is replayed as it was seen live when it dropped keys or carried a prefix.
# Loader and sampler loads are journaled, and the loader or sampler is marked restored for the
# data position judged at the first training forward after the model's load (Note [Data
# position], host/checks/resume_data.cpp; _position.py).
_JOURNALED = 64


@dataclasses.dataclass(eq=False)
class _Load:
    """One journaled load (Note [Load journal])."""

    kind: str  # "model", "optimizer", "scheduler", "loader"
    ref: Any  # weakref to the module, optimizer, scheduler, or loader/sampler (None: not weak)
    info: Optional[CkptInfo] = None  # model: the torch.load its state dict came from
    strict: bool = True  # model: checked strictly (or no result to read)
    missing: tuple = ()  # model, strict=False: the keys it lacked
    unexpected: tuple = ()  # model, strict=False: the keys it did not take
    layout: Any = None  # model, strict=False: shapes and order of both (_position.layout)
    opt: Any = None  # scheduler: weakref to its optimizer
    params: frozenset = frozenset()  # model: ids of the module's parameters at the load
    waiting: bool = True  # no step that judges it yet
    # model: optimizer -> its number of parameter groups when found to hold none of `params`
    unrelated: Any = None
    wrote: Any = None  # model: the parameters the load wrote (_resume_fit.written)
    keys: tuple = ()  # model: the keys of the state dict it was given, in its order
    groups: tuple = ()  # optimizer: the sizes of the saved state's parameter groups


_journal: "collections.deque[_Load]" = collections.deque(maxlen=_JOURNALED)
_step_hook: list = []  # the handle of the global step pre-hook, while one is installed


def _weak(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _on_any_step(opt, args, kwargs) -> None:
    """Global optimizer step pre-hook: the journaled loads this step judges stop waiting. It
    never fails the step, and never adds or removes a hook (torch iterates them as it calls this
    one): once nothing waits it returns at once, and it is removed at the next load."""
    if not _waiting[0]:
        return
    try:
        left = False
        for e in list(_journal):
            if e.waiting:
                _judged_by(e, opt)
                left = left or e.waiting
        _waiting[0] = left
    except Exception:  # noqa: BLE001 - never fail the user's step over this
        pass


def _judged_by(e: _Load, opt) -> None:
    if e.ref is not None and e.ref() is None:
        e.waiting = False  # what was loaded is gone
    elif e.kind == "model":
        n = len(opt.param_groups)
        if e.unrelated.get(opt) != n:
            if any(id(p) in e.params for g in opt.param_groups for p in g["params"]):
                e.waiting = False
            else:
                e.unrelated[opt] = n
    else:
        ref = e.ref if e.kind == "optimizer" else e.opt
        target = ref() if ref is not None else None
        if target is None or target is opt:
            e.waiting = False


_waiting = [False]  # some journaled load waits for its judgement


def _journal_add(e: _Load) -> _Load:
    """Journal a load; the step hook is installed while some load waits (removed here, at a
    load, once none does: never from inside a step)."""
    _journal.append(e)
    _waiting[0] = any(x.waiting for x in _journal)
    if _waiting[0] and not _step_hook:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook.append(register_optimizer_step_pre_hook(_on_any_step))
    elif not _waiting[0] and _step_hook:
        _step_hook.pop().remove()
    return e


def _record(make) -> Optional[_Load]:
    """Journal the load `make()` describes; None when that fails (the load stands, unjournaled)."""
    try:
        return _journal_add(make())
    except Exception as exc:  # noqa: BLE001 - never fail the user's load over this
        import warnings

        warnings.warn(f"trainsan: the load journal failed ({type(exc).__name__}: {exc}); this "
                      "load is not judged", stacklevel=3)
        return None


def _model_load(module, state_dict, strict: bool, result) -> _Load:
    checked = strict or result is None
    return _Load(
        "model", _weak(module), info=_lookup(state_dict), strict=checked,
        missing=() if checked else tuple(getattr(result, "missing_keys", ())),
        unexpected=() if checked else tuple(getattr(result, "unexpected_keys", ())),
        layout=None if checked else _position.layout(
            module, state_dict, tuple(getattr(result, "missing_keys", ())),
            tuple(getattr(result, "unexpected_keys", ()))),
        params=frozenset(id(p) for p in module.parameters()),
        unrelated=weakref.WeakKeyDictionary(),
        wrote=_resume_fit.written(module, () if checked else
                                  tuple(getattr(result, "missing_keys", ()))),
        keys=tuple(state_dict.keys()) if isinstance(state_dict, Mapping) else ())


def _optimizer_load(opt, state_dict) -> _Load:
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    return _Load("optimizer", _weak(opt), info=_lookup(state_dict),
                 groups=tuple(len(g.get("params") or ()) for g in groups if isinstance(g, Mapping))
                 if isinstance(groups, (list, tuple)) else ())


def model_load_of(info: Optional[CkptInfo], opt) -> Optional[_Load]:
    """The latest journaled model load from the same torch.load as `info` into a module that holds
    parameters of `opt` (Note [Optimizer slots by name]); None if none."""
    if info is None:
        return None
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    for e in reversed(_journal):
        if e.kind == "model" and e.info is info and e.keys and e.ref is not None \
                and e.ref() is not None and not ids.isdisjoint(e.params):
            return e
    return None


def _deliver(e: _Load, san, replay: bool) -> None:
    """Hand one journaled load to a sanitizer's ResumeWatch (live, or replayed at attach)."""
    w = san.resume
    target = e.ref() if e.ref is not None else None
    if e.kind == "model":
        if target is not None:
            w.model_loaded(target, e, replay)
    elif e.kind == "optimizer":
        if target is not None:
            w.optimizer_loaded(target, e)
    elif e.kind == "scheduler":
        opt = e.opt() if e.opt is not None else None
        if opt is not None:
            w.scheduler_loaded(opt)


def _concerns(e: _Load, san) -> bool:
    """Whether a journaled load is one of `san`'s: a load of its model, of its optimizers or of
    their schedulers."""
    if e.kind == "model":
        module = e.ref() if e.ref is not None else None
        return module is not None and _related(module, san.model)
    if e.kind in ("optimizer", "scheduler"):
        ref = e.ref if e.kind == "optimizer" else e.opt
        opt = ref() if ref is not None else None
        return opt is not None and any(o is opt for o in san.optimizers)
    return False


def replay_loads(san) -> None:
    """At attach: the journaled loads that concern `san` and still wait for their judgement, in
    order (Note [Load journal])."""
    for e in list(_journal):
        if e.waiting and _concerns(e, san):
            _guard(_deliver, e, san, True, what="this load before attach is not judged")


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
        _guard(_wrap_loader_classes)
        return obj

    def module_load(self, state_dict, strict=True, assign=False):
        result = orig_module(self, state_dict, strict, assign)
        entry = _record(lambda: _model_load(self, state_dict, strict, result))
        if entry is not None:
            for san in _owners(self):
                _guard(_deliver, entry, san, False)
        return result

    def optim_load(self, state_dict):
        out = orig_optim(self, state_dict)
        entry = _record(lambda: _optimizer_load(self, state_dict))
        for san in _watching() if entry is not None else ():
            _guard(_deliver, entry, san, False)
        return out

    def sched_wrapper(orig):
        def sched_load(self, state_dict):
            out = orig(self, state_dict)
            entry = _record(lambda: _Load("scheduler", _weak(self),
                                          opt=_weak(getattr(self, "optimizer", None))))
            for san in _watching() if entry is not None else ():
                _guard(_deliver, entry, san, False)
            return out

        sched_load.__wrapped__ = orig  # type: ignore[attr-defined]
        return sched_load

    for f, o in ((load, orig_load), (module_load, orig_module), (optim_load, orig_optim)):
        f.__wrapped__ = o  # type: ignore[attr-defined]
    return [(torch, "load", load), (torch.nn.Module, "load_state_dict", module_load),
            (torch.optim.Optimizer, "load_state_dict", optim_load)] + [
        (c, "load_state_dict", sched_wrapper(c.__dict__["load_state_dict"])) for c in sched_owners]


# Loader and sampler state (Note [Load journal]): the load_state_dict of every subclass of
# DataLoader or Sampler that defines one, wrapped when first seen: at install, at every torch.load
# (a resume loads its checkpoint before restoring the loader from it) and at every attach, while
# the journal is held.
_loader_depth = [0]  # a subclass's load_state_dict calling its base's is one load


def _loader_wrapper(orig):
    def load_state_dict(self, *args, **kwargs):
        _loader_depth[0] += 1
        try:
            out = orig(self, *args, **kwargs)
        finally:
            _loader_depth[0] -= 1
        if _loader_depth[0] == 0:
            _record(lambda: _Load("loader", _weak(self), waiting=False))
            _position.restored(self)
        return out

    load_state_dict.__wrapped__ = orig  # type: ignore[attr-defined]
    load_state_dict._trainsan_journal = True  # type: ignore[attr-defined]
    return load_state_dict


def _loader_classes() -> list:
    """(class, "load_state_dict", wrapper) for each subclass of DataLoader or Sampler that
    defines a load_state_dict not wrapped yet."""
    from torch.utils.data import DataLoader, Sampler

    out, stack, seen = [], [DataLoader, Sampler], set()
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        f = c.__dict__.get("load_state_dict")
        if callable(f) and not getattr(f, "_trainsan_journal", False):
            out.append((c, "load_state_dict", _loader_wrapper(f)))
        try:
            stack.extend(c.__subclasses__())
        except TypeError:
            pass
    return out


def _wrap_loader_classes() -> None:
    """The loader classes defined since the journal was installed (it is held)."""
    if _journal_patch.held():
        _journal_patch.extend(_loader_classes())


_journal_patch = Patch(
    "load_journal", ("attach", "launcher", "watch"),
    ["torch.load", "torch.nn.Module.load_state_dict", "torch.optim.Optimizer.load_state_dict",
     "torch.optim.lr_scheduler.*.load_state_dict",
     "torch.utils.data.{DataLoader,Sampler} subclasses' load_state_dict"], _patches)


class _Journal:
    """The load journal (Note [Load journal]) with the data position's loader numbering and the
    generator's seeding (Note [Replayed order]): the three patches held together, by a sanitizer
    ("attach"), the launcher, or watch_loads() ("watch")."""

    def acquire(self, lifetime: str) -> None:
        _journal_patch.acquire(lifetime)
        _loader_patch.acquire(lifetime)
        _seeds.rng_patch.acquire(lifetime)
        # The loader classes, at the first hold and any defined since (one walk a hold).
        _guard(_wrap_loader_classes, what="loader loads are not journaled")

    def release(self, lifetime: str) -> None:
        _seeds.rng_patch.release(lifetime)
        _loader_patch.release(lifetime)
        _journal_patch.release(lifetime)


journal = _Journal()


def watching_before(lifetime: str = "") -> bool:
    """Whether the journal is held (by a holder of `lifetime`)."""
    return _journal_patch.held(lifetime)


class LoadWatch:
    """What trainsan.watch_loads() returns: the load journal held until close() (or the end of a
    `with` block; Note [Load journal])."""

    def __init__(self) -> None:
        journal.acquire("watch")
        self._held = True

    def close(self) -> None:
        if self._held:
            self._held = False
            journal.release("watch")

    def __enter__(self) -> "LoadWatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def watch_loads() -> LoadWatch:
    """Journal every load from now on, for the sanitizers attached later (Note [Load journal]).

    ``import trainsan`` replaces nothing in torch. The launcher (``python -m trainsan run``)
    journals the loads from the script's first line; a script that attaches explicitly after
    restoring a checkpoint calls this once before the loads::

        trainsan.watch_loads()
        model.load_state_dict(ckpt["model"])  # judged at attach, as if attached before
        san = trainsan.attach(model, optimizer)

    It wraps torch.load and the ``load_state_dict`` of modules, optimizers, schedulers, data
    loaders and samplers (Note [Patches]) until the returned handle is closed (it is also a
    context manager); without it an explicit attach judges only what it can see at attach (Note
    [Loads before attach])."""
    return LoadWatch()
