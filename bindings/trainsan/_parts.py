"""Note [Parts]: the parts a sanitizer builds at attach, registered in event order."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

from . import _compile, _native, _patches
from ._gatherers import (Adopted, CustomGrads, Gatherer, Held, Hooks, LabelWindow, ParamsLive,
                         Provenances, Replicas, Reruns, Resumes, RootlessForwards, SavedTensors)
from ._hooks import _getstate_patch, _Hook, _weak_method
from ._journal import journal
from ._optimizer_like import optimizer_like
from ._patches import (_forward_clock, _loader_patch, _loss_patch, _save_patch, _scaler_patch,
                       _zero_grad_patch)
from ._tables import OPTIONS, enabled
from .attribution import attribution
from .audit import LabelGuard
from .autograd_checks import CustomGradCheck, SavedTensorCheck
from .determinism import Rerun
from .precision import Provenance
from .replicas import ReplicaComparison, active as replicas_active
from .resume import ResumeWatch

# Note [Parts]
# ~~~~~~~~~~~~
# What a sanitizer installs besides its C++ handle — hooks, gatherers of facts, process-wide
# patches held (Note [Gatherers], Note [Patches]) — is built by the builders of PARTS, in this
# file's order, which is the order of the sanitizer's part list and so of every event's calls
# (the label guard's window ends before the parameters are checked at the first step, the
# replicas compare the starting weights before the re-runs, ...). A builder gets the Setup of
# the binding (the Context, the model's parameter table, the options, the sanitizer's methods the
# hooks call) and returns a Gatherer, or None where it has nothing to add (its check is off, the
# model needs none); it may set the Context's fields other parts and the patches read (the label
# guard, the re-run, the resume watch). Adding a gatherer is one builder here, at the place its
# events must come; the Sanitizer names none of them.


@dataclasses.dataclass
class Setup:
    """One binding's inputs to the builders (Note [Parts])."""

    ctx: Any  # the Context (Note [Context])
    handle: Any
    names: list  # the watched tensors' names and tensors, in the handle's order
    params: list
    external: list  # per tensor: its gradient arrives outside autograd's accumulation (FSDP2)
    outside: list  # the names of the optimizer tensors the model does not hold
    opt_index: list
    options: dict
    checks: dict
    methods: dict  # the sanitizer's bound methods the parts call (held weakly by them)
    hooks: Optional[Hooks] = None  # the Hooks part (built first)


PARTS: list = []  # (name, builder), in event order


def part(name: str) -> Callable:
    def register(builder: Callable[[Setup], Optional[Gatherer]]) -> Callable:
        PARTS.append((name, builder))
        return builder

    return register


def build(setup: Setup) -> None:
    """Every part, appended to the Context's list as it is built (a builder that raises leaves
    what was built before it there, for close())."""
    for _, builder in PARTS:
        g = builder(setup)
        if g is not None:
            setup.ctx.parts.append(g)


@part("hooks")
def _hooks(s: Setup) -> Gatherer:
    """Hook handles, removed at close; first, the gradient hooks of tensors whose gradients
    arrive outside autograd's accumulation."""
    s.hooks = Hooks()
    for k, p in enumerate(s.params):
        if s.external[k]:
            s.hooks.add(p.register_post_accumulate_grad_hook(
                lambda _p, k=k, h=s.handle: h.grad_accumulated(k)))
    return s.hooks


@part("label_window")
def _label_window(s: Setup) -> Optional[Gatherer]:
    """Policy "raise": class-index targets are checked before the loss runs (audit.py) — targets
    on a CPU always (a host read, no sync), device targets with sync=True; otherwise the C++ op
    audit reports at the next event."""
    ctx = s.ctx
    LabelGuard.end_all_windows()
    ctx.label_guard = None
    if ctx.policy == "raise" and any(enabled(k, s.checks)
                                     for k in ("label_range", "label_dtype", "batch_mismatch")):
        sync = s.options.get("sync", OPTIONS["sync"])
        ctx.label_guard = LabelGuard(_weak_method(s.methods["check_target"]), host_only=not sync)
        return LabelWindow(ctx.label_guard, s.handle)
    return None


@part("getstate")
def _getstate(s: Setup) -> Gatherer:
    return Held(_getstate_patch)  # a pickled model carries none of the hooks below


@part("optimizer_like")
def _optimizer_like_part(s: Setup) -> Optional[Gatherer]:
    """Note [Optimizer-like objects]: the attached optimizers that are not torch's get its step
    hooks (before the model_hooks part registers them)."""
    like = [o for o in s.ctx.optimizers if optimizer_like(o)]
    return Adopted(like) if like else None


@part("model_hooks")
def _model_hooks(s: Setup) -> None:
    """The root forward pre-hook, the optimizers' step hooks, the leaf modules' output hooks."""
    ctx, m = s.ctx, s.methods
    s.hooks.add(ctx.model.register_forward_pre_hook(_Hook(ctx, m["on_forward"]),
                                                    with_kwargs=True))
    for k, opt in enumerate(ctx.optimizers):
        s.hooks.add(opt.register_step_pre_hook(_Hook(ctx, m["pre_step"], k)))
        s.hooks.add(opt.register_step_post_hook(_Hook(ctx, m["post_step"], k)))
    if enabled("nonfinite_activation", s.checks):
        for n, mod in ctx.model.named_modules():
            if not list(mod.children()):
                s.hooks.add(mod.register_forward_hook(_Hook(ctx, m["activation"], n)))
    return None


@part("scaler_patch")
def _scaler(s: Setup) -> Gatherer:
    return Held(_scaler_patch)


@part("loader_patch")
def _loader(s: Setup) -> Gatherer:
    return Held(_loader_patch)


@part("zero_grad_patch")
def _zero_grad(s: Setup) -> Gatherer:
    return Held(_zero_grad_patch)


@part("saved_tensors")
def _saved_tensors(s: Setup) -> Optional[Gatherer]:
    """inplace_before_backward (autograd_checks.py): saved-tensor hooks on sampled steps."""
    if not enabled("inplace_before_backward", s.checks):
        return None
    ctx = s.ctx
    m = s.methods
    check = SavedTensorCheck(s.handle, {id(p): n for n, p in zip(s.names, s.params)},
                             {id(b) for b in ctx.model.buffers()}, _weak_method(m["apply"]),
                             _weak_method(m["add_py"]))
    return SavedTensors(check, _weak_method(m["due"]))


@part("custom_grads")
def _custom_grads(s: Setup) -> Optional[Gatherer]:
    """bad_custom_grad: each custom Function at its first use, then every gradcheck_every; under
    several processes only when gradcheck_every was asked for (CustomGradCheck)."""
    if not enabled("bad_custom_grad", s.checks):
        return None
    if _native.drivers() is None:
        # Note [One orchestration] (bindings/csrc/hot.cpp): the measurement is C++ only.
        s.ctx.note("check_off", "trainsan: bad_custom_grad is not checked: its measurement "
                   f"runs in the _trainsan_hot module ({_native.drivers_problem()})")
        return None
    m = s.methods
    check = CustomGradCheck(s.handle, _weak_method(m["apply"]), _weak_method(m["add_py"]),
                            distributed="gradcheck_every" in s.options)
    return CustomGrads(check, s.handle)


@part("params_live")
def _params_live(s: Setup) -> Gatherer:
    """At the first step, whether the attached parameters are still the model's (Note [Attach
    order]); the tensors watched from outside the model are not its parameters."""
    own = list(zip(s.names, s.params))[:len(s.names) - len(s.outside)]
    return ParamsLive(s.ctx.model, own, _weak_method(s.methods["params_replaced"]))


@part("loss_patch")
def _loss(s: Setup) -> Gatherer:
    return Held(_loss_patch)


@part("save_patch")
def _save(s: Setup) -> Gatherer:
    return Held(_save_patch)


@part("compile_patch")
def _compile_patch(s: Setup) -> Gatherer:
    """Registered as open first: the compile patch makes the open sanitizers' hooks eager."""
    model = s.ctx.model
    _patches.register(s.ctx)
    return Held(_compile.compile_patch, lambda: _compile.unwrap_compiled_call(model))


@part("replicas")
def _replicas(s: Setup) -> Optional[Gatherer]:
    """rank_desync (Note [Replica comparison], replicas.py): a distributed run's replicas."""
    ctx = s.ctx
    ctx.replicas = None
    if not (enabled("rank_desync", s.checks) and replicas_active()):
        return None
    engines = _native.drivers()
    if engines is None:
        # Note [One orchestration] (bindings/csrc/hot.cpp): the schedule of the comparison's
        # collectives is C++ only (trainsan::ReplicaEngine).
        ctx.note("check_off", "trainsan: rank_desync is not checked: its comparison runs in the "
                 f"_trainsan_hot module ({_native.drivers_problem()})")
        return None
    try:
        ctx.replicas = ReplicaComparison(s.handle, ctx.model, s.names, s.params, ctx.optimizers,
                                         s.options, _weak_method(s.methods["apply"]),
                                         lambda: _forward_clock[0], engines)
    except Exception as exc:  # noqa: BLE001 - its machinery (side groups, engines): not the job's
        why = f"its comparison could not be set up ({type(exc).__name__}: {exc})"
        warnings.warn(f"trainsan: rank_desync is not checked: {why}", stacklevel=2)
        ctx.note("check_off", f"trainsan: rank_desync is not checked: {why}")
        return None
    return Replicas(ctx.replicas)


@part("reruns")
def _reruns(s: Setup) -> Gatherer:
    """nondeterminism: the step re-runs (Note [Re-run determinism]) and the recompute checks."""
    if _native.drivers() is None and int(s.options.get("rerun_every", 0)) > 0 and \
            enabled("nondeterminism", s.checks):
        # Note [One orchestration] (bindings/csrc/hot.cpp): the re-runs' driver is C++ only.
        s.ctx.note("check_off", "trainsan: nondeterminism's step re-runs (rerun_every) are not "
                   f"checked: their driver runs in the _trainsan_hot module "
                   f"({_native.drivers_problem()}); the recompute checks still are")
    s.ctx.rerun = Rerun(s.ctx, s.ctx.model)
    return Reruns(s.ctx.rerun)


@part("attribution")
def _attribution(s: Setup) -> Optional[Gatherer]:
    g = attribution(s.ctx, s.ctx.model, s.options)
    return g if type(g) is not Gatherer else None


@part("resumes")
def _resumes(s: Setup) -> Gatherer:
    """optimizer_reset (Note [Resume checks], host/checks/resume.cpp)."""
    s.ctx.resume = ResumeWatch(s.ctx)
    return Resumes(s.ctx.resume)


@part("journal")
def _journal(s: Setup) -> Gatherer:
    """The loads from now on (Note [Load journal])."""
    return Held(journal)


@part("provenance")
def _provenance(s: Setup) -> Gatherer:
    """Note [Overflow provenance] (host/checks/precision.cpp)."""
    s.ctx.prov = Provenance(s.ctx, s.ctx.model)
    return Provenances(s.ctx.prov)


@part("rootless")
def _rootless(s: Setup) -> Optional[Gatherer]:
    """Note [Models without a root forward]."""
    if not RootlessForwards.needed(s.ctx.model):
        return None
    rootless = RootlessForwards(s.ctx.model)
    rootless.install(_weak_method(s.methods["on_forward"]))
    return rootless
