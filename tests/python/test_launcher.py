"""``python -m trainsan run``: unmodified scripts (tests/python/launcher/) run with TrainSan.

Each script trains cleanly by default and plants a bug when given ``--bug``; the launcher must
attach by itself (an optimizer's model, a hand-written update loop, a DataLoader with spawned
workers, DDP under torchrun), stay silent on the clean runs, stop at the bug under policy raise
and report it under record, and leave a complete trace when the script is killed with SIGTERM.
Every run is a subprocess of a few seconds.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import _dist

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher")


def _script(name):
    return os.path.join(HERE, name)


# One intra-op thread per process: several processes (DataLoader workers, ranks) share the cores.
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _launch(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=ENV)


def _records(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _assert_clean(r, model_line):
    assert r.returncode == 0, r.stderr
    assert model_line in r.stderr
    assert "no findings" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def _assert_stopped(r, kind):
    """Policy raise: the script's traceback (launcher frames left out), the finding, exit 1."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"TrainingBugError: {kind} at step" in r.stderr, r.stderr
    assert f"stopped at the first error (policy raise): {kind}" in r.stderr
    assert "launcher.py" not in r.stderr, r.stderr
    assert f"[error] {kind}" in r.stderr  # the summary follows
    assert "done" not in r.stdout


# The launches below are independent: they run two at a time (one per core; each is mostly one
# busy process) when the first test needs them, and each test checks its own.
LAUNCHES = {
    "plain_clean": ["--trace", "{tmp}/run.jsonl", "--grad-explosion-factor", "20",
                    "--no-track-updates", "--checks", "trivial_loss=off,nonfinite_activation=on",
                    _script("plain_loop.py"), "--steps", "12"],
    "plain_raise": [_script("plain_loop.py"), "--bug", "no_zero_grad"],
    "plain_record": ["--policy", "record", _script("plain_loop.py"), "--bug", "no_zero_grad",
                     "--steps", "6"],
    "manual_clean": [_script("manual_loop.py")],
    "manual_raise": [_script("manual_loop.py"), "--bug", "no_zero_grad"],
    # -m: found from the working directory (HERE), which python -m puts on sys.path.
    "loader_clean_module": ["-m", "loader_script", "--epochs", "1"],
    "loader_raise": [_script("loader_script.py"), "--bug", "nan_sample"],
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("launches"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {name: pool.submit(_launch, *(a.format(tmp=tmp) for a in args), cwd=HERE)
                for name, args in LAUNCHES.items()}
        return tmp, {name: run.result() for name, run in runs.items()}


def test_plain_loop_clean_with_options_and_trace(launched):
    tmp, runs = launched
    r = runs["plain_clean"]
    trace = os.path.join(tmp, "run.jsonl")
    _assert_clean(r, "trainsan run: Sequential with Adam, trace " + trace)
    assert "done" in r.stdout and "12 steps, no findings" in r.stderr
    recs = _records(trace)
    header, summary = recs[0], recs[-1]
    assert header["type"] == "header" and summary["type"] == "summary"
    opts = header["options"]
    assert opts["grad_explosion_factor"] == 20 and opts["track_updates"] is False
    assert opts["checks"]["trivial_loss"] is False and opts["checks"]["nonfinite_activation"]
    # The script ran as itself: its own argv, after the launcher's options.
    assert header["argv"] == [_script("plain_loop.py"), "--steps", "12"]
    assert summary["steps"] == 12 and summary["findings"] == {}


def test_plain_loop_bug_raise(launched):
    _assert_stopped(launched[1]["plain_raise"], "stale_grad")


def test_plain_loop_bug_record(launched):
    r = launched[1]["plain_record"]
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout
    assert "6 steps" in r.stderr and "[error] stale_grad at step 1" in r.stderr


def test_manual_loop_clean(launched):
    _assert_clean(launched[1]["manual_clean"],
                  "trainsan run: Regressor with no optimizer (manual mode)")


def test_manual_loop_bug_raise(launched):
    _assert_stopped(launched[1]["manual_raise"], "stale_grad")


def test_dataloader_spawn_workers_clean_as_module(launched):
    """The module's spawned DataLoader workers import it by name as __mp_main__, and the batches
    they send back (a NamedTuple of the module) are found in the parent's __mp_main__."""
    _assert_clean(launched[1]["loader_clean_module"], "trainsan run: Sequential with SGD")


def test_dataloader_spawn_workers_bug_raise(launched):
    """As a path: the workers re-run the file as __mp_main__."""
    _assert_stopped(launched[1]["loader_raise"], "nonfinite_loss")


def test_sigterm_completes_the_trace(tmp_path):
    trace = tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainsan", "run", "--trace", str(trace), _script("plain_loop.py"),
         "--steps", "100000", "--sleep", "0.02"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if trace.exists() and trace.read_text().count('"type":"step"') >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "no findings" in err, err
    recs = _records(trace)
    assert recs[-1]["type"] == "summary" and recs[-1]["steps"] >= 3
    assert "done" not in out


@pytest.mark.skipif(_dist.skip_reason() is not None, reason=_dist.skip_reason() or "")
@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None,
                    reason="torchrun (torch.distributed.run) is not available")
def test_torchrun_ddp_ranks_attach(tmp_path):
    trace = tmp_path / "run.jsonl"
    env = dict(ENV)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # as in _dist.py: the loopback always works
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "trainsan", "run", "--trace", str(trace), _script("ddp_script.py")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    if r.returncode != 0 and "terminate called without an active exception" in r.stderr:
        # A rank that finished (its "done" line printed, its trace complete) sometimes aborts in
        # gloo's teardown at interpreter exit under load (pytorch/pytorch#190489; seen once in a
        # CI run, not reproduced in a dozen runs with or without TrainSan): run once more.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0 done" in r.stdout and "rank 1 done" in r.stdout
    for rank in (0, 1):
        summary = _records(tmp_path / f"run.rank{rank}.jsonl")[-1]
        assert summary["type"] == "summary" and summary["steps"] == 10
        assert summary["findings"] == {}
    # Rank 0 alone prints: its summary and a line for rank 1.
    assert r.stderr.count("trainsan run: DistributedDataParallel with SGD") == 1, r.stderr
    assert "10 steps, no findings" in r.stderr
    assert "trainsan run: rank 1: 10 steps, no findings" in r.stderr, r.stderr


def test_command_line_errors(capsys):
    from trainsan import launcher

    for argv, message in [
        (["--no-such-flag", "x.py"], "unrecognized arguments: --no-such-flag"),
        (["--sy", "x.py"], "unrecognized arguments: --sy"),  # no abbreviations
        (["--policy", "loud", "x.py"], "invalid choice: 'loud'"),
        (["--grad-explosion-factor", "big", "x.py"], "invalid float value: 'big'"),
        (["--checks", "no_such_kind=on", "x.py"], "unknown kind 'no_such_kind'"),
        (["--checks", "stale_grad=maybe", "x.py"], "write stale_grad=on or stale_grad=off"),
        ([], "give the script to run"),
    ]:
        with pytest.raises(SystemExit) as exc:
            launcher.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv
    assert launcher.main([os.path.join(HERE, "no_such_script.py")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert launcher.main(["-m", "no_such_module_here", "x.py"]) == 2
    assert "No module named no_such_module_here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--sync, --no-sync", "--grad-explosion-factor GRAD_EXPLOSION_FACTOR", "--trace",
                 "--checks", "-m MODULE"):
        assert flag in out


def test_script_arguments_are_the_scripts():
    from trainsan import launcher

    _, takes_value = launcher._parser()
    split = launcher._split
    assert split(["--sync", "--trace", "t.jsonl", "s.py", "--sync", "-m", "x"], takes_value) == (
        ["--sync", "--trace", "t.jsonl", "s.py"], ["--sync", "-m", "x"])
    assert split(["--policy=record", "-m", "pkg.mod", "--trace", "a"], takes_value) == (
        ["--policy=record", "-m", "pkg.mod"], ["--trace", "a"])
    assert split(["-mpkg", "a"], takes_value) == (["-mpkg"], ["a"])
    assert split(["--", "-odd-name.py", "a"], takes_value) == (["--", "-odd-name.py"], ["a"])
