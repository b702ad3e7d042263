"""How the global CPU generator was last set (Note [Replayed order] in
host/checks/resume_data.cpp): torch.manual_seed, torch.set_rng_state and torch.seed, wrapped while
the load journal is held (the "rng_seeds" row of Note [Patches]: the launcher from the script's
first line, trainsan.watch_loads(), an attached sanitizer). A few integers per call; nothing runs
at a training step.

A torch.set_rng_state that puts back a state this process read with torch.get_rng_state (the
very tensor: torch.random.fork_rng, torch.utils.checkpoint's recompute, TrainSan's own re-runs)
returns the generator to where it was and changes nothing here; one of a state from elsewhere (a
checkpoint's) is a restore."""

from __future__ import annotations

import collections
import weakref
from typing import Any, Optional

import torch

from ._registry import Patch

_clock = [0]  # generator settings seen so far
# The last settings, newest last: (clock, how, seed). how: "seed", "restore", "random".
_history: "collections.deque" = collections.deque(maxlen=16)
# id -> weak reference of the last states torch.get_rng_state returned (a put-back comes soon
# after its read: around a region, within a step)
_read: "collections.OrderedDict" = collections.OrderedDict()
_READ_KEPT = 64


def clock() -> int:
    """The number of generator settings seen so far (a torch.load notes it)."""
    return _clock[0]


def last() -> tuple:
    """(clock, how, seed) of the latest setting seen; (0, "", 0) when none."""
    return _history[-1] if _history else (0, "", 0)


def seed_before(at: int) -> Optional[int]:
    """The value of the last torch.manual_seed at or before clock `at`; None if none is known."""
    for c, how, seed in reversed(_history):
        if c <= at and how == "seed":
            return seed
    return None


def _note(how: str, seed: int = 0) -> None:
    _clock[0] += 1
    _history.append((_clock[0], how, seed))


def _fold(seed: Any) -> int:
    """A seed as torch takes it, within int64 (one above 2^63 - 1 less 2^64)."""
    s = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return s - (1 << 64) if s >= 1 << 63 else s


def _was_read(state: Any) -> bool:
    ref = _read.get(id(state))
    return ref is not None and ref() is state


def _patches() -> list:
    # Installed anew: what happened while nobody watched is unknown (a seed seen in an earlier
    # hold may have been followed by a restore).
    _history.clear()
    _read.clear()
    made = []
    for owner in (torch, torch.random):
        orig_seed, orig_set = owner.manual_seed, owner.set_rng_state
        orig_get, orig_random = owner.get_rng_state, owner.seed

        def manual_seed(seed, _orig=orig_seed):
            out = _orig(seed)
            try:
                _note("seed", _fold(seed))
            except Exception:  # noqa: BLE001 - bookkeeping never fails the call
                pass
            return out

        def set_rng_state(new_state, _orig=orig_set):
            out = _orig(new_state)
            if not _was_read(new_state):
                _note("restore")
            return out

        def get_rng_state(_orig=orig_get):
            out = _orig()
            try:
                _read[id(out)] = weakref.ref(out)
                _read.move_to_end(id(out))
                while len(_read) > _READ_KEPT:
                    _read.popitem(last=False)
            except Exception:  # noqa: BLE001
                pass
            return out

        def seed(_orig=orig_random):
            out = _orig()
            _note("random")
            return out

        for name, f, o in (("manual_seed", manual_seed, orig_seed),
                           ("set_rng_state", set_rng_state, orig_set),
                           ("get_rng_state", get_rng_state, orig_get), ("seed", seed, orig_random)):
            f.__wrapped__ = o  # type: ignore[attr-defined]
            made.append((owner, name, f))
    return made


rng_patch = Patch(
    "rng_seeds", ("attach", "launcher", "watch"),
    [f"torch.{m}{f}" for m in ("", "random.")
     for f in ("manual_seed", "set_rng_state", "get_rng_state", "seed")], _patches)
