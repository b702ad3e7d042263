"""The training-loop sanitizer: ``trainsan.attach(model, optimizer)``.

Python registers one forward pre-hook on the root module and step pre/post hooks on each
optimizer; each calls into C++ once per event. The per-parameter gradient hooks live in C++
(post-hooks on the parameters' AccumulateGrad nodes), so no Python runs per parameter per step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import warnings
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from . import _native
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


def _mode_dependent(m: torch.nn.Module) -> bool:
    """Whether m's forward behaves differently in train and eval mode (as far as its class says)."""
    if isinstance(m, torch.nn.modules.dropout._DropoutNd):
        return m.p > 0
    if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm,
                      torch.nn.modules.instancenorm._InstanceNorm)):
        return bool(m.track_running_stats)
    if isinstance(m, torch.nn.RNNBase):
        return m.dropout > 0 and m.num_layers > 1
    if isinstance(m, torch.nn.MultiheadAttention):
        return m.dropout > 0
    return False


def _mode_modules(model: torch.nn.Module, index: dict) -> list:
    """The modules whose mode the C++ rules judge, registered once: (name, module, owned parameter
    indices, mode-dependent). A module with parameters owns its own; a parameterless
    mode-dependent one (Dropout) those of its nearest ancestor with parameters. The root is not
    listed: its train flag comes with every forward."""
    mods = dict(model.named_modules())
    out = []
    for name, m in mods.items():
        if not name:
            continue
        own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        dep = _mode_dependent(m)
        if not own and dep:
            anc = name  # itself (recursively), then its ancestors up to the root
            while True:
                own = [index[id(p)] for p in mods[anc].parameters() if id(p) in index]
                if own or not anc:
                    break
                anc = anc.rpartition(".")[0]
        if own or dep:
            out.append((name, m, own, dep))
    return out


class TrainingBugError(RuntimeError):
    """Raised by policy ``"raise"`` on the first error-severity finding; ``.finding`` has it."""

    def __init__(self, finding: "Finding"):
        super().__init__(finding.message)
        self.finding = finding


class TrainingBugWarning(UserWarning):
    """Category of the warnings emitted by policy ``"warn"``."""


@dataclasses.dataclass
class Finding:
    """One thing TrainSan found wrong.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    step : int
        0-based optimizer step where it was first seen.
    severity : str
        ``"error"`` or ``"warning"``.
    tensor : str or None
        Parameter or module name, when the finding is about one.
    message : str
        What is wrong and what to look at.
    value : float or None
        The figure that triggered it.
    count : int
        How often it occurred; a repeat is reported once in full, then counted.
    last_step : int
        Step of the latest occurrence.
    """

    kind: str
    step: int
    severity: str
    tensor: Optional[str]
    message: str
    value: Optional[float] = None
    count: int = 1
    last_step: int = 0

    @classmethod
    def _from_tuple(cls, t: Sequence[Any]) -> "Finding":
        kind, step, severity, tensor, message, value, count, last_step = t
        return cls(
            kind=kind,
            step=int(step),
            severity=severity,
            tensor=tensor or None,
            message=message,
            value=None if value is None or math.isnan(value) else float(value),
            count=int(count),
            last_step=int(last_step),
        )

    def __str__(self) -> str:
        return f"[{self.severity}] {self.message}"


_KIND_ON = dict(zip(*(torch.ops.trainsan.kinds()[k] for k in (0, 2))))  # kind -> on by default

_attached: "weakref.WeakKeyDictionary[torch.nn.Module, Sanitizer]" = weakref.WeakKeyDictionary()

# GradScaler.step is wrapped while any sanitizer is open, to tell an AMP skip (the scaler found
# Inf/NaN and did not call optimizer.step) from a forgotten optimizer.step().
_scaler_patch = {"users": 0, "orig": None}
_step_counts: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_watchers: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()


def _patch_scaler() -> None:
    if _scaler_patch["users"] == 0:
        orig = torch.amp.GradScaler.step

        def step(self, optimizer, *args, **kwargs):
            before = _step_counts.get(optimizer, 0)
            out = orig(self, optimizer, *args, **kwargs)
            if _step_counts.get(optimizer, 0) == before:
                for san in list(_watchers.get(optimizer, [])):
                    san._amp_skip(optimizer)
            return out

        step.__wrapped__ = orig  # type: ignore[attr-defined]
        _scaler_patch["orig"] = orig
        torch.amp.GradScaler.step = step  # type: ignore[method-assign]
    _scaler_patch["users"] += 1


# duplicate_batch (Note [Stuck data]): while any sanitizer is open, DataLoader.__iter__ and the
# loader iterators' __next__ count how many batches each loader's latest iterator yielded; a
# loader iterated anew after yielding only its first batch of several (`next(iter(loader))`
# inside the loop) counts as a restart. Bookkeeping only: the batches are not touched.
_loader_patch: dict = {"users": 0, "iter": None, "next": None}
_loader_yielded: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # loader -> [n]
_data_restarts = [0]


def _patch_loader() -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    if _loader_patch["users"] == 0:
        orig_iter, orig_next = DataLoader.__iter__, _BaseDataLoaderIter.__next__

        def __iter__(self):
            try:
                st = _loader_yielded.get(self)
                if st is not None and st[0] == 1:
                    try:
                        n = len(self)
                    except TypeError:
                        n = None  # an iterable dataset without a length
                    if n is None or n > 1:
                        _data_restarts[0] += 1
            except Exception:
                pass
            it = orig_iter(self)
            try:
                st = [0]
                _loader_yielded[self] = st
                it._trainsan_yielded = st
            except Exception:
                pass
            return it

        def __next__(self):
            out = orig_next(self)
            st = self.__dict__.get("_trainsan_yielded")
            if st is not None:
                st[0] += 1
            return out

        __iter__.__wrapped__ = orig_iter  # type: ignore[attr-defined]
        __next__.__wrapped__ = orig_next  # type: ignore[attr-defined]
        _loader_patch.update(iter=orig_iter, next=orig_next, my_iter=__iter__, my_next=__next__)
        DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
    _loader_patch["users"] += 1


def _unpatch_loader() -> None:
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    _loader_patch["users"] -= 1
    if _loader_patch["users"] == 0 and _loader_patch["iter"] is not None:
        # Restore only what is still ours (someone may have wrapped it again since).
        if DataLoader.__dict__.get("__iter__") is _loader_patch["my_iter"]:
            DataLoader.__iter__ = _loader_patch["iter"]  # type: ignore[method-assign]
        if _BaseDataLoaderIter.__dict__.get("__next__") is _loader_patch["my_next"]:
            _BaseDataLoaderIter.__next__ = _loader_patch["next"]  # type: ignore[method-assign]
        _loader_patch.update(iter=None, next=None, my_iter=None, my_next=None)


def _unpatch_scaler() -> None:
    _scaler_patch["users"] -= 1
    if _scaler_patch["users"] == 0 and _scaler_patch["orig"] is not None:
        torch.amp.GradScaler.step = _scaler_patch["orig"]  # type: ignore[method-assign]
        _scaler_patch["orig"] = None


# The loss without watch_loss (Note [Loss roots]): torch.autograd.backward (which
# Tensor.backward calls) and GradScaler.scale are wrapped while any sanitizer is open (refcounted;
# the originals are restored on the last close).
#
# Note [Loss roots]
# ~~~~~~~~~~~~~~~~~
# The scalar a training backward starts from is the loss. Each such root (one tensor of one
# element with a grad_fn) is handed, before the backward runs, to the open sanitizers it belongs
# to, as watch_loss would: nonfinite_loss, loss_spike, trivial_loss. Which ones: the open
# sanitizers whose model ran a training forward so far; with one such sanitizer, that one (no graph
# walk). With several (a GAN's generator and discriminator), the autograd graph is walked from the
# root until one parameter of each is found (or 20000 nodes): the root goes to the sanitizers whose
# parameters it reaches, and when it reaches several, to the one whose latest training forward
# came first — the upstream model: a generator loss D(G(z)) reaches both G and D, and is G's
# (the discriminator loss on fake.detach() reaches only D). A loss that should be D's although
# it also reaches G (no detach) is then G's; watch_loss(loss) on D's sanitizer adds it there.
# The root of scaler.scale(loss).backward() is the scaled loss: the wrapped GradScaler.scale
# remembers the unscaled tensor on its result, and the sanitizer gets that one (the scale factor
# would make loss_spike and trivial_loss wrong). A tensor is watched once per step however it
# arrives (a backward, watch_loss, both): identity, held weakly, until the next optimizer step.
# torch.autograd.grad roots are not followed.
_loss_patch = {"users": 0, "backward": None, "scale": None}
_open_sanitizers: "weakref.WeakSet[Sanitizer]" = weakref.WeakSet()
_forward_clock = [0]  # ticks at every training forward of any sanitizer
_WALK_LIMIT = 20000


def _loss_owners(root: torch.Tensor) -> list:
    cands = [s for s in list(_open_sanitizers) if not s._closed and s._last_train_forward >= 0]
    if len(cands) <= 1:
        return cands
    found: dict = {}
    seen, stack, budget = set(), [root.grad_fn], _WALK_LIMIT
    while stack and budget > 0 and len(found) < len(cands):
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        budget -= 1
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            for s in cands:
                if id(var) in s._param_ids:
                    found.setdefault(s, True)
        stack.extend(fn for fn, _ in node.next_functions)
    if not found:
        return []
    return [min(found, key=lambda s: s._last_train_forward)]


def _watch_roots(tensors: Any) -> None:
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1:
        tensors = tensors[0]
    if not isinstance(tensors, torch.Tensor) or tensors.grad_fn is None or tensors.numel() != 1:
        return
    loss = getattr(tensors, "_trainsan_unscaled", tensors)
    if not isinstance(loss, torch.Tensor):
        loss = tensors
    for san in _loss_owners(tensors):
        san._auto_loss(loss)


def _patch_loss() -> None:
    if _loss_patch["users"] == 0:
        orig_backward = torch.autograd.backward
        orig_scale = torch.amp.GradScaler.scale

        def backward(tensors, *args, **kwargs):
            try:
                _watch_roots(tensors)
            except TrainingBugError:
                raise
            except Exception:  # never break the user's backward
                pass
            return orig_backward(tensors, *args, **kwargs)

        def scale(self, outputs):
            out = orig_scale(self, outputs)
            if isinstance(outputs, torch.Tensor) and isinstance(out, torch.Tensor) and (
                out is not outputs
            ):
                try:
                    out._trainsan_unscaled = outputs
                except Exception:
                    pass
            return out

        backward.__wrapped__ = orig_backward  # type: ignore[attr-defined]
        scale.__wrapped__ = orig_scale  # type: ignore[attr-defined]
        _loss_patch.update(backward=orig_backward, scale=orig_scale)
        torch.autograd.backward = backward
        torch.amp.GradScaler.scale = scale  # type: ignore[method-assign]
    _loss_patch["users"] += 1


def _unpatch_loss() -> None:
    _loss_patch["users"] -= 1
    if _loss_patch["users"] == 0 and _loss_patch["backward"] is not None:
        torch.autograd.backward = _loss_patch["backward"]
        torch.amp.GradScaler.scale = _loss_patch["scale"]  # type: ignore[method-assign]
        _loss_patch.update(backward=None, scale=None)


def _flat_tensors(obj: Any, out: list, depth: int = 0) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for o in obj:
            _flat_tensors(o, out, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for o in obj.values():
            _flat_tensors(o, out, depth + 1)
    return out


def _git_commit() -> Optional[str]:
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _header_extra(model: torch.nn.Module) -> str:
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = str(dev)
    if dev.type == "cuda":
        device += " (" + torch.cuda.get_device_name(dev) + ")"
    fields = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": device,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "seed": torch.initial_seed(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "git_commit": _git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return json.dumps(fields)[1:-1]


def _group_lrs(opt: torch.optim.Optimizer) -> list:
    """The learning rate of each param group; NaN where unknown (none, or a tensor on a device:
    reading it would synchronise). An unknown rate counts as nonzero."""
    out = []
    for g in opt.param_groups:
        lr = g.get("lr", None)
        if isinstance(lr, torch.Tensor):
            lr = float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else math.nan
        try:
            out.append(math.nan if lr is None else float(lr))
        except (TypeError, ValueError):
            out.append(math.nan)
    return out


def _steps_in_flight(optimizers: Sequence[torch.optim.Optimizer]) -> list:
    """The optimizers whose step() is running on this thread's stack (attach() called from inside
    a step, e.g. from a closure or a callback a trainer runs there): their indices."""
    found = []
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name in ("step", "wrapper"):
            me = f.f_locals.get("self")
            for k, opt in enumerate(optimizers):
                if me is opt and k not in found:
                    found.append(k)
        f = f.f_back
    return found


_ACTIONS = ("none", "warn", "raise")  # trainsan::Action, as the op library returns it


def _skip_frames() -> list:
    """Source lookup of op-audit findings skips TrainSan's hook files and torch's own files (the
    demo, also in this package, is user code)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(here, "sanitizer.py"),
        os.path.join(here, "audit.py"),
        os.path.join(here, "autograd_checks.py"),
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
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
        self._model = model
        self._optimizers = list(optimizers)
        self._closed = False
        # Set once this sanitizer holds a reference on the GradScaler patch: an __init__ that
        # raises (bad trace path, bad option) is still close()d by __del__, and must not release
        # a reference it never took (the count would go negative and AMP skips go unseen).
        self._scaler_patched = False
        self._loss_patched = False  # likewise for the backward patch (Note [Loss roots])
        self._last_train_forward = -1  # _forward_clock at this model's latest training forward
        self._watched: dict = {}  # id(loss) -> weakref: the losses watched since the last step
        self._handles: list = []
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
        )
        # Policy "raise": class-index targets are checked before the loss runs
        # (trainsan/audit.py) — targets on a CPU always (a host read, no sync), device targets
        # with sync=True; otherwise the C++ op audit reports at the next event.
        sync = options.get("sync", OPTIONS["sync"])
        LabelGuard.end_all_windows()
        self._label_guard = (
            LabelGuard(self._check_target, host_only=not sync)
            if policy == "raise"
            and (self._enabled("label_range", checks) or self._enabled("batch_mismatch", checks))
            else None
        )
        self._handles.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        for k, opt in enumerate(self._optimizers):
            self._handles.append(opt.register_step_pre_hook(self._make_pre_step(k)))
            self._handles.append(opt.register_step_post_hook(self._make_post_step(k)))
            _watchers.setdefault(opt, []).append(self)
        if self._enabled("nonfinite_activation", checks):
            for n, m in model.named_modules():
                if not list(m.children()):
                    self._handles.append(m.register_forward_hook(self._make_activation_hook(n)))
        _patch_scaler()
        self._scaler_patched = True
        _patch_loader()
        self._loader_patched = True
        # Autograd integrity (autograd_checks.py): saved-tensor hooks on sampled steps, and the
        # custom-Function gradcheck (opt-in, gradcheck_every).
        self._saved_check = (
            SavedTensorCheck(
                self._handle,
                {id(p): n for n, p in zip(names, params)},
                {id(b) for b in model.buffers()},
                self._apply,
                self._add_py,
            )
            if self._enabled("inplace_before_backward", checks)
            else None
        )
        self._gradcheck = (
            CustomGradCheck(self._handle, self._apply, self._add_py)
            if self._enabled("bad_custom_grad", checks)
            and int(options.get("gradcheck_every", OPTIONS["gradcheck_every"])) > 0
            else None
        )
        self._param_ids = {id(p) for p in params}
        _patch_loss()
        self._loss_patched = True
        _open_sanitizers.add(self)
        # Attached inside an optimizer's step (a callback in step(closure)): the rest of that step
        # is part of it, and its post-hook comes without a pre-hook (_make_post_step).
        self._stepping: set = set()
        for k in _steps_in_flight(self._optimizers):
            self._handle.step_in_flight(k)

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
        if self._closed:
            return None
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

    def _make_pre_step(self, k: int):
        def hook(opt, args, kwargs):
            if self._label_guard is not None:
                self._label_guard.pop()
            self._end_autograd_window()
            if not self._closed:
                self._stepping.add(k)
                self._apply(self._handle.step_begin(k))

        return hook

    def _make_post_step(self, k: int):
        def hook(opt, args, kwargs):
            _step_counts[opt] = _step_counts.get(opt, 0) + 1
            if self._closed:
                return
            self._watched.clear()  # a loss is watched once per step (Note [Loss roots])
            t0 = time.perf_counter()
            lrs = _group_lrs(opt)
            lr0 = all(lr == 0 for lr in lrs)
            if k not in self._stepping:
                # No pre-hook for this step: it was in flight when this sanitizer attached.
                self._handle.step_in_flight(k)
            self._stepping.discard(k)
            self._py_overhead += time.perf_counter() - t0
            self._apply(self._handle.step_end(k, lr0, self._take_overhead(), lrs))

        return hook

    def _make_activation_hook(self, name: str):
        def hook(module, args, output):
            if self._closed or not torch.is_grad_enabled():
                return
            outs = [t for t in _flat_tensors(output, []) if t.is_floating_point()]
            if outs:
                self._apply(self._handle.module_output(name, type(module).__name__, outs))

        return hook

    def _check_target(self, op, input, target, ignore_index, num_classes) -> None:
        self._apply(self._handle.check_target(op, input, target, ignore_index, num_classes))

    def _amp_skip(self, opt) -> None:
        if not self._closed and opt in self._optimizers:
            self._handle.amp_skip(self._optimizers.index(opt))

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
        self._apply(self._handle.loss(loss))

    def _take_overhead(self) -> float:
        t, self._py_overhead = self._py_overhead, 0.0
        return t

    # -- public API -----------------------------------------------------------------------------

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Check a loss (``nonfinite_loss``, ``loss_spike``, ``trivial_loss``) and return it
        unchanged. Optional in Python: the root of every training backward is watched already
        (Note [Loss roots]); the same tensor is checked once per step however it arrives."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"watch_loss: expected a tensor, got {type(loss).__name__}")
        if not self._closed and self._first_watch(loss):
            self._apply(self._handle.loss(loss))
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
        for opt in self._optimizers:
            ws = _watchers.get(opt, [])
            if self in ws:
                ws.remove(self)
        if self._scaler_patched:
            self._scaler_patched = False
            _unpatch_scaler()
        if getattr(self, "_loader_patched", False):
            self._loader_patched = False
            _unpatch_loader()
        _open_sanitizers.discard(self)
        if getattr(self, "_loss_patched", False):
            self._loss_patched = False
            _unpatch_loss()
        if _attached.get(self._model) is self:
            del _attached[self._model]
        self._apply(self._handle.close())

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
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


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
    if optimizer is None:
        opts: list = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        opts = [optimizer]
    else:
        try:
            opts = list(optimizer)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                "trainsan.attach: optimizer must be a torch.optim.Optimizer or a list of them, "
                f"got {type(optimizer).__name__}"
            ) from None
    for k, o in enumerate(opts):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"trainsan.attach: optimizer[{k}] must be a torch.optim.Optimizer, got "
                f"{type(o).__name__}"
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
    checks = dict(checks or {})
    bad = sorted(set(checks) - set(KINDS))
    if bad:
        raise ValueError(
            f"trainsan.attach: unknown check(s) {', '.join(bad)} (not a finding kind TrainSan "
            "implements); valid kinds: "
            + ", ".join(sorted(KINDS))
        )
    prev = _attached.get(model)
    if prev is not None and not prev.closed:
        raise RuntimeError(
            "trainsan.attach: this model already has a sanitizer attached; close() it first "
            "(or use `with trainsan.attach(...) as san:`)"
        )
    san = Sanitizer(model, opts, policy, trace, checks, options)
    _attached[model] = san
    return san
