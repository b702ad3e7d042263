"""TrainSan: a sanitizer for PyTorch training loops.

``trainsan.tensor_stats(tensors)`` computes, in one fused pass, the statistics every check needs
(NaN/Inf counts, norms, fingerprints) for many tensors at once; see ``docs/statistics.md``.
"""

from __future__ import annotations

import os

import torch

from ._attach import attach, attached
from ._findings import Finding, TrainingBugError, TrainingBugWarning
from ._tables import KINDS, OPTIONS, Options
from .attribution import poison_batches, skip_poison
from .checkpoint import CheckpointReport, check_checkpoint
from ._journal import watch_loads
from .sanitizer import Sanitizer
from .stats import PendingStats, TensorStats, gradient_stats, tensor_stats, tensor_stats_async



def _version() -> str:
    """The version written once, in ``project(trainsan VERSION ...)`` of CMakeLists.txt.

    Run from a source tree (``PYTHONPATH=bindings``, an editable install), that file is read, so
    an older installed copy cannot answer for the tree; otherwise the installed metadata (which
    the build took from the same line) answers.
    """
    import os
    import re

    cmake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "CMakeLists.txt")
    try:
        with open(cmake, encoding="utf-8") as fh:
            m = re.search(r"project\(\s*trainsan\s+VERSION\s+([0-9]+(?:\.[0-9]+)*)", fh.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("trainsan")
    except (ImportError, PackageNotFoundError):
        return "0+unknown"


__version__ = _version()

#: Where CMake finds the installed C++ API (``find_package(trainsan CONFIG)``, target
#: ``trainsan::trainsan``) and the torch it was built with: pass it as ``CMAKE_PREFIX_PATH``. It
#: holds both prefixes (";"-separated), so a project that calls ``find_package(Torch)`` before
#: ``find_package(trainsan)`` finds torch from it too.
cmake_prefix_path: str = ";".join([
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "share", "cmake"),
    torch.utils.cmake_prefix_path,
])

__all__ = [
    "CheckpointReport",
    "check_checkpoint",
    "KINDS",
    "OPTIONS",
    "Finding",
    "Options",
    "PendingStats",
    "Sanitizer",
    "TensorStats",
    "TrainingBugError",
    "TrainingBugWarning",
    "attach",
    "attached",
    "cmake_prefix_path",
    "cuda_compiled",
    "poison_batches",
    "skip_poison",
    "tensor_stats",
    "tensor_stats_async",
    "gradient_stats",
    "watch_loads",
]


def cuda_compiled() -> bool:
    """True when the native library was built with the CUDA kernels."""
    import torch

    return bool(torch.ops.trainsan.cuda_compiled())
