"""nondeterminism: the re-runs of Note [Re-run determinism] (host/checks/determinism.cpp).

On a step the sanitizer samples (rerun_every), the training forward records what it started
from — its inputs, the RNG states, a copy of the model's buffers (Note [One re-run recorder],
_rerun.py) — and the fingerprint of every module output, and the model's output gradients are
captured in the backward. Before the
optimizer step the forward and backward are re-run twice from that state
(torch.autograd.grad: .grad is never touched), the fingerprints compared, and the buffers and RNG
put back as the step left them. Where the fingerprints first differ is decided in C++
(trainsan::compare_reruns, which Sanitizer::rerun uses for LibTorch loops).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from . import _native
from ._hooks import DUE_RERUN
from ._facts import _local
from ._rerun import ForwardRecord, started_from
from .precision import _float_tensors
from .replicas import fingerprints


def _hashes(tensors: list) -> tuple:
    return tuple(fingerprints([_local(t).detach() for t in tensors]))


class Rerun:
    """The nondeterminism check of one sanitizer."""

    def __init__(self, san, model: torch.nn.Module):
        self._ref = weakref.ref(san)
        self._model = model
        self._rec: Optional[ForwardRecord] = None
        self._hooks: list = []
        self._forwards = 0  # training forwards since the last step
        self.disabled = False  # a compiled or distributed model

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
        for name, m in self._model.named_modules():
            self._hooks.append(m.register_forward_hook(
                lambda mod, a, out, _n=name: rec.modules.append(
                    (_n, type(mod).__name__, _hashes(_float_tensors(out, []))))))
        self._hooks.append(self._model.register_forward_hook(
            lambda mod, a, out: rec.watch_outputs(out, keep=False)))

    def before_step(self) -> None:
        """Before the optimizer step: the re-runs, where this step was sampled."""
        rec, self._rec = self._rec, None
        forwards, self._forwards = self._forwards, 0
        self._clear()
        san = self._ref()
        if rec is None or san is None or san.closed or forwards != 1 or not rec.cotangents:
            return
        a = self._run(rec)
        b = self._run(rec)
        facts = _compare(rec, a, b)
        if facts is not None:
            san.apply(san.handle.rerun_result(_native.fields(facts)))

    def _run(self, rec: ForwardRecord) -> tuple:
        model = self._model
        mods: list = []
        hooks = [m.register_forward_hook(
            lambda mod, a, out, _n=name: mods.append(
                (_n, type(mod).__name__, _hashes(_float_tensors(out, [])))))
            for name, m in model.named_modules()]
        try:
            with started_from(model, rec), torch.enable_grad():
                out = model(*rec.args, **rec.kwargs)
                outs = [t for t in _float_tensors(out, []) if t.requires_grad]
                pairs = [(outs[i], g) for i, g in sorted(rec.cotangents.items()) if i < len(outs)]
                named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
                grads = torch.autograd.grad([o for o, _ in pairs], [p for _, p in named],
                                            [g for _, g in pairs], allow_unused=True)
            order = list(range(len(named)))[::-1]  # backward order: the output's side first
            gl = [(named[i][0], grads[i]) for i in order if grads[i] is not None]
            ghash = dict(zip([n for n, _ in gl], _hashes([g for _, g in gl])))
            gnames = [n for n, _ in gl]
        finally:
            for h in hooks:
                h.remove()
        return mods, gnames, ghash


def _fingerprints(mods: list, gnames: list = (), ghash: Optional[dict] = None):
    """One run's fingerprints as the C++ comparison takes them (trainsan::RerunFingerprints)."""
    ghash = ghash or {}
    return torch.classes.trainsan.RerunFingerprints(
        [m[0] for m in mods], [m[1] for m in mods], [len(m[2]) for m in mods],
        [h for m in mods for h in m[2]], list(gnames), [ghash[n] for n in gnames])


def _compare(rec: ForwardRecord, a: tuple, b: tuple) -> Optional[dict]:
    """The first difference (RerunFacts by name: where, tensor, type, position, checked), or
    None: the C++ comparison (trainsan::compare_reruns, host/checks/determinism.cpp)."""
    return torch.ops.trainsan.compare_reruns(_fingerprints(rec.modules), _fingerprints(*a),
                                             _fingerprints(*b))


def _distributed() -> bool:
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001
        return False
