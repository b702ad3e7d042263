"""Loads the native op library (``libtrainsan_ops.so``) into ``torch.ops.trainsan``.

The library is looked up, in order, at ``$TRAINSAN_LIBRARY`` and next to this file. It links
torch's own libraries, so ``import torch`` must come first (it does, below).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIB_NAME = "libtrainsan_ops.so"
_loaded_from: str | None = None


def _candidates() -> list[Path]:
    env = os.environ.get("TRAINSAN_LIBRARY")
    paths = [Path(env)] if env else []
    paths.append(Path(__file__).resolve().parent / _LIB_NAME)
    return paths


def load() -> str:
    """Load the op library once and return the path it was loaded from."""
    global _loaded_from
    if _loaded_from is not None:
        return _loaded_from
    tried = []
    for path in _candidates():
        if not path.is_file():
            tried.append(f"{path} (missing)")
            continue
        try:
            torch.ops.load_library(str(path))
        except OSError as exc:  # ABI or torch-version mismatch, missing CUDA runtime, ...
            raise ImportError(
                f"trainsan: could not load its native library {path}: {exc}\n"
                f"It was built against another torch than the one imported "
                f"({torch.__version__}, {torch.__file__})? Rebuild it with "
                f"`pip install --no-build-isolation .` in this environment."
            ) from exc
        _loaded_from = str(path)
        return _loaded_from
    raise ImportError(
        "trainsan: its native library was not found; tried: "
        + "; ".join(tried)
        + ". Install the package with `pip install --no-build-isolation .` from the TrainSan "
        "checkout, or point $TRAINSAN_LIBRARY at a built libtrainsan_ops.so."
    )
