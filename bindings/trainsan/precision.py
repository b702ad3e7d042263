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

import json
import math
import struct
import warnings
import weakref
from typing import Any, Optional

import torch

from . import _native
from ._hooks import DUE_HEADROOM, DUE_PROVENANCE, DUE_STEP
from ._facts import _local, run_guarded
from .stats import FLOAT_FIELDS

_ABSMAX_COL = FLOAT_FIELDS.index("absmax")

FP16_MAX = 65504.0
_MAX_OUTPUTS = 8  # floating tensors flagged per module output (a tuple of many is a container)
_MAX_RANGE = 1  # float32 outputs beyond the fp16 range named per step: the first (the cause)


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
        self.ranges: list = []  # headroom steps: (module name, dtype, output)

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
            mins = torch.stack([self.values[k][0] for k in ks])
            maxs = torch.stack([self.values[k][1] for k in ks])
            out[ks] = torch.stack([mins, maxs], dim=1).double().cpu()
        return out


class Provenance:
    """The armed module hooks of one sanitizer."""

    def __init__(self, san, model: torch.nn.Module):
        self._san_ref = weakref.ref(san)  # the Sanitizer owns this object
        self._modules = [(n, m) for n, m in model.named_modules()]
        self._handles: list = []
        self._forward: Optional[_Pass] = None
        self._backward: Optional[_Pass] = None
        self._backward_done = True
        self._headroom = False  # this forward records its outputs' range counts
        self._ranged: set = set()
        self._step = 0
        self._headroom_step = -1
        self.disabled = False  # a compiled model: hooks would make dynamo recompile

    # -- arming ------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A training forward starts: read what the previous passes left, arm if due."""
        self.read_all()
        san = self._san_ref()
        if san is None or self.disabled:
            return
        self._step = san.due(DUE_STEP)
        # Once per step number (a skipped step repeats it).
        self._headroom = san.due(DUE_HEADROOM) and self._step != self._headroom_step
        if self._headroom:
            self._headroom_step = self._step
        if not (self._headroom or san.due(DUE_PROVENANCE)):
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
                if self._headroom and id(t) not in self._ranged:
                    self._ranged.add(id(t))
                    fwd.ranges.append((name, t.dtype, t.detach()))
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
        self._ranged = set()
        if fwd is not None and fwd.values:
            self._guarded(fwd, False)
        if fwd is not None and fwd.ranges:
            self._write_ranges(fwd.ranges)

    def _write_ranges(self, ranges: list) -> None:
        san = self._san_ref()
        if san is None or san.closed:
            return
        try:
            rows = range_rows([t for _, _, t in ranges])
            for (name, dtype, _), row in zip(ranges, rows):
                san.handle.trace_record(json.dumps(
                    range_record(self._step, "output", name or "(model)", dtype, row),
                    separators=(",", ":")))
        except Exception as exc:  # noqa: BLE001 - never crash the job TrainSan watches
            warnings.warn(f"trainsan: precision headroom of module outputs skipped "
                          f"({type(exc).__name__}: {exc})", stacklevel=3)

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
        run_guarded(self._report, (p, backward),
                    "overflow provenance (reading its flags failed)",
                    lambda: setattr(self, "disabled", True))

    def close(self) -> None:
        self._disarm()
        self._forward = self._backward = None

    def _report(self, p: _Pass, backward: bool) -> None:
        vals = p.read()
        if vals is None:
            return
        bad = ~torch.isfinite(vals).all(dim=1)
        first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1
        origin, ranges = None, []
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
            prior, where = 0.0, ""
            if first > 0:
                mags = vals[:first].abs().max(dim=1).values
                j = int(mags.argmax())
                prior = float(mags[j])
                n_j, _, _, d_j, _, in_j = p.meta[j]
                where = (f"the {'input' if in_j else 'output'} of {n_j or 'the model'} "
                         f"({d_j})")
            origin = _native.record(
                "ModuleOrigin", module=name, type=typ, dtype=dtype, autocast=ac,
                backward=backward, input=bool(is_input), inf_only=inf_only, position=first + 1,
                checked=len(p.meta), beyond_fp16=beyond, prior_absmax=prior, prior_where=where)
            if not backward:
                # float32 outputs beyond the fp16 range before it, under fp16 autocast: causes.
                for k in range(first):
                    n2, _, t2, d2, ac2, _ = p.meta[k]
                    big = float(vals[k].abs().max())
                    if ac2 == "float16" and d2 in ("float32", "float64") and big > FP16_MAX:
                        ranges.append(_native.record("RangeOverflow", module=n2, type=t2,
                                                     dtype=d2, absmax=big))
                        if len(ranges) >= _MAX_RANGE:
                            break
        san = self._san_ref()
        if san is not None and not san.closed:
            san.apply(san.handle.provenance(_native.facts(
                "Provenance", forward_checked=0 if backward else len(p.meta),
                backward_checked=len(p.meta) if backward else 0,
                forward=None if backward else origin, backward=origin if backward else None,
                fp16_range=ranges)))


# -- precision headroom ------------------------------------------------------------------------
#
# Note [Precision headroom]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Which tensors would survive a move to a narrower format, before the user tries? Per tensor, on
# the steps headroom_every samples (with a trace): of its finite nonzero values, how many would
# round to zero, round to a subnormal (precision lost) or overflow (to ±Inf, or NaN in FP8 E4M3)
# when cast to each format. float16 and bfloat16 are judged as autocast casts them (unscaled); the
# FP8 formats under per-tensor amax scaling as Transformer Engine applies it: y = |x| * s in
# float32 with s = fmax / amax (float32), then cast. The boundaries are the formats' own rounding
# points under round-to-nearest-even: a value rounds to zero at or below half the smallest
# subnormal (the tie goes to the even zero), to a subnormal below the midpoint between the largest
# subnormal and the smallest normal, and overflows at or above the midpoint between the largest
# finite value and the next step of the exponent. Every boundary becomes a threshold on |x| itself
# (for the scaled formats: the largest float32 a with fl(a * s) <= the boundary, which is exact
# because fl(a * s) is monotonic in a), so one pass per tensor counts every class of every format
# (torch.ops.trainsan.range_histogram: a parallel loop on the CPU, bucketize on a GPU), after one
# fused statistics pass for every tensor's amax. float64 tensors are compared in float64: their FP8
# classes can differ from a cast of fl32(x) for values within half a float32 ulp of a boundary.
# Tested against torch's own casts (tests/python/test_precision_headroom.py).


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _fl32(v: float) -> float:
    """v rounded to float32 (round to nearest even); ±inf beyond its range."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _down32(v: float) -> float:
    """The next float32 below a positive float32 v."""
    return _f32(_bits(v) - 1) if v > 0 else 0.0


def _up32(v: float) -> float:
    return _f32(_bits(v) + 1)


# name -> (largest finite, overflow midpoint, smallest normal, round-to-zero bound, scaled)
FORMATS = {
    "float16": (65504.0, 65520.0, 2.0 ** -14, 2.0 ** -25, False),
    "bfloat16": (_f32(0x7F7F0000), _f32(0x7F7F8000), 2.0 ** -126, 2.0 ** -134, False),
    "float8_e4m3": (448.0, 464.0, 2.0 ** -6, 2.0 ** -10, True),
    "float8_e5m2": (57344.0, 59392.0, 2.0 ** -14, 2.0 ** -17, True),
}
CLASSES = ("zero", "subnormal", "overflow")  # per format, in the trace's lists


def _scaled_bound(bound: float, s: float) -> float:
    """The largest float32 a >= 0 with fl32(a * s) <= bound (s a positive float32)."""
    c = _fl32(bound / s)
    if math.isinf(c):
        c = _f32(0x7F7FFFFF)
    while c > 0 and _fl32(c * s) > bound:
        c = _down32(c)
    while c < _f32(0x7F7FFFFF) and _fl32(_up32(c) * s) <= bound:
        c = _up32(c)
    return c


def _thresholds(dtype: torch.dtype, amax: float) -> list:
    """Per format (zero, subnormal-or-zero, not-overflow) upper bounds on |x|."""
    out = []
    s_amax = _fl32(amax) if amax > 0 and math.isfinite(amax) else 0.0
    for fmax, ovf, normal, zero, scaled in FORMATS.values():
        bounds = (zero, _down32(normal - zero), _down32(ovf))
        if not scaled:
            if dtype == torch.float64:
                bounds = (zero, math.nextafter(normal - zero, 0.0), math.nextafter(ovf, 0.0))
            out.append(bounds)
            continue
        s = _fl32(fmax / s_amax) if s_amax > 0 else 1.0
        if math.isinf(s) or s == 0.0:
            s = _f32(0x7F7FFFFF) if math.isinf(s) else 1.0
        out.append(tuple(_scaled_bound(b, s) for b in bounds))
    return out


def range_rows(tensors: list) -> list:
    """[(counts, amax)] per tensor: counts = [numel, non-finite, finite nonzero, then per format
    (FORMATS order) to zero, subnormal, overflow]; amax its largest finite magnitude."""
    if not tensors:
        return []
    local = [_local(t).detach() for t in tensors]
    out: list = [None] * len(local)
    groups: dict = {}
    for k, t in enumerate(local):
        groups.setdefault(t.device, []).append(k)
    for ks in groups.values():
        _, floats = torch.ops.trainsan.tensor_stats([local[k] for k in ks])
        amaxes = floats[:, _ABSMAX_COL].cpu().tolist()
        for k, amax in zip(ks, amaxes):
            amax = 0.0 if amax != amax else amax  # no finite element
            t = local[k]
            ths = _thresholds(t.dtype, amax)
            flat = sorted({b for th in ths for b in th})
            h = torch.ops.trainsan.range_histogram(t, flat).cpu().tolist()
            nonfinite, bins = h[0], h[2:]
            nonzero = sum(bins)
            cum, acc = {}, 0
            for b, n in zip(flat, bins):
                acc += n
                cum[b] = acc
            ints = [t.numel(), nonfinite, nonzero]
            for z, sub, ok in ths:
                ints += [cum[z], cum[sub] - cum[z], nonzero - cum[ok]]
            out[k] = (ints, amax)
    return out


def range_record(step: int, what: str, name: str, dtype: torch.dtype, row: tuple) -> dict:
    """One trace record {"type": "range", ...} of range_rows' row."""
    ints, amax = row
    rec = {"type": "range", "step": step, "what": what, "tensor": name,
           "dtype": _dtype_name(dtype), "numel": ints[0], "nonfinite": ints[1],
           "nonzero": ints[2], "amax": amax}
    for k, name_ in enumerate(FORMATS):
        rec[name_] = ints[3 + 3 * k: 6 + 3 * k]
    return rec


def write_headroom(handle, tracked: list, opt_index: list, k: int, step: int) -> None:
    """Note [Precision headroom]: range counts of optimizer k's weights (after the step) and
    gradients, as trace records; `tracked`: the attached (name, parameter) pairs, `opt_index`
    each one's optimizer."""
    try:
        items = []
        for (name, p), opt in zip(tracked, opt_index):
            if opt != k or not p.is_floating_point():
                continue
            items.append(("weight", name, p))
            g = p.grad
            if g is not None and g.is_floating_point() and g.layout == torch.strided:
                items.append(("grad", name, g))
        rows = range_rows([t for _, _, t in items])
        for (what, name, t), row in zip(items, rows):
            handle.trace_record(json.dumps(range_record(step, what, name, t.dtype, row),
                                           separators=(",", ":")))
    except Exception as exc:  # noqa: BLE001 - never crash the job TrainSan watches
        warnings.warn(f"trainsan: precision headroom skipped at step {step} "
                      f"({type(exc).__name__}: {exc})", stacklevel=3)
