"""TrainSan under torch.compile (Note [Compiled regions]): the eager entry around a compiled call
of the attached model, the compile-aware hooks' helpers, and the process-wide compile patch.

Note [Compiled regions]
~~~~~~~~~~~~~~~~~~~~~~~
Dynamo traces every Python hook that runs inside a compiled region: the root module's forward
pre-hook (torch.compile(model) and model.compile() both trace the model's __call__, hooks
included), the leaf modules' activation hooks, the optimizer's step hooks (a compiled
optimizer.step()), and the __torch_function__ of a mode that is on the stack when compiled code
is entered (the label guard). A hook that calls the C++ sanitizer (a TorchScript object),
time.perf_counter or the saved-tensor-hooks stack is a graph break there, and an error with
fullgraph=True. So:

* The forward event runs eagerly, outside the graph, at the compiled call's own entry:
  OptimizedModule.__call__ (torch.compile(model), before or after attach; attach() of an
  OptimizedModule attaches the module inside) and the model's _compiled_call_impl (model.compile(),
  before or after attach). The entry marks the sanitizer (_in_compiled) for the call; the root
  pre-hook, traced inside, reads the mark and returns: dynamo folds is_compiling() and guards on
  the mark, so nothing of TrainSan's reaches the graph — no break, fullgraph=True works.
* Where there is no entry of ours — the root module called inside a function the user compiled
  (a compiled train step), and the step hooks inside a compiled optimizer.step() — the hook
  leaves the graph on purpose: it calls a torch._dynamo.disable()d copy of itself (one graph
  break; the event runs eagerly). In a compiled step that break sits in Optimizer.step's hook
  wrapper, next to the two breaks torch.optim itself puts around the update
  (_use_grad_for_differentiable): the update's graph is not split, and fullgraph=True is not
  possible there without TrainSan either. Once dynamo is loaded those hooks always go through the
  disable()d copy, also eagerly: a frame dynamo falls back on still runs TrainSan uncompiled.
* Activation hooks (nonfinite_activation) inside a compiled region are traced away: not checked.
* The label guard (a TorchFunctionMode) is on dynamo's guards (the mode stack): compiled code
  entered while it is pushed recompiles when it is not, i.e. when the audited window closes. The
  compiled-module entry pops it for the call and pushes it back after; a compiled *function*
  (torch.compile(fn) while a sanitizer is open, or dynamo starting to compile while the guard is
  pushed: a function compiled before attach) switches the guard off for that sanitizer (in the
  latter case after one recompile, at the next step). Under compile its __torch_function__ is a
  pass-through (no call into the sanitizer from traced code). The C++ op audit still sees the ops
  that run eagerly (a loss computed after the compiled model); it is paused on this thread for
  the compiled call (Sanitizer::pause_audit): the graph's ops are not audited, and AOTAutograd's
  joint trace on the first call runs autograd nodes, which would otherwise end the audited window
  as if backward had begun.
TrainSan never imports torch._dynamo itself (the import costs seconds): the OptimizedModule entry
and the disable()d copies are installed once the program has loaded it (torch.compile does).
"""

from __future__ import annotations

import sys
import weakref

import torch

from ._patches import _open_sanitizers, attached_to
from ._registry import Patch

is_compiling = torch.compiler.is_compiling


def dynamo():
    """torch._dynamo when the program loaded it (torch.compile does), else None."""
    return sys.modules.get("torch._dynamo")


def _optimized_module_cls():
    d = sys.modules.get("torch._dynamo.eval_frame")
    return None if d is None else d.OptimizedModule


def unwrap_compiled(model):
    """The module an OptimizedModule (torch.compile(model)) compiles, else `model`."""
    om = _optimized_module_cls()
    if om is not None and isinstance(model, om):
        return model._orig_mod
    return model


def _open_sanitizer_of(module):
    """trainsan.attached(module)."""
    return attached_to(unwrap_compiled(module))


def _compiled_forward(san, module, call, args, kwargs):
    """The attached model's forward through a compiled callable: the forward event eagerly
    before, the label guard off during the call, back on after it."""
    san.prov.disabled = True  # module hooks armed per step would make dynamo recompile
    san.rerun.disabled = True
    san.on_forward(module, args, kwargs)  # eager: may raise (policy "raise")
    guard = san.label_guard
    window = guard is not None and guard._active
    if window:
        guard.pop()
    san.in_compiled += 1
    handle = san.handle
    handle.pause_audit(True)  # the graph's ops are not audited; its tracing runs autograd nodes
    try:
        out = call(*args, **kwargs)
    finally:
        handle.pause_audit(False)
        san.in_compiled -= 1
    if window:
        guard.push()
    return out


class _CompiledCall:
    """model._compiled_call_impl of an attached model (model.compile()): the eager entry."""

    def __init__(self, module, compiled):
        self._module = weakref.ref(module)
        self.compiled = compiled  # what nn.Module.compile set

    def __call__(self, *args, **kwargs):
        module = self._module()
        san = None if module is None or is_compiling() else _open_sanitizer_of(module)
        if san is None:
            return self.compiled(*args, **kwargs)
        return _compiled_forward(san, module, self.compiled, args, kwargs)


def wrap_compiled_call(module) -> None:
    c = module.__dict__.get("_compiled_call_impl")
    if c is not None and not isinstance(c, _CompiledCall):
        module._compiled_call_impl = _CompiledCall(module, c)


def unwrap_compiled_call(module) -> None:
    c = module.__dict__.get("_compiled_call_impl")
    if isinstance(c, _CompiledCall):
        module._compiled_call_impl = c.compiled


class _CompilePatch:
    """torch.compile and nn.Module.compile wrapped while at least one sanitizer is open (a
    _patches.Patch), and OptimizedModule.__call__ with dynamo's compile-start callback added once
    torch._dynamo is loaded (a second Patch, held while the first is)."""

    def __init__(self):
        self.users = 0
        self._base = Patch(
            "compile", ("attach",), ["torch.compile", "torch.nn.Module.compile"],
            lambda: [
                (torch, "compile", _torch_compile(torch.__dict__["compile"])),
                (torch.nn.Module, "compile", _module_compile(torch.nn.Module.__dict__["compile"])),
            ]
        )
        self._late = Patch(
            "compiled_call", ("attach",), ["torch._dynamo.eval_frame.OptimizedModule.__call__"],
            lambda: [
                (cls, "__call__", _optimized_call(cls.__dict__["__call__"]))
                for cls in [_optimized_module_cls()]
            ]
        )
        self._late_held = False
        self._callback = None

    def acquire(self, lifetime: str = "attach") -> None:
        self._base.acquire(lifetime)
        self.users += 1
        self.dynamo_loaded()

    def release(self, lifetime: str = "attach") -> None:
        self._base.release(lifetime)
        self.users -= 1
        if self.users == 0:
            if self._late_held:
                self._late_held = False
                self._late.release("attach")
            if self._callback is not None and dynamo() is not None:
                try:
                    dynamo().callback_handler.remove_start_callback(self._callback)
                except Exception:  # noqa: BLE001 - never fail a close over a callback
                    pass
            self._callback = None

    def dynamo_loaded(self) -> None:
        """Once torch._dynamo is loaded: wrap OptimizedModule.__call__, register the
        compile-start callback and give the open sanitizers' hooks their eager copies."""
        if self.users == 0 or dynamo() is None or _optimized_module_cls() is None:
            return
        if not self._late_held:
            self._late_held = True
            self._late.acquire("attach")
        if self._callback is None:
            try:
                self._callback = dynamo().callback_handler.register_start_callback(
                    _compile_start
                )
            except Exception:  # noqa: BLE001 - an older/newer dynamo: no late guard switch-off
                self._callback = None
        for san in list(_open_sanitizers):
            for ref in san.eager_hooks:
                h = ref()
                if h is not None:
                    h.make_eager()


compile_patch = _CompilePatch()


def _compile_start(*_args) -> None:
    """dynamo starts compiling a frame: if a label guard is pushed now, compiled code runs in its
    window (a function compiled before attach): that guard stays off from now on."""
    for san in list(_open_sanitizers):
        g = san.label_guard
        if g is not None and g._active:
            g.compiled = True


def _torch_compile(orig):
    def compile(model=None, *args, **kwargs):
        out = orig(model, *args, **kwargs)
        compile_patch.dynamo_loaded()
        if (
            model is not None
            and not isinstance(model, torch.nn.Module)
            and getattr(model, "__func__", None) is not torch.nn.Module._call_impl
        ):
            # A compiled function (a loss, a train step, optimizer.step) may run inside the label
            # window: the label guard stays off.
            for san in list(_open_sanitizers):
                if san.label_guard is not None:
                    san.label_guard.compiled = True
        return out

    compile.__wrapped__ = orig  # type: ignore[attr-defined]
    compile.__doc__ = orig.__doc__
    return compile


def _module_compile(orig):
    def compile(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        compile_patch.dynamo_loaded()
        if _open_sanitizer_of(self) is not None:
            wrap_compiled_call(self)

    compile.__wrapped__ = orig  # type: ignore[attr-defined]
    compile.__doc__ = orig.__doc__
    return compile


def _attached_inside(om):
    """The open sanitizer of the module an OptimizedModule compiles, looking through wrappers
    that hold the model as `.module` (DistributedDataParallel, DataParallel)."""
    m = om.__dict__["_modules"].get("_orig_mod")
    for _ in range(4):
        if m is None:
            return None, None
        san = _open_sanitizer_of(m)
        if san is not None:
            return san, m
        m = m.__dict__["_modules"].get("module")
    return None, None


def _optimized_call(orig):
    def __call__(self, *args, **kwargs):
        san, inner = (None, None) if is_compiling() else _attached_inside(self)
        if san is None:
            return orig(self, *args, **kwargs)
        return _compiled_forward(san, inner, lambda *a, **k: orig(self, *a, **k), args, kwargs)

    __call__.__wrapped__ = orig  # type: ignore[attr-defined]
    return __call__
