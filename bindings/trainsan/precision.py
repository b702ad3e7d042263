"""Overflow provenance: the armed module hooks (Note [Overflow provenance] in
host/checks/precision.cpp) and the gradient scaler's facts.

On an armed step (the sanitizer's C++ side says which: every ``provenance_every``-th step and the
``provenance_rearm`` steps after a non-finite value or a scaler skip) every submodule of the
attached model gets a forward hook for that step only: one ``aminmax`` per floating output on its
device (NaN propagates to both ends, ±Inf shows, a float32 value beyond ±65504 shows) and, where
the output needs a gradient, a tensor hook that does the same to the gradient arriving at it in
the backward. Nothing is read on the way: the flags are read once per pass (forward: when its
loss is watched or the step begins; backward: when the step begins or the scaler skips it), and
only the first non-finite tensor in execution order — with the module's parameters beyond the
fp16 range when it ran under fp16 autocast — goes to the sanitizer as facts. The hooks never
change an output or a gradient, and are removed when the pass's flags are read.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Optional

import torch

from ._facts import _local

FP16_MAX = 65504.0
_MAX_OUTPUTS = 8  # floating tensors flagged per module output (a tuple of many is a container)
_MAX_RANGE = 3  # float32 outputs beyond the fp16 range named per step


def _float_tensors(out: Any, acc: list) -> list:
    if isinstance(out, torch.Tensor):
        if out.is_floating_point() and out.numel() > 0 and len(acc) < _MAX_OUTPUTS:
            acc.append(out)
    elif isinstance(out, (list, tuple)):
        for o in out:
            _float_tensors(o, acc)
    elif isinstance(out, dict):
        for o in out.values():
            _float_tensors(o, acc)
    return acc


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _autocast_dtype(device_type: str) -> str:
    try:
        if torch.is_autocast_enabled(device_type):
            return _dtype_name(torch.get_autocast_dtype(device_type))
    except Exception:  # noqa: BLE001 - a device type autocast does not know
        pass
    return ""


class _Pass:
    """The flags of one forward or one backward: per flagged tensor its metadata and its
    (min, max) on its device."""

    def __init__(self) -> None:
        self.meta: list = []  # (module name, module, type, dtype, autocast, is an input)
        self.values: list = []  # (min, max): 0-d tensors on the tensor's device, in its dtype
        self.seen: dict = {}  # id -> tensor flagged (kept alive: ids are not reused meanwhile)

    def add(self, name: str, module, t: torch.Tensor, autocast: str, is_input=False) -> None:
        self.seen[id(t)] = t
        local = _local(t).detach()  # a DTensor: this rank's shard
        if local.numel() == 0:
            return
        self.values.append(torch.aminmax(local))  # one reduction; stacked when read
        self.meta.append(
            (name, module, type(module).__name__, _dtype_name(t.dtype), autocast, is_input))

    def read(self) -> Optional[torch.Tensor]:
        """[n, 2] float64 on the host (one stack and one read per device and dtype)."""
        if not self.values:
            return None
        groups: dict = {}
        for k, (mn, _) in enumerate(self.values):
            groups.setdefault((mn.device, mn.dtype), []).append(k)
        out = torch.empty(len(self.values), 2, dtype=torch.float64)
        for ks in groups.values():
            pairs = torch.stack([torch.stack(self.values[k]) for k in ks]) if len(ks) < 2 else None
            if pairs is None:
                mins = torch.stack([self.values[k][0] for k in ks])
                maxs = torch.stack([self.values[k][1] for k in ks])
                pairs = torch.stack([mins, maxs], dim=1)
            out[ks] = pairs.double().cpu()
        return out


class Provenance:
    """The armed module hooks of one sanitizer."""

    def __init__(self, san, model: torch.nn.Module):
        self._san_ref = weakref.ref(san)  # the Sanitizer owns this object
        self._modules = [(n, m) for n, m in model.named_modules()]
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._handles: list = []
        self._forward: Optional[_Pass] = None
        self._backward: Optional[_Pass] = None
        self._backward_done = True
        self.disabled = False  # a compiled model: hooks would make dynamo recompile

    # -- arming ------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A training forward starts: read what the previous passes left, arm if due."""
        self.read_all()
        san = self._san_ref()
        if san is None or self.disabled or not san._handle.provenance_armed():
            return
        self._forward = _Pass()
        self._backward = _Pass()
        self._backward_done = False
        hook, pre = self._hook, self._pre_hook
        for name, m in self._modules:
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, _n=name: pre(_n, mod, args)))
            self._handles.append(m.register_forward_hook(
                lambda mod, args, out, _n=name: hook(_n, mod, out)))

    def _pre_hook(self, name: str, module, args) -> None:
        """The module's inputs that no flagged output held: made between submodules."""
        fwd = self._forward
        if fwd is None or not torch.is_grad_enabled():
            return
        try:
            if torch.compiler.is_compiling():
                return
            for t in _float_tensors(args, []):
                if id(t) not in fwd.seen:
                    fwd.add(name, module, t, _autocast_dtype(t.device.type), is_input=True)
        except Exception:  # noqa: BLE001 - never break the user's forward
            pass

    def _hook(self, name: str, module, out) -> None:
        fwd, bwd = self._forward, self._backward
        if fwd is None or bwd is None or not torch.is_grad_enabled():
            return
        try:
            if torch.compiler.is_compiling():
                return
            for t in _float_tensors(out, []):
                ac = _autocast_dtype(t.device.type)
                fwd.add(name, module, t, ac)
                if t.requires_grad:
                    t.register_hook(
                        lambda g, _n=name, _m=module, _ac=ac: self._grad_hook(bwd, _n, _m, g, _ac)
                    )
        except Exception:  # noqa: BLE001 - never break the user's forward
            pass

    def _grad_hook(self, bwd: _Pass, name: str, module, grad, ac: str) -> None:
        if bwd is not self._backward or self._backward_done or grad is None:
            return
        try:
            if grad.is_floating_point() and grad.numel() > 0:
                bwd.add(name, module, grad, ac)
        except Exception:  # noqa: BLE001 - never break the user's backward
            pass

    def _disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- reading -----------------------------------------------------------------------------

    def read_forward(self) -> None:
        """Before a loss is watched: the forward's flags to the sanitizer."""
        fwd, self._forward = self._forward, None
        self._disarm()
        if fwd is not None and fwd.values:
            self._guarded(fwd, False)

    def read_all(self) -> None:
        """Before the step (or a scaler skip, or the next forward): both passes' flags."""
        self.read_forward()
        bwd = self._backward
        if bwd is None:
            return
        self._backward = None
        self._backward_done = True
        if bwd.values:
            self._guarded(bwd, True)

    def _guarded(self, p: "_Pass", backward: bool) -> None:
        """_report; a failure of this machinery (not a finding) switches it off with a warning
        instead of reaching the training loop."""
        from ._findings import TrainingBugError

        try:
            self._report(p, backward)
        except TrainingBugError:
            raise
        except Exception as exc:  # noqa: BLE001 - never crash the job TrainSan watches
            self.disabled = True
            warnings.warn(
                f"trainsan: overflow provenance stops: reading its flags failed "
                f"({type(exc).__name__}: {exc}); the other checks go on",
                stacklevel=4,
            )

    def close(self) -> None:
        self._disarm()
        self._forward = self._backward = None

    def _report(self, p: _Pass, backward: bool) -> None:
        vals = p.read()
        if vals is None:
            return
        bad = ~torch.isfinite(vals).all(dim=1)
        origin_strs, origin_ints, names, counts = [], [], [], []
        first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
        range_strs, range_max = [], []
        if first >= 0:
            name, module, typ, dtype, ac, is_input = p.meta[first]
            beyond = []
            if ac == "float16" and not backward and not is_input:
                for pn, prm in module.named_parameters(prefix=name):
                    if prm.is_floating_point():
                        n = int((prm.detach().abs() > FP16_MAX).logical_and(
                            torch.isfinite(prm.detach())).sum())
                        if n:
                            beyond.append((pn, n))
            mn, mx = vals[first].tolist()
            inf_only = not (mn != mn or mx != mx)  # neither end NaN: ±Inf only
            origin_strs += [name, typ, dtype, ac]
            origin_ints += [int(backward), int(inf_only), first + 1, len(p.meta), len(beyond),
                            int(is_input)]
            names += [b[0] for b in beyond]
            counts += [b[1] for b in beyond]
            if not backward:
                # float32 outputs beyond the fp16 range before it, under fp16 autocast: causes.
                for k in range(first):
                    n2, _, t2, d2, ac2, _ = p.meta[k]
                    big = float(vals[k].abs().max())
                    if ac2 == "float16" and d2 in ("float32", "float64") and big > FP16_MAX:
                        range_strs += [n2, t2, d2]
                        range_max.append(big)
                        if len(range_max) >= _MAX_RANGE:
                            break
        fc = len(p.meta) if not backward else 0
        bc = len(p.meta) if backward else 0
        san = self._san_ref()
        if san is not None and not san._closed:
            san._apply(san._handle.provenance(
                fc, bc, origin_strs, origin_ints, names, counts, range_strs, range_max))
