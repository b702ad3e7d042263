"""Running a test script, plain or under `python -m trainsan run --policy record`: one helper for
the launcher tests of the resume suites."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run_script(*args: str, launcher: bool = True, env: dict = ENV,
               timeout: float = 180) -> subprocess.CompletedProcess:
    pre = [sys.executable, "-m", "trainsan", "run", "--policy", "record"] if launcher else [
        sys.executable]
    return subprocess.run(pre + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)
