"""The hooks a sanitizer installs on the model and its optimizers: dynamo-aware weak hooks
(_Hook), the nn.Module.__getstate__ patch that keeps them out of copies, and the step of an
optimizer that runs a closure (_StepClosure) or whose GradScaler skips it.

Note [Sanitizer lifetime]
~~~~~~~~~~~~~~~~~~~~~~~~~
Nothing TrainSan installs holds the sanitizer strongly: the module and optimizer hooks are
_Hook objects that call it through a weak reference, and the process-wide registries
(_attached, _watchers, _open_sanitizers in _patches.py) hold it weakly. So a sanitizer the user
drops without close() is garbage-collected, and its finalizer (__del__ -> close()) removes every
hook and writes the trace summary: the model is left as it was and can be attached again.
Dropping the object returned by attach() at once (`trainsan.attach(model, opt)` as a statement)
would check nothing, so the finalizer warns when it closes a sanitizer nobody closed.
The hooks are also invisible to copies: while a sanitizer is open, nn.Module.__getstate__ (what
copy.deepcopy, pickle and torch.save(model) use) leaves _Hook entries out of the state, so an
EMA or best-model copy, or a saved whole module, carries no sanitizer and no reference to one.

Note [Closure steps]
~~~~~~~~~~~~~~~~~~~~
optimizer.step(closure) runs the loop's forward and backward inside the step: Lightning's
automatic optimization does it every step, LBFGS evaluates the closure several times. The first
evaluation is the step's training forward and backward, exactly as in a plain loop, so the
step's pre-hook does not begin the step: it hands the optimizer a _StepClosure, and the step
begins (snapshot, step_begin) when the closure has returned the first time. Every check that
sees a plain loop's forward (inputs, modes, op audits, the loss) sees that evaluation; later
evaluations (LBFGS line search) are inside the step, where only nonfinite_loss applies. An
optimizer seen evaluating its closure more than once in a step (LBFGS) is a line-search
optimizer: from its next step on, the step begins before its closure runs, so every evaluation
is inside the step (its first loss is a trial like the others: no loss_spike or trivial_loss on a
second-order method that legitimately solves a convex problem in a step or two), and its steps
are judged as steps that need not move the weights (LBFGS returns without an update when its own
tolerances say it has converged): the rules that expect a move (skipped_step, update_ratio) do
not apply to it, as with a learning rate of 0. An optimizer that never calls its closure gets a
step without a beginning (step_in_flight).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import _compile
from ._faults import guarded_call
from ._registry import Patch

_EAGER_METHODS = ("_on_forward", "_pre_step", "_post_step")


def _no_callback_getter() -> Any:
    return True  # unknown: always the disable()d copy


# Whether dynamo's frame-evaluation callback is set (None: not, so no frame of ours is traced).
_eval_frame_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                               "get_eval_frame_callback", _no_callback_getter)

# Sanitizer._due_flag(i): the fields of the handle's due() tuple, asked once per training forward.
DUE_STEP, DUE_INPLACE, DUE_RERUN, DUE_RECOMPUTE, DUE_HEADROOM, DUE_PROVENANCE = range(6)


class _Hook:
    """A module/optimizer hook that calls `method`, a sanitizer's bound method held weakly (Note
    [Sanitizer lifetime]), with `args` before the hook's own arguments; `ctx` is that sanitizer's
    Context (Note [Context]). A no-op once the sanitizer is gone. Traced by dynamo (Note [Compiled
    regions] in _compile.py): activation hooks vanish, the root pre-hook returns where a compiled
    call's entry reports the forward, and otherwise the root pre-hook and the step hooks call
    `_eager`, a torch._dynamo.disable()d copy (one break). Run eagerly they call `_eager` too
    while dynamo's frame callback is set (a frame it fell back on, whose new frames it would
    trace), and the sanitizer directly otherwise."""

    __slots__ = ("_ctx", "_ref", "_root", "_args", "_eager", "__weakref__")

    def __init__(self, ctx, method: Any, *args: Any):
        self._ctx = weakref.ref(ctx)
        self._ref = weakref.WeakMethod(method)
        name = method.__name__
        self._root = name == "_on_forward"
        self._args = args
        self._eager = None
        if name in _EAGER_METHODS:
            ctx.eager_hooks.append(weakref.ref(self))
            if _compile.dynamo() is not None:
                self.make_eager()

    def make_eager(self) -> None:
        if self._eager is None:
            self._eager = _compile.dynamo().disable(self._run)

    def _run(self, *args: Any) -> Any:
        m = self._ref()
        if m is None:
            return None
        return m(*self._args, *args)

    def __call__(self, *args: Any) -> Any:
        eager = self._eager
        if _compile.is_compiling():
            if eager is None:
                return None  # activation hooks: traced away
            if self._root:
                ctx = self._ctx()
                if ctx is None or ctx.in_compiled:
                    return None  # a compiled module's entry reports this forward
            return eager(*args)  # no entry of ours: leave the graph here (one break)
        if eager is not None and _eval_frame_callback() is not None:
            # A frame dynamo fell back on is running: dynamo would trace a new frame of ours.
            return eager(*args)
        # No dynamo callback is set (an eager loop): the disable()d copy would only cost its
        # wrapper (~20 us a step with its code cold, Note [Hot path]).
        return self._run(*args)


def _weak_method(bound) -> Any:
    """`bound` (a bound method of a sanitizer) called through a weak reference: for callbacks
    handed to objects that process-wide state may hold (a pushed TorchFunctionMode, saved-tensor
    hooks, the Function.apply patch)."""
    ref = weakref.WeakMethod(bound)
    where = bound.__name__.lstrip("_")

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return None if m is None else guarded_call(m.__self__._ctx, where, m, *args, **kwargs)

    return call


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _module_getstate() -> list:
    """nn.Module.__getstate__ without TrainSan's hooks (Note [Sanitizer lifetime])."""
    orig = torch.nn.Module.__getstate__

    def __getstate__(self):
        state = orig(self)
        hooks = state.get("_forward_pre_hooks")
        ours = [k for k, h in (hooks or {}).items() if isinstance(h, _Hook)]
        fwd = state.get("_forward_hooks")
        ours += [k for k, h in (fwd or {}).items() if isinstance(h, _Hook)]
        if ours:
            for name in _HOOK_DICTS:
                d = state.get(name)
                if d is not None and any(k in d for k in ours):
                    state[name] = type(d)((k, v) for k, v in d.items() if k not in ours)
        return state

    __getstate__.__wrapped__ = orig  # type: ignore[attr-defined]
    return [(torch.nn.Module, "__getstate__", __getstate__)]


_getstate_patch = Patch("getstate", ("attach",), ["torch.nn.Module.__getstate__"],
                        _module_getstate)


def _scaler_found_inf(opt) -> bool:
    """Inside GradScaler.step of an optimizer that does its own AMP scaling (fused Adam/AdamW/SGD:
    `_step_supports_amp_scaling`): whether the scaler found Inf/NaN (the step will not update).
    A read of one flag: a device sync on GPU, in fp16 runs with a fused optimizer only."""
    found = opt.__dict__.get("found_inf")
    if not isinstance(found, torch.Tensor) or opt.__dict__.get("grad_scale") is None:
        return False
    try:
        return bool(found.item() != 0)
    except Exception:  # noqa: BLE001 - never fail the user's step over this
        return False


class _StepClosure:
    """The closure handed to the optimizer (Note [Closure steps]); `ctx`: the sanitizer's
    Context (Note [Context])."""

    def __init__(self, ctx, k: int, closure):
        self._ref = weakref.ref(ctx)
        self._k = k
        self._closure = closure
        self._begun = False
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        out = self._closure(*args, **kwargs)
        if not self._begun:
            self._begun = True
            ctx = self._ref()
            if ctx is not None:
                ctx.begin_step(self._k)
        return out