"""What a Sanitizer holds besides its C++ handle: the gatherers of facts for the C++ checks, the
hooks it registered and the process-wide patches it holds, all behind one protocol (Gatherer),
in one list the sanitizer calls in order (Note [Gatherers])."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from . import _compile, _optimizer_like
from ._hooks import DUE_INPLACE
from .recompute import RecomputeWatch

# Note [Gatherers]
# ~~~~~~~~~~~~~~~~
# A Sanitizer keeps everything it installs or runs besides its own hooks' events in one list of
# Gatherers and calls every member at each event in the list's order: a training forward, a loss,
# the beginning of an optimizer step, its end (or the GradScaler's skip of it), a GradScaler step, a
# clearing of the gradients (zero_grad), and close(), which closes every member (each hook removed,
# each process-wide patch released) before the C++ side writes the summary. The order matters where
# two members act at the same event: the label guard's window and the autograd checks' windows end
# before the parameters are checked at the first step, the replicas compare the starting weights
# before the re-runs, the resume facts and the overflow flags are read (the order of PARTS, Note
# [Parts] in _parts.py). Each member is built by a builder of _parts.py (Note [Parts]) and sees its
# sanitizer through its Context (Note [Context]). The adapters below fit the gatherers written
# before the protocol; a new gatherer can subclass Gatherer itself.


class Gatherer:
    """One member of a sanitizer's list (Note [Gatherers]); every event is a no-op unless
    overridden. `k` is the optimizer's index among the attached ones."""

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        """A forward of the attached model, after the C++ side saw it; `train`: a training
        forward (train mode, grad enabled)."""

    def on_loss(self, loss: Any) -> None:
        """Before a loss (a backward's root, or watch_loss) is judged."""

    def before_step(self, k: int) -> None:
        """Optimizer k's step begins (before its update and the C++ step_begin)."""

    def after_step(self, k: int, skipped: bool) -> None:
        """After optimizer k's step was judged, or its GradScaler skipped it (`skipped`)."""

    def on_scaler(self, k: int, skipped: bool) -> None:
        """A GradScaler step of optimizer k (`skipped`: it found Inf/NaN), before it is judged."""

    def before_clear(self, k: int) -> None:
        """The gradients of optimizer k (-1: of the model) are about to be cleared (zero_grad),
        before the C++ side reads those no step used (Note [Discarded gradients])."""

    def close(self) -> list:
        """The sanitizer closes: release everything; returns reports to apply with its own."""
        return []


class Hooks(Gatherer):
    """Hook handles (module, optimizer, parameter hooks), removed at close."""

    def __init__(self) -> None:
        self.handles: list = []

    def add(self, handle) -> None:
        self.handles.append(handle)

    def close(self) -> list:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        return []


class Held(Gatherer):
    """A process-wide patch (_registry.Patch, or _journal.journal), held for the "attach" lifetime
    from now until close (Note [Patches]); `before_release` runs first then."""

    def __init__(self, patch, before_release: Optional[Callable[[], None]] = None) -> None:
        patch.acquire("attach")
        self._patch = patch
        self._before_release = before_release

    def close(self) -> list:
        if self._patch is not None:
            patch, self._patch = self._patch, None
            if self._before_release is not None:
                self._before_release()
            patch.release("attach")
        return []


class Adopted(Gatherer):
    """Optimizer-like objects given a torch optimizer's step hooks while watched (Note
    [Optimizer-like objects], _optimizer_like.py), released at close."""

    def __init__(self, optimizers: list) -> None:
        self._optimizers = []
        for o in optimizers:
            _optimizer_like.adopt(o)
            self._optimizers.append(o)

    def close(self) -> list:
        optimizers, self._optimizers = self._optimizers, []
        for o in optimizers:
            _optimizer_like.release(o)
        return []


class LabelWindow(Gatherer):
    """The label guard (audit.LabelGuard) pushed for the audited window: from a training forward
    the C++ side audits to the optimizer step."""

    def __init__(self, guard, handle) -> None:
        self._guard = guard
        self._handle = handle

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        # Note [Op audit] (host/audit/observer.cpp): any grad-enabled forward, in either mode.
        if torch.is_grad_enabled() and self._handle.auditing():
            self._guard.push()
        else:
            self._guard.pop()

    def before_step(self, k: int) -> None:
        self._guard.pop()

    def close(self) -> list:
        self._guard.pop()
        return []


class SavedTensors(Gatherer):
    """inplace_before_backward (autograd_checks.SavedTensorCheck): its saved-tensor hooks on the
    sampled steps, from the training forward until the step."""

    def __init__(self, check, due: Callable[[int], Any]) -> None:
        self._check = check
        self._due = due  # the sanitizer's _due_flag, held weakly

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        if not train:
            return
        if self._due(DUE_INPLACE):
            self._check.begin()
        else:
            self._check.end()

    def before_step(self, k: int) -> None:
        self._check.end()

    def close(self) -> list:
        self._check.end()
        return []


class CustomGrads(Gatherer):
    """bad_custom_grad (autograd_checks.CustomGradCheck): armed from the training forward until
    the step (first uses), re-checking on the gradcheck_every steps."""

    def __init__(self, check, handle) -> None:
        self._check = check
        self._handle = handle

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        if train:
            self._check.open()

    def before_step(self, k: int) -> None:
        self._check.end()

    def close(self) -> list:
        self._check.end()
        self._check.close()
        return []


def params_replaced_message(gone: list, attached: int) -> str:
    """Why parameters replaced after attach() are a problem, and the order to use."""
    return (
        f"trainsan: {len(gone)} of the {attached} parameters attached are no "
        f"longer the model's (e.g. {gone[0]!r}): they were replaced after attach() "
        "(fully_shard, distribute_module, to_empty, load_state_dict(assign=True), "
        "parametrizations?), so TrainSan would watch tensors the model no longer uses. "
        "Replace them first, build the optimizer on the model as it is then, and attach "
        "last (for FSDP2: fully_shard, then the optimizer, then trainsan.attach)"
    )


class ParamsLive(Gatherer):
    """At the first step: the attached parameters must still be the model's. fully_shard,
    distribute_module, to_empty or load_state_dict(assign=True) after attach() replace them: the
    hooks and statistics would watch tensors the model no longer uses. `replaced(message)` is
    told (the sanitizer raises under policy "raise", re-binds otherwise: Note [Attach order])."""

    def __init__(self, model, tracked: list, replaced: Callable[[str], None]) -> None:
        self._model = model
        self._tracked = tracked  # (name, parameter) as attached
        self._replaced = replaced
        self._done = False

    def before_step(self, k: int) -> None:
        if self._done:
            return
        self._done = True
        live = {id(p) for p in self._model.parameters()}
        gone = [n for n, p in self._tracked if id(p) not in live]
        if gone:
            self._replaced(params_replaced_message(gone, len(self._tracked)))

    def close(self) -> list:
        self._done = True
        return []


class Replicas(Gatherer):
    """rank_desync (replicas.ReplicaComparison): the starting weights at the first step, every
    step event after it, what is pending at close."""

    def __init__(self, comparison) -> None:
        self.comparison = comparison

    def before_step(self, k: int) -> None:
        self.comparison.first_step()

    def after_step(self, k: int, skipped: bool) -> None:
        self.comparison.on_step(k, skipped=skipped)

    def close(self) -> list:
        return self.comparison.close()


class Reruns(Gatherer):
    """nondeterminism: the re-runs (determinism.Rerun), recorded in the training forward, re-run
    before the step; and the recompute checks of activation checkpointing
    (recompute.RecomputeWatch), sampled from the training forward, compared before the step."""

    def __init__(self, rerun) -> None:
        self._rerun = rerun
        self._recompute = RecomputeWatch(rerun._ref(), rerun._model)

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        if train:
            self._rerun.begin_forward(args, kwargs)
            self._recompute.on_forward()

    def before_step(self, k: int) -> None:
        self._rerun.before_step()
        self._recompute.before_step()

    def close(self) -> list:
        self._rerun._clear()
        self._recompute.close()
        return []


class Resumes(Gatherer):
    """optimizer_reset (resume.ResumeWatch): an optimizer's first step after a load; the data
    position at the first training forward after it (Note [Data position])."""

    def __init__(self, watch) -> None:
        self._watch = watch

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        if train and self._watch._data is not None:
            self._watch.first_forward()

    def before_step(self, k: int) -> None:
        self._watch.first_step(k)


class Provenances(Gatherer):
    """Overflow provenance and precision headroom (precision.Provenance): armed in the training
    forward, its flags read before the loss, before the step and at a GradScaler skip."""

    def __init__(self, prov) -> None:
        self._prov = prov

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        if train:
            self._prov.begin_forward()

    def on_loss(self, loss: Any) -> None:
        self._prov.read_forward()

    def before_step(self, k: int) -> None:
        self._prov.read_all()

    def on_scaler(self, k: int, skipped: bool) -> None:
        if skipped:
            self._prov.read_all()  # the skipped step's flags, before the scaler's finding

    def before_clear(self, k: int) -> None:
        self._prov.read_all()  # a guarded loop's flags, before its gradients are read

    def close(self) -> list:
        self._prov.close()
        return []


# Note [Models without a root forward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An agent whose optimizer holds actor and critic but whose class defines no forward() (its code
# calls agent.actor(x) and agent.critic(x), or a method such as get_action_and_value that does)
# is never called itself, so its forward pre-hook never fires: no training forward, no loss root,
# none of the forward rules. For such a model RootlessForwards installs process-wide module hooks
# that report each outermost call of one of the model's submodules (no other of its modules
# running on the thread) as a forward of the model, with that submodule's inputs and train flag.
# A model that has a forward() but is trained through .forward(x) or its children is not guessed
# at: coverage() says its forward hook never fired.


class RootlessForwards(Gatherer):
    """Reports the outermost calls of the model's submodules as its forwards (Note [Models
    without a root forward])."""

    def __init__(self, model) -> None:
        self._model = weakref.ref(model)
        self._report: Optional[Callable] = None
        self._members: set = set()
        self._depth = threading.local()
        self._handles: list = []

    @staticmethod
    def needed(model) -> bool:
        """The model's class defines no forward(): calling it would raise."""
        return type(model).forward is torch.nn.Module.forward

    def install(self, report: Callable) -> None:
        """`report(module, args, kwargs)`: the sanitizer's _on_forward, held weakly."""
        model = self._model()
        if model is None or self._handles:
            return
        self._report = report
        self._members = {id(m) for m in model.modules()}
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]

    def _pre(self, module, args) -> None:
        if id(module) not in self._members or _compile.is_compiling():
            return
        depth = getattr(self._depth, "n", 0) + 1
        self._depth.n = depth
        if depth == 1 and module is not self._model():
            self._report(module, args, {})

    def _post(self, module, args, output) -> None:
        if id(module) in self._members and not _compile.is_compiling():
            self._depth.n = max(0, getattr(self._depth, "n", 0) - 1)

    def close(self) -> list:
        for h in self._handles:
            h.remove()
        self._handles = []
        return []


def event_calls(members: list) -> dict:
    """event name -> the bound methods of the members that override it, in list order (an event
    calls only those)."""
    out = {}
    for name in ("on_forward", "on_loss", "before_step", "after_step", "on_scaler",
                 "before_clear"):
        base = getattr(Gatherer, name)
        out[name] = [getattr(m, name) for m in members if getattr(type(m), name) is not base]
    return out
