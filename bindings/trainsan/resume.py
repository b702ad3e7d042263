"""Resumes (optimizer_reset; bad_checkpoint of a lossy load): the facts of Note [Resume checks]
in host/checks/resume.cpp that one sanitizer gathers (ResumeWatch) from the loads the process-wide
load journal hands it (_journal.py, Note [Load journal]: live, or replayed at attach); without the
journal, an attach judges what it can see (Note [Loads before attach])."""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Optional

import torch

from . import _native, _position, _resume_fit
from ._journal import CkptInfo, _guard, _Load, model_load_of
from .checkpoint import state_mismatches


# Note [Loads before attach]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# The journal is installed by the launcher before the script's first line, by trainsan.
# watch_loads(), and by an attach for the loads after it (Note [Patches]); `import trainsan`
# installs nothing. An explicit attach made after loads nobody journaled judges what it can see
# of them at attach: an optimizer that keeps state (Adam, SGD with momentum), holds none, and has
# a learning-rate scheduler past its first epoch (found among the optimizer's referrers, looked
# for only where a scheduler was built over it: schedulers set each group's initial_lr). A
# scheduler steps after its optimizer, so one past epoch 0 over an optimizer that never stepped
# was restored from a checkpoint whose optimizer state was not: unless optimizer.load_state_dict
# comes before the optimizer's first step, that step gives optimizer_reset
# (scheduler_epoch_at_attach, host/checks/resume.cpp). What such an attach cannot see — a model
# load without its optimizer's when no scheduler was restored either, a strict=False load's
# dropped keys, a state restored by position, the data position — needs the journal: one line,
# trainsan.watch_loads(), before the loads.
def _scheduler_epochs(opt) -> list:
    """The last_epoch of each learning-rate scheduler over `opt` that keeps base rates (not
    ReduceLROnPlateau), found by _schedulers_of's walk of the optimizer's referrers."""
    return [_epoch_of(s) for s in _schedulers_of(opt)
            if "base_lrs" in vars(s) and _epoch_of(s) >= 0]


def _epoch_of(sched) -> int:
    """A scheduler's last_epoch; -1 where it has none."""
    e = getattr(sched, "last_epoch", None)
    return e if isinstance(e, int) and not isinstance(e, bool) else -1


def _schedulers_of(opt) -> list:
    """The torch learning-rate schedulers over `opt` (one walk of its referrers, and of a
    scheduler's __dict__ where that is what refers to it), containers (SequentialLR,
    ChainedScheduler) before the schedulers they hold."""
    import gc

    from torch.optim.lr_scheduler import LRScheduler

    found = []
    for r in gc.get_referrers(opt):
        if isinstance(r, LRScheduler):
            cands = [r]
        elif isinstance(r, dict) and r.get("optimizer") is opt and "last_epoch" in r:
            cands = [o for o in gc.get_referrers(r)
                     if isinstance(o, LRScheduler) and getattr(o, "__dict__", None) is r]
        else:
            continue
        for c in cands:
            if getattr(c, "optimizer", None) is opt and all(c is not x for x in found):
                found.append(c)
    inner = {id(x) for c in found for x in (getattr(c, "_schedulers", None) or ())}
    return [c for c in found if id(c) not in inner] + [c for c in found if id(c) in inner]


# Note [Restarted schedule]: how many changes of a watched optimizer's rate are sent at most (a
# restart that leaves the checkpoint's schedule gradually does so within a few dozen changes).
_SCHEDULE_CHANGES = 1000


def _rate_at(sched, epoch: int) -> float:
    """The first group's rate `sched` sets at `epoch` by its own formula (LambdaLR, and the
    closed forms of StepLR, CosineAnnealingLR, ...; OneCycleLR, CyclicLR, and SequentialLR of those
    by its milestones), computed on a copy
    over copies of the groups (nothing of the scheduler or the optimizer changes); NaN where it
    has no formula of its epoch (ReduceLROnPlateau, CosineAnnealingWarmRestarts, SequentialLR,
    a subclass of its own)."""
    import copy
    import types

    from torch.optim import lr_scheduler as L

    kind = type(sched)
    if kind is L.SequentialLR:  # the child in charge at `epoch`, counted from its milestone
        import bisect

        ms = list(getattr(sched, "_milestones", ()))
        children = list(getattr(sched, "_schedulers", ()))
        i = bisect.bisect_right(ms, epoch)
        if not children or i >= len(children):
            return math.nan
        return _rate_at(children[i], epoch - (ms[i - 1] if i > 0 else 0))
    closed = "_get_closed_form_lr" in vars(kind) and kind.__module__ == L.__name__
    if not closed and kind not in (L.LambdaLR, L.OneCycleLR, L.CyclicLR):
        return math.nan
    try:
        c = copy.copy(sched)
        c.optimizer = types.SimpleNamespace(
            param_groups=[dict(g) for g in sched.optimizer.param_groups])
        c.last_epoch = epoch
        c._get_lr_called_within_step = True
        lrs = c._get_closed_form_lr() if closed else c.get_lr()
        lr = lrs[0] if lrs else math.nan
        return float(lr) if isinstance(lr, (int, float)) else math.nan
    except Exception:  # noqa: BLE001 - a schedule past its end (OneCycleLR), an odd one
        return math.nan


def _last_rate(sched) -> float:
    last = getattr(sched, "_last_lr", None)
    lr = last[0] if isinstance(last, (list, tuple)) and last else None
    return float(lr) if isinstance(lr, (int, float)) else math.nan


def _group_rate(opt) -> float:
    lr = opt.param_groups[0].get("lr") if opt.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else math.nan


def _stateful(opt: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps state across steps (plain SGD does not)."""
    if type(opt) is torch.optim.SGD:
        return any(g.get("momentum", 0) for g in opt.param_groups)
    return True


@dataclasses.dataclass
class _RateWatch:
    """An unrestored scheduler behind the checkpoint's epoch, its optimizer's rate watched
    (Note [Restarted schedule])."""

    sched: "weakref.ref"  # the live scheduler
    epoch_then: int  # its last_epoch at the optimizer's first step after the resume
    checkpoint_epoch: int  # the saved scheduler's last_epoch
    rate: float  # the group's rate at the last step seen
    changes: int = 0  # changes of the rate sent so far


class ResumeWatch:
    """The resume facts of one sanitizer (Note [Resume checks])."""

    def __init__(self, san) -> None:
        self._ref = weakref.ref(san)
        self._pending: dict = {}  # optimizer index -> the model's load (_Load)
        self._moments_due: set = set()  # optimizer indices loaded, their moments not compared
        self._restored: set = set()  # optimizer indices restored while attached
        self._opt_loads: dict = {}  # optimizer index -> its last load (_Load)
        self._sched_restored: set = set()
        self._data: Optional[CkptInfo] = None  # the data position to judge (Note [Data position])
        # optimizer index -> its scheduler's epoch, seen at attach (Note [Loads before attach])
        self._at_attach: dict = {}
        # optimizer index -> its unrestored scheduler's watch (Note [Restarted schedule])
        self._lr_watch: dict = {}

    def _san(self):
        san = self._ref()
        return None if san is None or san.closed else san

    def _index(self, opt) -> Optional[int]:
        san = self._san()
        if san is None:
            return None
        for k, o in enumerate(san.optimizers):
            if o is opt:
                return k
        return None

    def _send(self, **facts) -> None:
        """A resume event: trainsan::ResumeFacts by field name (resume_facts.def)."""
        san = self._san()
        if san is not None:
            san.apply(san.handle.resume(_native.facts("ResumeFacts", **facts)))

    def model_loaded(self, module, e: "_Load", replay: bool = False) -> None:
        """A load of the model (Note [Load journal]: live, or replayed at attach)."""
        san = self._san()
        if san is None:
            return
        self._pending = {k: e for k in range(len(san.optimizers))}
        self._data = e.info
        if e.strict:
            if not replay:
                self._send(moment=0)  # the resume event (Note [Replayed data])
            return
        missing, unexpected = list(e.missing), list(e.unexpected)
        prefix, matched = _prefix(missing, unexpected)
        optimized = {id(p) for o in san.optimizers for g in o.param_groups for p in g["params"]}
        params = dict(module.named_parameters())
        frozen = [k for k in missing if k in params and not params[k].requires_grad]
        unopt = [k for k in missing if k in params and params[k].requires_grad
                 and san.optimizers and id(params[k]) not in optimized]
        lay, left = e.layout or {}, set(frozen) | set(unopt)
        moved = [k for k, m in enumerate(lay.get("missing", ())) if m not in left]
        if replay and not (prefix or frozen or unopt or (moved and lay.get("unexpected"))):
            return  # nothing to judge at the load (Note [Load journal])
        self._send(moment=0, prefix=prefix, prefix_keys=matched, dropped_frozen=frozen,
                   dropped_unoptimized=unopt,
                   missing_params=[lay["missing"][k] for k in moved],
                   missing_shapes=[lay["missing_shapes"][k] for k in moved],
                   missing_interior=[lay["missing_interior"][k] for k in moved],
                   missing_gap=[lay["missing_gap"][k] for k in moved],
                   unexpected_keys=list(lay.get("unexpected", ())),
                   unexpected_shapes=list(lay.get("unexpected_shapes", ())),
                   unexpected_interior=list(lay.get("unexpected_interior", ())),
                   unexpected_gap=list(lay.get("unexpected_gap", ())),
                   unexpected_replaced=list(lay.get("unexpected_replaced", ())))

    def first_forward(self) -> None:
        """At a training forward: the first after a model load judges the data position."""
        info, self._data = self._data, None
        if info is not None and self._san() is not None:
            _guard(self._data_position, info, what="the data position is not judged")

    def _data_position(self, info: CkptInfo) -> None:
        facts = _position.facts(info, bool(self._restored))
        if facts is not None:
            self._send(**facts)

    def optimizer_loaded(self, opt, e: Optional[_Load] = None) -> None:
        k = self._index(opt)
        if k is None:
            return
        self._restored.add(k)
        self._opt_loads[k] = e
        san = self._san()
        names = {id(p): n for n, p in san.model.named_parameters()}
        bad = state_mismatches(opt, names)
        if bad:
            self._send(moment=1, opt=k, optimizer_type=type(opt).__name__, state_mismatched=bad)
        else:
            self._moments_due.add(k)  # compared at its first step (Note [Resume checks])

    def _slots(self, k: int, opt) -> dict:
        """Note [Optimizer slots by name]: the optimizer's slots against the saved key order of
        the model's load from the same checkpoint ({} where there is none)."""
        e = self._opt_loads.pop(k, None)
        try:
            model = model_load_of(e.info, opt) if e is not None and e.groups else None
            module = model.ref() if model is not None else None
        except Exception:  # noqa: BLE001 - never fail the user's step over this: not judged
            return {}
        if module is None:
            return {}
        return _resume_fit.slot_facts(opt, module, model.keys, e.groups)

    def scheduler_loaded(self, opt) -> None:
        """A load of a scheduler of `opt`."""
        k = self._index(opt)
        if k is not None:
            self._sched_restored.add(k)
            self._lr_watch.pop(k, None)

    def _rate_changed(self, k: int) -> None:
        """Note [Restarted schedule]: at each step of a watched optimizer, a change of its rate is
        sent (kScheduleStep; the rule decides, and ignores what comes after its verdict), up to
        _SCHEDULE_CHANGES changes."""
        san = self._san()
        w = self._lr_watch[k]
        sched = w.sched()
        if san is None or sched is None:
            del self._lr_watch[k]
            return
        lr = _group_rate(san.optimizers[k])
        if lr == w.rate or (math.isnan(lr) and math.isnan(w.rate)):
            return
        w.rate = lr
        w.changes += 1
        now = _epoch_of(sched)
        schedule_lr = (_rate_at(sched, w.checkpoint_epoch + now - w.epoch_then) if now >= 0
                       else math.nan)
        if w.changes >= _SCHEDULE_CHANGES or math.isnan(schedule_lr):
            del self._lr_watch[k]  # enough changes, or no formula to judge them by
        self._send(moment=3, opt=k, lr=lr, scheduler_lr=_last_rate(sched), scheduler_epoch_now=now,
                   schedule_lr=schedule_lr)

    def _live_scheduler(self, k: int, opt, info: CkptInfo) -> dict:
        """ResumeFacts of the scheduler over optimizer k at its first step after a load whose
        checkpoint holds a scheduler state that was not restored (Note [Restarted schedule]); the
        watch begins where it is behind the checkpoint's. {} where there is none, or where finding
        it failed (never the user's step's failure)."""
        try:
            scheds = _schedulers_of(opt)
            if not scheds:
                return {}
            # The furthest along (a scheduler replaced by another one may linger until the
            # collector runs; a container, listed first, is at least as far as the schedulers it
            # holds).
            by_epoch = [x for x in scheds if not math.isnan(_rate_at(x, 0))]
            sched = max(by_epoch or scheds, key=_epoch_of)
            epoch = _epoch_of(sched)
            if epoch < 0:
                return {}
            if by_epoch and k in self._restored and epoch < info.scheduler_epoch:
                self._lr_watch[k] = _RateWatch(weakref.ref(sched), epoch, info.scheduler_epoch,
                                               _group_rate(opt))
            return dict(scheduler_type=type(sched).__name__, scheduler_epoch_now=epoch,
                        scheduler_by_epoch=bool(by_epoch))
        except Exception:  # noqa: BLE001 - never fail the user's step over this
            return {}

    def seen_at_attach(self) -> None:
        """Note [Loads before attach]: what an attach made without the journal can still see."""
        san = self._san()
        if san is None:
            return
        for k, opt in enumerate(san.optimizers):
            if k in self._pending or k in self._restored or not _stateful(opt) or opt.state \
                    or not any("initial_lr" in g for g in opt.param_groups):
                continue  # state, or no scheduler was ever built over it (it sets initial_lr)
            epoch = max(_scheduler_epochs(opt), default=0)
            if epoch > 0:
                self._at_attach[k] = epoch

    def first_step(self, k: int) -> None:
        """Before optimizer k's first step after the model's load or its own (and, while its
        rate is watched, each later one: Note [Restarted schedule])."""
        if k in self._lr_watch:
            _guard(self._rate_changed, k, what="the learning rate is not judged")
        at_attach = self._at_attach.pop(k, 0)
        if at_attach and k not in self._restored:
            san = self._san()
            opt = san.optimizers[k] if san is not None else None
            if opt is not None and not opt.state:
                self._send(moment=2, opt=k, optimizer_type=type(opt).__name__, stateful=True,
                           optimizer_with_state=0, scheduler_epoch_at_attach=at_attach)
        if k not in self._pending and k not in self._moments_due:
            return
        e = self._pending.pop(k, None)
        info = e.info if e is not None else None
        san = self._san()
        if san is None:
            return
        opt = san.optimizers[k]
        facts = {}
        if k in self._moments_due:
            self._moments_due.discard(k)
            names = {id(p): n for n, p in san.model.named_parameters()}
            facts["moments"] = _resume_fit.moment_scales(opt, names)
            facts.update(self._slots(k, opt))
        if info is None:
            if facts.get("moments") or facts.get("slot_params"):
                self._send(moment=2, opt=k, optimizer_type=type(opt).__name__, **facts)
            return
        facts.update(_resume_fit.fine_tune_facts(opt, e.wrote, info.optimizers))
        with_state = sum(1 for g in opt.param_groups for p in g["params"] if opt.state.get(p))
        lr = _group_rate(opt)
        sched_ok = k in self._sched_restored
        self._lr_watch.pop(k, None)
        if info.scheduler_epoch > 0 and not sched_ok:
            facts.update(self._live_scheduler(k, opt, info))
        self._send(moment=2, opt=k, optimizer_type=type(opt).__name__, progress=info.progress,
                   optimizer_with_state=with_state, scheduler_epoch=info.scheduler_epoch,
                   checkpoint_has_optimizer_state=info.has_optimizer_state,
                   optimizer_restored=k in self._restored, stateful=_stateful(opt),
                   scheduler_restored=sched_ok, lr=lr, checkpoint_lr=info.lr, **facts)


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
