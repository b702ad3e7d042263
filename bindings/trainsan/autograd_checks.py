"""Autograd-integrity checks: the facts behind ``inplace_before_backward`` and
``bad_custom_grad``. The rules and messages are C++ (host/checks/autograd.cpp); this module only
gathers facts on sampled steps and hands them to the sanitizer's handle.

* :class:`SavedTensorCheck` pushes saved-tensor hooks (``torch.autograd.graph``) for the training
  forward of a sampled step, from the forward pre-hook to the optimizer step (the op audit's
  window, which also covers the loss computation). Pack fingerprints each saved tensor (Note
  [Saved-tensor fingerprint]) and keeps its version; the first unpack (backward has started)
  fingerprints every pending tensor again and compares them all at once (one read of the
  flags); an unpack whose tensor's fingerprint moved
  while its version did not is a write autograd cannot see. The saved tensor itself is never
  changed: pack keeps a ``detach()`` alias (same storage, same version counter) and unpack returns
  it. Saved-tensor hooks switch off autograd's own version check for the tensors they see, so
  unpack performs it, with autograd's message.
* :class:`CustomGradCheck` wraps ``torch.autograd.Function.apply`` while some sanitizer has
  ``gradcheck_every`` > 0; on sampled steps the first application of each custom Function (not
  torch's own) is re-run in float64 on copies of its inputs: its backward's uᵀJv against central
  differences along a random direction, per differentiable input (Note [Directional gradcheck]).
  The user's RNG state is kept (``fork_rng``) and every evaluation is seeded alike, so a
  stochastic Function (a custom dropout) is evaluated with one random draw.
"""

from __future__ import annotations

import time
import zlib
from typing import Any, Callable, Optional

import torch

from . import _native
from ._patches import Patch

_ops = torch.ops.trainsan

# Note [Saved-tensor fingerprint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# (Σx, Σ|x|) in the tensor's own floating precision (integer tensors: Σx in int64), compared
# bitwise (NaN included): two vectorised reductions that cost about a memory read each (the fused
# statistics pass with its hash costs several times more on CPU), deterministic for an unchanged
# tensor (same data, same layout, same reduction order). A write this check is for — clamp, scale,
# standardise, overwrite, zero — moves them; a change below the sums' rounding (a relative change
# of ~1e-7 of Σ|x|) or one that keeps both sums (a permutation of the elements) is not seen.
_state = {"in_gradcheck": False}


def _fingerprintable(t: torch.Tensor) -> bool:
    return (
        t.layout == torch.strided
        and t.device.type in ("cpu", "cuda")
        and type(t) is torch.Tensor
        and not t.is_complex()
    )


def _resident(t: torch.Tensor) -> bool:
    """Whether t's elements are in memory: FSDP frees the storage of unsharded parameters
    (resize to 0 bytes) after the forward and all-gathers it again just before their backward."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """float64 [2], compared through its bits (Note [Saved-tensor fingerprint])."""
    if t.is_floating_point():
        f = torch.stack([t.sum(), torch.linalg.vector_norm(t, 1)])
    else:
        f = t.sum(dtype=torch.int64).expand(2)
    return f.to(torch.float64).view(torch.int64)


def _node_name() -> str:
    n = torch._C._current_autograd_node()
    return type(n).__name__ if n is not None else ""


class _Saved:
    __slots__ = ("alias", "version", "before", "changed", "name")

    def __init__(self, alias, version, before, name):
        self.alias = alias
        self.version = version
        self.before = before  # the fingerprint's bits, int64 [2], or None: not fingerprinted
        self.changed: Optional[bool] = None  # set by the batched pass at backward start
        self.name = name


class SavedTensorCheck:
    """inplace_before_backward: saved-tensor hooks during a sampled step's training window."""

    def __init__(
        self, handle, param_names: dict, buffer_ids: set, apply: Callable, add_time: Callable
    ):
        self._handle = handle
        self._names = param_names  # id(parameter) -> name
        # Module buffers are state the forward itself updates in place (BatchNorm's running
        # statistics, which batch_norm saves and updates without a version bump; spectral norm's
        # power-iteration vectors): not fingerprinted.
        self._buffers = buffer_ids
        self._apply = apply
        self._add_time = add_time
        self._pack_fn = self._pack  # stable objects: told apart on the hooks stack
        self._unpack_fn = self._unpack
        self._pushed = False
        self._open = False  # fingerprint what is saved (forward start .. backward start)
        self._pending: list = []
        self.windows = 0  # sampled forwards with the hooks pushed
        self.not_checked = 0  # sampled forwards skipped: other saved-tensor hooks active
        self.tensors_checked = 0

    # -- the window -------------------------------------------------------------------------------

    def begin(self) -> None:
        """A sampled training forward starts (forward pre-hook)."""
        self.end()
        if self._pushed:
            return  # our hooks are still below the user's: keep them, no new window
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None or not torch._C._autograd._saved_tensors_hooks_is_enabled():
            # Other hooks (save_on_cpu, checkpoint) would be popped out of order: not this step.
            self.not_checked += 1
            return
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack_fn, self._unpack_fn)
        self._pushed = True
        self._open = True
        self.windows += 1

    def end(self) -> None:
        """The step (optimizer pre-hook), the next forward, or close(): stop fingerprinting and
        pop our hooks when they are on top (else at a later event, once the user's are gone)."""
        self._open = False
        self._pending = []
        if self._pushed:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] is self._pack_fn:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                self._pushed = False

    @property
    def pushed(self) -> bool:
        return self._pushed

    # -- the hooks --------------------------------------------------------------------------------

    def _pack(self, x: torch.Tensor) -> Any:
        try:
            version = x._version
        except Exception:  # inference tensors have no version counter
            version = None
        alias = x.detach()
        if not self._open or _state["in_gradcheck"] or torch.compiler.is_compiling():
            return _Saved(alias, version, None, None)
        t0 = time.perf_counter()
        base = x._base
        if id(x) in self._buffers or (base is not None and id(base) in self._buffers):
            return _Saved(alias, version, None, None)
        before = None
        if version is not None and _fingerprintable(alias):
            try:
                before = _fingerprint(alias)
            except Exception:
                before = None
        name = self._names.get(id(x))
        if name is None and base is not None:
            name = self._names.get(id(base))
            if name is not None:
                name = (name, list(base.shape))  # a view of a parameter (weight.t()): its shape
        rec = _Saved(alias, version, before, name)
        if before is not None:
            self._pending.append(rec)
        self._add_time(time.perf_counter() - t0)
        return rec

    def _flush(self) -> None:
        """Backward has started: fingerprint every pending saved tensor again, in one pass."""
        pending, self._pending = self._pending, []
        self._open = False
        # Not resident now (freed until their own backward: FSDP): fingerprinted alone at unpack.
        pending = [r for r in pending if _resident(r.alias)]
        if not pending:
            return
        try:
            after = torch.stack([_fingerprint(r.alias) for r in pending])
            before = torch.stack([r.before for r in pending])
            changed = (after != before).any(1).tolist()
        except Exception:
            return
        for r, c in zip(pending, changed):
            r.changed = bool(c)

    def _unpack(self, rec: _Saved) -> torch.Tensor:
        a = rec.alias
        if rec.version is not None and a._version != rec.version:
            # What autograd checks itself when no saved-tensor hooks are active.
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{a.type()} {list(a.shape)}], which is saved by "
                f"{_node_name() or 'an autograd node'}, is at version {a._version}; expected "
                f"version {rec.version} instead. Hint: enable anomaly detection to find the "
                "operation that failed to compute its gradient, with "
                "torch.autograd.set_detect_anomaly(True). (TrainSan's saved-tensor check, "
                "active on this step, performs autograd's version check.)"
            )
        if rec.before is None:
            return a
        t0 = time.perf_counter()
        if self._open or self._pending:
            self._flush()
        changed = rec.changed
        if changed is None:  # saved in an earlier window, or not resident at the flush: alone
            try:
                changed = _resident(a) and bool((_fingerprint(a) != rec.before).any().item())
            except Exception:
                changed = False
        rec.before = None  # checked once (a second backward with retain_graph is not rechecked)
        self.tensors_checked += 1
        self._add_time(time.perf_counter() - t0)
        if changed:
            name, shape = rec.name, list(a.shape)
            if isinstance(name, tuple):
                name, shape = name
            dtype = str(a.dtype).replace("torch.", "")
            self._apply(self._handle.saved_tensor_changed(_native.facts(
                "SavedTensorChange", node=_node_name(), tensor=name or "", sizes=shape,
                dtype=dtype)))
        return a


# ------------------------------------------------------------------------------------------------
# bad_custom_grad


_fn_users: list = []  # the CustomGradChecks of the open sanitizers


def _function_apply() -> list:
    orig_fn = torch.autograd.Function.__dict__["apply"].__func__  # a classmethod

    def apply(cls, *args, **kwargs):
        users = [c for c in _fn_users if c.wants(cls)]
        if (
            not users
            or _state["in_gradcheck"]
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()  # traced: Note [Compiled regions] in _compile.py
        ):
            return orig_fn(cls, *args, **kwargs)
        copies = _copies(args)
        out = orig_fn(cls, *args, **kwargs)
        if copies is not None:
            t0 = time.perf_counter()
            for c in users:
                c.seen.add(cls)
            results = _directional_check(orig_fn, cls, copies, kwargs)
            for c in users:
                c._add_time(time.perf_counter() - t0)
            for c in users:
                c.report(cls, results)
        return out

    apply.__wrapped__ = orig_fn  # type: ignore[attr-defined]
    return [(torch.autograd.Function, "apply", classmethod(apply))]


_fn_patch = Patch(_function_apply)


def _patch_function_apply(checker: "CustomGradCheck") -> None:
    _fn_users.append(checker)
    _fn_patch.acquire()


def _unpatch_function_apply(checker: "CustomGradCheck") -> None:
    if checker in _fn_users:
        _fn_users.remove(checker)
        _fn_patch.release()


def _copies(args) -> Optional[list]:
    """float64 copies of the floating tensor arguments (clones of the others), with the
    positions of the differentiable ones; None when nothing is differentiable."""
    diff = [
        k
        for k, a in enumerate(args)
        if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point()
    ]
    if not diff:
        return None
    out = []
    with torch.no_grad():
        for a in args:
            if isinstance(a, torch.Tensor):
                plain = type(a) in (torch.Tensor, torch.nn.Parameter)
                if a.is_complex() or a.layout != torch.strided or not plain:
                    return None
                a = a.detach()
                out.append(a.to(torch.float64, copy=True) if a.is_floating_point() else a.clone())
            else:
                out.append(a)
    return [out, diff]


def _float_outputs(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, torch.Tensor)]
    return []


def _directional_check(orig_fn, cls, copies, kwargs) -> list:
    """Per differentiable input: CustomGradResult by name (autograd_facts.h), but its function. The
    evaluations are Python's (the Function is a Python object); ε and the figures come from the
    C++ measurement's own directional_eps/directional_figures (host/custom_grad.cpp), which
    trainsan::check_custom_grad runs for LibTorch functions."""
    base, diff = copies
    name = f"{cls.__module__}.{cls.__qualname__}"
    seed = zlib.crc32(name.encode()) & 0x7FFFFFFF
    devices = sorted(
        {a.device.index or 0 for a in base if isinstance(a, torch.Tensor) and a.is_cuda}
    )
    gen = torch.Generator().manual_seed(seed)
    _state["in_gradcheck"] = True
    results = []
    try:
        with torch.random.fork_rng(devices=devices):

            torch.manual_seed(seed)
            cpu_state = torch.get_rng_state()
            cuda_states = [torch.cuda.get_rng_state(d) for d in devices]

            def run(xs, grad: bool):
                # One random draw for every evaluation: the same generator states each time.
                torch.set_rng_state(cpu_state)
                for d, st in zip(devices, cuda_states):
                    torch.cuda.set_rng_state(st, d)
                with torch.set_grad_enabled(grad):
                    return _float_outputs(orig_fn(cls, *xs, **kwargs))

            leaves = {k: base[k].clone().requires_grad_() for k in diff}
            xs = [leaves[k].clone() if k in leaves else a for k, a in enumerate(base)]
            outs = run(xs, True)
            keep = [j for j, o in enumerate(outs) if o.requires_grad and o.is_floating_point()]
            if not keep:
                return []
            douts = [outs[j] for j in keep]
            us = [torch.randn(o.shape, dtype=o.dtype, generator=gen).to(o.device) for o in douts]
            grads = torch.autograd.grad(
                douts, [leaves[k] for k in diff], us, allow_unused=True, materialize_grads=True
            )
            with torch.no_grad():
                y0 = run(base, False)
                y0 = [y0[j] for j in keep]
                for a, b in zip(y0, douts):
                    if a.shape != b.shape or not torch.equal(a, b.detach()):
                        return []  # not deterministic under one seed: nothing to compare
                low = any(o.dtype != torch.float64 for o in y0)
                us = [u.to(o.dtype) for u, o in zip(us, y0)]
                for i, k in enumerate(diff):
                    x = base[k]
                    v = torch.randn(x.shape, dtype=torch.float64, generator=gen).to(x.device)
                    eps = _ops.directional_eps(x, low)
                    plus = list(base)
                    plus[k] = x + eps * v
                    minus = list(base)
                    minus[k] = x - eps * v
                    yp, ym = run(plus, False), run(minus, False)
                    yp, ym = [yp[j] for j in keep], [ym[j] for j in keep]
                    # CustomGradResult's figures by name
                    figures = _ops.directional_figures(us, v, y0, yp, ym, grads[i], eps)
                    results.append(dict(figures, input_index=k))
    except Exception:
        return []  # a Function that cannot run in float64 or on copies: not checked
    finally:
        _state["in_gradcheck"] = False
    return results


class CustomGradCheck:
    """bad_custom_grad: checks custom Functions applied during sampled steps."""

    def __init__(self, handle, apply: Callable, add_time: Callable):
        self._handle = handle
        self._apply = apply
        self._add_time = add_time
        self.armed = False
        self.seen: set = set()
        self._step = -1
        self.functions_checked = 0
        _patch_function_apply(self)

    def begin(self, armed: bool, step: int) -> None:
        """A training forward (forward pre-hook): armed on the steps the sanitizer samples."""
        if step != self._step:
            self.seen = set()
            self._step = step
        self.armed = armed

    def end(self) -> None:
        self.armed = False

    def wants(self, cls) -> bool:
        return (
            self.armed
            and cls not in self.seen
            and not cls.__module__.startswith("torch.")
            and getattr(cls, "trainsan_gradcheck", True)
        )

    def report(self, cls, results: list) -> None:
        name = f"{cls.__module__}.{cls.__qualname__}"
        self.functions_checked += 1
        found: list = []
        for r in results:
            found += self._handle.custom_grad_result(_native.fields(dict(r, function=name)))
        self._apply(found)

    def close(self) -> None:
        self.armed = False
        _unpatch_function_apply(self)
