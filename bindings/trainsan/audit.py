"""Python side of the op audits (``broadcast``, ``label_range``, ``label_dtype``,
``batch_mismatch``).

The audits themselves run in C++ (host/audit/, Note [Op audit] in host/audit/observer.cpp): an
ATen RecordFunction observer looks at the ops of a sampled step's forward and loss, for Python
and LibTorch programs alike. An observer cannot stop an op (ATen swallows exceptions thrown by
its callbacks), so its findings reach the policy at the sanitizer's next event.

With policy ``"raise"`` this module adds one thing: while a step is audited, a
:class:`LabelGuard` (a ``TorchFunctionMode``) checks the target — on a CPU always (a host read),
on a GPU with ``sync=True`` only (else a device sync) — of each class-index loss
(``F.cross_entropy``, ``F.nll_loss``, ``F.multi_margin_loss``, ``F.one_hot``) *before* the call
and raises :class:`trainsan.TrainingBugError` there, so that an out-of-range label never reaches
the op (on a GPU: never triggers its device-side assert, which would leave the CUDA context
unusable). It costs a Python call per torch function during audited steps only.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["LabelGuard"]

_GUARDS: "weakref.WeakSet[LabelGuard]" = weakref.WeakSet()


def _binder(fn):
    sig = inspect.signature(fn)

    def bind(args, kwargs):
        b = sig.bind(*args, **kwargs)
        b.apply_defaults()
        return b.arguments

    return bind


# func -> (the ATen op it calls, named as the C++ observer names it; argument binder;
# has ignore_index)
_CLASS_INDEX = {
    F.cross_entropy: ("aten::cross_entropy_loss", _binder(F.cross_entropy), True),
    F.nll_loss: ("aten::nll_loss_nd", _binder(F.nll_loss), True),
    F.multi_margin_loss: ("aten::multi_margin_loss", _binder(F.multi_margin_loss), False),
}


class LabelGuard(TorchFunctionMode):
    """Checks class-index targets before the loss runs; ``check`` raises on a bad one.

    ``check(op, input, target, ignore_index, num_classes)`` is the sanitizer's hook into the C++
    audit (``Sanitizer._check_target``). :meth:`push` and :meth:`pop` put the mode on / take it
    off the torch-function mode stack of the calling thread, outside any ``with`` block (the
    audited window runs from the forward pre-hook to the optimizer step).
    """

    def __init__(self, check: Callable[..., None], host_only: bool = False):
        super().__init__()
        self._check = check
        self._host_only = host_only  # only targets on a CPU (no device sync without sync=True)
        self._pushed = False
        self._active = False
        self.compiled = False  # compiled code ran in its window: stays off (Note [Compiled regions])
        _GUARDS.add(self)

    @staticmethod
    def end_all_windows() -> None:
        """Take every guard's audited window down (a new sanitizer is attached): a window left
        open by an exception (the sanitizer never got to its step, nor closed) must not keep
        checking another model's losses. Its own next training forward opens it again."""
        for g in list(_GUARDS):
            g.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # Traced into a compiled region (Note [Compiled regions] in _compile.py): no check
            # there; this guard has been switched off for the next windows.
            return func(*args, **kwargs)
        if self._active:
            spec = _CLASS_INDEX.get(func)
            if spec is not None:
                name, bind, has_ignore = spec
                a = bind(args, kwargs)
                target = a.get("target")
                if (
                    isinstance(target, torch.Tensor)
                    and isinstance(a.get("input"), torch.Tensor)
                    and not (self._host_only and target.device.type != "cpu")
                ):
                    ignore: Optional[int] = int(a["ignore_index"]) if has_ignore else None
                    self._check(name, a["input"], target, ignore, -1)
            elif (
                func is F.one_hot
                and args
                and isinstance(args[0], torch.Tensor)
                and not (self._host_only and args[0].device.type != "cpu")
            ):
                num_classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
                self._check("aten::one_hot", None, args[0], None, int(num_classes))
        return func(*args, **kwargs)

    def push(self) -> None:
        if self.compiled:
            # Compiled code ran in an audited window (Note [Compiled regions]): the mode stays off
            # (dynamo guards on the mode stack; pushing it on audited steps only would recompile
            # whenever the window opens or closes).
            self.pop()
            return
        self.pop()
        if not self._pushed:
            torch._C._push_on_torch_function_stack(self)
            self._pushed = True
        self._active = True

    def pop(self) -> None:
        self._active = False
        if not self._pushed:
            return
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is self:
            torch._C._pop_torch_function_stack()
            self._pushed = False
        elif not any(torch._C._get_function_stack_at(k) is self for k in range(n)):
            self._pushed = False  # the stack was cleared under us
        # else: a mode pushed after ours is still above it; ours stays, inactive (a pass-through),
        # until a later pop finds it on top, rather than popping someone else's mode
