"""Note [Context]: what a sanitizer's parts may read and call."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

# Note [Context]
# ~~~~~~~~~~~~~~
# A Sanitizer is the user's object (attach() returns it; its public methods are the API). What it
# shares with the code that works for it — the gatherers of facts (Note [Gatherers]), the
# process-wide patches (Note [Patches]) and their registries, the compile entry, the launcher's
# pairing and children — is its Context, and nothing else: those modules hold and pass Contexts,
# never a Sanitizer's private attributes. A Context holds
#   * the state they read, written in one place (the Sanitizer's build, its events): the model
#     and optimizers, the C++ handle and its hot events, whether it is closed, the parts, the
#     parameters' ids, the latest training forward, the compiled-call state;
#   * the sanitizer's entries they call (bind(): the events the patches deliver, applying a
#     policy, the due flags), each held through a weak reference, so that a Context kept by a
#     process-wide registry or a patch never keeps its Sanitizer alive (Note [Sanitizer
#     lifetime]): a call on a Context whose Sanitizer is gone does nothing and returns None;
#   * `sanitizer()`, the Sanitizer itself (None once collected), for what gives it back to the
#     user (trainsan.attached()).
# The Sanitizer keeps one Context for its life: a re-binding (Note [Attach order]) rebuilds the
# state in the same Context, so registries and parts holding it see the new binding.

ENTRIES = (
    "apply",  # (reports): the policy's answers, raised or warned (Sanitizer._apply)
    "due",  # (i) -> field i (DUE_* in _hooks.py) of this training forward's due() flags
    "note",  # (about, message, **extra): a note record (Note [Attach order])
    "on_fault",  # (where, exc): its own code failed in the loop (Note [Faults])
    "on_forward",  # (module, args, kwargs): a forward of the model (its forward pre-hook)
    "begin_step",  # (k): optimizer k's step begins (after a closure's first call)
    "scaler_step",  # (opt, skipped, scale): a GradScaler step of one of its optimizers
    "gradients_cleared",  # (opt | None): a zero_grad of one of its optimizers (None: the model)
    "auto_loss",  # (loss): the root of a training backward (Note [Loss roots])
    "backward_without_graph",  # (): a backward whose roots have no graph (no_grad_leak)
    "check_save",  # (obj, f): a torch.save while attached (Note [Checkpoint checks])
    "walk_leaves",  # () -> the graph leaves that are its parameters (FSDP2: and their stand-ins)
)


class _Entry:
    """A sanitizer's bound method held weakly (Note [Context])."""

    __slots__ = ("_ref",)

    def __init__(self, bound: Callable) -> None:
        self._ref = weakref.WeakMethod(bound)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self._ref()
        return None if m is None else m(*args, **kwargs)


def _gone(*args: Any, **kwargs: Any) -> None:
    return None


class Context:
    """What a sanitizer's parts may read and call (Note [Context])."""

    def __init__(self, sanitizer: Any, model: Any, optimizers: list, policy: str) -> None:
        self.sanitizer = weakref.ref(sanitizer)
        self.model = model
        self.optimizers = optimizers  # the attached optimizers, in order (index k)
        self.policy = policy
        self.closed = False
        self.handle: Any = None  # torch.classes.trainsan.Sanitizer
        self.hot: Any = None  # its per-step events (_native.HotEvents, Note [Hot path])
        self.parts: list = []  # the gatherers, in order (Note [Gatherers])
        self.param_ids: Any = frozenset()  # ids of the attached parameters
        self.fsdp_ids: Any = frozenset()  # ids of the FSDP2-sharded ones among them
        self.last_train_forward = -1  # _patches._forward_clock at its latest training forward
        self.in_compiled = 0  # inside a compiled call of the model (Note [Compiled regions])
        self.eager_hooks: list = []  # weakrefs to its _Hooks with a disable()d copy
        self.label_guard: Any = None  # audit.LabelGuard under policy raise
        self.resume: Any = None  # resume.ResumeWatch
        self.rerun: Any = None  # determinism.Rerun
        self.prov: Any = None  # precision.Provenance
        self.replicas: Any = None  # replicas.ReplicaComparison (rank_desync), or None
        self.fault: Optional[str] = None  # Note [Faults]: why it stopped checking
        self.binding = 0  # re-bindings so far (Note [Attach order])
        for name in ENTRIES:
            setattr(self, name, _gone)

    def bind(self, **entries: Callable) -> None:
        """The sanitizer's entries (ENTRIES), each a bound method, held weakly."""
        for name, bound in entries.items():
            if name not in ENTRIES:
                raise ValueError(f"trainsan: {name!r} is no entry of a Context (Note [Context])")
            setattr(self, name, _Entry(bound))
