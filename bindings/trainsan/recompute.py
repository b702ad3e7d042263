"""nondeterminism of activation checkpointing: the recompute checks of Note [Recompute checks]
(host/checks/determinism.cpp).

torch.utils.checkpoint runs a region's function twice: for the forward, and again in the backward,
whose gradients are those of the second call. On the steps recompute_every samples, each region's
function is wrapped (_Region) so that its first call and its second fingerprint their floating
outputs and the RNG states at their starts; before the optimizer step the sanitizer hands each
region's two records to the C++ comparison (trainsan::compare_recompute), which words a difference.
The wrapper is installed while a sanitizer is attached (Note [Patches]); attach re-points the
module globals and the model's stored checkpoint functions made before it. Unsampled steps cost
one check of a flag per region call (Note [Recompute wrapper]).
"""

from __future__ import annotations

import functools
import hashlib
import sys
import weakref
from typing import Any, Optional

import torch
import torch.utils.checkpoint as _tuc

from . import _native
from ._hooks import DUE_RECOMPUTE
from ._facts import _local
from ._rerun import rng as _rng
from .precision import _float_tensors
from ._registry import Patch
from .replicas import _HASH_COL

# Note [Recompute wrapper]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# torch.utils.checkpoint.checkpoint is replaced, while a sanitizer is attached (the "checkpoint"
# row of Note [Patches]), by checkpoint() below; so is every other module's global that holds the
# original (transformers' modeling_utils imports it by name, and gradient_checkpointing_enable()
# stores functools.partial(checkpoint, **kwargs) on the model's layers: attach() re-points those
# partials too, and checkpoint_sequential() calls the module's global, so it goes through the
# wrapper as well). The last close puts every one of them back.
# While no open sanitizer samples its current step (_sampling[0] == 0), the wrapper calls the
# original at once: one check of a flag per region call. On a sampled step it wraps the region's
# function in a _Region, which fingerprints what its first two calls return: the forward (under
# no_grad with use_reentrant=True, or with grad enabled under the checkpoint's saved-tensor hooks
# with use_reentrant=False) and the recompute in the backward. The non-reentrant checkpoint stops
# a recompute as soon as it has recomputed the tensors the backward needs (early stop: it raises
# out of the function before it returns); on a sampled step the wrapper turns early stop off for
# that region's call (set_checkpoint_early_stop(False) while checkpoint() builds the region), so
# that the recompute runs to its end and returns its outputs. The numbers are the same: early
# stop only skips work after the last saved tensor; the step costs the rest of each region's
# recompute once. The fingerprints stay on the device (one fused pass per call, no read) until
# the step, which reads them all at once. Under torch.compile the original is called (Dynamo
# traces checkpoint itself); a region called without grad (eval, no_grad) or whose outputs need
# no gradient is never recomputed and has nothing to compare.

_ORIGINAL = _tuc.checkpoint
_sampling = [0]  # open sanitizers whose current step is sampled
_regions: list = []  # the _Regions of the sampled steps, until a sanitizer takes them
_MAX_REGIONS = 4096


class _Region:
    """A checkpointed function; its first two calls are recorded (forward, recompute)."""

    __slots__ = ("fn", "calls", "records", "failed", "__weakref__")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls = 0
        self.records: list = []  # (rng fingerprints, device tensor of output fingerprints | None)
        self.failed = False

    def __call__(self, *args, **kwargs):
        n = self.calls
        self.calls += 1
        if n > 1 or self.failed:
            return self.fn(*args, **kwargs)
        try:
            rng = _rng_fingerprints()
        except Exception:  # noqa: BLE001 - the check never breaks the training
            self.failed = True
            return self.fn(*args, **kwargs)
        out = self.fn(*args, **kwargs)
        try:
            ts = [_local(t).detach() for t in _float_tensors(out, [])
                  if t.layout == torch.strided]
            hashes = torch.ops.trainsan.tensor_stats(ts)[0][:, _HASH_COL] if ts else None
            self.records.append((rng, hashes))
        except Exception:  # noqa: BLE001
            self.failed = True
        return out


def _digest(t: torch.Tensor) -> int:
    d = hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=8)
    return int.from_bytes(d.digest(), "little", signed=True)


def _rng_fingerprints() -> list:
    cpu, cuda = _rng()
    return [_digest(cpu)] + [_digest(s) for s in (cuda or [])]


@functools.wraps(_ORIGINAL)
def checkpoint(function, *args, **kwargs):
    if not _sampling[0] or len(_regions) >= _MAX_REGIONS or torch.compiler.is_compiling():
        return _ORIGINAL(function, *args, **kwargs)
    region = _Region(function)
    _regions.append(region)
    if kwargs.get("use_reentrant", True) is False:
        with _tuc.set_checkpoint_early_stop(False):  # Note [Recompute wrapper]
            return _ORIGINAL(region, *args, **kwargs)
    return _ORIGINAL(region, *args, **kwargs)


def _repoint(obj: Any) -> Any:
    """`obj` with the original checkpoint replaced by ours: itself, or a partial of ours."""
    if obj is _ORIGINAL:
        return checkpoint
    if isinstance(obj, functools.partial) and obj.func is _ORIGINAL:
        return functools.partial(checkpoint, *obj.args, **obj.keywords)
    return None


def _globals() -> list:
    """(module, name, ours) for each module global that holds the original checkpoint."""
    out = []
    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not isinstance(d, dict) or mod is _tuc or d is globals():
            continue
        try:
            out += [(mod, name, checkpoint) for name, v in list(d.items()) if v is _ORIGINAL]
        except Exception:  # noqa: BLE001 - an odd module object
            continue
    return out


def rebind(model: Optional[torch.nn.Module] = None) -> None:
    """Point the modules' globals (and `model`'s stored checkpoint functions) that hold the
    original checkpoint at ours (Note [Recompute wrapper]); put back with the patch."""
    if not _patch.held():
        return
    _patch.extend(_globals())
    if model is not None:
        stored = []
        for m in model.modules():
            f = m.__dict__.get("_gradient_checkpointing_func")
            new = _repoint(f) if f is not None else None
            if new is not None:
                stored.append((m, "_gradient_checkpointing_func", new))
        _patch.extend(stored)


_patch = Patch("checkpoint", ("attach",),
               ["torch.utils.checkpoint.checkpoint", "* module globals bound to it",
                "* a model's stored partial(checkpoint) (_gradient_checkpointing_func)"],
               lambda: [(_tuc, "checkpoint", checkpoint)] * (_tuc.checkpoint is _ORIGINAL) +
               _globals())


def _module_of(fn: Any, names: dict) -> tuple:
    """(the module a region runs, the name of what it runs) for naming it: a module, a bound
    method of one, a partial of either (transformers: partial(forward, layer)), a segment of
    checkpoint_sequential, or a closure over a module of the model."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            if fn.args and isinstance(fn.args[0], torch.nn.Module):
                return fn.args[0], ""
            fn = fn.func
            continue
        if isinstance(fn, torch.nn.Module):
            return fn, ""
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            name = getattr(fn, "__name__", "")
            return owner, "" if name == "forward" else name
        break
    code = getattr(fn, "__code__", None)
    cells = dict(zip(code.co_freevars, fn.__closure__ or ())) if code is not None else {}
    try:
        if code is not None and code.co_name == "forward" and {"functions", "start", "end"} <= \
                set(cells):  # checkpoint_sequential's segment
            fs, a, b = (cells[k].cell_contents for k in ("functions", "start", "end"))
            first, last = _name(fs[a], names), _name(fs[b], names)
            return None, first if a == b else f"{first}..{last}"
        kw = getattr(fn, "__kwdefaults__", None) or {}
        bound = [c.cell_contents for c in cells.values()] + \
            list(getattr(fn, "__defaults__", None) or ()) + list(kw.values())
        for v in bound:  # a closure over a module, or a lambda's default argument
            if isinstance(v, torch.nn.Module) and id(v) in names:
                return v, ""
    except (ValueError, IndexError, TypeError):  # an empty cell, an odd segment
        pass
    return None, ""


def _name(obj: Any, names: dict) -> str:
    n = names.get(id(obj))
    if n is not None:
        return n or "(model)"
    return type(obj).__name__


def region_name(fn: Any, names: dict) -> tuple:
    """(region, type) of a checkpointed function, given the model's {id(module): name}."""
    mod, what = _module_of(fn, names)
    if mod is not None:
        where = _name(mod, names)
        return (f"{where}.{what}" if what else where), type(mod).__name__
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if what:  # a segment of checkpoint_sequential
        return what, "checkpoint_sequential"
    return qual, qual


def _read(hashes: list) -> dict:
    """id(device tensor of fingerprints) -> its values: one read per device."""
    out: dict = {}
    by_device: dict = {}
    for h in hashes:
        by_device.setdefault(h.device, []).append(h)
    for hs in by_device.values():
        flat = torch.cat([h.reshape(-1) for h in hs]).cpu().tolist()
        k = 0
        for h in hs:
            out[id(h)] = flat[k:k + h.numel()]
            k += h.numel()
    return out


class RecomputeWatch:
    """The recompute checks of one sanitizer (Note [Recompute checks]), held by its
    nondeterminism gatherer (_gatherers.Reruns)."""

    def __init__(self, san, model: torch.nn.Module) -> None:
        self._ref = weakref.ref(san)
        self._model = model
        self._sampling = False
        _patch.acquire("attach")
        self._held = True
        rebind(model)  # gradient_checkpointing_enable() before attach (Note [Recompute wrapper])

    def on_forward(self) -> None:
        """A training forward of the attached model: is this step sampled?"""
        if self._sampling:
            return
        san = self._ref()
        if san is None or san.closed or not _patch.held() or not san.due(DUE_RECOMPUTE):
            return
        self._sampling = True
        _sampling[0] += 1

    def _stop(self) -> None:
        if self._sampling:
            self._sampling = False
            _sampling[0] -= 1

    def before_step(self) -> None:
        """Before the optimizer step: compare the regions recomputed since the step began."""
        if not self._sampling:
            return
        self._stop()
        san = self._ref()
        names = {id(m): n for n, m in self._model.named_modules()}
        mine = []
        for r in list(_regions):
            mod, _ = _module_of(r.fn, names)
            if mod is None or id(mod) in names or not _sampling[0]:
                mine.append(r)
        taken = {id(r) for r in mine}
        _regions[:] = [r for r in _regions if id(r) not in taken]
        if san is None or san.closed:
            return
        done = [r for r in mine if not r.failed and len(r.records) == 2]
        if not done:
            return
        read = _read([h for r in done for _, h in r.records if h is not None])
        reports = []
        for r in done:
            (rng_a, ha), (rng_b, hb) = r.records
            a = read[id(ha)] if ha is not None else []
            b = read[id(hb)] if hb is not None else []
            region, kind = region_name(r.fn, names)
            facts = torch.ops.trainsan.compare_recompute(region, kind, a, rng_a, b, rng_b)
            if facts is not None:
                reports.append(_native.fields(facts))
        for facts in reports:
            san.apply(san.handle.rerun_result(facts))

    def close(self) -> None:
        self._stop()
        if not _sampling[0]:
            _regions.clear()
        if self._held:
            self._held = False
            _patch.release("attach")

    def __del__(self) -> None:  # a sanitizer dropped without close() samples no more
        self._stop()
