"""Resumes (optimizer_reset; bad_checkpoint of a lossy load): the facts of Note [Resume checks]
in host/checks/resume.cpp that one sanitizer gathers (ResumeWatch) from the loads the process-wide
load journal hands it (_journal.py, Note [Load journal]: live, or replayed at attach); without the
journal, an attach judges what it can see (Note [Loads before attach])."""

from __future__ import annotations

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
    """The last_epoch of each learning-rate scheduler that holds `opt` (one walk of the
    optimizer's referrers: the scheduler, or its __dict__ where that is a dict of its own, as
    after its load_state_dict)."""
    import gc

    from torch.optim.lr_scheduler import LRScheduler

    out = []
    for r in gc.get_referrers(opt):
        d = vars(r) if isinstance(r, LRScheduler) else r
        if isinstance(d, dict) and d.get("optimizer") is opt and "base_lrs" in d:
            epoch = d.get("last_epoch")
            if isinstance(epoch, int) and not isinstance(epoch, bool):
                out.append(epoch)
    return out



def _stateful(opt: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps state across steps (plain SGD does not)."""
    if type(opt) is torch.optim.SGD:
        return any(g.get("momentum", 0) for g in opt.param_groups)
    return True


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
        """Before optimizer k's first step after the model's load or its own."""
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
        lr = opt.param_groups[0].get("lr") if opt.param_groups else None
        lr = float(lr) if isinstance(lr, (int, float)) else math.nan
        sched_ok = k in self._sched_restored
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
