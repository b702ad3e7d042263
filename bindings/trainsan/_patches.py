"""Process-wide patches (Note [Patches], _registry.py), each installed while at least one
sanitizer is open: GradScaler.step (AMP skips), DataLoader iteration (Note [Stuck data], Note
[Repeated batches]; also held by the load journal for Note [Data position]),
Optimizer/Module.zero_grad (Note [Discarded gradients]), torch.autograd.backward /
GradScaler.scale (Note [Loss roots]; also held by the launcher, whose pairing runs first) and
torch.save (Note [Checkpoint checks]); and the registries of open sanitizers they and the compile
entry (_compile.py) look sanitizers up in."""

from __future__ import annotations

import weakref
import zlib
from typing import Any, Optional

import torch

from . import _foreign, _position
from ._facts import _flat_tensors
from ._findings import TrainingBugError
from ._registry import Patch


# The open sanitizers' Contexts (Note [Context]), held weakly (Note [Sanitizer lifetime] in
# _hooks.py).
_open_sanitizers: "weakref.WeakSet" = weakref.WeakSet()  # of Context
# The same as a tuple of weak references, rebuilt at each register/unregister: the per-step
# events read it (iterating a WeakSet costs tens of microseconds in a training step).
_open_refs: tuple = ()


def open_sanitizers() -> list:
    """The Contexts of the open sanitizers (not closed, not collected)."""
    out = []
    for ref in _open_refs:
        ctx = ref()
        if ctx is not None and not ctx.closed:
            out.append(ctx)
    return out


def _rebuild_open() -> None:
    global _open_refs
    _open_refs = tuple(weakref.ref(s) for s in list(_open_sanitizers))

# optimizer -> the Contexts of the sanitizers watching it (its GradScaler steps)
_watchers: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.WeakSet]" = (
    weakref.WeakKeyDictionary())
# model -> weakref to the Context of the sanitizer attach() attached to it
_attached: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def register(ctx) -> None:
    """An open sanitizer (its Context): the patches' events (and its optimizers' GradScaler
    steps) reach it."""
    for opt in ctx.optimizers:
        _watchers.setdefault(opt, weakref.WeakSet()).add(ctx)
    _open_sanitizers.add(ctx)
    _rebuild_open()


def unregister(ctx) -> None:
    """A closed sanitizer: out of every registry (attach() may attach its model again)."""
    for opt in ctx.optimizers:
        ws = _watchers.get(opt, [])
        if ctx in ws:
            ws.remove(ctx)
    _open_sanitizers.discard(ctx)
    _rebuild_open()
    ref = _attached.get(ctx.model)
    if ref is not None and ref() in (ctx, None):
        del _attached[ctx.model]


def attached_to(model: torch.nn.Module) -> Optional[Any]:
    """The Context of the open sanitizer attach() attached to `model` (the module itself), or
    None."""
    ref = _attached.get(model)
    ctx = ref() if ref is not None else None
    return None if ctx is None or ctx.closed or ctx.sanitizer() is None else ctx


# GradScaler.step is wrapped while any sanitizer is open, to tell an AMP skip (the scaler found
# Inf/NaN and did not call optimizer.step) from a forgotten optimizer.step().
class _StepCounts:
    """optimizer -> optimizer steps seen so far, holding the optimizer weakly. A dict keyed by
    id() with the weak reference beside the count: a WeakKeyDictionary makes a new weak reference
    at every lookup and store, on the path of every step."""

    def __init__(self) -> None:
        self._d: dict = {}  # id(opt) -> [weakref(opt), count]

    def get(self, opt: Any, default: int = 0) -> int:
        e = self._d.get(id(opt))
        return e[1] if e is not None and e[0]() is opt else default

    def bump(self, opt: Any) -> None:
        e = self._d.get(id(opt))
        if e is not None and e[0]() is opt:
            e[1] += 1
            return
        key = id(opt)
        try:
            ref = weakref.ref(opt, lambda _r, key=key: self._drop(key, _r))
        except TypeError:
            return
        self._d[key] = [ref, 1]

    def _drop(self, key: int, ref: Any) -> None:
        e = self._d.get(key)
        if e is not None and e[0] is ref:
            del self._d[key]


_step_counts = _StepCounts()


def _scale_of(scaler, skipped: bool) -> float:
    """The scale this step's gradients were multiplied by (update() has not run yet): read on
    the CPU, and on a GPU only at a skip (a device sync: rare in a healthy run); NaN otherwise."""
    s = getattr(scaler, "_scale", None)
    if not isinstance(s, torch.Tensor):
        return float("nan")
    if s.device.type != "cpu" and not skipped:
        return float("nan")
    try:
        return float(s)
    except Exception:  # noqa: BLE001 - never fail the user's step over this
        return float("nan")


def _scaler_step() -> list:
    orig = torch.amp.GradScaler.step

    def step(self, optimizer, *args, **kwargs):
        before = _step_counts.get(optimizer, 0)
        out = orig(self, optimizer, *args, **kwargs)
        watchers = _watchers.get(optimizer)
        if watchers and self.is_enabled():
            skipped = _step_counts.get(optimizer, 0) == before
            scale = _scale_of(self, skipped)
            for ctx in list(watchers):
                ctx.scaler_step(optimizer, skipped, scale)
        return out

    step.__wrapped__ = orig  # type: ignore[attr-defined]
    return [(torch.amp.GradScaler, "step", step)]


_scaler_patch = Patch("scaler_step", ("attach",), ["torch.amp.GradScaler.step"], _scaler_step)


# duplicate_batch (Note [Stuck data]): while any sanitizer is open, DataLoader.__iter__ and the
# loader iterators' __next__ count how many batches each loader's latest iterator yielded; a
# loader iterated anew after yielding only its first batch of several (`next(iter(loader))`
# inside the loop) counts as a restart. Bookkeeping only: the batches are not touched.
_loader_yielded: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> [n]
_data_restarts = [0]
# The loader passes (Note [Repeated batches], host/checks/inputs.cpp): every DataLoader iteration
# gets a serial number, and the latest batch a loader yielded is described to the next training
# forward (only to it): [its pass, the loader's num_workers, whether it has a worker_init_fn,
# weak references to its uint8/int8/int16 tensors (label_dtype, Note [Label dtype] in
# host/audit/labels.cpp), a sampled fingerprint of it (Note [Ignored batches] in
# host/checks/inputs.cpp; 0: not read)].
_loader_passes = [0]
_loader_last: list = [-1, 0, False, [], 0]
_SAMPLED = 64  # elements of a batch's first tensor read for its sampled fingerprint
_SMALL_INTS = (torch.uint8, torch.int8, torch.int16)


def _batch_tensors(obj: Any) -> list:
    """The tensors of a batch, in order (two levels, 16 items of each container)."""
    return _flat_tensors(obj, [], items=16)


def _small_ints(tensors: list) -> list:
    """Weak references to the uint8/int8/int16 tensors of a batch's."""
    return [weakref.ref(t) for t in tensors if t.dtype in _SMALL_INTS]


def _sampled_fingerprint(tensors: list) -> int:
    """A fingerprint of a batch from _SAMPLED evenly spaced elements of its first tensor (their
    bits, its shape and dtype), read only where that tensor is a dense one on the CPU (as a loader
    yields it: no device sync); 0 otherwise (Note [Ignored batches] in host/checks/inputs.cpp)."""
    t = tensors[0] if tensors else None
    if t is None or t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0 or \
            t.is_complex() or not t.is_contiguous():
        return 0
    with torch.no_grad():
        flat = t.detach().view(-1)
        idx = torch.linspace(0, flat.numel() - 1, min(_SAMPLED, flat.numel())).long()
        bits = flat[idx].contiguous().view(torch.uint8).numpy().tobytes()
    h = zlib.crc32(bits, zlib.crc32(repr((tuple(t.shape), t.dtype)).encode()))
    return h or 1


def take_loader_facts() -> tuple:
    """(pass, num_workers, worker_init_fn given, small-integer tensors, sampled fingerprint) of the
    latest batch, once: a training forward takes them, and the next one without a new batch gets
    (-1, 0, False, [], 0) (a loop that does not fetch a batch per step is not judged by a loader
    it used before)."""
    p, workers, init, refs, sampled = _loader_last
    _loader_last[:] = [-1, 0, False, [], 0]
    return p, workers, init, [t for t in (r() for r in refs) if t is not None], sampled


def _number_pass(loader, it) -> None:
    """A new pass over `loader` (Note [Repeated batches]): its serial number and workers, on the
    iterator, for the batches it yields."""
    try:
        _loader_passes[0] += 1
        it._trainsan_pass = (_loader_passes[0], int(loader.num_workers),
                             loader.worker_init_fn is not None)
    except Exception:  # noqa: BLE001 - bookkeeping never fails the loop
        pass


def _loader_iteration() -> list:
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    orig_iter, orig_next = DataLoader.__iter__, _BaseDataLoaderIter.__next__

    def __iter__(self):
        if not _loader_patch.held("attach"):
            # The launcher's or the load journal's alone: the data position, and the pass's
            # numbering (the launcher attaches at the first forward, after the loop's iterator
            # was made: its batches are that sanitizer's, Note [Ignored batches]).
            it = orig_iter(self)
            _position.iterated(self, it)
            _number_pass(self, it)
            return it
        try:
            st = _loader_yielded.get(self)
            if st is not None and st[0] == 1:
                try:
                    n = len(self)
                except TypeError:
                    n = None  # an iterable dataset without a length
                if n is None or n > 1:
                    _data_restarts[0] += 1
        except Exception:
            pass
        it = orig_iter(self)
        _position.iterated(self, it)  # Note [Data position]
        try:
            st = [0]
            _loader_yielded[self] = st
            it._trainsan_yielded = st
        except Exception:
            pass
        _number_pass(self, it)
        return it

    def __next__(self):
        out = orig_next(self)
        st = self.__dict__.get("_trainsan_yielded")
        if st is not None:
            st[0] += 1
        facts = self.__dict__.get("_trainsan_pass")
        if facts is not None:
            try:
                tensors = _batch_tensors(out)  # one walk for both
                _loader_last[:] = [*facts, _small_ints(tensors), _sampled_fingerprint(tensors)]
            except Exception:  # noqa: BLE001 - bookkeeping never fails the loop
                pass
        return out

    __iter__.__wrapped__ = orig_iter  # type: ignore[attr-defined]
    __next__.__wrapped__ = orig_next  # type: ignore[attr-defined]
    return [(DataLoader, "__iter__", __iter__), (_BaseDataLoaderIter, "__next__", __next__)]


_loader_patch = Patch(
    "loader_iteration", ("attach", "launcher", "watch"),
    ["torch.utils.data.DataLoader.__iter__",
     "torch.utils.data.dataloader._BaseDataLoaderIter.__next__"], _loader_iteration)


# nonfinite_grad of a loop that skips its step (Note [Discarded gradients], host/sanitizer.cpp):
# Optimizer.zero_grad and Module.zero_grad tell the open sanitizers of that optimizer or model
# that its gradients are about to be cleared, so that gradients no step used are read first.
def clearing(opt) -> None:
    """The gradients of optimizer `opt` are about to be cleared: its sanitizers are told (a torch
    optimizer's zero_grad, and an optimizer-like one's: Note [Optimizer-like objects])."""
    for ctx in list(_watchers.get(opt, ())):
        ctx.gradients_cleared(opt)


def _zero_grad() -> list:
    orig_opt, orig_mod = torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad

    def opt_zero_grad(self, *args, **kwargs):
        clearing(self)
        return orig_opt(self, *args, **kwargs)

    def mod_zero_grad(self, *args, **kwargs):
        ref = _attached.get(self)
        ctx = ref() if ref is not None else None
        if ctx is not None and not ctx.closed:
            ctx.gradients_cleared(None)
        return orig_mod(self, *args, **kwargs)

    opt_zero_grad.__wrapped__ = orig_opt  # type: ignore[attr-defined]
    mod_zero_grad.__wrapped__ = orig_mod  # type: ignore[attr-defined]
    return [(torch.optim.Optimizer, "zero_grad", opt_zero_grad),
            (torch.nn.Module, "zero_grad", mod_zero_grad)]


_zero_grad_patch = Patch("zero_grad", ("attach",),
                         ["torch.optim.Optimizer.zero_grad", "torch.nn.Module.zero_grad"],
                         _zero_grad)


# The loss without watch_loss (Note [Loss roots]): torch.autograd.backward (which
# Tensor.backward calls) and GradScaler.scale are wrapped while any sanitizer is open (refcounted;
# the originals are restored on the last close).
#
# Note [Loss roots]
# ~~~~~~~~~~~~~~~~~
# The scalar a training backward starts from is the loss. Each such root (one tensor of one
# element with a grad_fn) is handed, before the backward runs, to the open sanitizers it belongs
# to, as watch_loss would: nonfinite_loss, loss_spike, trivial_loss. Which ones: the open
# sanitizers whose model ran a training forward so far; with one such sanitizer, that one (no graph
# walk). With several (a GAN's generator and discriminator), the autograd graph is walked from the
# root until one parameter of each is found (or 20000 nodes; past that, with one candidate, it is
# taken as its): the root goes to the sanitizers whose
# parameters it reaches, and when it reaches several, to the one whose latest training forward
# came first — the upstream model: a generator loss D(G(z)) reaches both G and D, and is G's
# (the discriminator loss on fake.detach() reaches only D). A loss that should be D's although
# it also reaches G (no detach) is then G's; watch_loss(loss) on D's sanitizer adds it there.
# The root of scaler.scale(loss).backward() is the scaled loss: the wrapped GradScaler.scale
# remembers the unscaled tensor on its result, and the sanitizer gets that one (the scale factor
# would make loss_spike and trivial_loss wrong). A tensor is watched once per step however it
# arrives (a backward, watch_loss, both): identity, held weakly, until the next optimizer step.
# The walk also runs with one such sanitizer: a root that reaches none of its parameters (an
# unattached probe model, a fine-tuned copy) is not its loss. The leaves the graph reaches are
# the attached parameters, or, under FSDP2, the unsharded parameters FSDP swaps in for them
# (Sanitizer._walk_leaves). torch.autograd.grad roots are not followed. A root walked to its end
# that reached none of a sanitizer's parameters but other requires-grad leaves is a foreign
# backward to it (Note [Foreign backwards], _foreign.py).
_forward_clock = [0]  # ticks at every training forward of any sanitizer
# Called by the backward wrapper with its roots after the open sanitizers saw the backward: each
# returns the sanitizers it attached just now (the launcher's Pairer._before_backward), which see
# it then.
before_backward: list = []


def _loss_owners(root: torch.Tensor) -> list:
    opened = open_sanitizers()
    cands = [s for s in opened if s.last_train_forward >= 0]
    # Note [Foreign backwards] (host/checks/gradient_flow.cpp): the walk also looks for the models
    # of the sanitizers with an optimizer whose model ran no training forward yet (a loss wrapper
    # holding an older copy of it may be all that runs), and a root it walks to its end without
    # reaching some sanitizer's parameters is reported to it with the leaves it did reach.
    targets = cands + [s for s in opened if s.last_train_forward < 0 and s.optimizers]
    if not targets:
        return []
    if len(targets) == 1 and cands and not cands[0].fsdp_ids:
        # One sanitizer to attribute to, holding its own parameters: its handle walks (the same
        # walk, with the parameters it holds); a root that does not reach them is walked again
        # below, for the foreign-backward facts.
        try:
            if cands[0].hot.loss_reaches(root) == 1:
                return cands
        except Exception:  # noqa: BLE001 - the walk below decides
            pass
    # The walk is C++'s (walk_loss_graph, trainsan/loss_walk.h): each target's leaves by identity.
    flat, sizes = [], []
    for s in targets:
        own = s.walk_leaves()
        flat.extend(own)
        sizes.append(len(own))
    reaches, reached, complete, out_of_budget = torch.ops.trainsan.walk_loss_graph(
        root, flat, sizes)
    found = [s for s, r in zip(targets, reaches) if r]
    if complete and reached:  # walked to its end
        missed = [s for s in targets if s not in found and s.optimizers]
        if missed:
            _foreign.report(missed, reached, _step_counts)
    owners = [s for s in found if s in cands]
    if not owners:
        # Walked out of budget: with one candidate, it (as before); a graph walked to its end that
        # reaches none of the attached parameters is another model's loss (a probe, a copy).
        return cands if out_of_budget and len(cands) == 1 else []
    return [min(owners, key=lambda s: s.last_train_forward)]


def _watch_roots(tensors: Any) -> None:
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
        tensors = tensors[0]
    if not isinstance(tensors, torch.Tensor) or tensors.grad_fn is None or tensors.numel() != 1:
        return
    loss = getattr(tensors, "_trainsan_unscaled", tensors)
    if not isinstance(loss, torch.Tensor):
        loss = tensors
    for ctx in _loss_owners(tensors):
        ctx.auto_loss(loss)


def _graphless(tensors: Any) -> bool:
    """A backward on roots none of which has an autograd graph: torch raises "element 0 of tensors
    does not require grad" — tell the sanitizers first (no_grad_leak, Note [Mode rules])."""
    if isinstance(tensors, torch.Tensor):
        return not tensors.requires_grad
    roots = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
    return bool(roots) and all(isinstance(t, torch.Tensor) and not t.requires_grad
                               for t in roots)


def backward_seen(tensors: Any, sanitizers: Optional[list] = None) -> None:
    """What a backward of `tensors` tells the open sanitizers (or `sanitizers`, attached inside
    it, after the wrapper below ran): its loss root, or that it has no graph. Never raises but
    a finding (policy raise)."""
    try:
        if _graphless(tensors):
            for ctx in sanitizers if sanitizers is not None else open_sanitizers():
                if not ctx.closed:
                    ctx.backward_without_graph()
        else:
            _watch_roots(tensors)
    except TrainingBugError:
        raise
    except Exception:  # never break the user's backward
        pass


def _loss_roots() -> list:
    orig_backward = torch.autograd.backward
    orig_scale = torch.amp.GradScaler.scale

    def backward(tensors, *args, **kwargs):
        backward_seen(tensors)
        for hook in list(before_backward):  # the launcher's pairing (_pairing.py)
            made = hook(tensors)
            if made:  # attached now, after the open sanitizers were told above: tell them
                backward_seen(tensors, made)
        return orig_backward(tensors, *args, **kwargs)

    def scale(self, outputs):
        out = orig_scale(self, outputs)
        if isinstance(outputs, torch.Tensor) and isinstance(out, torch.Tensor) and (
            out is not outputs
        ):
            try:
                out._trainsan_unscaled = outputs
            except Exception:
                pass
        return out

    backward.__wrapped__ = orig_backward  # type: ignore[attr-defined]
    scale.__wrapped__ = orig_scale  # type: ignore[attr-defined]
    return [(torch.autograd, "backward", backward), (torch.amp.GradScaler, "scale", scale)]


_loss_patch = Patch("backward", ("attach", "launcher"),
                    ["torch.autograd.backward", "torch.amp.GradScaler.scale"], _loss_roots)


# bad_checkpoint (Note [Checkpoint checks], host/checks/checkpoint.cpp): torch.save is wrapped
# while any sanitizer is open (refcounted); a save whose object holds the tensors of an attached
# model (its state_dict(), the model itself, a dict of those) is checked by that model's
# sanitizer before the file is written, so under policy "raise" a bad checkpoint never reaches
# the disk. Anything else is saved untouched, and a failure of the check itself never fails the
# save.
def _save() -> list:
    orig = torch.save

    def save(obj, f, *args, **kwargs):
        for ctx in open_sanitizers():
            try:
                ctx.check_save(obj, f)
            except TrainingBugError:
                raise
            except Exception as exc:  # noqa: BLE001 - never fail the user's save over this
                import warnings

                warnings.warn(f"trainsan: the checkpoint check of this save failed "
                              f"({type(exc).__name__}: {exc}); saved unchecked", stacklevel=2)
        return orig(obj, f, *args, **kwargs)

    save.__wrapped__ = orig  # type: ignore[attr-defined]
    return [(torch, "save", save)]


_save_patch = Patch("save", ("attach",), ["torch.save"], _save)
