"""The training-loop sanitizer: the Sanitizer that ``trainsan.attach(model, optimizer)`` returns.

Python registers one forward pre-hook on the root module and step pre/post hooks on each
optimizer; each calls into C++ once per event. The per-parameter gradient hooks live in C++
(post-hooks on the parameters' AccumulateGrad nodes), so no Python runs per parameter per step.
What else gathers facts for the C++ checks (the label guard, the autograd checks, the replica
comparison, the re-runs, the resume facts, overflow provenance) and the process-wide patches
the sanitizer holds are members of one list (Note [Gatherers] in _gatherers.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import warnings
import weakref
from typing import Any, Optional, Sequence

import torch

from . import _compile, _native, _patches
from ._facts import (_flat_tensors, _fsdp_sharded_ids, _fsdp_unsharded, _group_lrs,
                     _header_extra, _is_dtensor, _local, _loss_targets, _mode_modules,
                     _optimizers_holding_none, _param_table, _skip_frames, _steps_in_flight,
                     outside_model, placeholders)
from ._attach_order import _ADDITIVE, _GOES_ON, _user_stacklevel
from ._context import Context
from ._faults import absorb, entry, fault_text, warn_fault
from ._findings import (Finding, TrainingBugError, TrainingBugWarning, merge_findings,
                        summary_text)
from ._gatherers import event_calls
from ._native import HotEvents
from ._hooks import _scaler_found_inf, _StepClosure
from ._parts import Setup, build as build_parts
from ._patches import (_attached, _data_restarts, _forward_clock, _step_counts, attached_to,
                       take_loader_facts)
from ._tables import ACTIONS, KINDS, OPTIONS, Options, option_strings
from .checkpoint import gather, holds_model
from .precision import write_headroom
from .attribution import attributed
from ._journal import replay_loads, watching_before
from .stats import TensorStats, _unpack

__all__ = [
    "Finding",
    "Sanitizer",
    "TrainingBugError",
    "TrainingBugWarning",
    "OPTIONS",
    "KINDS",
    "Options",
]


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
        # Note [Context]: what the parts, patches and registries may read and call.
        self._ctx = Context(self, model, list(optimizers), policy)
        self._ctx.bind(
            apply=self._apply, due=self._due_flag, note=self._note,
            on_fault=self._on_fault, on_forward=self._on_forward, begin_step=self._begin_step,
            scaler_step=self._scaler_step, gradients_cleared=self._gradients_cleared,
            auto_loss=self._auto_loss, backward_without_graph=self._backward_without_graph,
            check_save=self._check_save, walk_leaves=self._walk_leaves)
        self._trace_path = trace
        self._checks = checks
        self._options = options
        self._calls = event_calls([])
        # Note [Attach order]: what a re-binding keeps.
        self._ctx.binding = 0  # re-bindings so far (Note [Attach order])
        self._notes: list = []  # the trace's note records, also in summary() and coverage()
        self._before: list = []  # the findings of the parameters watched before re-binding
        self._counts_before: dict = {}  # their coverage counts
        self._build()

    def _build(self, rebinding: bool = False) -> None:
        """Install everything for the model and optimizers as they are now (attach, and a
        re-binding: Note [Attach order])."""
        model, policy, trace, checks, options = (
            self._ctx.model, self._ctx.policy, self._trace_path, self._checks, self._options)
        self._ctx.closed = False
        # Note [Gatherers]: what close() releases, in the order the events call it. An __init__
        # that raises is still close()d (by __del__): only what was installed is in the list.
        self._ctx.parts = []
        self._calls = event_calls([])
        self._tracing = bool(trace)  # a trace is written: step fingerprints of the targets
        self._due: Optional[tuple] = None  # the handle's due() during a training forward's members
        self._ctx.in_compiled = 0
        self._ctx.eager_hooks = []
        self._ctx.last_train_forward = -1
        # A loss of this model went into a backward since the last optimizer step or clear: a
        # zero_grad then may discard gradients no step used (Note [Discarded gradients]).
        self._unstepped_backward = False
        self._watched: dict = {}  # id(loss) -> weakref: the losses watched since the last step
        self._headroom_at: dict = {}  # optimizer -> step whose range counts are due at its end
        self._py_overhead = 0.0
        self._ctx.fault = None  # Note [Faults] (_faults.py): why it stopped checking
        names, params, opt_index, group_index, outside = _param_table(model, self._ctx.optimizers)
        if not params:
            raise ValueError(
                "trainsan.attach: the model has no parameters and no optimizer trains any "
                "tensor; attach to the module you train, with its optimizer"
            )
        opts = option_strings(options, policy, trace, checks)
        holding_none = _optimizers_holding_none(self._ctx.optimizers, params)
        if holding_none and policy == "raise" and not rebinding:
            raise ValueError(holding_none[0])  # a re-binding's is the first step's finding
        self._dt_index = [k for k, p in enumerate(params) if _is_dtensor(p)]
        fsdp_ids = _fsdp_sharded_ids(model)
        self._ctx.fsdp_ids = fsdp_ids
        self._unsharded: Optional[list] = None
        external = [int(id(p) in fsdp_ids) for p in params]
        locals_ = [_local(p) for p in params]
        index = {}
        for k, p in enumerate(params):
            index.setdefault(id(p), k)
        modes = _mode_modules(model, index)
        self._sensitive = [m for _, m, _, _ in modes]
        # One dict by name (Note [Facts by name]): trainsan::SanitizerArgs — the parameters, the
        # options, and Setup's table (host/include/trainsan/setup.def).
        self._ctx.handle = torch.classes.trainsan.Sanitizer(_native.facts(
            "SanitizerArgs",
            parameters=[
                _native.record("Parameter", name=n, tensor=p, optimizer=o, group=g, local=lo,
                               external_grad_hook=bool(ext))
                for n, p, o, g, lo, ext in zip(names, params, opt_index, group_index, locals_,
                                               external)],
            options=list(opts.items()),
            mode_modules=[
                _native.record("ModuleInfo", name=n, type=type(m).__name__, params=list(own),
                               mode_dependent=bool(dep))
                for n, m, own, dep in modes],
            manual=not self._ctx.optimizers,
            header_extra=_header_extra(model),
            skip_frames=_skip_frames(),
            gathers_events=True,  # the package gathers the event and python kinds' facts
        ))
        handle = self._ctx.handle
        trace_error = handle.take_trace_error()  # Note [Bounded trace]: told at attach
        if trace_error:
            warnings.warn(trace_error, UserWarning, stacklevel=3)
        self._ctx.hot = HotEvents(handle)  # its per-step events (Note [Hot path])
        # Note [Attach order]: the notes so far go into a restarted trace too; an optimizer that
        # holds none of the model's parameters is one under "warn" and "record".
        for rec in self._notes:
            handle.trace_record(json.dumps(rec))
        for msg in holding_none:
            self._note("optimizer_holds_none",
                       msg + _GOES_ON["optimizer_holds_none"].format(policy=policy))
        meta = placeholders(model)
        if meta:  # Note [Placeholder parameters] (_facts.py)
            shown = ", ".join(meta[:4]) + (", ..." if len(meta) > 4 else "")
            self._note("placeholders",
                       f"trainsan.attach: {len(meta)} parameter(s) of the attached "
                       f"{type(model).__name__} are on the meta device beside its materialised "
                       f"ones ({shown}): placeholders that hold no values, not watched")
        if outside:  # Note [Tensors outside the model] (_facts.py)
            shown = ", ".join(outside[:8]) + (", ..." if len(outside) > 8 else "")
            self._note("outside_model",
                       f"trainsan.attach: the optimizer trains {len(outside)} tensor(s) the "
                       f"attached {type(model).__name__} does not hold ({shown}): watched as "
                       "its parameters, under these names")
        self._dt_params = [params[k] for k in self._dt_index]
        self._ctx.param_ids = {id(p) for p in params}
        self._tracked = list(zip(names, params))
        self._opt_index = list(opt_index)
        # Attached inside an optimizer's step (a callback in step(closure)): the rest of that step
        # is part of it, and its post-hook comes without a pre-hook (_make_post_step).
        self._stepping: set = set()
        self._amp_skipping: set = set()  # optimizers whose current step the GradScaler skips
        self._closures: dict = {}  # optimizer index -> its step's _StepClosure
        self._line_search: set = set()  # optimizers that evaluate a closure several times a step
        for k in _steps_in_flight(self._ctx.optimizers):
            handle.step_in_flight(k)
        journaled = watching_before()  # Note [Loads before attach]
        # Note [Parts]: everything else it installs, in event order.
        build_parts(Setup(
            self._ctx, handle, names, params, external, outside, opt_index, options, checks,
            methods={"on_forward": self._on_forward, "pre_step": self._pre_step,
                     "post_step": self._post_step, "activation": self._activation,
                     "check_target": self._check_target, "params_replaced": self._params_replaced,
                     "apply": self._apply, "add_py": self._add_py, "due": self._due_flag}))
        self._calls = event_calls(self._ctx.parts)
        # Loads made before this attach, judged as if it had come first (Note [Load journal]); a
        # finding that raises (policy raise) leaves nothing attached.
        try:
            replay_loads(self._ctx)
            if not journaled:
                self._ctx.resume.seen_at_attach()
        except TrainingBugError:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - the finding replayed is the error
                pass
            raise

    # -- attach order (Note [Attach order]) --------------------------------------------------------

    def _on_fault(self, where: str, exc: Exception) -> None:
        """Note [Faults]: TrainSan's own code failed in the loop; it stops checking, told once."""
        if self._ctx.fault is not None:
            return
        step = int(self._ctx.handle.step()) if self._ctx.handle is not None else 0
        self._ctx.fault = fault_text(where, step, exc)
        warn_fault(self._ctx.fault)
        try:
            self._note("fault", self._ctx.fault)
        except Exception:  # noqa: BLE001 - the trace may be what failed
            pass

    def _note(self, about: str, message: str, **extra: Any) -> None:
        """A note: a trace record, listed by summary() and coverage(); warned under "warn"."""
        if any(n["about"] == about and n["message"] == message for n in self._notes):
            return
        rec = {"type": "note", "about": about, "step": int(self._ctx.handle.step()),
               "message": message, **extra}
        self._notes.append(rec)
        self._ctx.handle.trace_record(json.dumps(rec))
        if self._ctx.policy == "warn":
            warnings.warn(message, TrainingBugWarning, stacklevel=_user_stacklevel())

    def _params_replaced(self, message: str) -> None:
        """ParamsLive: the attached parameters are no longer the model's (at the first step)."""
        if self._ctx.policy == "raise":
            raise RuntimeError(message)
        self._rebind(message)

    def _rebind(self, message: str) -> None:
        """Re-bind to the model's current parameters (Note [Attach order], _attach_order.py):
        what it installed is released quietly and built anew; findings and counts carry over."""
        ctx = self._ctx
        registered = attached_to(ctx.model) is ctx
        old, old_hot = ctx.handle, ctx.hot
        counts = dict(old.coverage()[0])
        self._release_quietly()
        try:
            old.close()  # its reports are not applied; its summary record is overwritten
        except Exception:  # noqa: BLE001
            pass
        self._ctx.binding += 1
        try:
            self._build(rebinding=True)
        except Exception as exc:  # noqa: BLE001 - never raise into the script under warn/record
            self._release_quietly()
            if ctx.handle is not old:
                try:
                    ctx.handle.close()
                except Exception:  # noqa: BLE001
                    pass
            ctx.handle, ctx.hot = old, old_hot  # what it found stays readable
            warnings.warn(f"{message}; re-binding to the model's current parameters failed "
                          f"({type(exc).__name__}: {exc}): this sanitizer checks nothing more",
                          TrainingBugWarning, stacklevel=_user_stacklevel())
            return
        before = [Finding._from_dict(t) for t in old.findings()]
        self._before = merge_findings(self._before, before)
        for key in _ADDITIVE:
            if key in counts:
                self._counts_before[key] = self._counts_before.get(key, 0) + int(counts[key])
        if registered:
            _attached[ctx.model] = weakref.ref(ctx)
            _compile.wrap_compiled_call(ctx.model)
        extra = {"findings_before": [dataclasses.asdict(f) for f in before]} if before else {}
        self._note("parameters_replaced",
                   message + _GOES_ON["parameters_replaced"].format(policy=ctx.policy), **extra)

    def _release_quietly(self) -> None:
        """Closed, out of the registries, every part closed, errors ignored (a re-binding)."""
        self._ctx.closed = True
        _patches.unregister(self._ctx)
        for part in self._ctx.parts:
            try:
                part.close()
            except Exception:  # noqa: BLE001 - quiet: what is left is built anew
                pass

    # -- events ---------------------------------------------------------------------------------

    def _apply(self, reports) -> None:
        """Map the policy's answers (decided in C++) to an exception or a warning."""
        if not reports:
            return  # most events report nothing: no generator for them
        for t, action in attributed(self._ctx, reports):  # Note [Re-run attribution]
            if ACTIONS[action] == "raise":
                raise TrainingBugError(Finding._from_dict(t))
            if ACTIONS[action] == "warn":
                warnings.warn(t["message"], TrainingBugWarning, stacklevel=3)

    @entry
    def _on_forward(self, module, args, kwargs):
        if self._ctx.closed or self._ctx.in_compiled:
            return None  # (a compiled call's entry reported this forward: Note [Compiled regions])
        t0 = time.perf_counter()
        training = module.training
        if training and torch.is_grad_enabled():
            _forward_clock[0] += 1
            self._ctx.last_train_forward = _forward_clock[0]
        inputs = _flat_tensors(args, []) + _flat_tensors(kwargs, []) if training else []
        module_eval = [not m.training for m in self._sensitive]
        lpass, workers, init, batch, sampled = (
            take_loader_facts() if training and torch.is_grad_enabled()
            else (-1, 0, False, [], 0))
        # The forward's reports, and what the members ask at a training forward (the handle's
        # due(), Sanitizer._due_flag) in the same call.
        t1 = time.perf_counter()  # the C++ event times itself (Note [Own time])
        found, due = self._ctx.hot.forward(
            training, inputs, module_eval, self._take_overhead() + (t1 - t0), _data_restarts[0],
            lpass, workers, init, batch, sampled
        )
        t0 = time.perf_counter()
        train = training and torch.is_grad_enabled()
        self._due = due if train else None
        try:
            for call in self._calls["on_forward"]:
                call(args, kwargs, train)
        finally:
            self._due = None
        self._py_overhead += time.perf_counter() - t0
        self._apply(found)
        return None

    def _due_flag(self, i: int) -> Any:
        """Field `i` (DUE_* in _hooks.py) of the handle's due(): the step, and whether the
        saved-tensor check, a re-run, a recompute check, the precision headroom and overflow
        provenance are due — from the one call a training forward makes for its members, or
        asked now outside one."""
        due = self._due
        return (due if due is not None else self._ctx.handle.due())[i]

    def _add_py(self, seconds: float) -> None:
        self._py_overhead += seconds

    @entry
    def _pre_step(self, k: int, opt, args, kwargs):
        if _scaler_found_inf(opt):
            # GradScaler.step calls a fused optimizer's step even when it found Inf/NaN (the
            # fused kernel then skips the update): an AMP skip, not a step (_post_step).
            self._amp_skipping.add(k)
            return None
        # args[0] is the optimizer itself (torch.optim's hook wrapper passes step's own args).
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure) and not self._ctx.closed and k not in self._line_search:
            # Note [Closure steps]: the step begins when its closure has run once.
            wrapped = _StepClosure(self._ctx, k, closure)
            self._closures[k] = wrapped
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._begin_step(k)
        return None

    def _begin_step(self, k: int) -> None:
        # Every member, also once closed (each is a no-op then, but for windows still to end).
        t0 = time.perf_counter()
        binding = self._ctx.binding
        for call in self._calls["before_step"]:
            call(k)
            if self._ctx.binding != binding:
                return  # re-bound: this step is in flight for the new hooks (Note [Attach order])
        self._py_overhead += time.perf_counter() - t0
        if not self._ctx.closed:
            self._stepping.add(k)
            # A fused optimizer stepped by a GradScaler (which hands it `grad_scale`) unscales
            # the gradients inside its step, in place and without moving their versions: they
            # are read at the step end then (Note [Gradients read at the step's beginning]).
            final = self._ctx.optimizers[k].__dict__.get("grad_scale") is None
            reports, headroom = self._ctx.hot.step_begin(k, final)  # headroom: the step, when due
            if headroom >= 0:
                self._headroom_at[k] = headroom
            self._apply(reports)

    def _walk_leaves(self) -> list:
        """The leaves of an autograd graph that are this model's (Note [Loss roots]): its
        parameters and, under FSDP2, the unsharded parameters it swaps in for them (created at its
        lazy init, so looked up when asked)."""
        own = [p for _, p in self._tracked]
        if not self._ctx.fsdp_ids:
            return own
        if self._unsharded is None or len(self._unsharded) < len(self._ctx.fsdp_ids):
            self._unsharded = _fsdp_unsharded(self._ctx.model)
        return own + self._unsharded

    @entry
    def _post_step(self, k: int, opt, args, kwargs):
        if k in self._amp_skipping:
            self._amp_skipping.discard(k)
            return  # not counted: the GradScaler patch sees no step and reports the AMP skip
        _step_counts.bump(opt)
        self._unstepped_backward = False
        if self._ctx.closed:
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
            self._ctx.handle.step_in_flight(k)
        self._stepping.discard(k)
        if self._dt_index:
            ps = self._dt_params
            self._ctx.handle.local_shards(
                self._dt_index,
                [p._local_tensor for p in ps],
                [None if p.grad is None else p.grad._local_tensor for p in ps],
            )
        self._py_overhead += time.perf_counter() - t0
        reports = self._ctx.hot.step_end(k, lr0, self._take_overhead(), lrs)
        if k in self._headroom_at:
            t0 = time.perf_counter()
            step = self._headroom_at.pop(k)
            write_headroom(self._ctx.handle, self._tracked, self._opt_index, k, step)
            self._py_overhead += time.perf_counter() - t0
        if self._calls["after_step"]:
            t0 = time.perf_counter()
            for call in self._calls["after_step"]:
                call(k, False)
            self._py_overhead += time.perf_counter() - t0
        self._apply(reports)

    @entry
    def _check_save(self, obj, f) -> None:
        """torch.save(obj, f) while attached (Note [Checkpoint checks]): judged before writing
        when obj holds this model's tensors."""
        if self._ctx.closed or not holds_model(obj, self._ctx.model):
            return
        t0 = time.perf_counter()
        # A path, or a file object's own path (ignite's Checkpoint saves through an open
        # file); a buffer without one by its type.
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        where = os.fspath(name) if isinstance(name, (str, os.PathLike)) else type(f).__name__
        facts = gather(obj, f"torch.save to {where}", self._ctx.model, self._ctx.optimizers,
                       part_ok=True)
        self._py_overhead += time.perf_counter() - t0
        self._apply(self._ctx.handle.checkpoint(facts.fields()))

    @entry
    def _activation(self, name: str, module, args, output):
        if self._ctx.closed or not torch.is_grad_enabled():
            return
        outs = [t for t in _flat_tensors(output, []) if t.is_floating_point()]
        if outs:
            self._apply(self._ctx.handle.module_output(name, type(module).__name__, outs))

    @entry
    def _check_target(self, op, input, target, ignore_index, num_classes) -> None:
        self._apply(self._ctx.handle.check_target(op, input, target, ignore_index, num_classes))

    @entry
    def _gradients_cleared(self, opt) -> None:
        """zero_grad of optimizer `opt` (None: of the model) is about to run (Note [Discarded
        gradients])."""
        if self._ctx.closed:
            return
        if opt is None:
            k = -1
        elif opt in self._ctx.optimizers:
            k = self._ctx.optimizers.index(opt)
        else:
            return
        if self._unstepped_backward:
            # The flags of the backward whose gradients may go unused, before they are read (only
            # then: a zero_grad between the forward and its backward must not read them early).
            self._unstepped_backward = False
            t0 = time.perf_counter()
            for call in self._calls["before_clear"]:
                call(k)
            self._py_overhead += time.perf_counter() - t0
        self._apply(self._ctx.hot.gradients_cleared(k))

    @entry
    def _scaler_step(self, opt, skipped: bool, scale: float) -> None:
        """A GradScaler step of optimizer `opt` (after it: skipped, or the optimizer stepped)."""
        if self._ctx.closed or opt not in self._ctx.optimizers:
            return
        k = self._ctx.optimizers.index(opt)
        self._unstepped_backward = False
        for call in self._calls["on_scaler"]:
            call(k, skipped)
        self._apply(self._ctx.handle.scaler_step(k, skipped, scale))
        if skipped:
            for call in self._calls["after_step"]:
                call(k, True)

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

    @entry
    def _backward_without_graph(self) -> None:
        self._apply(self._ctx.handle.backward_without_graph())

    @entry
    def _auto_loss(self, loss: torch.Tensor) -> None:
        """The root of a training backward (Note [Loss roots]): watched as by watch_loss."""
        if self._ctx.closed:
            return
        self._unstepped_backward = True
        t0 = time.perf_counter()
        if not self._first_watch(loss):
            return
        for call in self._calls["on_loss"]:
            call(loss)
        self._py_overhead += time.perf_counter() - t0
        self._apply(self._ctx.hot.loss(_local(loss)))
        self._targets(loss)

    def _targets(self, loss: torch.Tensor) -> None:
        """The targets the loss was computed against, for the trace's step fingerprints; only
        when a trace is written."""
        if not self._tracing:
            return
        t0 = time.perf_counter()
        found = _loss_targets(loss)
        if found:
            self._ctx.handle.loss_targets(found)
        self._py_overhead += time.perf_counter() - t0

    def _take_overhead(self) -> float:
        t, self._py_overhead = self._py_overhead, 0.0
        return t

    # -- public API -----------------------------------------------------------------------------

    def training_forward(self, *inputs: Any, **kwinputs: Any) -> None:
        """Report a training forward that does not go through the attached module's __call__
        (Lightning calls ``training_step`` as a method, and a step may call a submodule): what
        the module's forward pre-hook does, with `inputs` and `kwinputs` as the forward's
        positional and keyword inputs (for duplicate_batch). Grad mode and the modules'
        train/eval modes are read now."""
        self._on_forward(self._ctx.model, inputs, kwinputs)

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Check a loss (``nonfinite_loss``, ``loss_spike``, ``trivial_loss``) and return it
        unchanged. Optional in Python: the root of every training backward is watched already
        (Note [Loss roots]); the same tensor is checked once per step however it arrives."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"watch_loss: expected a tensor, got {type(loss).__name__}")
        if not self._ctx.closed and self._first_watch(loss):
            for call in self._calls["on_loss"]:
                call(loss)
            self._apply(self._ctx.hot.loss(_local(loss)))
            self._targets(loss)
        return loss

    @property
    def findings(self) -> list[Finding]:
        """Every distinct finding so far, each with its count."""
        now = [Finding._from_dict(t) for t in self._ctx.handle.findings()]
        return merge_findings(self._before, now) if self._before else now

    @property
    def step(self) -> int:
        """Number of completed optimizer steps."""
        return int(self._ctx.handle.step())

    @property
    def overhead_seconds(self) -> float:
        """Time spent inside TrainSan so far (C++ and Python hooks)."""
        return float(self._ctx.handle.overhead_s()) + self._py_overhead

    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def coverage(self) -> dict:
        """What was checked so far: counts (``steps_checked``, ``update_steps``,
        ``update_period``, ``training_forwards``, ``other_forwards``, ``losses_checked``,
        ``inputs_fingerprinted``, ``audited_forwards``, ``ops_audited``), ``unchecked``:
        ``{kind: reason}`` for the enabled checks that never had what they need, ``fault``: why
        TrainSan stopped checking (its own error in the loop, Note [Faults]; None), ``unread``:
        the parameters of a dtype the statistics pass does not read (``"name (dtype)"``), and
        ``outside_model``: per attached optimizer holding parameters that are not the model's,
        ``{optimizer, type, count, of, shapes, why}`` (those parameters are not checked)."""
        counts, kinds, reasons, trace_error, unread, fault = self._ctx.handle.coverage()
        out = dict(counts)
        for key, n in self._counts_before.items():  # before a re-binding (Note [Attach order])
            out[key] = out.get(key, 0) + n
        out["unchecked"] = dict(zip(kinds, reasons))
        out["trace_error"] = trace_error or None
        out["unread"] = list(unread)
        out["fault"] = self._ctx.fault or fault or None  # Python's, or the C++ events' (Note [Faults])
        out["outside_model"] = outside_model(self._ctx.optimizers, self._ctx.param_ids)
        if self._ctx.replicas is not None and not self._ctx.replicas.sets:
            out["unchecked"]["rank_desync"] = (
                "no parameter has replicas on this rank (each is sharded on every mesh dimension "
                "or marked tensor_model_parallel)"
            )
        if self._notes:
            out["notes"] = [n["message"] for n in self._notes]
        return out

    def summary(self) -> str:
        """A short human-readable summary: the findings, what was checked, and which checks never
        had what they need (a clean summary means "checked and clean", not "saw nothing")."""
        return summary_text(self.step, self.findings, self.coverage())

    def last_stats(self) -> dict[str, TensorStats]:
        """Statistics of the last checked step: ``"<param>"``, ``"<param>.grad"`` and
        ``"<param>.update"`` (for the update, ``l2``/``absmax`` are ‖Δθ‖ and max|Δθ|, ``zero`` the
        number of unchanged elements)."""
        names, ints, floats = self._ctx.handle.last_stats()
        return dict(zip(names, _unpack(ints, floats)))

    def close(self) -> None:
        """Flush pending checks, write the trace summary and remove every hook."""
        if self._ctx.closed:
            return
        self._ctx.closed = True
        _patches.unregister(self._ctx)
        # Every member of the list (Note [Gatherers]): each gatherer closed, each hook removed,
        # each patch released, also when one of them fails (raised after the others).
        found: list = []
        error: Optional[BaseException] = None
        for part in self._ctx.parts:
            try:
                found += part.close()
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        try:
            if error is not None:
                raise error
            self._apply(found + list(self._ctx.handle.close()))
        except Exception as exc:
            if self._ctx.handle is None or not absorb(self._ctx, "close", exc):
                raise  # (no handle: an attach that failed, closed by __del__)

    @property
    def closed(self) -> bool:
        return self._ctx.closed

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
            if not self._ctx.closed and self._ctx.handle is not None:
                warnings.warn(
                    "trainsan: a Sanitizer was garbage-collected without close(); its hooks are "
                    "removed and it checks nothing more. Keep the object attach() returns "
                    "(san = trainsan.attach(...)) for as long as you train, and close() it or use "
                    "`with trainsan.attach(...) as san:`",
                    ResourceWarning if sys.is_finalizing() else UserWarning,
                    stacklevel=2,
                )
            if not self._ctx.closed:
                self.close()
        except Exception:
            pass
