"""TrainSan: a sanitizer for PyTorch training loops.

``trainsan.tensor_stats(tensors)`` computes, in one fused pass, the statistics every check needs
(NaN/Inf counts, norms, fingerprints) for many tensors at once; see ``shared/DESIGN.md``.
"""

from __future__ import annotations

from .sanitizer import (
    KINDS,
    OPTIONS,
    Finding,
    Sanitizer,
    TrainingBugError,
    TrainingBugWarning,
    attach,
)
from .stats import PendingStats, TensorStats, tensor_stats, tensor_stats_async

__version__ = "0.1.0"

__all__ = [
    "KINDS",
    "OPTIONS",
    "Finding",
    "PendingStats",
    "Sanitizer",
    "TensorStats",
    "TrainingBugError",
    "TrainingBugWarning",
    "attach",
    "cuda_compiled",
    "tensor_stats",
    "tensor_stats_async",
]


def cuda_compiled() -> bool:
    """True when the native library was built with the CUDA kernels."""
    import torch

    return bool(torch.ops.trainsan.cuda_compiled())
