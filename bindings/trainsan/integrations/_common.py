"""What the framework callbacks share: option checks, the lazily made class, the summary, a close
that never masks the exception a training run is leaving with. Imports no framework."""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable, Optional, Union

import torch

from .._tables import OPTIONS
from .._journal import watch_loads

Summary = Union[bool, Callable[[str], Any], None]


def check_options(where: str, options: dict) -> dict:
    """The keyword options of trainsan.attach, checked when the callback is made (a misspelt
    option fails at once, not when training starts)."""
    valid = set(OPTIONS) | {"checks"}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise TypeError(
            f"{where}: unknown option(s) {', '.join(unknown)}; the options are trainsan.attach's: "
            + ", ".join(sorted(valid))
        )
    return dict(options)


def rank_options(options: dict, rank: int) -> dict:
    """The options for one process: ``{rank}`` in the trace path becomes its global rank (with
    several processes each writes its own trace: ``trace="run.{rank}.jsonl"``)."""
    trace = options.get("trace")
    if isinstance(trace, str) and "{rank}" in trace:
        return {**options, "trace": trace.replace("{rank}", str(rank))}
    return options


def with_window(options: dict, steps: Any) -> dict:
    """The options with the trainer's gradient accumulation window declared (accumulation_steps,
    Note [Accumulation windows] in host/checks/accumulation.cpp), unless the user set it: a
    window of 1 (no accumulation) declares nothing."""
    if "accumulation_steps" in options or not isinstance(steps, int) or steps <= 1:
        return options
    return {**options, "accumulation_steps": steps}


def check_summary(where: str, summary: Summary) -> Summary:
    if summary is None or isinstance(summary, bool) or callable(summary):
        return summary
    raise TypeError(
        f"{where}: summary must be True (print it to stderr), False or a callable taking the "
        f"text, got {type(summary).__name__}"
    )


def missing_class(name: str, module: str, what: str, pip: str, error: ImportError) -> type:
    """A stand-in for a callback whose framework is not installed: importable, and its
    constructor raises an ImportError that says what to install."""
    message = (
        f"{module}.{name} needs {what}, which could not be imported ({error}); "
        f"install it with: pip install {pip}"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError(message) from error

    return type(name, (), {"__init__": __init__, "__module__": module, "__doc__": message})


def unwrap_model(model: Any) -> Any:
    """The module a DistributedDataParallel / DataParallel wrapper holds (torch.compile's
    OptimizedModule is unwrapped by trainsan.attach itself)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    for _ in range(8):
        if isinstance(model, wrappers):
            model = model.module
        else:
            break
    return model


def report_summary(san: Any, summary: Summary, rank: int = 0, world: int = 1) -> Optional[str]:
    """Print (or hand to `summary`) the closed sanitizer's summary; each rank reports its own
    findings, so with several processes every line says which rank it is."""
    if san is None or not summary:
        return None
    try:
        text = san.summary()
    except Exception as e:  # noqa: BLE001 - a summary must never fail the training run
        text = f"trainsan: no summary ({type(e).__name__}: {e})"
    if world > 1:
        text = "\n".join(f"[rank {rank}] {line}" for line in text.splitlines())
    if callable(summary):
        summary(text)
    else:
        print(text, file=sys.stderr, flush=True)
    return text


def close_quietly(san: Any) -> None:
    """close() while an exception is already on its way out (Lightning's on_exception, a
    sanitizer left open by a train() that raised): close() may report what it still held, but
    must not replace the exception that ended training."""
    if san is None or san.closed:
        return
    try:
        san.close()
    except Exception as e:  # noqa: BLE001
        warnings.warn(
            f"trainsan: closing the sanitizer raised {type(e).__name__}: {e}", stacklevel=2
        )


def training_forward(san: Any, batch: Any) -> None:
    """Report a training forward on `batch` to `san` (Sanitizer.training_forward): Lightning calls
    training_step as a method, not through the module's __call__, so the attached module's
    forward hook never fires when the step calls a submodule (self.net(x))."""
    san.training_forward(batch)


class CallbackBase:
    """What both framework callbacks share: the options (checked when the callback is built),
    the summary setting, the sanitizer of the current run and its findings.

    Parameters
    ----------
    summary : bool or callable, default True
        At the end of training print :meth:`trainsan.Sanitizer.summary` to stderr (True), say
        nothing (False), or call ``summary(text)``.
    **options
        The keyword options of :func:`trainsan.attach`: ``policy``, ``trace``, ``checks``,
        ``sync``, ``overhead_budget``, ...

    Attributes
    ----------
    sanitizer : trainsan.Sanitizer or None
        The sanitizer of the current (or latest) run; still readable after it closed.
    findings : list of trainsan.Finding
        Its findings.
    """

    NAME = "trainsan.integrations"

    def __init__(self, *, summary: Summary = True, **options: Any) -> None:
        self.options = check_options(self.NAME, options)
        self.summary = check_summary(self.NAME, summary)
        self.sanitizer = None
        self.last_summary: Optional[str] = None
        # The Trainer restores a checkpoint (resume_from_checkpoint, ckpt_path) before the
        # callback attaches: the load journal is held while the callback exists (Note [Load
        # journal]; Note [Patches]), so the attach judges those loads.
        self._loads = watch_loads()
        weakref.finalize(self, self._loads.close)

    @property
    def findings(self) -> list:
        return [] if self.sanitizer is None else self.sanitizer.findings

    def close(self) -> None:
        """Close the sanitizer (after a run that raised; the end-of-training event does it
        otherwise)."""
        close_quietly(self.sanitizer)

    def finish(self, rank: int, world: int, quiet: bool = False) -> None:
        """End of training: close the sanitizer (quiet: never raising, the run already failed;
        else it may raise what it still held under policy "raise"), then report its summary."""
        san = self.sanitizer
        if san is None or san.closed:
            return
        try:
            if quiet:
                close_quietly(san)
            else:
                san.close()
        finally:
            self.last_summary = report_summary(san, self.summary, rank=rank, world=world)


def lazy_class(module: str, namespace: dict, name: str, build: Callable[[], type], hook: str):
    """PEP 562 ``__getattr__`` and ``__dir__`` for an integration module whose class `name` is
    made by `build()`, importing the framework, at the first lookup of the name. A stand-in made
    because the framework is missing (it lacks the callback method `hook`) is not kept, so a later
    install is seen."""

    def __getattr__(attr: str) -> Any:
        if attr == name:
            cls = build()
            if hasattr(cls, hook):
                namespace[attr] = cls
            return cls
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")

    def __dir__() -> list:
        return sorted(set(namespace) | {name})

    return __getattr__, __dir__
