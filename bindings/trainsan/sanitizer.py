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

# Modules whose forward depends on train/eval.
_MODE_SENSITIVE = (
    torch.nn.modules.dropout._DropoutNd,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)


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


def _unpatch_scaler() -> None:
    _scaler_patch["users"] -= 1
    if _scaler_patch["users"] == 0 and _scaler_patch["orig"] is not None:
        torch.amp.GradScaler.step = _scaler_patch["orig"]  # type: ignore[method-assign]
        _scaler_patch["orig"] = None


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


def _lr_zero(opt: torch.optim.Optimizer) -> bool:
    for g in opt.param_groups:
        lr = g.get("lr", None)
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu":
                return False  # reading it would synchronise; treat as nonzero
            lr = float(lr)
        if lr is None or lr != 0:
            return False
    return True


_ACTIONS = ("none", "warn", "raise")  # trainsan::Action, as the op library returns it


def _skip_frames() -> list:
    """Source lookup of op-audit findings skips TrainSan's hook files and torch's own files (the
    demo, also in this package, is user code)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(here, "sanitizer.py"),
        os.path.join(here, "audit.py"),
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
        self._handles: list = []
        self._py_overhead = 0.0
        names, params, opt_index = [], [], []
        where = {}
        for k, opt in enumerate(self._optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    where.setdefault(id(p), k)
        for name, p in model.named_parameters():
            names.append(name)
            params.append(p)
            opt_index.append(where.get(id(p), -1))
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
        sensitive = [(n, m) for n, m in model.named_modules() if isinstance(m, _MODE_SENSITIVE)]
        self._sensitive = [m for _, m in sensitive]
        self._handle = torch.classes.trainsan.Sanitizer(
            names,
            params,
            opt_index,
            opts,
            _header_extra(model),
            [n for n, _ in sensitive],
            [type(m).__name__ for _, m in sensitive],
            _skip_frames(),
            not self._optimizers,
        )
        # sync=True with policy "raise": class-index targets are checked before the loss runs
        # (trainsan/audit.py); otherwise the C++ op audit reports at the next event.
        sync = options.get("sync", OPTIONS["sync"])
        self._label_guard = (
            LabelGuard(self._check_target)
            if policy == "raise"
            and sync
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
        inputs = _flat_tensors(args, []) + _flat_tensors(kwargs, []) if training else []
        module_eval = [not m.training for m in self._sensitive]
        found = self._handle.forward(training, inputs, module_eval, self._take_overhead())
        if self._label_guard is not None:
            if torch.is_grad_enabled() and training and self._handle.auditing():
                self._label_guard.push()
            else:
                self._label_guard.pop()
        self._py_overhead += time.perf_counter() - t0
        self._apply(found)
        return None

    def _make_pre_step(self, k: int):
        def hook(opt, args, kwargs):
            if self._label_guard is not None:
                self._label_guard.pop()
            if not self._closed:
                self._apply(self._handle.step_begin(k))

        return hook

    def _make_post_step(self, k: int):
        def hook(opt, args, kwargs):
            _step_counts[opt] = _step_counts.get(opt, 0) + 1
            if self._closed:
                return
            t0 = time.perf_counter()
            lr0 = _lr_zero(opt)
            self._py_overhead += time.perf_counter() - t0
            self._apply(self._handle.step_end(k, lr0, self._take_overhead()))

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

    def _take_overhead(self) -> float:
        t, self._py_overhead = self._py_overhead, 0.0
        return t

    # -- public API -----------------------------------------------------------------------------

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Check a loss for NaN/Inf (``nonfinite_loss``) and return it unchanged."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"watch_loss: expected a tensor, got {type(loss).__name__}")
        if not self._closed:
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

    def summary(self) -> str:
        """A short human-readable summary of the findings."""
        fs = self.findings
        if not fs:
            return f"trainsan: {self.step} steps, no findings"
        lines = [f"trainsan: {self.step} steps, {len(fs)} distinct finding(s):"]
        for f in fs:
            rep = f" (x{f.count}, last at step {f.last_step})" if f.count > 1 else ""
            lines.append(f"  [{f.severity}] {f.message}{rep}")
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
            except TrainingBugError:
                pass  # do not mask the exception already propagating

    def __del__(self):
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass


def _opt_str(v: Any) -> str:
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
