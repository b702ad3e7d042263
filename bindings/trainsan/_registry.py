"""Note [Patches]: the one table of the attributes TrainSan replaces in torch, and the reference
counted Patch that replaces them."""

from __future__ import annotations

from typing import Any, Callable, Iterable

# Note [Patches]
# ~~~~~~~~~~~~~~
# `import trainsan` replaces nothing. Every attribute TrainSan replaces in torch (or in Python's
# multiprocessing) belongs to one Patch, and every Patch is a row of PATCHES, made where its
# wrappers are written (their state lives beside them) and registered here by its name: the
# attributes it replaces (`targets`, each in one row only: one wrapper per attribute) and who may
# hold it (`lifetimes`):
#   "attach"   - a sanitizer, from attach (or Sanitizer(...)) to close (the Held gatherer);
#   "launcher" - `python -m trainsan run`, from before the script's first line to its end;
#   "watch"    - trainsan.watch_loads(), until the handle it returns is closed.
# A Patch is reference counted: its first holder installs what its `make()` returns, a list of
# (owner, name, replacement) built around the current attributes; the last holder puts the
# originals back, each only where the attribute is still ours (another library may have wrapped
# it since; our wrapper then stays inside theirs and passes through). A Patch whose set of
# attributes grows while held (the load_state_dict of a DataLoader subclass defined later, a
# module global or a model's stored partial that holds the original checkpoint function) adds
# them with extend(), and they are put back with the rest. A row's targets name the attributes
# (a "*" where the patch walks a family: the scheduler classes, the loader subclasses, the
# modules' globals). test_patches.py pins it: a fresh interpreter's torch is the same after
# `import trainsan`, the table's attributes are replaced while a sanitizer is attached, and
# everything is put back at close.
PATCHES: dict = {}  # name -> Patch
_TARGETS: dict = {}  # target -> the name of its Patch

LIFETIMES = ("attach", "launcher", "watch")


class Patch:
    """Attributes replaced while at least one holder holds the patch (Note [Patches])."""

    def __init__(self, name: str, lifetimes: Iterable[str], targets: Iterable[str],
                 make: Callable[[], list]) -> None:
        self.name = name
        self.lifetimes = tuple(lifetimes)
        self.targets = tuple(targets)
        bad = [x for x in self.lifetimes if x not in LIFETIMES]
        if bad or not self.lifetimes:
            raise ValueError(f"trainsan: patch {name!r}: lifetimes {self.lifetimes} are not "
                             f"among {LIFETIMES}")
        if name in PATCHES:
            raise ValueError(f"trainsan: patch {name!r} is registered twice")
        for t in self.targets:
            if t in _TARGETS:
                raise ValueError(f"trainsan: {t} is wrapped by both {_TARGETS[t]!r} and "
                                 f"{name!r}: one wrapper per attribute (Note [Patches])")
        for t in self.targets:
            _TARGETS[t] = name
        PATCHES[name] = self
        self.users = 0
        self._holders: dict = {}  # lifetime -> holds
        self._make = make
        self._saved: list = []  # (owner, name, original, replacement)

    def acquire(self, lifetime: str) -> None:
        """One more holder of `lifetime` (one of the row's lifetimes)."""
        if lifetime not in self.lifetimes:
            raise ValueError(f"trainsan: patch {self.name!r} is not held for {lifetime!r} "
                             f"(its lifetimes: {self.lifetimes}; Note [Patches])")
        if self.users == 0:
            self.extend(self._make())
        self.users += 1
        self._holders[lifetime] = self._holders.get(lifetime, 0) + 1

    def release(self, lifetime: str) -> None:
        """One holder fewer; the last puts the originals back."""
        if self._holders.get(lifetime, 0) <= 0:
            return  # released twice: nothing to give back
        self._holders[lifetime] -= 1
        self.users -= 1
        if self.users == 0:
            for owner, name, orig, new in reversed(self._saved):
                d = _dict_of(owner)
                if d is not None and d.get(name) is new:
                    setattr(owner, name, orig)
            self._saved = []

    def held(self, lifetime: str = "") -> bool:
        """Whether the patch is installed (by a holder of `lifetime`, when given)."""
        return self._holders.get(lifetime, 0) > 0 if lifetime else self.users > 0

    def extend(self, replacements: Iterable[tuple]) -> None:
        """Install more (owner, name, replacement) while held; put back with the rest."""
        for owner, name, new in replacements:
            d = _dict_of(owner)
            orig = d[name] if d is not None and name in d else getattr(owner, name)
            self._saved.append((owner, name, orig, new))
            setattr(owner, name, new)


def _dict_of(owner: Any):
    try:
        return vars(owner)
    except TypeError:
        return None


def installed() -> list:
    """The names of the patches installed now."""
    return [name for name, p in PATCHES.items() if p.users > 0]
