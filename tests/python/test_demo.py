"""The README's demo: a clean run has no findings; a planted bug is caught and explained."""

import subprocess
import sys

import pytest

pytest.importorskip("sklearn")


def _demo(*args):
    return subprocess.run(
        [sys.executable, "-m", "trainsan", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_list_bugs():
    r = _demo("--list-bugs")
    assert r.returncode == 0
    for name in ("stale_grad", "skipped_step", "missing_grad", "broadcast", "eval_mode"):
        assert name in r.stdout


def test_clean_run_has_no_findings(tmp_path):
    r = _demo("--epochs", "1", "--trace", str(tmp_path / "t.jsonl"))
    assert r.returncode == 0, r.stderr
    assert "epoch 1/1" in r.stdout and "no findings" in r.stdout


@pytest.mark.parametrize("bug", ["missing_grad", "broadcast"])
def test_planted_bug_is_caught(tmp_path, bug):
    r = _demo("--bug", bug, "--epochs", "1", "--trace", str(tmp_path / "t.jsonl"))
    assert r.returncode == 0, r.stderr
    assert f"kind:     {bug} (error)" in r.stdout
    assert "raised in the training loop at demo.py:" in r.stdout
