"""``python -m trainsan run``: which model each optimizer the script builds is attached with, and
when (Note [Launcher pairing]); launcher.py runs the script and closes what was attached."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Optional

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

import trainsan

from . import _compile, _journal, _optimizer_like, _patches
from ._facts import script_names
from ._gatherers import RootlessForwards
from ._registry import Patch

# -- pairing optimizers with models ---------------------------------------------------------------

# Note [Launcher pairing]
# ~~~~~~~~~~~~~~~~~~~~~~~
# While the script runs, torch.optim.Optimizer.__init__ is wrapped to record every optimizer it
# builds (weakly, in creation order), and two process-wide module hooks watch the top-level module
# calls (a call on this thread with no other module's forward running: the model, not its layers;
# a DDP or torch.compile wrapper, not the module inside). They stay installed while something is
# pending — an optimizer not paired yet, or no sanitizer at all — and are removed once not.
# * A top-level call of a module M whose trainable parameters some recorded optimizers hold, with
#   gradients enabled or in train mode under no_grad (a training forward under no_grad is found
#   as no_grad_leak at its backward), attaches trainsan.attach(M, those optimizers) when M holds
#   all of their parameters; otherwise the smallest live module holding them all (an agent whose
#   heads are called directly: full dotted names), or, where none does, one _Roots model over the
#   roots holding them (named by the script's variables). Before M's forward runs; the
#   forward itself is reported to the new sanitizer (its own pre-hook, registered during the
#   call, is not called for it), so the whole first step is seen, loss included. The newest
#   optimizer comes first (a parameter held by several is judged by the newest), and an older one
#   whose parameters newer ones hold entirely is taken as replaced by them (an optimizer rebuilt
#   for a new phase; Lookahead around its base) and is paired no more.
# * A top-level call in train mode with gradients enabled, in a script that has built no
#   optimizer, attaches M in manual mode (trainsan.attach(M)): a loop updating p.data by hand.
# * Recorded optimizers still unpaired at the script's first backward() are paired there, as
#   below (a forward that skipped the module hooks), so every optimizer is attached no later than
#   its first backward or step.
# * A recorded optimizer that steps unpaired is paired at that step's global pre-hook (so that step
#   is in flight: attach() sees it on the stack, and the step rules do not judge it). If it holds
#   parameters of an attached model (the optimizer of a new phase; a model run once before its
#   optimizer existed, now in manual mode), that model is re-attached with the optimizers that
#   now hold its parameters: the old sanitizer is closed and the new one writes the same trace.
#   Not at the model's next call: torch has collected the model's hooks when the global pre-hook
#   runs, and calls a hook removed then with the wrong arguments. Otherwise (the model was only
#   called under no_grad, through model.forward(), or compiled in place by model.compile(),
#   whose calls skip the module hooks) the smallest live module holding all of its parameters
#   (or one _Roots model over the roots holding them) is attached, found through the garbage
#   collector.
# * Manual mode's model is a guess made at a call (the first top-level call of a module in train
#   mode with gradients enabled), and the backwards say what the script trains (Note [Manual
#   mode's model]).
# At exit, optimizers never attached and optimizer tensors no attached model holds are listed,
# and so are the parameters a backward reached that no sanitizer watches.
#
# Note [Manual mode's model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# In a script that builds no optimizer, the module first called at top level in train mode with
# gradients enabled need not be the model: Keras 3 (torch backend) calls each layer of a model
# once, at top level, while it builds the model (keras.Input, Sequential), and the model itself
# holds its layers' variables in a ParameterDict of its own, not through its layers as
# submodules; a script may call a sub-network alone before the whole. So the backwards check the
# guess: at the 1st, 2nd, 4th, 8th, ... backward of such a script, the graph of each root is
# walked to its leaves (walk_loss_graph, Note [Loss roots]), and the parameters it reaches that
# no sanitizer watches are the model's too. The manual-mode model whose parameters the root
# reaches is re-attached as the smallest live module holding its parameters and those (of those
# holding the same, the outermost; or one _Roots model over the roots holding them), before that
# backward runs, which its new sanitizer sees. Where no manual-mode model is reached (a model
# trained in eval mode from its first call, which no call attached), the module holding the
# parameters reached is attached in manual mode the same way. Parameters reached that are still
# watched by no sanitizer at exit (held by no live module, or by one attach() refused) are named
# in the closing lines.
# Each model gets a slot: the first writes --trace PATH, the k-th PATH with .k before the
# extension (and .rankN before that under torchrun).


@dataclasses.dataclass
class _Pairing:
    model: torch.nn.Module
    optimizers: list
    san: trainsan.Sanitizer
    slot: int
    trace: Optional[str]
    _ids: set  # ids of the model's parameters, as of the sanitizer's binding _bound
    replaced: bool = False
    _bound: int = 0
    why: str = "its optimizers changed"  # why it was replaced

    @property
    def ids(self) -> set:
        """ids of the model's parameters; read anew after the sanitizer re-bound to replaced
        parameters (Note [Attach order])."""
        bound = self.san._ctx.binding  # Note [Context]
        if bound != self._bound:
            self._ids, self._bound = {id(p) for p in self.model.parameters()}, bound
        return self._ids

    def known_ids(self) -> set:
        """The model's parameters now and as attached (replaced since attach, in manual mode too,
        an optimizer built over the old ones still belongs to it)."""
        return self.ids | {id(p) for p in self.model.parameters()}


def _held(opt: torch.optim.Optimizer) -> set:
    return {id(p) for g in opt.param_groups for p in g["params"]}


def _trainable(module: torch.nn.Module) -> set:
    return {id(p) for p in module.parameters() if p.requires_grad}


def _holders(ids: set) -> list:
    """The modules to attach for optimizers holding the parameters `ids`: the smallest live module
    holding all of them (of those holding the same parameters, the outermost: full dotted names),
    whether or not its own forward is ever called (an agent whose code calls agent.actor and
    agent.critic); where no module holds them all, each root module (nobody's submodule) holding
    some of them, most first. Found through the garbage collector; torch.compile wrappers are
    looked through."""
    mods = [o for o in gc.get_objects()
            if issubclass(type(o), torch.nn.Module) and _compile.unwrap_compiled(o) is o]
    best, best_n, some = None, 0, []
    inner = {id(c) for m in mods for c in m.children()}
    for m in mods:
        # (placeholders on the meta device are not counted: Note [Placeholder parameters])
        own = {id(p) for p in m.parameters() if not p.is_meta}
        if ids <= own:
            if best is None or len(own) < best_n or (
                    len(own) == best_n and any(x is best for x in m.modules())):
                best, best_n = m, len(own)
        elif id(m) not in inner and own & ids:
            some.append((len(own & ids), m))
    if best is not None:
        return [best]
    return [m for _, m in sorted(some, key=lambda t: -t[0])]


def _param_names(params: list) -> list:
    """Names for `params` (the closing lines): the script's variable of the root module holding
    each and its name there, else the root's class; else the script's variable of the parameter,
    else its shape."""
    want = {id(p) for p in params}
    mods = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    inner = {id(c) for m in mods for c in m.children()}
    by_id = script_names(torch.nn.Module)
    named: dict = {}
    for m in mods:
        if id(m) in inner:
            continue
        for n, p in m.named_parameters():
            if id(p) in want and id(p) not in named:
                named[id(p)] = f"{by_id.get(id(m)) or type(m).__name__}.{n}"
    bare = script_names(torch.Tensor)  # held by no module: the script's variable
    return [named.get(id(p)) or bare.get(id(p)) or f"a parameter of shape {list(p.shape)}"
            for p in params]


def _call_kwargs(module: torch.nn.Module) -> dict:
    """The keyword arguments of the call of `module` under way (a process-wide forward pre-hook
    gets the positional ones only): read from Module._call_impl's frame, where they are a local
    (HF Trainer, skorch and trl call model(**batch), so its first step's inputs are fingerprinted
    too). {} where that frame is not found."""
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        if f.f_code.co_name in ("inner", "_call_impl") and f.f_locals.get("self") is module:
            kwargs = f.f_locals.get("kwargs")
            return dict(kwargs) if isinstance(kwargs, dict) else {}
        f = f.f_back
    return {}


class _Roots(torch.nn.Module):
    """Several root modules trained by one optimizer, as one model for one sanitizer: its
    children are the roots, named by the script's variables. It has no forward(): the outermost
    calls of the roots are its forwards (Note [Models without a root forward])."""


def _root_names(roots: list) -> list:
    by_id = script_names(torch.nn.Module)
    names, used = [], set()
    for k, m in enumerate(roots):
        name = by_id.get(id(m)) or f"{type(m).__name__.lower()}{k}"
        while name in used:
            name += "_"
        used.add(name)
        names.append(name)
    return names


def _one_model(roots: list) -> torch.nn.Module:
    """The module to attach for `roots` (Note [Launcher pairing])."""
    if len(roots) == 1:
        return roots[0]
    combined = _Roots()
    for name, m in zip(_root_names(roots), roots):
        combined.add_module(name, m)
    return combined


_pairers: list = []  # the installed Pairers (one per process in practice)


def _optimizer_init() -> list:
    orig = torch.optim.Optimizer.__dict__["__init__"]

    def __init__(opt, *args, **kwargs):
        orig(opt, *args, **kwargs)
        for pairer in list(_pairers):
            pairer._optimizer_built(opt)

    __init__.__wrapped__ = orig  # type: ignore[attr-defined]
    return [(torch.optim.Optimizer, "__init__", __init__)]


# Note [Patches]: every optimizer built while the launcher runs is numbered (its pairing).
_init_patch = Patch("optimizer_init", ("launcher",), ["torch.optim.Optimizer.__init__"],
                    _optimizer_init)


class Pairer:
    """Attaches a sanitizer to each optimizer the script builds (Note [Launcher pairing])."""

    def __init__(self, trace: Optional[str], rank: Optional[int], **attach_kwargs: Any):
        self.pairings: list[_Pairing] = []
        self.notes: list[str] = []  # what could not be attached, printed with the summaries
        self._trace = trace
        self._rank = rank
        self._kwargs = attach_kwargs
        self._order: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # opt -> number
        self._built = 0
        self._built_types: list = []  # every optimizer built, by class name (the closing lines)
        self._retired: "weakref.WeakSet" = weakref.WeakSet()  # replaced by newer optimizers
        self._orphans: "weakref.WeakSet" = weakref.WeakSet()  # stepped, no module holds them
        self._skip: "weakref.WeakSet" = weakref.WeakSet()  # modules attach() refused
        self._depth = threading.local()
        self._module_hooks: list = []
        self._step_hook = None
        self._installed = False  # holds the load journal, "optimizer_init" and "backward"
        self._like_calls = 0  # grad-enabled top-level calls with no optimizer (_look_for_like)
        self._manual_backwards = 0  # backwards of a script without optimizers (_manual_reach)
        # Parameters a walked backward reached that no sanitizer watched then: id -> weakref
        self._reached: dict = {}

    # installation -------------------------------------------------------------------------------

    def install(self) -> None:
        # The load journal from the script's first line (Note [Load journal]): the loads before
        # the first training forward, where the launcher attaches, are judged at that attach.
        _journal.journal.acquire("launcher")
        _init_patch.acquire("launcher")
        _patches._loss_patch.acquire("launcher")
        _pairers.append(self)
        _patches.before_backward.append(self._before_backward)
        self._installed = True
        self._step_hook = register_optimizer_step_pre_hook(self._on_step)
        # OptimizedModule warns that global module hooks fire once more for it: ours expect that.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there "
                                "are global hooks")
        self._sync_hooks()

    def _optimizer_built(self, opt) -> None:
        """Optimizer.__init__ returned (the "optimizer_init" patch)."""
        self._built += 1
        self._order[opt] = self._built
        self._built_types.append(type(opt).__name__)
        self._sync_hooks()

    def _before_backward(self, tensors: Any) -> list:
        """Before a backward of `tensors` (the "backward" patch, after the open sanitizers saw
        it): the sanitizers attached for the optimizers still unpaired (Note [Loss roots]), or
        for what it trains in a script without optimizers (Note [Manual mode's model])."""
        if not self._installed or _compile.is_compiling():
            return []
        made = self._on_backward() if self._pending() else []
        if not len(self._order):
            made += self._manual_reach(tensors)
        return made

    def _manual_reach(self, tensors: Any) -> list:
        """Note [Manual mode's model]: the sanitizers attached for what this backward trains."""
        self._manual_backwards += 1
        n = self._manual_backwards
        if n & (n - 1):
            return []
        roots = tensors if isinstance(tensors, (list, tuple)) else (tensors,)
        leaves: dict = {}
        for root in roots:
            if isinstance(root, torch.Tensor) and root.grad_fn is not None:
                for t in torch.ops.trainsan.walk_loss_graph(root, [], [])[1]:
                    if isinstance(t, torch.nn.Parameter) and t.requires_grad and not t.is_meta:
                        leaves[id(t)] = t
        watched = self._watched()
        fresh = {i for i in leaves if i not in watched}
        if not fresh:
            return []
        owner = next((p for p in self._active() if not p.optimizers and p.ids & leaves.keys()),
                     None)
        ids = fresh | (owner.ids if owner is not None else set())
        roots_ = [_compile.unwrap_compiled(m) for m in _holders(ids)]
        made = []
        if roots_:
            model = _one_model(roots_)
            if owner is not None and model is owner.model:
                pass  # (it holds them already: watched since, a re-binding's business)
            elif owner is not None:
                owner.why = (f"a backward trained {len(fresh)} parameter(s) beyond it: "
                             f"re-attached to {type(model).__name__}")
                san = self._attach(model, [], owner)
                made = [] if san is None else [san._ctx]
            elif model not in self._skip and trainsan.attached(model) is None:
                san = self._attach(model, [], None)
                made = [] if san is None else [san._ctx]
        watched = self._watched()
        for i in fresh - watched:
            self._reached[i] = weakref.ref(leaves[i])
        return made

    def _watched(self) -> set:
        """ids of the tensors the attached sanitizers watch."""
        out: set = set()
        for p in self._active():
            out |= p.ids | p.san._ctx.param_ids  # Note [Context]
        return out

    def uninstall(self) -> None:
        self._set_module_hooks(False)
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if self._installed:
            self._installed = False
            if self in _pairers:
                _pairers.remove(self)
            if self._before_backward in _patches.before_backward:
                _patches.before_backward.remove(self._before_backward)
            _patches._loss_patch.release("launcher")
            _init_patch.release("launcher")
            _journal.journal.release("launcher")

    def _active(self) -> list:
        return [p for p in self.pairings if not p.replaced]

    def _pending(self) -> list:
        paired = {id(o) for p in self._active() for o in p.optimizers}
        return [o for o in list(self._order.keys())
                if id(o) not in paired and o not in self._retired and o not in self._orphans]

    def _sync_hooks(self) -> None:
        self._set_module_hooks(bool(self._pending()) or not self._active())

    def _set_module_hooks(self, on: bool) -> None:
        if on and not self._module_hooks:
            self._depth = threading.local()  # a call under way when they went off never returns
            self._module_hooks = [
                register_module_forward_pre_hook(self._on_call),
                register_module_forward_hook(self._on_return, always_call=True),
            ]
        elif not on and self._module_hooks:
            for h in self._module_hooks:
                h.remove()
            self._module_hooks = []

    # events -------------------------------------------------------------------------------------

    def _on_call(self, module: torch.nn.Module, args: tuple) -> None:
        if _compile.is_compiling():
            return  # traced into a graph: a no-op there (compiled calls are paired at the step)
        depth = getattr(self._depth, "n", 0) + 1
        self._depth.n = depth
        if depth == 1:
            grad = torch.is_grad_enabled()
            if grad or module.training:
                self._on_top_call(module, args, grad)

    def _on_return(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not _compile.is_compiling():
            self._depth.n = max(0, getattr(self._depth, "n", 0) - 1)

    def _on_top_call(self, module: torch.nn.Module, args: tuple, grad: bool) -> None:
        model = _compile.unwrap_compiled(module)
        ids = _trainable(model)
        if not ids or model in self._skip or self._ours(model) or any(
                p.ids & ids for p in self._active()):
            return  # nothing to train, refused, or attached (itself, a wrapper or a submodule)
        opts = self._candidates(ids)
        if not opts and not len(self._order) and grad and self._look_for_like():
            # No torch optimizer in the script: one of its own kind (fastai's Optimizer) that
            # holds this module's parameters is paired as a torch one would be (Note
            # [Optimizer-like objects]).
            for opt in _optimizer_like.holding(ids):
                self._optimizer_built(opt)
            opts = self._candidates(ids)
        if not opts:
            if grad and model.training and not len(self._order):
                # no optimizer in the script: a loop updating p.data by hand (manual mode)
                san = self._attach(model, [], None)
                if san is not None and model is module:
                    san.training_forward(*args, **_call_kwargs(module))
            return  # the script has optimizers, none of them for this module; or eval mode
        held = set().union(*(_held(o) for o in opts))
        if held <= {id(p) for p in model.parameters()}:
            targets = [model]
        else:
            # The optimizers hold more than this module: attach the module holding them all (an
            # agent whose code calls agent.actor(x), agent.critic(x)), or each root holding some.
            targets = self._free([_compile.unwrap_compiled(m) for m in _holders(held)])
            if not targets:
                return
            model = _one_model(targets)
        san = self._attach(model, self._candidates({id(p) for p in model.parameters()}), None)
        if san is not None and model is module:
            # The sanitizer's own pre-hook was registered during this call and is not called for
            # it: report the forward (for a torch.compile wrapper the hook traced inside does).
            # Under no_grad too: a training forward without gradients (no_grad_leak).
            san.training_forward(*args, **_call_kwargs(module))
        elif san is not None and RootlessForwards.needed(model):
            san.training_forward(*args)  # this call was the first of its submodules' calls

    def _look_for_like(self) -> bool:
        """Whether this call looks for optimizer-like objects (a walk of the garbage collector's
        objects): at the 1st, 2nd, 4th, 8th, ... grad-enabled top-level call without one."""
        self._like_calls += 1
        return self._like_calls & (self._like_calls - 1) == 0

    def _free(self, roots: list) -> list:
        """Of `roots`, those not refused and not attached (through themselves or another)."""
        out = []
        for root in roots:
            own = {id(p) for p in root.parameters()}
            if root not in self._skip and not self._ours(root) and not any(
                    p.ids & own for p in self._active()):
                out.append(root)
        return out

    def _ours(self, model: torch.nn.Module) -> bool:
        """`model` has one of our sanitizers (its parameters may have been replaced since: it is
        re-attached at its optimizer's step, not inside a call, Note [Launcher pairing])."""
        san = trainsan.attached(model)
        return san is not None and any(p.san is san for p in self._active())

    def _on_step(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if opt not in self._order or not any(o is opt for o in self._pending()):
            return
        self._pair(opt, "stepped")

    def _on_backward(self) -> list:
        """Before the first backward while optimizers are pending: pair them (a forward that
        skipped the module hooks: model.forward(), model.compile()). The Contexts of the
        sanitizers made here."""
        before = len(self.pairings)
        for opt in self._pending():
            if any(o is opt for o in self._pending()):  # (pairing one may have paired others)
                self._pair(opt, "ran backward() for")
        return [p.san._ctx for p in self.pairings[before:]]  # (Contexts, as backward_seen reads)

    def _pair(self, opt: torch.optim.Optimizer, event: str) -> None:
        """Pairs an optimizer that no training forward paired (Note [Launcher pairing])."""
        ids = _held(opt)
        owner = next((p for p in self._active() if p.known_ids() & ids), None)
        if owner is not None:
            self._attach(owner.model, self._candidates(owner.known_ids()), owner)
            return
        roots = [_compile.unwrap_compiled(m) for m in _holders(ids)]
        if not roots:
            self._orphans.add(opt)
            self.notes.append(f"the script {event} {type(opt).__name__} ({len(ids)} tensors), "
                              "but no module holds its parameters: not checked")
        free = self._free(roots)  # less those refused (a note says why) or attached
        if free:
            model = _one_model(free)
            self._attach(model, self._candidates({id(p) for p in model.parameters()}), None)
        if roots and not any(o is opt for p in self._active() for o in p.optimizers):
            self._orphans.add(opt)  # its models were refused (the notes say why)
        self._sync_hooks()

    def uncovered(self) -> list:
        """Lines for the optimizers' parameters no sanitizer checks: optimizers never attached
        (with why), and parameters of attached ones that no attached model holds."""
        lines = []
        covered = set()
        for p in self._active():
            # the model's parameters, and the tensors its sanitizer watches beside them (Note
            # [Tensors outside the model] in _facts.py)
            covered |= p.ids | p.san._ctx.param_ids  # Note [Context]
        for opt, n in sorted(list(self._order.items()), key=lambda t: t[1]):
            held = _held(opt)
            if opt in self._orphans or opt in self._retired:
                continue  # a note says why, or a newer optimizer holding the same took over
            if not any(o is opt for p in self._active() for o in p.optimizers):
                lines.append(f"{type(opt).__name__} (optimizer {n}, {len(held)} tensors) was not "
                             "checked: it never stepped, and no module holding its parameters "
                             "ran a training forward or a backward")
                continue
            gone = held - covered
            if gone:
                lines.append(f"{len(gone)} of the {len(held)} tensors of {type(opt).__name__} "
                             f"(optimizer {n}) are in no attached model: not checked (no live "
                             "module holds them: tensors given to the optimizer directly)")
        # Note [Manual mode's model]: parameters a backward trained that no sanitizer watches.
        alive = [r() for i, r in self._reached.items() if i not in covered]
        alive = [t for t in alive if t is not None]
        if alive:
            names = _param_names(alive)
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            lines.append(f"{len(alive)} parameter(s) that a backward reached are in no attached "
                         f"model: not checked ({shown})")
        return lines

    # attaching ----------------------------------------------------------------------------------

    def _candidates(self, ids: set) -> list:
        """The recorded optimizers holding any of `ids`, newest first, less those replaced by
        newer ones (which are retired for good)."""
        out, newer = [], set()
        for _, opt in sorted(((n, o) for o, n in list(self._order.items())
                              if o not in self._retired), key=lambda t: -t[0]):
            held = _held(opt)
            if not held & ids:
                continue
            if out and held <= newer:
                self._retired.add(opt)
                continue
            out.append(opt)
            newer |= held
        return out

    def _trace_path(self, slot: int) -> Optional[str]:
        if not self._trace:
            return None
        stem, ext = os.path.splitext(self._trace)
        rank = "" if self._rank is None else f".rank{self._rank}"
        return f"{stem}{rank}{'.' + str(slot) if slot else ''}{ext}"

    def _attach(self, model: torch.nn.Module, opts: list,
                old: Optional[_Pairing]) -> Optional[trainsan.Sanitizer]:
        prev = trainsan.attached(model)
        if old is None and prev is not None:
            # Ours, found again because its parameters were replaced since: re-attached.
            old = next((p for p in self._active() if p.san is prev), None)
        if old is None and prev is not None:
            self._skip.add(model)
            self.notes.append(f"the script attaches its own sanitizer to {type(model).__name__}: "
                              "left to it")
            return None
        slot = old.slot if old is not None else len({p.slot for p in self.pairings})
        trace = self._trace_path(slot)
        if old is not None:
            old.replaced = True
            old.san.close()  # may raise a pending finding (policy raise): the run's error then
        try:
            san = trainsan.attach(model, opts or None, trace=trace, **self._kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            if isinstance(exc, trainsan.TrainingBugError):
                raise
            self._skip.add(model)
            self.notes.append(f"could not attach to {type(model).__name__}: {exc}")
            print(f"trainsan run: {self.notes[-1]}", file=sys.stderr)
            self._sync_hooks()
            return None
        self.pairings.append(_Pairing(model, list(opts), san, slot, trace,
                                      {id(p) for p in model.parameters()}))
        self._sync_hooks()
        return san
