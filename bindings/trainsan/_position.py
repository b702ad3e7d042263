"""The data position after a resume (Note [Data position], host/checks/resume_data.cpp): which
DataLoader fed the first training forward after the model's load, how far its pass had got, and
whether its position was restored; and the layout of a strict=False load (Note [Renamed layers]).

While the load journal is installed (Note [Load journal]), each new DataLoader iterator is
numbered and the last few are kept by weak reference (iterated(), called by the one
DataLoader.__iter__ wrapper, _patches.py) — a few operations per pass over a loader, nothing per
batch (the iterator counts its own batches: _num_yielded)."""

from __future__ import annotations

import collections
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch

from . import _seeds

_serial = [0]  # DataLoader iterators made so far
# (serial, weakref loader, weakref it, the generator's last setting then: _seeds.last())
_iters: "collections.deque" = collections.deque(maxlen=8)
_restored: "weakref.WeakSet" = weakref.WeakSet()  # loaders and samplers restored (load_state_dict)

_EPOCH_KEYS = ("epoch", "epochs")
_STEP_KEYS = ("global_step", "step", "iteration", "iter", "steps")


def serial() -> int:
    """The number of DataLoader iterators made so far (a torch.load notes it)."""
    return _serial[0]


def restored(obj: Any) -> None:
    """A loader or sampler whose load_state_dict ran (the load journal's loader wrapper)."""
    try:
        _restored.add(obj)
    except TypeError:
        pass


def counters(obj: Mapping) -> tuple:
    """(epoch, step, step key, loader state key) of a checkpoint's top level; -1 / "" if none."""
    epoch, step, step_key, loader_key = -1, -1, "", ""
    for k in _EPOCH_KEYS:
        v = obj.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            epoch = v
            break
    for k in _STEP_KEYS:
        v = obj.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            step, step_key = v, k
            break
    for k, v in obj.items():
        if isinstance(k, str) and isinstance(v, Mapping) and v and (
                "loader" in k.lower() or "sampler" in k.lower()):
            loader_key = k
            break
    return epoch, step, step_key, loader_key


def iterated(loader: Any, it: Any) -> None:
    """A new iterator of `loader` (the one DataLoader.__iter__ wrapper, _patches.py): numbered,
    and the last few kept by weak reference."""
    try:
        _serial[0] += 1
        _iters.append((_serial[0], weakref.ref(loader), weakref.ref(it), _seeds.last()))
    except TypeError:
        pass


def _latest(after: int) -> Optional[tuple]:
    """(loader, iterator, the generator's last setting when it was made) made last after serial
    `after` that yielded a batch; None if none."""
    for s, lref, iref, rng in reversed(_iters):
        if s <= after:
            break
        loader, it = lref(), iref()
        if loader is not None and it is not None and getattr(it, "_num_yielded", 0) >= 1:
            return loader, it, rng
    return None


def _global_shuffle(loader) -> bool:
    """Whether the loader shuffles with torch's RandomSampler drawing from the global generator
    (no generator of its own; Note [Replayed order])."""
    from torch.utils.data import RandomSampler

    bs = getattr(loader, "batch_sampler", None)
    sampler = getattr(bs, "sampler", None) if bs is not None else getattr(loader, "sampler", None)
    return (isinstance(sampler, RandomSampler) and getattr(sampler, "generator", 0) is None
            and type(sampler).__iter__ is RandomSampler.__iter__)


def _rng_facts(info, rng: tuple) -> dict:
    """The generator's setting before the pass (Note [Replayed order]) against the checkpoint's
    torch.load."""
    at, how, seed = rng
    after = how == "seed" and at > info.rng_clock
    before = _seeds.seed_before(info.rng_clock) if after else None
    return dict(rng_last=how, rng_seed=seed, rng_seed_after_load=after,
                rng_seed_repeats=before is not None and before == seed)


def _own_sampler(loader) -> bool:
    """Whether the loader draws with torch's own full-epoch samplers (they start at the
    epoch's first batch) or a Sampler that restores its position with load_state_dict (the
    journal sees it), over data that is not a range of the data set (the rest of an epoch)."""
    from torch.utils.data import (BatchSampler, DistributedSampler, RandomSampler, Sampler,
                                  SequentialSampler, Subset)

    bs = getattr(loader, "batch_sampler", None)
    if bs is not None and type(bs) is not BatchSampler:
        return False
    sampler = getattr(loader, "sampler", None)
    if type(sampler) not in (SequentialSampler, RandomSampler, DistributedSampler) and not (
            isinstance(sampler, Sampler) and callable(getattr(sampler, "load_state_dict", None))):
        return False
    ds = getattr(loader, "dataset", None)
    return not (isinstance(ds, Subset) and isinstance(ds.indices, range))


def _restored_loader(loader) -> bool:
    from torch.utils.data import Sampler

    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if obj is None:
            continue
        try:
            if obj in _restored:
                return True
        except TypeError:  # unhashable
            pass
        if callable(getattr(obj, "load_state_dict", None)) and not isinstance(
                obj, (Sampler, torch.utils.data.DataLoader)):
            return True  # restorable where the journal does not see it
    return False


def facts(info, restored_any: bool) -> Optional[dict]:
    """ResumeFacts of the first training forward after a model load from checkpoint `info`
    (_journal.CkptInfo); None where no loader was iterated since its torch.load."""
    found = _latest(info.iters_before)
    if found is None:
        return None
    loader, it, rng = found
    try:
        batches = len(loader) if _own_sampler(loader) else -1
    except TypeError:
        batches = -1
    sampler = getattr(loader, "sampler", None)
    epoch = getattr(sampler, "epoch", None)
    shuffles = bool(getattr(sampler, "shuffle", True))
    return dict(
        first_forward=True, checkpoint_has_optimizer_state=info.has_optimizer_state,
        optimizer_restored=restored_any, checkpoint_epoch=info.epoch,
        checkpoint_step=info.step, step_key=info.step_key, loader_state_key=info.loader_key,
        loader_batches=batches, loader_yielded=int(getattr(it, "_num_yielded", 0)),
        loader_restored=_restored_loader(loader), sampler_type=type(sampler).__name__,
        sampler_epoch=epoch if (isinstance(epoch, int) and callable(
            getattr(sampler, "set_epoch", None)) and shuffles) else -1,
        loader_global_rng=_global_shuffle(loader), **_rng_facts(info, rng))


def _shape(v: Any) -> str:
    return "x".join(str(d) for d in v.shape) if isinstance(v, torch.Tensor) else ""


def layout(module: torch.nn.Module, state_dict: Mapping, missing: tuple,
           unexpected: tuple) -> dict:
    """The strict=False load's parameters left out and keys not taken, with their shapes and
    whether a loaded key follows each (Note [Renamed layers]); {} when either side is empty, or
    where it cannot be read (the load is journaled without it)."""
    if not missing or not unexpected:
        return {}
    try:
        return _layout(module, state_dict, missing, unexpected)
    except Exception:  # noqa: BLE001 - never fail the user's load over this
        return {}


def _layout(module: torch.nn.Module, state_dict: Mapping, missing: tuple,
            unexpected: tuple) -> dict:
    params = dict(module.named_parameters())
    own = list(module.state_dict(keep_vars=True).keys())
    miss, unexp = set(missing), set(unexpected)
    last_loaded = max((k for k, n in enumerate(own) if n not in miss), default=-1)
    pos = {n: k for k, n in enumerate(own)}
    keys = list(state_dict.keys())
    last_taken = max((k for k, n in enumerate(keys) if n not in unexp), default=-1)
    mp = [m for m in own if m in miss and m in params]
    gap, place = {}, {}  # missing key -> loaded keys before it; loaded key -> its index
    for n in own:
        if n in miss:
            gap[n] = len(place)
        else:
            place[n] = len(place)
    return dict(
        missing=tuple(mp), missing_shapes=tuple(_shape(params[m]) for m in mp),
        missing_interior=tuple(pos[m] < last_loaded for m in mp),
        missing_gap=tuple(gap[m] for m in mp),
        unexpected=tuple(k for k in keys if k in unexp),
        unexpected_shapes=tuple(_shape(state_dict[k]) for k in keys if k in unexp),
        unexpected_interior=tuple(j < last_taken for j, k in enumerate(keys) if k in unexp),
        unexpected_gap=_places(keys, unexp, place),
        unexpected_replaced=_replaced(module, [k for k in keys if k in unexp]))


def _places(keys: list, unexp: set, place: dict) -> tuple:
    """Per unexpected key (in the state dict's order): its place between the keys that loaded —
    how many come before it in the model's order — where its loaded neighbours in the state dict
    are neighbours in the model too; -1 where they are not (Note [Renamed layers])."""
    before, prev = [], -1  # the model's index of the loaded key before each unexpected one
    for k in keys:
        if k in unexp:
            before.append(prev)
        else:
            prev = place.get(k, -2)
    after, nxt = [], len(place)  # ... and after it
    for k in reversed(keys):
        if k in unexp:
            after.append(nxt)
        else:
            nxt = place.get(k, -2)
    after.reverse()
    return tuple(p + 1 if p >= -1 and q == p + 1 else -1 for p, q in zip(before, after))


def _replaced(module: torch.nn.Module, keys: list) -> tuple:
    """Per key: its module is still one of the model's and holds no parameter or buffer (the
    old layer replaced by nn.Identity() on purpose; Note [Renamed layers])."""
    mods = dict(module.named_modules())

    def empty(path: str) -> bool:
        m = mods.get(path) if path else None
        return m is not None and next(m.parameters(), None) is None and next(
            m.buffers(), None) is None

    return tuple(empty(k.rpartition(".")[0]) for k in keys)
