"""``python -m trainsan run``: an unmodified training script, run with TrainSan attached.

    python -m trainsan run [options] script.py [args ...]
    python -m trainsan run [options] -m package.module [args ...]
    torchrun --nproc-per-node N -m trainsan run [options] script.py [args ...]

The script runs as ``__main__`` (Note [Running the script as __main__]); each optimizer it builds
gets a sanitizer, paired with the smallest module that holds its parameters, and a loop without an
optimizer gets one in manual mode (Note [Launcher pairing]). At exit — normal, an exception,
SIGTERM or SIGINT — the sanitizers are closed (their traces get the summary record) and their
summaries printed to stderr (Note [Launcher exit]). The options are :func:`trainsan.attach`'s,
as flags generated from its option table (``--sync``, ``--grad-explosion-factor 20``).
Processes the script starts to train in — ``torch.multiprocessing.spawn``/``start_processes``,
``multiprocessing.Process`` (Hogwild) — are checked like torchrun ranks, each with its own
sanitizers and ``.rankN`` trace; DataLoader workers and other library processes are left alone
(Note [Launcher children], _children.py).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import io
import json
import os
import signal
import sys
import time
import traceback
import types
from typing import Any, Optional

import torch

import trainsan

from . import _children
from ._pairing import Pairer, _Pairing
from ._tables import check_options

PROG = "python -m trainsan run"
_ON = {"on": True, "true": True, "1": True, "yes": True,
       "off": False, "false": False, "0": False, "no": False}


# -- command line --------------------------------------------------------------------------------

def _parser() -> tuple[argparse.ArgumentParser, set]:
    """The launcher's parser, with a flag per row of the option table (options.def), and the
    flags that take a value (to find where the script's own arguments begin)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage="%(prog)s [options] (script.py | -m module) [args ...]",
        description="Run an unmodified training script with TrainSan attached to every optimizer "
        "it builds (paired with the smallest module that holds its parameters; a loop without an "
        "optimizer gets manual mode). At exit the sanitizers are closed and their summaries "
        "printed to stderr. Under torchrun each rank attaches, traces get .rankN in their name, "
        "and rank 0 prints its summary and a line per other rank; processes the script starts "
        "itself (torch.multiprocessing.spawn, multiprocessing.Process) are checked as ranks "
        "the same way, and the launcher prints a line per rank.",
        epilog="Everything after the script (or -m module) is the script's own arguments. "
        "Exit status: the script's; 1 when it raised (with policy raise, at the first error "
        "finding, also one in a process it started); 128+N when stopped by signal N.",
        allow_abbrev=False,
    )
    parser.add_argument("-m", dest="module", metavar="MODULE",
                        help="run a library module as __main__, as python -m does")
    parser.add_argument("script", nargs="?", help="the training script (a .py file, or a "
                        "directory holding __main__.py)")
    group = parser.add_argument_group("TrainSan options (trainsan.attach's; the README documents "
                                      "each rule)")
    takes_value = {"-m"}
    names, types_, defaults, choices, docs = torch.ops.trainsan.options()
    for name, typ, default, choice, doc in zip(names, types_, defaults, choices, docs):
        flag = "--" + name.replace("_", "-")
        if typ == "bool":
            group.add_argument(flag, dest=name, default=None,
                               action=argparse.BooleanOptionalAction,
                               help=f"{doc} (default: {'on' if default == 'true' else 'off'})")
            continue
        if name == "trace":
            doc += (" (under torchrun, and in processes the script starts, each rank writes PATH "
                    "with .rankN before the extension)")
        group.add_argument(
            flag, dest=name, default=None,
            metavar=None if choice else "PATH" if name == "trace" else name.upper(),
            type={"int": int, "float": float}.get(typ, str),
            choices=choice.split("|") if choice and typ == "str" else None,
            help=f"{doc} (default: {default or 'none'}"
            + (f"; range {choice})" if choice and typ != "str" else ")"),
        )
        takes_value.add(flag)
    group.add_argument(
        "--checks", action="append", default=[], metavar="KIND=on|off[,...]",
        help="switch finding kinds on or off (repeatable); kinds: " + ", ".join(trainsan.KINDS),
    )
    takes_value.add("--checks")
    return parser, takes_value


def _split(argv: list, takes_value: set) -> tuple[list, list]:
    """(the launcher's arguments up to and including the script or -m module, the script's own
    arguments): the launcher's options come first, and the first word that is not one of them
    (or the value of -m) is the script, as with python itself."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[: i + 2], argv[i + 2 :]
        if tok.startswith("-m") and not tok.startswith("--"):
            end = i + 2 if tok == "-m" else i + 1
            return argv[:end], argv[end:]
        if tok.startswith("-") and tok != "-":
            i += 2 if tok in takes_value else 1  # an unknown flag is argparse's error later
            continue
        return argv[: i + 1], argv[i + 1 :]
    return argv, []


def _checks(parser: argparse.ArgumentParser, values: list) -> dict:
    """``--checks kind=on,kind=off`` -> ``{kind: bool}``, unknown kinds and values as errors."""
    out = {}
    for item in (v for value in values for v in value.split(",") if v):
        kind, _, state = item.partition("=")
        if kind not in trainsan.KINDS:
            parser.error(f"--checks: unknown kind {kind!r}; kinds: " + ", ".join(trainsan.KINDS))
        if state.lower() not in _ON:
            parser.error(f"--checks: {item!r}: write {kind}=on or {kind}=off")
        out[kind] = _ON[state.lower()]
    return out


# -- the script as __main__ -----------------------------------------------------------------------

# Note [Running the script as __main__]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# As coverage's runner does: a fresh module named __main__ holds the script's globals and is
# sys.modules["__main__"] for as long as the process lives, and the script's code (compiled with
# dont_inherit=True: the launcher's __future__ imports do not leak into it) runs in its dict.
# runpy.run_path/run_module are not used because they make that module themselves and restore the
# previous __main__ when the code returns, so the module cannot be registered under other names
# before the script starts, and atexit handlers or pickling at exit would see the launcher.
# * sys.modules["__mp_main__"] is the same module. multiprocessing aliased __mp_main__ to the
#   launcher's __main__ when torch imported it; a spawn (or forkserver) child runs the script as
#   __mp_main__ (from __file__, or by name for -m, where `if __name__ == "__main__":` is false),
#   so objects it pickles back — a DataLoader worker's batch of a NamedTuple defined in the
#   script — name that module, and the parent must find the script there.
# * __file__ is absolute, so a child started after the script changed directory finds it; for a
#   path __spec__ is None (children re-run the file), for -m it is the module's spec (children
#   import it by name), as under python itself.
# * sys.argv is [the script as given | the module's file, *args]; sys.path[0] is the script's
#   directory (symlinks resolved) or, for -m, the working directory — what `python script.py` and
#   `python -m module` would have put there (untouched under -P / PYTHONSAFEPATH).

def _load_path(path: str) -> tuple[types.ModuleType, Any, str]:
    """The __main__ module, code and sys.path[0] for a script path (or a directory holding
    __main__.py)."""
    if os.path.isdir(path):
        path0, path = os.path.realpath(path), os.path.join(path, "__main__.py")
    else:
        path0 = os.path.dirname(os.path.realpath(path))
    with io.open_code(path) as fh:
        source = fh.read()
    code = compile(source, os.path.abspath(path), "exec", dont_inherit=True)
    mod = types.ModuleType("__main__")
    mod.__file__ = os.path.abspath(path)
    mod.__loader__ = importlib.machinery.SourceFileLoader("__main__", mod.__file__)
    mod.__spec__ = None
    mod.__package__ = None
    mod.__cached__ = None
    return mod, code, path0


def _load_module(name: str) -> tuple[types.ModuleType, Any]:
    """The __main__ module and code for ``-m name`` (a package runs its __main__ submodule)."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(name + ".__main__")
        if spec is None:
            raise ImportError(f"{name} is a package and cannot be directly executed")
    if spec is None or spec.loader is None:
        raise ImportError(f"No module named {name}")
    code = spec.loader.get_code(spec.name)
    if code is None:
        raise ImportError(f"No code object available for {name}")
    mod = types.ModuleType("__main__")
    mod.__spec__ = spec
    mod.__file__ = spec.origin
    mod.__loader__ = spec.loader
    mod.__package__ = spec.parent
    mod.__cached__ = spec.cached
    return mod, code


def _become_main(mod: types.ModuleType, argv: list, path0: Optional[str]) -> None:
    mod.__builtins__ = sys.modules["builtins"]
    sys.modules["__main__"] = sys.modules["__mp_main__"] = mod
    sys.argv = argv
    if path0 is not None and not getattr(sys.flags, "safe_path", False):
        sys.path[0] = path0


# -- exit ----------------------------------------------------------------------------------------

# Note [Launcher exit]
# ~~~~~~~~~~~~~~~~~~~~
# However the script ends, the sanitizers are closed (each trace gets its summary record) and,
# on rank 0 (or without torchrun), each summary is printed to stderr after a line naming the model
# and its optimizers. SIGTERM (what torchrun and schedulers send) raises SystemExit(143) in the
# main thread, so the script's finally blocks run and the launcher closes as after an exception;
# SIGINT raises KeyboardInterrupt as usual (exit 130). While closing, both signals are held off
# and honoured afterwards (exit 128+N). An exception is printed with the launcher's frames left
# out; a TrainingBugError (policy raise) is followed by a line naming the finding, and exits 1.
# Rank 0 of a torchrun job also prints a line per other rank, from that rank's trace summary,
# waiting a few seconds for it; ranks that finish later are reported as not readable yet.

class _Signalled(SystemExit):
    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class _Signals:
    """SIGTERM as an exception in the script; both signals held off while the launcher closes."""

    def __init__(self):
        self._pid = os.getpid()
        self._closing = False
        self.held: list = []
        self._saved = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(sig)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._saved[sig] = current
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) inherited the handler: die as it would have.
            signal.signal(signum, self._saved[signum])
            os.kill(os.getpid(), signum)
            return
        if self._closing:
            self.held.append(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise _Signalled(signum)

    def closing(self) -> None:
        self._closing = True

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


def _print_exception(exc: BaseException) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _describe(p: _Pairing, several: bool) -> str:
    name = type(p.model).__name__ + (f" (model {p.slot + 1})" if several else "")
    opts = ", ".join(type(o).__name__ for o in p.optimizers) or "no optimizer (manual mode)"
    where = f", trace {p.trace}" if p.trace else ""
    state = f" (replaced: {p.why})" if p.replaced else ""
    return f"trainsan run: {name} with {opts}{where}{state}"


def _rank_line(path: str, rank: int, wait_s: float) -> str:
    """One line for another rank, from the summary record of its trace."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, encoding="utf-8") as fh:
                last = fh.read().rstrip("\n").rpartition("\n")[2]
            rec = json.loads(last)
            if rec.get("type") == "summary":
                break
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return f"trainsan run: rank {rank}: no summary in {path} yet (still running?)"
        time.sleep(0.1)
    found = rec.get("findings", {})
    if not found:
        what = "no findings"
    else:
        what = f"{sum(found.values())} distinct finding(s): " + ", ".join(
            f"{k} x{n} ({trainsan.KINDS.get(k, '?')})" for k, n in found.items())
    return f"trainsan run: rank {rank}: {rec.get('steps', 0)} steps, {what} ({path})"


def _other_ranks(pairer: Pairer, trace: Optional[str], world: int) -> list:
    if not trace:
        return [f"trainsan run: ranks 1..{world - 1}: pass --trace to see their findings here"]
    lines = []
    stem, ext = os.path.splitext(trace)
    slots = sorted({p.slot for p in pairer.pairings}) or [0]
    deadline = time.monotonic() + 5.0
    for rank in range(1, world):
        for slot in slots:
            path = f"{stem}.rank{rank}{'.' + str(slot) if slot else ''}{ext}"
            lines.append(_rank_line(path, rank, max(0.0, deadline - time.monotonic())))
    return lines


def _finish(pairer: Pairer, status: int, trace: Optional[str], rank: Optional[int],
            world: int, children: Any = None) -> int:
    """Close every sanitizer and print the summaries (Note [Launcher exit]); the exit status."""
    for p in pairer.pairings:
        try:
            p.san.close()
        except trainsan.TrainingBugError as exc:  # a finding the close flushed (policy raise)
            print(f"trainsan run: at close: {exc.finding}", file=sys.stderr)
            status = status or 1
    if rank not in (None, 0):
        return status
    shown = [p for p in pairer.pairings if not p.replaced or p.san.findings]
    several = len({p.slot for p in pairer.pairings}) > 1
    for p in shown:
        print(_describe(p, several), file=sys.stderr)
        print(p.san.summary(), file=sys.stderr)
    started = children.closing_lines(bool(shown), _rank_line) if children is not None else []
    if started and children.stopped:  # a child stopped by policy raise (Note [Launcher children])
        status = status or 1
    if not shown and not pairer.notes and not started:
        if pairer._built:
            print(f"trainsan run: nothing was checked: the script built {pairer._built} "
                  f"optimizer(s) ({', '.join(sorted(set(pairer._built_types)))}) but none "
                  "stepped, ran a backward or had a module holding its parameters called in "
                  "train mode", file=sys.stderr)
        else:
            print("trainsan run: nothing was checked: the script built no optimizer and called "
                  "no module with trainable parameters in train mode with gradients enabled",
                  file=sys.stderr)
    for note in pairer.notes + pairer.uncovered():
        print(f"trainsan run: {note}", file=sys.stderr)
    if world > 1:
        for line in _other_ranks(pairer, trace, world):
            print(line, file=sys.stderr)
    for line in started:  # processes the script started (Note [Launcher children])
        print(line, file=sys.stderr)
    return status


# -- processes the script starts -----------------------------------------------------------------

class _ChildPairer(Pairer):
    """The Pairer of a process the script started: its rank is torch.distributed's once the
    process has joined a group (read when a trace is named), else the process index."""

    @property
    def _rank(self) -> int:
        if self._dist_rank is None:
            self._dist_rank = _children.dist_rank()
        return self._index if self._dist_rank is None else self._dist_rank

    @_rank.setter
    def _rank(self, index: int) -> None:  # Pairer.__init__'s
        self._index = index
        self._dist_rank: Optional[int] = None


def _run_child(config: dict, index: int, call: Any) -> Any:
    """call() in a process the script started, checked as rank `index` (Note [Launcher
    children]): the launcher's run and exit, for one rank."""
    _children.forget_inherited()
    trace = config["trace"]
    pairer = _ChildPairer(trace, index, **config["attach"])
    signals = _Signals()
    pairer.install()
    failed = True
    try:
        result = call()
        failed = False
        return result
    except trainsan.TrainingBugError as exc:  # the launcher (the parent) says so and exits 1
        _children.stopped(config, pairer._rank, exc.finding.kind, exc.finding.step)
        raise
    finally:
        signals.closing()
        pairer.uninstall()
        status = _finish(pairer, 0, trace, pairer._rank, 1)  # the parent prints the ranks' lines
        sys.stderr.flush()
        signals.restore()
        if not failed and (status or signals.held):
            raise SystemExit(128 + signals.held[0] if signals.held else status)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


# -- entry point ---------------------------------------------------------------------------------

def main(argv: list) -> int:
    parser, takes_value = _parser()
    ours, script_args = _split(argv, takes_value)
    args = parser.parse_args(ours)
    if args.script is None and args.module is None:
        parser.error("give the script to run (script.py) or a module (-m module)")
    checks = _checks(parser, args.checks)
    options = {n: v for n, v in vars(args).items()
               if n in trainsan.OPTIONS and n not in ("policy", "trace") and v is not None}
    trace = os.path.abspath(args.trace) if args.trace else None
    try:
        check_options(options, args.policy or trainsan.OPTIONS["policy"], trace, checks)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc).split("\n")[0])
    if trace and not os.path.isdir(os.path.dirname(trace)):
        parser.error(f"--trace: the directory of {trace} does not exist")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0")) if world > 1 else None
    try:
        if args.module is not None:
            mod, code = _load_module(args.module)
            argv0, path0 = mod.__file__, os.getcwd()
        else:
            mod, code, path0 = _load_path(args.script)
            argv0 = args.script
    except (OSError, ImportError, SyntaxError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    pairer = Pairer(trace, rank, policy=args.policy, checks=checks, **options)
    _become_main(mod, [argv0, *script_args], path0)
    signals = _Signals()
    status = 0
    pairer.install()
    children = None
    if world == 1:  # the processes the script starts are checked too (Note [Launcher children])
        children = _children.Children(pairer, signals, _run_child, trace,
                                      dict(policy=args.policy, checks=checks, **options))
        children.install()
    try:
        exec(code, mod.__dict__)
    except SystemExit as exc:
        status = _exit_status(exc)
        if isinstance(exc, _Signalled):
            print(f"trainsan run: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
    except KeyboardInterrupt:
        status = 128 + signal.SIGINT
        print("trainsan run: interrupted (SIGINT)", file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - the script's error, reported as python would
        _print_exception(exc)
        status = 1
        if isinstance(exc, trainsan.TrainingBugError):
            f = exc.finding
            print(f"trainsan run: stopped at the first error (policy raise): {f.kind} at step "
                  f"{f.step}; --policy warn or record lets the script go on", file=sys.stderr)
    finally:
        signals.closing()
        pairer.uninstall()
        if children is not None:
            children.uninstall()
    status = _finish(pairer, status, trace, rank, world, children)
    sys.stdout.flush()
    sys.stderr.flush()
    signals.restore()
    if signals.held:
        return 128 + signals.held[0]
    return status
