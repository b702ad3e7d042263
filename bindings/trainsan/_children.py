"""``python -m trainsan run``: the processes the script starts are checked as ranks of their own.

Note [Launcher children]
~~~~~~~~~~~~~~~~~~~~~~~~
A script that trains in processes it starts itself — ``torch.multiprocessing.spawn`` (DDP
tutorials), ``start_processes``, ``multiprocessing.Process`` (Hogwild) — gets each of them checked
like a torchrun rank. While the script runs, ``multiprocessing.process.BaseProcess.start`` is
wrapped (every start method and context goes through it) and looks at the process's target:
* ``torch.multiprocessing.spawn._wrap`` (what mp.spawn and start_processes start, one per process
  index i): its fn becomes ``functools.partial(child_main, run, config, fn)``, which _wrap calls
  as fn(i, *args); the child's index is i.
* any other target that is the script's code — defined in ``__main__`` (the script) or in a module
  that is neither installed (standard library, site-packages) nor one of torch, multiprocessing,
  concurrent, trainsan — becomes ``functools.partial(process_main, run, config, target, k)``, k
  the order in which the script started such processes (0, 1, ...). Library processes keep their
  target: DataLoader workers (torch.utils.data), Pool and Manager processes, ProcessPoolExecutor
  workers, and a Process subclass that overrides run() (it has no target; not checked).
``config`` is a plain dict (the launcher's attach options and --trace path) and ``run`` is
launcher._run_child, so the partial pickles for the spawn and forkserver start methods: the child
unpickles it (importing trainsan.launcher) after multiprocessing has re-run the script as
__mp_main__ (Note [Running the script as __main__]). (The launcher imports this module, not the
other way round: it hands over what the child needs.)

In the child, launcher._run_child installs a fresh launcher Pairer (Note [Launcher pairing]) around
the script's function. Under fork the child inherited the parent's: its hooks and the wrapped
Optimizer.__init__ are removed, the start wrapper undone (grandchildren are not checked), and the
sanitizers it attached are dropped quietly (``forget_inherited``, ``_drop``: hooks and patches
released, out of the registries, the C++ handle kept alive and never closed — closing would write
into the parent's open trace file; a forked child ends with os._exit, so no destructor runs
either). The child's rank is torch.distributed's once the function has joined a process group (read
when it attaches, so ``dist.init_process_group`` inside the function counts), else its index; with
--trace PATH it writes ``stem.rankN.ext`` (``stem.rankN.k.ext`` for its k-th model), as a torchrun
rank does (a second mp.spawn in the same script reuses the indices, and so the trace names).
SIGTERM (what mp.spawn sends the other processes when one fails) raises SystemExit in the child, so
its sanitizers are closed and its trace completed. When the function returns or raises, the child
closes its sanitizers and rank 0 prints its summary to stderr (launcher._finish); the others print
nothing. A TrainingBugError (policy raise) leaves a word in the parent's "stops" directory and is
re-raised: torch.multiprocessing reports it to the parent (ProcessRaisedException, with the child's
traceback), multiprocessing prints it in the child.

The parent knows how many processes it started: at its exit it says so instead of "nothing was
checked", names each rank that policy raise stopped (and then exits 1, even if the script ignored
its processes' exit codes, as the Hogwild example does) and prints a line per rank from that
rank's trace summary (waiting a few seconds for ranks still closing), as torchrun's rank 0 does for
the other ranks. Under torchrun nothing is wrapped (each rank's children would share its trace
name).
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import shutil
import site
import sys
import sysconfig
import tempfile
import time
from typing import Any, Callable, Optional

from . import _patches
from ._gatherers import Replicas
from ._registry import Patch

_LIBRARIES = ("torch", "multiprocessing", "concurrent", "trainsan")
_installed: Optional[Children] = None  # the launcher's, in its process (and inherited by forks)


def _process_start() -> list:
    orig = multiprocessing.process.BaseProcess.__dict__["start"]

    def start(proc, *args, **kwargs):
        if _installed is not None:
            _installed._wrap(proc)
        return orig(proc, *args, **kwargs)

    start.__wrapped__ = orig  # type: ignore[attr-defined]
    return [(multiprocessing.process.BaseProcess, "start", start)]


# Note [Patches]: a process the launched script starts is checked too (Note [Launcher children]).
_start_patch = Patch("process_start", ("launcher",), ["multiprocessing.process.BaseProcess.start"],
                     _process_start)
_dropped: list = []  # inherited sanitizers, kept alive for good (Note [Launcher children])


# -- the parent -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _library_dirs() -> tuple:
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", lambda: [])())
    dirs.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def is_script_code(target: Any) -> bool:
    """Whether a process target is the script's code, not a library's (Note [Launcher
    children])."""
    while isinstance(target, functools.partial):
        target = target.func
    name = getattr(getattr(target, "__func__", target), "__module__", None)
    if not isinstance(name, str):
        return False
    if name in ("__main__", "__mp_main__"):
        return True
    if name.partition(".")[0] in _LIBRARIES:
        return False
    path = getattr(sys.modules.get(name), "__file__", None)
    return bool(path) and not os.path.realpath(path).startswith(_library_dirs())


class Children:
    """Wraps the processes the script starts (Note [Launcher children]); counts them.

    `pairer` and `signals` are the launcher's (a forked child takes them out); `run(config,
    index, call)` is the launcher's function that checks `call()` in a child, named by reference
    in what a spawned child unpickles (so that it imports the launcher)."""

    def __init__(self, pairer: Any, signals: Any, run: Callable, trace: Optional[str],
                 attach_kwargs: dict):
        self.pairer = pairer
        self.signals = signals
        self._run = run
        # "stops": a directory where a child stopped by policy raise leaves a word (made at the
        # first child, removed at the end).
        self.config = {"trace": trace, "attach": dict(attach_kwargs), "stops": None}
        self.ranks: set = set()  # the indices of the processes started
        self.how: set = set()  # "torch.multiprocessing", "multiprocessing.Process"
        self.stopped: list = []  # "rank N: stopped at ...", read at the end
        self._processes = 0

    def install(self) -> None:
        global _installed
        _installed = self
        _start_patch.acquire("launcher")

    def uninstall(self) -> None:
        global _installed
        if _installed is self:
            _installed = None
            _start_patch.release("launcher")

    def _wrap(self, proc: multiprocessing.process.BaseProcess) -> None:
        target = getattr(proc, "_target", None)
        if target is None:
            return  # a Process subclass with its own run(): not checked
        spawn_wrap = getattr(sys.modules.get("torch.multiprocessing.spawn"), "_wrap", None)
        ours = target is spawn_wrap and len(proc._args) == 4  # _wrap(fn, i, args, error_file)
        if not ours and not is_script_code(target):
            return
        if self.config["stops"] is None:
            self.config["stops"] = tempfile.mkdtemp(prefix="trainsan-run-")
        if ours:
            fn, index, args, error_file = proc._args
            fn = functools.partial(child_main, self._run, self.config, fn)
            proc._args = (fn, index, args, error_file)
            how = "torch.multiprocessing"
        else:
            index = self._processes
            self._processes += 1
            proc._target = functools.partial(process_main, self._run, self.config, target, index)
            how = "multiprocessing.Process"
        self.ranks.add(index)
        self.how.add(how)

    def closing_lines(self, checked_here: bool, rank_line: Callable) -> list:
        """What the parent prints at exit about the processes it started (nothing if none);
        `rank_line(path, rank, wait_s)` is a rank's line from its trace. Fills `stopped`."""
        if not self.ranks:
            return []
        n = len(self.ranks)
        how = " and ".join(sorted(self.how))
        lines = [f"trainsan run: {'this process checked nothing: ' if not checked_here else ''}"
                 f"the script started {n} process{'es' if n > 1 else ''} ({how}), each checked "
                 "on its own as a rank; rank 0 prints its summary"]
        stops = self.config["stops"]
        try:
            words = sorted(os.listdir(stops), key=lambda f: int(f[4:]) if f[4:].isdigit() else 0)
        except OSError:
            words = []
        for name in words:
            with open(os.path.join(stops, name), encoding="utf-8") as fh:
                self.stopped.append(f"rank {name[4:]}: {fh.read()}")
            lines.append(f"trainsan run: {self.stopped[-1]}")
        shutil.rmtree(stops, ignore_errors=True)
        trace = self.config["trace"]
        if not trace:
            if n > 1:
                others = max(self.ranks)
                which = "rank 1" if others == 1 else f"ranks 1..{others}"
                lines.append(f"trainsan run: {which}: pass --trace to see "
                             f"{'its' if others == 1 else 'their'} findings here")
            return lines
        deadline = time.monotonic() + 5.0
        for rank in sorted(self.ranks):
            for path in _rank_paths(trace, rank):
                lines.append(rank_line(path, rank, max(0.0, deadline - time.monotonic())))
        return lines


def _rank_paths(trace: str, rank: int) -> list:
    """Rank `rank`'s traces: stem.rankN.ext, then stem.rankN.k.ext for its k-th model."""
    stem, ext = os.path.splitext(trace)
    paths = [f"{stem}.rank{rank}{ext}"]
    while os.path.exists(f"{stem}.rank{rank}.{len(paths)}{ext}"):
        paths.append(f"{stem}.rank{rank}.{len(paths)}{ext}")
    return paths


# -- the child ------------------------------------------------------------------------------------

def child_main(run: Callable, config: dict, fn: Callable, index: int, *args: Any) -> Any:
    """A torch.multiprocessing process: fn(index, *args), checked (Note [Launcher children])."""
    return run(config, index, lambda: fn(index, *args))


def process_main(run: Callable, config: dict, target: Callable, index: int, *args: Any,
                 **kwargs: Any) -> Any:
    """A multiprocessing.Process of the script: target(*args, **kwargs), checked."""
    return run(config, index, lambda: target(*args, **kwargs))


def dist_rank() -> Optional[int]:
    """This process's torch.distributed rank, or None outside a process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (RuntimeError, ValueError):
        pass
    return None


def forget_inherited() -> None:
    """Under fork: the parent's launcher state, out of this child (Note [Launcher children])."""
    inherited = _installed
    if inherited is None:
        return
    inherited.uninstall()
    inherited.pairer.uninstall()
    for p in inherited.pairer.pairings:
        if not p.san.closed:
            _drop(p.san._ctx)  # Note [Context]
    inherited.signals.restore()  # the handlers it replaced (this process installs its own)


def _drop(ctx: Any) -> None:
    """An inherited sanitizer (its Context), out of this process without touching its trace."""
    ctx.closed = True
    _patches.unregister(ctx)
    for part in ctx.parts:
        if isinstance(part, Replicas):
            continue  # its close() talks to the other ranks, on the parent's behalf
        try:
            part.close()
        except Exception:  # noqa: BLE001 - best effort: the child goes on without it
            pass
    _dropped.append(ctx)


def stopped(config: dict, rank: int, kind: str, step: int) -> None:
    """Policy raise stopped this child at a finding: a word for the parent."""
    try:
        with open(os.path.join(config["stops"], f"rank{rank}"), "w", encoding="utf-8") as fh:
            fh.write(f"stopped at the first error (policy raise): {kind} at step {step}")
    except (OSError, TypeError):
        pass  # the parent is done
