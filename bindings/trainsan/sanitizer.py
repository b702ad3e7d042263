"""The training-loop sanitizer: ``trainsan.attach(model, optimizer)``.

Python registers one forward pre-hook on the root module and step pre/post hooks on each
optimizer; each calls into C++ once per event. The per-parameter gradient hooks live in C++
(post-hooks on the parameters' AccumulateGrad nodes), so no Python runs per parameter per step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from . import _compile, _native
from .audit import LabelGuard
from .autograd_checks import CustomGradCheck, SavedTensorCheck
from .stats import TensorStats

_native.load()

__all__ = [
    "Finding",
    "Sanitizer",
    "TrainingBugError",
    "TrainingBugWarning",
    "attach",
    "attached",
    "OPTIONS",
    "KINDS",
    "Options",
]

def _kind_table() -> dict:
    names, severities, _on, _families, _rules = torch.ops.trainsan.kinds()
    return dict(zip(names, severities))


def _option_table() -> dict:
    names, types, defaults, _choices, _docs = torch.ops.trainsan.options()
    parse = {
        "str": str,
        "int": int,
        "float": float,
        "bool": lambda v: v == "true",
    }
    return {n: parse[t](d) for n, t, d in zip(names, types, defaults)}


#: The finding kinds TrainSan implements and their severities, from the C++ table
#: (host/include/trainsan/kinds.def).
KINDS: dict = _kind_table()

#: Every option with its default, from the C++ table (host/include/trainsan/options.def);
#: ``policy`` and ``trace`` are :func:`attach`'s own arguments, the rest its keyword options.
OPTIONS: dict = _option_table()

#: The options as a dataclass (``trainsan.Options()`` holds the defaults), generated from the
#: same table.
Options = dataclasses.make_dataclass(
    "Options", [(n, type(v), dataclasses.field(default=v)) for n, v in OPTIONS.items()]
)
Options.__doc__ = "TrainSan's options and their defaults (the README documents each rule)."

# Modules whose forward depends on train/eval (Note [Mode rules] in host/checks/mode.cpp).
_MODE_SENSITIVE = (
    torch.nn.modules.dropout._DropoutNd,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)


from ._facts import (  # noqa: E402
    _flat_tensors,
    _group_lrs,
    _header_extra,
    _is_dtensor,
    _local,
    _mode_modules,
    _skip_frames,
    _steps_in_flight,
)
from ._findings import Finding, TrainingBugError, TrainingBugWarning  # noqa: E402
from .determinism import Rerun  # noqa: E402
from .precision import Provenance, range_record, range_rows  # noqa: E402
from .replicas import ReplicaComparison  # noqa: E402
from .resume import ResumeWatch, inputs_of_trace, resume_patch  # noqa: E402
from .replicas import active as replicas_active  # noqa: E402
from ._patches import (  # noqa: E402
    Patch,
    _data_restarts,
    _forward_clock,
    _loader_patch,
    _loss_patch,
    _open_sanitizers,
    _save_patch,
    _scaler_patch,
    _step_counts,
    _watchers,
)


_KIND_ON = dict(zip(*(torch.ops.trainsan.kinds()[k] for k in (0, 2))))  # kind -> on by default

# model -> weakref to its open sanitizer (weak both ways: Note [Sanitizer lifetime])
_attached: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_ACTIONS = ("none", "warn", "raise")  # trainsan::Action, as the op library returns it
_NO_IDS: frozenset = frozenset()


# Note [Sanitizer lifetime]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Nothing TrainSan installs holds the sanitizer strongly: the module and optimizer hooks are
# _Hook objects that call it through a weak reference, and the process-wide registries
# (_attached, _watchers, _open_sanitizers) hold it weakly. So a sanitizer the user drops
# without close() is garbage-collected, and its finalizer (__del__ -> close()) removes every hook
# and writes the trace summary: the model is left as it was and can be attached again. Dropping
# the object returned by attach() at once (`trainsan.attach(model, opt)` as a statement) would
# check nothing, so the finalizer warns when it closes a sanitizer nobody closed.
# The hooks are also invisible to copies: while a sanitizer is open, nn.Module.__getstate__ (what
# copy.deepcopy, pickle and torch.save(model) use) leaves _Hook entries out of the state, so an
# EMA or best-model copy, or a saved whole module, carries no sanitizer and no reference to one.


_EAGER_METHODS = ("_on_forward", "_pre_step", "_post_step")


class _Hook:
    """A module/optimizer hook that calls `method` of a sanitizer held weakly (Note [Sanitizer
    lifetime]), with `args` before the hook's own arguments. A no-op once the sanitizer is gone.
    Traced by dynamo (Note [Compiled regions] in _compile.py): activation hooks vanish, the root
    pre-hook returns where a compiled call's entry reports the forward, and otherwise the root
    pre-hook and the step hooks call `_eager`, a torch._dynamo.disable()d copy (one break)."""

    __slots__ = ("_ref", "_method", "_args", "_eager", "__weakref__")

    def __init__(self, san: "Sanitizer", method: str, *args: Any):
        self._ref = weakref.ref(san)
        self._method = method
        self._args = args
        self._eager = None
        if method in _EAGER_METHODS:
            san._eager_hooks.append(weakref.ref(self))
            if _compile.dynamo() is not None:
                self.make_eager()

    def make_eager(self) -> None:
        if self._eager is None:
            self._eager = _compile.dynamo().disable(self._run)

    def _run(self, *args: Any) -> Any:
        san = self._ref()
        if san is None:
            return None
        return getattr(san, self._method)(*self._args, *args)

    def __call__(self, *args: Any) -> Any:
        eager = self._eager
        if _compile.is_compiling():
            if eager is None:
                return None  # activation hooks: traced away
            if self._method == "_on_forward":
                san = self._ref()
                if san is None or san._in_compiled:
                    return None  # a compiled module's entry reports this forward
            return eager(*args)  # no entry of ours: leave the graph here (one break)
        if eager is not None:
            return eager(*args)  # never compiled, even from a frame dynamo fell back on
        return self._run(*args)


def _weak_method(bound) -> Any:
    """`bound` (a bound method of a sanitizer) called through a weak reference: for callbacks
    handed to objects that process-wide state may hold (a pushed TorchFunctionMode, saved-tensor
    hooks, the Function.apply patch)."""
    ref = weakref.WeakMethod(bound)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        return None if m is None else m(*args, **kwargs)

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


_getstate_patch = Patch(_module_getstate)


# Note [Closure steps]
# ~~~~~~~~~~~~~~~~~~~~
# optimizer.step(closure) runs the loop's forward and backward inside the step: Lightning's
# automatic optimization does it every step, LBFGS evaluates the closure several times. The first
# evaluation is the step's training forward and backward, exactly as in a plain loop, so the
# step's pre-hook does not begin the step: it hands the optimizer a _StepClosure, and the step
# begins (snapshot, step_begin) when the closure has returned the first time. Every check that
# sees a plain loop's forward (inputs, modes, op audits, the loss) sees that evaluation; later
# evaluations (LBFGS line search) are inside the step, where only nonfinite_loss applies. An
# optimizer seen evaluating its closure more than once in a step (LBFGS) is a line-search
# optimizer: from its next step on, the step begins before its closure runs, so every evaluation
# is inside the step (its first loss is a trial like the others: no loss_spike or trivial_loss on a
# second-order method that legitimately solves a convex problem in a step or two), and its steps
# are judged as steps that need not move the weights (LBFGS returns without an update when its own
# tolerances say it has converged): the rules that expect a move (skipped_step, update_ratio) do
# not apply to it, as with a learning rate of 0. An optimizer that never calls its closure gets a
# step without a beginning (step_in_flight).


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
    """The closure handed to the optimizer (Note [Closure steps])."""

    def __init__(self, san: "Sanitizer", k: int, closure):
        self._ref = weakref.ref(san)
        self._k = k
        self._closure = closure
        self._begun = False
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        out = self._closure(*args, **kwargs)
        if not self._begun:
            self._begun = True
            san = self._ref()
            if san is not None:
                san._begin_step(self._k)
        return out


def _unwrap_optimizer(o: Any) -> Any:
    """The torch optimizer inside a wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer: anything with an ``.optimizer`` attribute that is not itself a working
    torch optimizer). A real Optimizer subclass that wraps another (Lookahead) is kept: its own
    step is the update."""
    for _ in range(8):
        if isinstance(o, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in o.__dict__:
            return o
        inner = getattr(o, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(o, "_optimizer", None)
        if inner is None or inner is o:
            return o
        o = inner
    return o


class Sanitizer:
    """A sanitizer attached to one model (and its optimizers). Create it with :func:`attach`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        policy: str,
        trace: Optional[str],
        checks: dict,
        options: dict,
    ):
        # Read before anything is installed: a bad resume_trace fails attach() cleanly.
        seen_inputs = (inputs_of_trace(str(options["resume_trace"]))
                       if options.get("resume_trace") else None)
        self._model = model
        self._optimizers = list(optimizers)
        self._closed = False
        self._tracing = bool(trace)  # a trace is written: step fingerprints of the targets
        self._getstate_patched = False
        self._compile_patched = False
        self._in_compiled = 0  # inside a compiled call of the model (Note [Compiled regions])
        self._eager_hooks: list = []  # weakrefs to the _Hooks with a disable()d copy
        # Set once this sanitizer holds a reference on the GradScaler patch: an __init__ that
        # raises (bad trace path, bad option) is still close()d by __del__, and must not release
        # a reference it never took (the count would go negative and AMP skips go unseen).
        self._scaler_patched = False
        self._loss_patched = False  # likewise for the backward patch (Note [Loss roots])
        self._last_train_forward = -1  # _forward_clock at this model's latest training forward
        self._watched: dict = {}  # id(loss) -> weakref: the losses watched since the last step
        self._handles: list = []
        self._prov = Provenance(self, model)  # Note [Overflow provenance] (precision.cpp)
        self._rerun = Rerun(self, model)  # Note [Re-run determinism] (determinism.cpp)
        self._headroom_at: dict = {}  # optimizer -> step whose range counts are due at its end
        self._py_overhead = 0.0
        names, params, opt_index, group_index = [], [], [], []
        where = {}  # id(param) -> (optimizer, group)
        for k, opt in enumerate(self._optimizers):
            for gi, g in enumerate(opt.param_groups):
                for p in g["params"]:
                    where.setdefault(id(p), (k, gi))
        for name, p in model.named_parameters():
            names.append(name)
            params.append(p)
            k, gi = where.get(id(p), (-1, 0))
            opt_index.append(k)
            group_index.append(gi)
        if not params:
            raise ValueError(
                "trainsan.attach: the model has no parameters; attach to the module you train"
            )
        opts = {k: _opt_str(v) for k, v in options.items()}
        opts["policy"] = policy
        if trace:
            opts["trace"] = os.fspath(trace)
        for kind, on in checks.items():
            opts["check." + kind] = _opt_str(bool(on))
        _check_optimizers_hold_model(self._optimizers, params)
        self._dt_index = [k for k, p in enumerate(params) if _is_dtensor(p)]
        fsdp_ids = _fsdp_sharded_ids(model)
        self._fsdp_ids = fsdp_ids
        self._unsharded_ids: Optional[set] = None
        external = [int(id(p) in fsdp_ids) for p in params]
        locals_ = [_local(p) for p in params]
        index = {}
        for k, p in enumerate(params):
            index.setdefault(id(p), k)
        modes = _mode_modules(model, index)
        self._sensitive = [m for _, m, _, _ in modes]
        self._handle = torch.classes.trainsan.Sanitizer(
            names,
            params,
            opt_index,
            opts,
            _header_extra(model),
            [n for n, _, _, _ in modes],
            [type(m).__name__ for _, m, _, _ in modes],
            _skip_frames(),
            not self._optimizers,
            group_index,
            [len(own) for _, _, own, _ in modes],
            [i for _, _, own, _ in modes for i in own],
            [int(dep) for _, _, _, dep in modes],
            locals_,
            external,
        )
        for k, p in enumerate(params):
            if external[k]:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(
                        lambda _p, k=k, h=self._handle: h.grad_accumulated(k)
                    )
                )
        self._dt_params = [params[k] for k in self._dt_index]
        # Policy "raise": class-index targets are checked before the loss runs
        # (trainsan/audit.py) — targets on a CPU always (a host read, no sync), device targets
        # with sync=True; otherwise the C++ op audit reports at the next event.
        sync = options.get("sync", OPTIONS["sync"])
        LabelGuard.end_all_windows()
        self._label_guard = (
            LabelGuard(_weak_method(self._check_target), host_only=not sync)
            if policy == "raise"
            and (self._enabled("label_range", checks) or self._enabled("batch_mismatch", checks))
            else None
        )
        _getstate_patch.acquire()
        self._getstate_patched = True
        self._handles.append(
            model.register_forward_pre_hook(_Hook(self, "_on_forward"), with_kwargs=True)
        )
        for k, opt in enumerate(self._optimizers):
            self._handles.append(opt.register_step_pre_hook(_Hook(self, "_pre_step", k)))
            self._handles.append(opt.register_step_post_hook(_Hook(self, "_post_step", k)))
            _watchers.setdefault(opt, weakref.WeakSet()).add(self)
        if self._enabled("nonfinite_activation", checks):
            for n, m in model.named_modules():
                if not list(m.children()):
                    self._handles.append(m.register_forward_hook(_Hook(self, "_activation", n)))
        _scaler_patch.acquire()
        self._scaler_patched = True
        _loader_patch.acquire()
        self._loader_patched = True
        # Autograd integrity (autograd_checks.py): saved-tensor hooks on sampled steps, and the
        # custom-Function gradcheck (opt-in, gradcheck_every).
        self._saved_check = (
            SavedTensorCheck(
                self._handle,
                {id(p): n for n, p in zip(names, params)},
                {id(b) for b in model.buffers()},
                _weak_method(self._apply),
                _weak_method(self._add_py),
            )
            if self._enabled("inplace_before_backward", checks)
            else None
        )
        self._gradcheck = (
            CustomGradCheck(self._handle, _weak_method(self._apply), _weak_method(self._add_py))
            if self._enabled("bad_custom_grad", checks)
            and int(options.get("gradcheck_every", OPTIONS["gradcheck_every"])) > 0
            else None
        )
        self._param_ids = {id(p) for p in params}
        self._tracked = list(zip(names, params))
        self._opt_index = list(opt_index)
        self._live_checked = False  # _check_params_live() at the first step
        _loss_patch.acquire()
        self._loss_patched = True
        _save_patch.acquire()
        self._save_patched = True
        resume_patch.acquire()
        self._resume_patched = True
        self._resume = ResumeWatch(self)  # Note [Resume checks] (host/checks/resume.cpp)
        if seen_inputs is not None:
            self._handle.inputs_seen(*seen_inputs)
        _open_sanitizers.add(self)
        _compile.compile_patch.acquire()
        self._compile_patched = True
        # Attached inside an optimizer's step (a callback in step(closure)): the rest of that step
        # is part of it, and its post-hook comes without a pre-hook (_make_post_step).
        self._stepping: set = set()
        self._amp_skipping: set = set()  # optimizers whose current step the GradScaler skips
        self._closures: dict = {}  # optimizer index -> its step's _StepClosure
        self._line_search: set = set()  # optimizers that evaluate a closure several times a step
        for k in _steps_in_flight(self._optimizers):
            self._handle.step_in_flight(k)
        # rank_desync (Note [Replica comparison], replicas.py): a distributed run's replicas.
        self._replicas: Optional[ReplicaComparison] = None
        if self._enabled("rank_desync", checks) and replicas_active():
            self._replicas = ReplicaComparison(
                self._handle,
                model,
                names,
                params,
                self._optimizers,
                options,
                _weak_method(self._apply),
                lambda: _forward_clock[0],
            )

    @staticmethod
    def _enabled(kind: str, checks: dict) -> bool:
        return bool(checks.get(kind, _KIND_ON[kind]))

    # -- events ---------------------------------------------------------------------------------

    def _apply(self, reports) -> None:
        """Map the policy's answers (decided in C++) to an exception or a warning."""
        for t, action in reports:
            if _ACTIONS[action] == "raise":
                raise TrainingBugError(Finding._from_tuple(t))
            if _ACTIONS[action] == "warn":
                warnings.warn(t[4], TrainingBugWarning, stacklevel=3)

    def _on_forward(self, module, args, kwargs):
        if self._closed or self._in_compiled:
            return None  # (a compiled call's entry reported this forward: Note [Compiled regions])
        t0 = time.perf_counter()
        training = module.training
        if training and torch.is_grad_enabled():
            _forward_clock[0] += 1
            self._last_train_forward = _forward_clock[0]
        inputs = _flat_tensors(args, []) + _flat_tensors(kwargs, []) if training else []
        module_eval = [not m.training for m in self._sensitive]
        found = self._handle.forward(
            training, inputs, module_eval, self._take_overhead(), _data_restarts[0]
        )
        if self._label_guard is not None:
            if torch.is_grad_enabled() and training and self._handle.auditing():
                self._label_guard.push()
            else:
                self._label_guard.pop()
        if training and torch.is_grad_enabled():
            self._autograd_window()
            self._rerun.begin_forward(args, kwargs)
            self._prov.begin_forward()
        self._py_overhead += time.perf_counter() - t0
        self._apply(found)
        return None

    def _autograd_window(self) -> None:
        """A training forward: open the sampled windows of the autograd checks (they last until
        the optimizer step; the saved-tensor check's fingerprints until backward starts)."""
        if self._saved_check is not None:
            if self._handle.inplace_check_step():
                self._saved_check.begin()
            else:
                self._saved_check.end()
        if self._gradcheck is not None:
            self._gradcheck.begin(self._handle.gradcheck_step(), self._handle.step())

    def _end_autograd_window(self) -> None:
        if getattr(self, "_saved_check", None) is not None:
            self._saved_check.end()
        if getattr(self, "_gradcheck", None) is not None:
            self._gradcheck.end()

    def _add_py(self, seconds: float) -> None:
        self._py_overhead += seconds

    def _pre_step(self, k: int, opt, args, kwargs):
        if _scaler_found_inf(opt):
            # GradScaler.step calls a fused optimizer's step even when it found Inf/NaN (the
            # fused kernel then skips the update): an AMP skip, not a step (_post_step).
            self._amp_skipping.add(k)
            return None
        # args[0] is the optimizer itself (torch.optim's hook wrapper passes step's own args).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure) and not self._closed and k not in self._line_search:
            # Note [Closure steps]: the step begins when its closure has run once.
            wrapped = _StepClosure(self, k, closure)
            self._closures[k] = wrapped
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._begin_step(k)
        return None

    def _begin_step(self, k: int) -> None:
        if self._label_guard is not None:
            self._label_guard.pop()
        self._end_autograd_window()
        if not self._live_checked and not self._closed:
            self._live_checked = True
            self._check_params_live()
        if not self._closed:
            if self._replicas is not None:
                self._replicas.first_step()
            self._stepping.add(k)
            self._rerun.before_step()
            self._resume.first_step(k)
            self._prov.read_all()
            if self._handle.headroom_due():
                self._headroom_at[k] = self._handle.step()
            self._apply(self._handle.step_begin(k))

    def _grad_leaf_ids(self) -> set:
        """ids of the leaves the autograd graph holds for this model's parameters besides the
        parameters themselves: FSDP2's unsharded parameters (created at its lazy init, so looked
        up when asked; Note [Loss roots])."""
        if not self._fsdp_ids:
            return _NO_IDS
        if self._unsharded_ids is None or len(self._unsharded_ids) < len(self._fsdp_ids):
            self._unsharded_ids = _fsdp_unsharded_ids(self._model)
        return self._unsharded_ids

    def _check_params_live(self) -> None:
        """At the first step: the attached parameters must still be the model's. fully_shard,
        distribute_module, to_empty or load_state_dict(assign=True) after attach() replace them:
        the hooks and statistics would watch tensors the model no longer uses."""
        live = {id(p) for p in self._model.parameters()}
        gone = [n for n, p in self._tracked if id(p) not in live]
        if gone:
            raise RuntimeError(
                f"trainsan: {len(gone)} of the {len(self._tracked)} parameters attached are no "
                f"longer the model's (e.g. {gone[0]!r}): they were replaced after attach() "
                "(fully_shard, distribute_module, to_empty, load_state_dict(assign=True), "
                "parametrizations?), so TrainSan would watch tensors the model no longer uses. "
                "Replace them first, build the optimizer on the model as it is then, and attach "
                "last (for FSDP2: fully_shard, then the optimizer, then trainsan.attach)"
            )

    def _post_step(self, k: int, opt, args, kwargs):
        if k in self._amp_skipping:
            self._amp_skipping.discard(k)
            return  # not counted: the GradScaler patch sees no step and reports the AMP skip
        _step_counts[opt] = _step_counts.get(opt, 0) + 1
        if self._closed:
            return
        self._watched.clear()  # a loss is watched once per step (Note [Loss roots])
        t0 = time.perf_counter()
        wrapped = self._closures.pop(k, None)
        if wrapped is not None and wrapped.calls > 1:
            self._line_search.add(k)  # Note [Closure steps]
        lrs = _group_lrs(opt)
        # A line-search optimizer may leave the weights unchanged by its own tests (converged):
        # judged as a step that expects no move, like a learning rate of 0 (Note [Closure steps]).
        lr0 = all(lr == 0 for lr in lrs) or k in self._line_search
        if k not in self._stepping:
            # No pre-hook for this step: it was in flight when this sanitizer attached (or its
            # closure was never called).
            self._handle.step_in_flight(k)
        self._stepping.discard(k)
        if self._dt_index:
            ps = self._dt_params
            self._handle.local_shards(
                self._dt_index,
                [p._local_tensor for p in ps],
                [None if p.grad is None else p.grad._local_tensor for p in ps],
            )
        self._py_overhead += time.perf_counter() - t0
        reports = self._handle.step_end(k, lr0, self._take_overhead(), lrs)
        if k in self._headroom_at:
            self._write_headroom(k, self._headroom_at.pop(k))
        if self._replicas is not None:
            t0 = time.perf_counter()
            self._replicas.on_step(k, skipped=False)
            self._py_overhead += time.perf_counter() - t0
        self._apply(reports)

    def _check_save(self, obj, f) -> None:
        """torch.save(obj, f) while attached (Note [Checkpoint checks]): judged before writing
        when obj holds this model's tensors."""
        if self._closed or not _holds_model(obj, self._model):
            return
        t0 = time.perf_counter()
        from .checkpoint import gather

        where = os.fspath(f) if isinstance(f, (str, os.PathLike)) else type(f).__name__
        facts = gather(obj, f"torch.save to {where}", self._model, self._optimizers,
                       part_ok=True)
        self._py_overhead += time.perf_counter() - t0
        self._apply(self._handle.checkpoint(facts.fields()))

    def _write_headroom(self, k: int, step: int) -> None:
        """Note [Precision headroom]: range counts of optimizer k's weights (after the step)
        and gradients, as trace records."""
        t0 = time.perf_counter()
        try:
            items = []
            for (name, p), opt in zip(self._tracked, self._opt_index):
                if opt != k or not p.is_floating_point():
                    continue
                items.append(("weight", name, p))
                g = p.grad
                if g is not None and g.is_floating_point() and g.layout == torch.strided:
                    items.append(("grad", name, g))
            rows = range_rows([t for _, _, t in items])
            for (what, name, t), row in zip(items, rows):
                self._handle.trace_record(json.dumps(range_record(step, what, name, t.dtype, row)))
        except Exception as exc:  # noqa: BLE001 - never crash the job TrainSan watches
            warnings.warn(f"trainsan: precision headroom skipped at step {step} "
                          f"({type(exc).__name__}: {exc})", stacklevel=3)
        self._py_overhead += time.perf_counter() - t0

    def _activation(self, name: str, module, args, output):
        if self._closed or not torch.is_grad_enabled():
            return
        outs = [t for t in _flat_tensors(output, []) if t.is_floating_point()]
        if outs:
            self._apply(self._handle.module_output(name, type(module).__name__, outs))

    def _check_target(self, op, input, target, ignore_index, num_classes) -> None:
        self._apply(self._handle.check_target(op, input, target, ignore_index, num_classes))

    def _scaler_step(self, opt, skipped: bool, scale: float) -> None:
        """A GradScaler step of optimizer `opt` (after it: skipped, or the optimizer stepped)."""
        if self._closed or opt not in self._optimizers:
            return
        k = self._optimizers.index(opt)
        if skipped:
            self._prov.read_all()  # the skipped step's flags, before the scaler's finding
        self._apply(self._handle.scaler_step(k, skipped, scale))
        if skipped and self._replicas is not None:
            self._replicas.on_step(k, skipped=True)

    def _first_watch(self, loss: torch.Tensor) -> bool:
        """True the first time this tensor object is seen since the last step (Note [Loss
        roots]); a dead entry whose id was reused does not count."""
        ref = self._watched.get(id(loss))
        if ref is not None and ref() is loss:
            return False
        if len(self._watched) >= 256:
            self._watched = {k: r for k, r in self._watched.items() if r() is not None}
        try:
            self._watched[id(loss)] = weakref.ref(loss)
        except TypeError:
            pass
        return True

    def _auto_loss(self, loss: torch.Tensor) -> None:
        """The root of a training backward (Note [Loss roots]): watched as by watch_loss."""
        if self._closed or not self._first_watch(loss):
            return
        self._prov.read_forward()
        self._apply(self._handle.loss(_local(loss)))
        self._targets(loss)

    def _targets(self, loss: torch.Tensor) -> None:
        """The targets the loss was computed against (the `_saved_target` of the loss nodes
        nearest the root), for the trace's step fingerprints; only when a trace is written."""
        if not self._tracing:
            return
        t0 = time.perf_counter()
        found, seen, frontier = [], set(), [getattr(loss, "grad_fn", None)]
        while frontier and len(seen) < 16:
            node = frontier.pop(0)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            t = getattr(node, "_saved_target", None)
            if isinstance(t, torch.Tensor):
                found.append(_local(t))
            frontier += [n for n, _ in getattr(node, "next_functions", ())]
        if found:
            self._handle.loss_targets(found)
        self._py_overhead += time.perf_counter() - t0

    def _take_overhead(self) -> float:
        t, self._py_overhead = self._py_overhead, 0.0
        return t

    # -- public API -----------------------------------------------------------------------------

    def training_forward(self, *inputs: Any) -> None:
        """Report a training forward that does not go through the attached module's __call__
        (Lightning calls ``training_step`` as a method, and a step may call a submodule): what
        the module's forward pre-hook does, with `inputs` as the forward's inputs (for
        duplicate_batch). Grad mode and the modules' train/eval modes are read now."""
        self._on_forward(self._model, inputs, {})

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Check a loss (``nonfinite_loss``, ``loss_spike``, ``trivial_loss``) and return it
        unchanged. Optional in Python: the root of every training backward is watched already
        (Note [Loss roots]); the same tensor is checked once per step however it arrives."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"watch_loss: expected a tensor, got {type(loss).__name__}")
        if not self._closed and self._first_watch(loss):
            self._prov.read_forward()
            self._apply(self._handle.loss(_local(loss)))
            self._targets(loss)
        return loss

    @property
    def findings(self) -> list[Finding]:
        """Every distinct finding so far, each with its count."""
        return [Finding._from_tuple(t) for t in self._handle.findings()]

    @property
    def step(self) -> int:
        """Number of completed optimizer steps."""
        return int(self._handle.step())

    @property
    def overhead_seconds(self) -> float:
        """Time spent inside TrainSan so far (C++ and Python hooks)."""
        return float(self._handle.overhead_s()) + self._py_overhead

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def coverage(self) -> dict:
        """What was checked so far: counts (``steps_checked``, ``update_steps``,
        ``update_period``, ``training_forwards``, ``other_forwards``, ``losses_checked``,
        ``inputs_fingerprinted``, ``audited_forwards``, ``ops_audited``) and ``unchecked``:
        ``{kind: reason}`` for the enabled checks that never had what they need."""
        counts, kinds, reasons = self._handle.coverage()
        out = dict(counts)
        out["unchecked"] = dict(zip(kinds, reasons))
        if self._replicas is not None and not self._replicas.sets:
            out["unchecked"]["rank_desync"] = (
                "no parameter has replicas on this rank (each is sharded on every mesh dimension "
                "or marked tensor_model_parallel)"
            )
        return out

    def summary(self) -> str:
        """A short human-readable summary: the findings, what was checked, and which checks never
        had what they need (a clean summary means "checked and clean", not "saw nothing")."""
        fs = self.findings
        c = self.coverage()
        if not fs:
            lines = [f"trainsan: {self.step} steps, no findings"]
        else:
            lines = [f"trainsan: {self.step} steps, {len(fs)} distinct finding(s):"]
        for f in fs:
            rep = f" (x{f.count}, last at step {f.last_step})" if f.count > 1 else ""
            lines.append(f"  [{f.severity}] {f.message}{rep}")
        period = c["update_period"]
        lines.append(
            f"  checked: {c['steps_checked']} step(s) ({c['update_steps']} with update statistics"
            + (f", now every {period}th" if period > 1 else "")
            + f"), {c['training_forwards']} training forward(s), {c['losses_checked']} loss(es), "
            f"inputs at {c['inputs_fingerprinted']} step(s), {c['audited_forwards']} audited "
            f"forward(s) ({c['ops_audited']} ops)"
        )
        for kind, why in c["unchecked"].items():
            lines.append(f"  not checked: {kind}: {why}")
        return "\n".join(lines)

    def last_stats(self) -> dict[str, TensorStats]:
        """Statistics of the last checked step: ``"<param>"``, ``"<param>.grad"`` and
        ``"<param>.update"`` (for the update, ``l2``/``absmax`` are ‖Δθ‖ and max|Δθ|, ``zero`` the
        number of unchanged elements)."""
        names, ints, floats = self._handle.last_stats()
        from .stats import _unpack

        return dict(zip(names, _unpack(ints, floats)))

    def close(self) -> None:
        """Flush pending checks, write the trace summary and remove every hook."""
        if self._closed:
            return
        self._closed = True
        guard = getattr(self, "_label_guard", None)
        if guard is not None:
            guard.pop()
        self._end_autograd_window()
        if getattr(self, "_gradcheck", None) is not None:
            self._gradcheck.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if getattr(self, "_prov", None) is not None:
            self._prov.close()
        if getattr(self, "_rerun", None) is not None:
            self._rerun._clear()
        for opt in self._optimizers:
            ws = _watchers.get(opt, [])
            if self in ws:
                ws.remove(self)
        if self._scaler_patched:
            self._scaler_patched = False
            _scaler_patch.release()
        if getattr(self, "_loader_patched", False):
            self._loader_patched = False
            _loader_patch.release()
        _open_sanitizers.discard(self)
        if getattr(self, "_loss_patched", False):
            self._loss_patched = False
            _loss_patch.release()
        if getattr(self, "_save_patched", False):
            self._save_patched = False
            _save_patch.release()
        if getattr(self, "_resume_patched", False):
            self._resume_patched = False
            resume_patch.release()
        ref = _attached.get(self._model)
        if ref is not None and ref() in (self, None):
            del _attached[self._model]
        if self._getstate_patched:
            self._getstate_patched = False
            _getstate_patch.release()
        if self._compile_patched:
            self._compile_patched = False
            _compile.unwrap_compiled_call(self._model)
            _compile.compile_patch.release()
        found: list = []
        replicas = getattr(self, "_replicas", None)
        if replicas is not None:
            found = replicas.close()  # its findings are raised with close()'s own
        self._apply(found + list(self._handle.close()))

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Sanitizer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - never mask the exception already propagating
                pass

    def __del__(self):
        # Note [Sanitizer lifetime]: dropped without close().
        try:
            if not self._closed and hasattr(self, "_handle"):
                warnings.warn(
                    "trainsan: a Sanitizer was garbage-collected without close(); its hooks are "
                    "removed and it checks nothing more. Keep the object attach() returns "
                    "(san = trainsan.attach(...)) for as long as you train, and close() it or use "
                    "`with trainsan.attach(...) as san:`",
                    ResourceWarning if sys.is_finalizing() else UserWarning,
                    stacklevel=2,
                )
            if not self._closed:
                self.close()
        except Exception:
            pass


def _holds_model(obj, model: torch.nn.Module) -> bool:
    """Whether a saved object holds the model, or tensors sharing its parameters' storage (its
    state_dict(), or one of its wrapper's)."""
    ptrs = set()
    for p in model.parameters():
        try:
            ptrs.add(p.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001 - a parameter without storage (meta, some subclasses)
            pass
    ptrs.discard(0)
    mods = {id(m) for m in model.modules()}

    def walk(o, depth: int) -> bool:
        if depth > 4:
            return False
        if isinstance(o, torch.nn.Module):
            return id(o) in mods or any(id(m) in mods for m in o.modules())
        if isinstance(o, torch.Tensor):
            try:
                return o.untyped_storage().data_ptr() in ptrs
            except Exception:  # noqa: BLE001
                return False
        if isinstance(o, dict):
            return any(walk(v, depth + 1) for v in o.values())
        if isinstance(o, (list, tuple)):
            return any(walk(v, depth + 1) for v in o)
        return False

    return walk(obj, 0)


def _fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's per-parameter records (FSDPParam) of the model's fully_shard()ed modules; empty
    without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001 - torch without distributed
        return []
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def _fsdp_sharded_ids(model: torch.nn.Module) -> set:
    """ids of the FSDP2 sharded parameters of the model (fully_shard)."""
    return {id(fp.sharded_param) for fp in _fsdp_params(model)}


def _fsdp_unsharded_ids(model: torch.nn.Module) -> set:
    """ids of the unsharded parameters FSDP2 swaps in during forward and backward (those that
    exist yet)."""
    return {id(u) for fp in _fsdp_params(model) if (u := getattr(fp, "_unsharded_param", None))
            is not None}


def _check_optimizers_hold_model(optimizers, params) -> None:
    """An optimizer that holds none of the model's parameters updates tensors the model does not
    use: it was built before the parameters were replaced (fully_shard, distribute_module, ...)."""
    ids = {id(p) for p in params}
    for k, opt in enumerate(optimizers):
        held = [p for g in opt.param_groups for p in g["params"]]
        if held and not any(id(p) in ids for p in held):
            sharded = any(_is_dtensor(p) for p in params) and not any(_is_dtensor(p) for p in held)
            raise ValueError(
                f"trainsan.attach: optimizer[{k}] holds none of the model's parameters "
                f"({len(held)} tensor(s), none of them in model.parameters()) — "
                + ("the model's parameters are sharded DTensors and the optimizer's are not: "
                   "it was built before fully_shard (or distribute_module) replaced them, so it "
                   "updates tensors the model no longer uses; build the optimizer after "
                   "fully_shard(model)"
                   if sharded else
                   "it was built before the model's parameters were replaced (fully_shard, "
                   "distribute_module, to_empty, load_state_dict(assign=True)) or belongs to "
                   "another model; build it from model.parameters() of the model you train")
            )


def attached(model: torch.nn.Module) -> Optional[Sanitizer]:
    """The open sanitizer attached to `model` (through attach()), or None."""
    ref = _attached.get(_compile.unwrap_compiled(model))
    san = ref() if ref is not None else None
    return None if san is None or san.closed else san


def _opt_str(v: Any) -> str:
    if v is None:
        return "0"  # overhead_budget=None, grad_explosion_limit=None: none
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def attach(
    model: torch.nn.Module,
    optimizer: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None] = None,
    *,
    policy: Optional[str] = None,
    trace: Union[str, os.PathLike, None] = None,
    checks: Optional[dict] = None,
    **options: Any,
) -> Sanitizer:
    """Attach TrainSan to a model and its optimizer(s); the training loop stays unchanged.

    Parameters
    ----------
    model : torch.nn.Module
        The module whose forward is the training forward.
    optimizer : torch.optim.Optimizer or list of them, optional
        Omit it for loops that update parameters by hand; steps are then delimited by training
        forwards (the README lists the checks that need an optimizer).
    policy : {"raise", "warn", "record"}, optional
        Default ``OPTIONS["policy"]`` (``"raise"``). ``"raise"`` raises :class:`TrainingBugError` at the first error-severity finding,
        ``"warn"`` emits :class:`TrainingBugWarning`, ``"record"`` only records.
    trace : path, optional
        JSON Lines trace (header, step records, findings, summary), flushed every step.
    checks : dict, optional
        ``{kind: bool}`` to switch checks off, or the opt-in ones (``nonfinite_activation``) on.
    **options
        Thresholds and switches of :data:`OPTIONS` (``sync``, ``track_updates``,
        ``trace_every``, ``grad_explosion_factor``, ...).

    Returns
    -------
    Sanitizer
        Use as a context manager, or call :meth:`Sanitizer.close`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"trainsan.attach: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    # attach(torch.compile(model)): watch the module inside (its parameter names, no "_orig_mod.");
    # its forward is reported at the compiled call's entry (Note [Compiled regions]).
    model = _compile.unwrap_compiled(model)
    if optimizer is None:
        opts: list = []
    elif isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "param_groups"):
        opts = [optimizer]
    else:
        try:
            opts = list(optimizer)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                "trainsan.attach: optimizer must be a torch.optim.Optimizer or a list of them, "
                f"got {type(optimizer).__name__}"
            ) from None
    opts = [_unwrap_optimizer(o) for o in opts]
    for k, o in enumerate(opts):
        if not isinstance(o, torch.optim.Optimizer) or "_optimizer_step_pre_hooks" not in o.__dict__:
            if isinstance(o, torch.optim.Optimizer):
                raise TypeError(
                    f"trainsan.attach: optimizer[{k}] ({type(o).__name__}) is a torch optimizer "
                    "whose __init__ did not call torch.optim.Optimizer.__init__, so it has no step "
                    "hooks; pass the torch optimizer it wraps"
                )
            raise TypeError(
                f"trainsan.attach: optimizer[{k}] must be a torch.optim.Optimizer (or a wrapper "
                f"holding one in .optimizer), got {type(o).__name__}"
            )
        if not any(len(g["params"]) for g in o.param_groups):
            raise ValueError(f"trainsan.attach: optimizer[{k}] has no parameters")
    if policy is None:
        policy = OPTIONS["policy"]
    if not isinstance(policy, str):
        raise ValueError(f"trainsan.attach: policy must be a string, got {type(policy).__name__}")
    unknown = sorted(set(options) - (set(OPTIONS) - {"policy", "trace"}))
    if unknown:
        raise TypeError(
            f"trainsan.attach: unknown option(s) {', '.join(unknown)}; valid options: "
            + ", ".join(sorted(set(OPTIONS) - {"policy", "trace"}))
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"trainsan.attach: {len(meta)} parameter(s) of the model are on the meta device "
            f"(not materialised; e.g. {meta[0]!r}); attach after model.to_empty(device=...) and "
            "loading the weights, so TrainSan watches the real parameters"
        )
    checks = dict(checks or {})
    bad = sorted(set(checks) - set(KINDS))
    if bad:
        raise ValueError(
            f"trainsan.attach: unknown check(s) {', '.join(bad)} (not a finding kind TrainSan "
            "implements); valid kinds: "
            + ", ".join(sorted(KINDS))
        )
    ref = _attached.get(model)
    prev = ref() if ref is not None else None
    if prev is not None and not prev.closed:
        raise RuntimeError(
            "trainsan.attach: this model already has a sanitizer attached; close() it first "
            "(or use `with trainsan.attach(...) as san:`)"
        )
    san = Sanitizer(model, opts, policy, trace, checks, options)
    _attached[model] = weakref.ref(san)
    _compile.wrap_compiled_call(model)  # model.compile() before attach (Note [Compiled regions])
    return san
