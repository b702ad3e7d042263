"""Running a test script, plain or under `python -m trainsan run --policy record`, and the loop
modules of tests/python/launcher/ (each loop a function of an `attach(model, opt)`) under an
explicit trainsan.attach: the helpers of the launcher-and-attach suites."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import trainsan

LAUNCHER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher")

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run_script(*args: str, launcher: bool = True, env: dict = ENV,
               timeout: float = 180) -> subprocess.CompletedProcess:
    pre = [sys.executable, "-m", "trainsan", "run", "--policy", "record"] if launcher else [
        sys.executable]
    return subprocess.run(pre + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


def load_loops(filename: str) -> ModuleType:
    """The loop module tests/python/launcher/`filename`, imported as the launcher runs it."""
    path = os.path.join(LAUNCHER_DIR, filename)
    spec = importlib.util.spec_from_file_location(os.path.splitext(filename)[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_attached(loop, **options) -> list:
    """Runs `loop(attach)` with every model it attaches watched under policy record (and
    `options`); the findings of all its sanitizers, each closed."""
    sans = []

    def attach(model, opt):
        san = trainsan.attach(model, opt, policy="record", **options)
        sans.append(san)
        return san

    loop(attach)
    findings = []
    for san in sans:
        san.close()
        findings += list(san.findings)
    return findings
