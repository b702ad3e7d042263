"""nondeterminism: the re-runs of Note [Re-run determinism] (host/checks/determinism.cpp).

On a step the sanitizer samples (rerun_every), the training forward records what it started
from — its inputs, the RNG states, a copy of the model's buffers (Note [One re-run recorder],
_rerun.py) — and the fingerprint of every module output, and the model's output gradients are
captured in the backward. Before the optimizer step the C++ driver (Sanitizer::rerun, Note [One
re-run driver] in host/feeds/rerun_feed.cpp, through _trainsan_hot) re-runs the forward and
backward twice from that state with the callables given here (torch.autograd.grad: .grad is never
touched), compares the fingerprints (trainsan::compare_reruns) and reports; the buffers and RNG
are put back as the step left them. Without _trainsan_hot the re-runs are off (a note says so).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Optional

import torch

from . import _native
from ._hooks import DUE_RERUN
from ._facts import _local
from ._rerun import ForwardRecord, autocast_as, started_from
from .precision import _float_tensors
from .replicas import fingerprints


def _hashes(tensors: list) -> list:
    return fingerprints([_local(t).detach() for t in tensors])


class Rerun:
    """The nondeterminism check of one sanitizer: the recording and the callables of its
    re-runs; the orchestration is C++ (Note [One re-run driver])."""

    def __init__(self, san, model: torch.nn.Module):
        self._ref = weakref.ref(san)
        self._model = model
        self._rec: Optional[ForwardRecord] = None
        self._hooks: list = []
        self._forwards = 0  # training forwards since the last step
        self.disabled = _native.drivers() is None  # no driver; or a compiled or distributed model

    def _clear(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def begin_forward(self, args: Any, kwargs: Any) -> None:
        self._forwards += 1
        self._clear()
        san = self._ref()
        if self._forwards > 1:  # accumulation: the step's gradients are not one backward's
            self._rec = None
            return
        if san is None or self.disabled or not san.due(DUE_RERUN) or _distributed():
            return
        rec = ForwardRecord(self._model, args, kwargs)  # Note [One re-run recorder]
        self._rec = rec
        self._hooks.extend(_record_modules(self._model, rec.modules))
        self._hooks.append(self._model.register_forward_hook(
            lambda mod, a, out: rec.watch_outputs(out, keep=False)))

    def before_step(self) -> None:
        """Before the optimizer step: the re-runs, where this step was sampled."""
        rec, self._rec = self._rec, None
        forwards, self._forwards = self._forwards, 0
        self._clear()
        san = self._ref()
        drivers = _native.drivers()
        if rec is None or san is None or san.closed or forwards != 1 or not rec.cotangents or \
                drivers is None:
            return
        model = self._model
        scope = contextlib.ExitStack()

        def start() -> None:
            scope.enter_context(started_from(model, rec))

        def run() -> Any:
            return _run(drivers, model, rec)

        step = _record(drivers, rec.modules, [])
        san.apply(drivers.rerun(san.handle.hot_id(), start, scope.close, run, step))


def _record_modules(model: torch.nn.Module, into: list) -> list:
    """Forward hooks that append (name, type, fingerprints of its floating outputs) of every
    module's output to `into`, in execution order: their handles."""
    return [m.register_forward_hook(
        lambda mod, a, out, _n=name: into.append(
            (_n, type(mod).__name__, _hashes(_float_tensors(out, [])))))
        for name, m in model.named_modules()]


def _run(drivers: Any, model: torch.nn.Module, rec: ForwardRecord) -> Any:
    """One re-run (the driver's StepRerun::run, between start() and restore()): the forward on
    the recorded inputs, each module's output fingerprinted in its hook, and the gradients of the
    parameters from the recorded output gradients (torch.autograd.grad), named by
    model.named_parameters() in backward order: a RerunRecord."""
    mods: list = []
    hooks = _record_modules(model, mods)
    try:
        with torch.enable_grad():
            with autocast_as(rec):  # the forward's autocast regions, as the step's
                out = model(*rec.args, **rec.kwargs)
            outs = [t for t in _float_tensors(out, []) if t.requires_grad]
            pairs = [(outs[i], g) for i, g in sorted(rec.cotangents.items()) if i < len(outs)]
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            grads = torch.autograd.grad([o for o, _ in pairs], [p for _, p in named],
                                        [g for _, g in pairs], allow_unused=True)
    finally:
        for h in hooks:
            h.remove()
    order = reversed(range(len(named)))  # backward order: the output's side first
    return _record(drivers, mods, [(named[i][0], _local(grads[i]).detach()) for i in order
                                   if grads[i] is not None])


def _record(drivers: Any, mods: list, grads: list) -> Any:
    """A trainsan::RerunRecord of module fingerprints and named gradients."""
    r = drivers.RerunRecord()
    for name, kind, hashes in mods:
        r.add_hashes(name, kind, hashes)
    for name, g in grads:
        r.add_grad(name, g)
    return r


def _distributed() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001
        return False
