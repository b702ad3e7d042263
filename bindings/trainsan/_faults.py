"""TrainSan's own failures inside the training loop it watches (Note [Faults]).

Note [Faults]
~~~~~~~~~~~~~
A sanitizer runs inside the user's loop: in module and optimizer hooks, in the patched
backward, zero_grad, GradScaler.step and torch.save, in callbacks the gatherers hand out. An
exception out of TrainSan's own code there (a bug of ours, a tensor or a loop shape nobody
foresaw) would end a job that was training correctly, the worst thing a sanitizer can do. So
every entry point from the loop into a sanitizer (the methods marked @entry, and the callbacks
made by _hooks._weak_method) goes through `absorb`:
  - what the policy asks for passes through untouched: a TrainingBugError (policy "raise" on an
    error finding), a CheckpointError (torch.save refused under "raise"), device_stop's stop;
  - under policy "raise" every other exception passes through too: a strict run wants to know;
  - under "warn" and "record" it is absorbed: one warning (where, the step, the exception, what
    to do), a note in the trace, summary() and coverage()["fault"]; the sanitizer then checks
    nothing more (every entry returns at once: a half-done step would only make false findings)
    and the job goes on. close() still removes every hook and writes the trace summary.
The C++ events do the same for a LibTorch loop (and for the C++ half of a Python one):
host/sanitizer_api.cpp's `guarded`, whose fault coverage() merges with this one's.
A check with machinery of its own (precision provenance, the replica comparison) is guarded
closer first (_facts.run_guarded): it alone stops, with a warning, and the others go on; `absorb`
is the last line, for everything else.
"""

from __future__ import annotations

import functools
import traceback
import warnings
from typing import Any, Callable

from ._findings import TrainingBugError
from .checkpoint import CheckpointError

# The message prefix of device_stop's deliberate stop (host/sanitizer_pass.cpp).
_DEVICE_STOP = "trainsan: device_stop:"


def deliberate(exc: BaseException) -> bool:
    """An exception the policy or an option asks for: never absorbed."""
    return isinstance(exc, (TrainingBugError, CheckpointError)) or (
        isinstance(exc, RuntimeError) and str(exc).startswith(_DEVICE_STOP))


def absorb(ctx: Any, where: str, exc: Exception) -> bool:
    """Whether `exc`, raised by TrainSan's code at `where` for the sanitizer of Context `ctx`
    (Note [Context]), is absorbed (the caller then returns as if nothing happened); False: the
    caller re-raises it."""
    if ctx is None or deliberate(exc) or ctx.policy == "raise":
        return False
    try:
        ctx.on_fault(where, exc)
    except Exception:  # noqa: BLE001 - reporting a fault must not be one
        pass
    return True


def guarded_call(ctx: Any, where: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) for the sanitizer of Context `ctx`, from the loop: nothing once it
    stopped checking, and an exception absorbed or re-raised by `absorb` (Note [Faults])."""
    if ctx.fault is not None:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if not absorb(ctx, where, exc):
            raise
        return None


def entry(method: Callable) -> Callable:
    """A sanitizer method the loop calls (a hook, a patch): Note [Faults]. The method's
    sanitizer keeps its Context in `_ctx` (Note [Context])."""
    where = method.__name__.lstrip("_")

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        return guarded_call(self._ctx, where, method, self, *args, **kwargs)

    return call


def fault_text(where: str, step: int, exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    last = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return (f"trainsan: internal error in {where} at step {step}: {type(exc).__name__}: {exc}"
            f"{last}. TrainSan stopped checking this run and the job goes on; please report it "
            "with this message (policy 'raise' re-raises such errors)")


def warn_fault(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)
