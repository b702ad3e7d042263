"""``python -m trainsan run``: the processes a script starts are checked as ranks of their own
(Note [Launcher children], bindings/trainsan/_children.py).

The scripts (tests/python/launcher/) are written as the public examples are: DDP ranks started
by ``torch.multiprocessing.spawn`` (spawn_ddp.py), Hogwild workers started by
``multiprocessing.Process`` (hogwild.py, fork by default, spawn with --start-method spawn), and a
DataLoader with worker processes (loader_script.py), whose workers must be left alone. Each trains
cleanly by default and plants a bug with ``--bug``: the bug must be found in the process that has
it (its trace ``run.rankN.jsonl``, and the parent's line for that rank), stop the run under policy
raise (the launcher exits 1 naming the kind), and the clean runs stay silent. Every run is a
subprocess of a few seconds.
"""

import functools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import _dist

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher")
DIST = _dist.skip_reason() is None


def _script(name):
    return os.path.join(HERE, name)


# One intra-op thread per process: several processes share the cores.
ENV = dict(os.environ, OMP_NUM_THREADS="1")
if "GLOO_SOCKET_IFNAME" not in ENV and os.path.exists("/sys/class/net/lo"):
    ENV["GLOO_SOCKET_IFNAME"] = "lo"  # as in _dist.py: the loopback always works


def _launch(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=HERE, env=ENV)


def _records(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _summary(path):
    recs = _records(path)
    assert recs[-1]["type"] == "summary", recs[-1]
    return recs[-1]


def _started(n, how):
    return f"the script started {n} processes ({how}), each checked on its own as a rank"


# Hogwild is lock-free by design: another process's step may rewrite the shared weights between a
# forward and its backward. At the defaults inplace_before_backward knows shared-memory parameters
# (Note [Shared-memory parameters], host/checks/autograd.cpp): the runs must stay silent.
LAUNCHES = {
    "hogwild_clean": ["--trace", "{tmp}/hogwild_clean.jsonl", _script("hogwild.py")],
    "hogwild_busy": ["--audit-first-steps", "100", "--trace", "{tmp}/hogwild_busy.jsonl",
                     _script("hogwild.py"), "--processes", "3", "--steps", "40"],
    "hogwild_raise": [_script("hogwild.py"), "--bug", "detach"],
    "hogwild_spawn_record": ["--policy", "record", "--trace",
                             "{tmp}/hogwild_spawn.jsonl", _script("hogwild.py"),
                             "--start-method", "spawn", "--bug", "detach"],
    "fork_after_training": ["--trace", "{tmp}/fork.jsonl", _script("fork_after_training.py")],
    "loader_fork": ["--trace", "{tmp}/loader.jsonl", _script("loader_script.py"), "--epochs", "1",
                    "--context", "fork"],
}
if DIST:
    LAUNCHES.update({
        "ddp_clean": ["--trace", "{tmp}/ddp_clean.jsonl", _script("spawn_ddp.py")],
        "ddp_warn": ["--policy", "warn", "--trace", "{tmp}/ddp_warn.jsonl", _script("spawn_ddp.py"),
                     "--bug", "nan_input"],
        "ddp_raise": [_script("spawn_ddp.py"), "--bug", "nan_input"],
    })
requires_gloo = pytest.mark.skipif(not DIST, reason=_dist.skip_reason() or "")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every launch, two at a time (one per core), when the first test needs them."""
    tmp = str(tmp_path_factory.mktemp("spawned"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {name: pool.submit(_launch, *(a.format(tmp=tmp) for a in args))
                for name, args in LAUNCHES.items()}
        return tmp, {name: run.result() for name, run in runs.items()}


def _assert_silent(r):
    assert r.returncode == 0, r.stdout + r.stderr
    for noise in ("Traceback", "TrainingBugWarning", "finding(s)", "nothing was checked"):
        assert noise not in r.stderr, r.stderr


@requires_gloo
def test_spawn_ddp_clean(launched):
    tmp, runs = launched
    r = runs["ddp_clean"]
    _assert_silent(r)
    assert "rank 0 done" in r.stdout and "rank 1 done" in r.stdout and "done" in r.stdout
    for rank in (0, 1):
        path = os.path.join(tmp, f"ddp_clean.rank{rank}.jsonl")
        summary = _summary(path)
        assert summary["steps"] == 6 and summary["findings"] == {}
        assert f"trainsan run: rank {rank}: 6 steps, no findings ({path})" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(tmp, "ddp_clean.jsonl"))  # the parent trained nothing
    # Rank 0 printed its summary; the parent says where the work ran, not "nothing was checked".
    assert r.stderr.count("trainsan run: DistributedDataParallel with SGD, trace ") == 1
    assert "trainsan run: this process checked nothing: " + _started(
        2, "torch.multiprocessing") in r.stderr, r.stderr


@requires_gloo
def test_spawn_ddp_nan_on_rank_1_found_there(launched):
    tmp, runs = launched
    r = runs["ddp_warn"]
    assert r.returncode == 0, r.stdout + r.stderr
    rank0, rank1 = (_summary(os.path.join(tmp, f"ddp_warn.rank{k}.jsonl")) for k in (0, 1))
    # The NaN batch is rank 1's: its loss at step 2; rank 0 sees it only through the allreduce.
    assert "nonfinite_loss" in rank1["findings"], rank1
    found1 = [rec for rec in _records(os.path.join(tmp, "ddp_warn.rank1.jsonl"))
              if rec["type"] == "finding" and rec["kind"] == "nonfinite_loss"]
    assert found1 and found1[0]["step"] == 2, found1
    assert "nonfinite_grad" in rank0["findings"]
    # The parent's line for rank 1 names its findings, after rank 0's summary.
    line1 = next(line for line in r.stderr.splitlines() if line.startswith("trainsan run: rank 1:"))
    assert "nonfinite_loss" in line1 and "6 steps" in line1, line1
    assert r.stderr.index("trainsan run: DistributedDataParallel with SGD") < r.stderr.index(line1)


@requires_gloo
def test_spawn_ddp_nan_raise_stops_the_run(launched):
    r = launched[1]["ddp_raise"]
    assert r.returncode == 1, r.stdout + r.stderr
    # torch.multiprocessing's ProcessRaisedException, with rank 1's traceback ...
    assert "ProcessRaisedException" in r.stderr, r.stderr
    assert "TrainingBugError: nonfinite_loss at step 2" in r.stderr, r.stderr
    # ... and the launcher's line naming the rank and the finding.
    assert ("trainsan run: rank 1: stopped at the first error (policy raise): nonfinite_loss at "
            "step 2") in r.stderr, r.stderr
    assert "rank 0 done" not in r.stdout and "\ndone" not in r.stdout


def test_hogwild_clean(launched):
    tmp, runs = launched
    r = runs["hogwild_clean"]
    _assert_silent(r)
    assert "process 0: loss" in r.stdout and "process 1: loss" in r.stdout
    assert "test accuracy" in r.stdout
    for rank in (0, 1):
        summary = _summary(os.path.join(tmp, f"hogwild_clean.rank{rank}.jsonl"))
        assert summary["steps"] == 8 and summary["findings"] == {}
    assert r.stderr.count("trainsan run: Net with SGD, trace ") == 1, r.stderr
    assert _started(2, "multiprocessing.Process") in r.stderr, r.stderr
    assert "trainsan run: rank 1: 8 steps, no findings" in r.stderr, r.stderr


def test_hogwild_lock_free_updates_are_not_inplace_writes(launched):
    """Three processes, every step sampled by the saved-tensor check: the other processes' steps
    rewrite the shared weights between a forward and its backward (Hogwild's design), which
    inplace_before_backward must not report (Note [Shared-memory parameters])."""
    tmp, runs = launched
    r = runs["hogwild_busy"]
    _assert_silent(r)
    for rank in (0, 1, 2):
        summary = _summary(os.path.join(tmp, f"hogwild_busy.rank{rank}.jsonl"))
        assert summary["steps"] == 40 and summary["findings"] == {}, summary


def test_hogwild_detach_raise(launched):
    """The script does not look at its processes' exit codes (as the Hogwild example): the
    launcher exits 1 because policy raise stopped them."""
    r = launched[1]["hogwild_raise"]
    assert r.returncode == 1, r.stdout + r.stderr
    assert "TrainingBugError: missing_grad at step 2" in r.stderr, r.stderr
    for rank in (0, 1):
        assert (f"trainsan run: rank {rank}: stopped at the first error (policy raise): "
                "missing_grad at step 2") in r.stderr, r.stderr
    assert "trainsan run: rank 1: pass --trace to see its findings here" in r.stderr
    assert "test accuracy" in r.stdout  # the parent's own code ran on


def test_hogwild_spawn_detach_record(launched):
    """Spawned: each child re-runs the script as __mp_main__ and unpickles the wrapped target."""
    tmp, runs = launched
    r = runs["hogwild_spawn_record"]
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        path = os.path.join(tmp, f"hogwild_spawn.rank{rank}.jsonl")
        summary = _summary(path)
        assert summary["steps"] == 8 and set(summary["findings"]) == {"missing_grad"}, summary
        line = f"trainsan run: rank {rank}: 8 steps, "
        assert line in r.stderr and "missing_grad x" in r.stderr.split(line)[1].split("\n")[0]
    assert "[error] missing_grad at step 2: fc1.weight" in r.stderr  # rank 0's summary


def test_forked_children_leave_the_parents_trace_alone(launched):
    """start_processes with fork after the parent trained: each child drops the sanitizer it
    inherited (without closing it, which would write into the parent's trace) and gets its own."""
    tmp, runs = launched
    r = runs["fork_after_training"]
    assert r.returncode == 0, r.stdout + r.stderr
    types = [rec["type"] for rec in _records(os.path.join(tmp, "fork.jsonl"))]
    assert types.count("header") == 1 and types.count("summary") == 1, types
    assert types.count("step") == 5 and types[-1] == "summary", types  # 3 before, 2 after
    for rank in (0, 1):
        summary = _summary(os.path.join(tmp, f"fork.rank{rank}.jsonl"))
        assert summary["steps"] == 4 and summary["findings"] == {}
    # The parent checked its own model (and says so) and its children.
    assert "trainsan run: Sequential with Adam, trace " in r.stderr, r.stderr
    assert "this process checked nothing" not in r.stderr
    assert "trainsan run: " + _started(2, "torch.multiprocessing") in r.stderr, r.stderr
    assert "rank 1: 4 steps, no findings" in r.stderr


def test_dataloader_workers_are_not_wrapped(launched):
    """Forked DataLoader workers (test_launcher.py runs spawned ones): the launcher's own model
    is checked as before, and no process counts as the script's."""
    tmp, runs = launched
    r = runs["loader_fork"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the script started" not in r.stderr, r.stderr
    assert "trainsan run: Sequential with SGD, trace " in r.stderr and "no findings" in r.stderr
    assert _summary(os.path.join(tmp, "loader.jsonl"))["findings"] == {}
    assert not [f for f in os.listdir(tmp) if f.startswith("loader.rank")]


def test_which_targets_are_the_scripts():
    """Library processes keep their target; the script's functions (in __main__, or a module of
    its own, not installed) are wrapped."""
    import concurrent.futures.process
    import multiprocessing.pool

    import torch.utils.data._utils.worker
    from torch.multiprocessing.spawn import _wrap  # torch.multiprocessing.spawn: the function
    from trainsan import _children

    for target in (torch.utils.data._utils.worker._worker_loop, _wrap,
                   multiprocessing.pool.worker, concurrent.futures.process._process_worker,
                   _children.child_main, json.dumps, print, None):
        assert not _children.is_script_code(target), target
    assert _children.is_script_code(_records)  # this test module: not installed

    def train(rank):
        pass

    train.__module__ = "__main__"
    assert _children.is_script_code(train)
    assert _children.is_script_code(functools.partial(train, 0))
