"""The fused statistics pass: one pass over many tensors, one :class:`TensorStats` each."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Optional

import torch

from . import _native

_native.load()

#: Column names of the packed rows, from the op library (kernels/stats.h, Note [Packed row]).
INT_FIELDS, FLOAT_FIELDS = (tuple(c) for c in torch.ops.trainsan.stats_fields())
_OPTIONAL = ("min", "max", "absmax")  # None where no element is finite (NaN in the packed row)
_SUPPORTED = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)


@dataclasses.dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor (see ``docs/statistics.md``).

    Attributes
    ----------
    numel, nan, posinf, neginf, zero, subnormal, fp16_overflow : int
        Exact counts. ``subnormal`` counts nonzero elements below the smallest normal number of
        the tensor's own dtype; ``fp16_overflow`` counts finite elements with ``|x| > 65504``.
    min, max, absmax : float or None
        Over the finite elements only; ``None`` when no element is finite.
    sum, l2 : float
        Sum and Euclidean norm of the finite elements, accumulated in float64 (0 when none).
    hash : int
        Unsigned 64-bit fingerprint of every element's exact bits and logical row-major index,
        independent of memory layout, thread count and reduction order.
    """

    numel: int
    nan: int
    posinf: int
    neginf: int
    zero: int
    subnormal: int
    fp16_overflow: int
    min: Optional[float]
    max: Optional[float]
    absmax: Optional[float]
    sum: float
    l2: float
    hash: int

    @property
    def nonfinite(self) -> int:
        """Number of NaN and ±Inf elements."""
        return self.nan + self.posinf + self.neginf

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check(tensors: object, fn: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            f"{fn}: expected a list of tensors, got a single tensor; wrap it: {fn}([t])"
        )
    if not isinstance(tensors, Iterable):
        raise TypeError(f"{fn}: expected a list of tensors, got {type(tensors).__name__}")
    out = list(tensors)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{fn}: tensors[{i}] is a {type(t).__name__}, not a torch.Tensor"
                + (" (a parameter's .grad is None until backward runs)" if t is None else "")
            )
        if t.layout != torch.strided:
            raise ValueError(
                f"{fn}: tensors[{i}] has layout {t.layout}; only dense tensors are supported, "
                "call .to_dense()"
            )
        if t.is_nested:
            raise ValueError(
                f"{fn}: tensors[{i}] is a nested tensor; pass its components (.unbind()) instead"
            )
        if t.is_quantized:
            raise ValueError(f"{fn}: tensors[{i}] is quantized; call .dequantize() first")
        if t.is_meta:
            raise ValueError(
                f"{fn}: tensors[{i}] is a meta tensor, which holds no data to compute "
                "statistics of"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{fn}: tensors[{i}] is on device {t.device}; only CPU and CUDA tensors are "
                "supported"
            )
        if t.dtype not in _SUPPORTED and not t.is_complex():
            raise TypeError(
                f"{fn}: tensors[{i}] has dtype {t.dtype}, which is not supported (supported: "
                + ", ".join(str(d).replace("torch.", "") for d in _SUPPORTED)
                + ", and complex ones, read as their real and imaginary parts)"
            )
    return out


def _unpack(ints: torch.Tensor, floats: torch.Tensor) -> list[TensorStats]:
    out = []
    for ri, rf in zip(ints.tolist(), floats.tolist()):
        row = dict(zip(INT_FIELDS, ri))
        for k, v in zip(FLOAT_FIELDS, rf):
            row[k] = None if k in _OPTIONAL and math.isnan(v) else v
        row["hash"] &= 0xFFFFFFFFFFFFFFFF
        out.append(TensorStats(**row))
    return out


class PendingStats:
    """Results of :func:`tensor_stats_async`, still on the tensors' devices.

    The packed buffers (``ints`` int64 ``[N, 8]``, ``floats`` float64 ``[N, 5]`` per device) are
    being filled on the current CUDA stream; :meth:`result` waits for them and unpacks.
    """

    def __init__(self, n: int, groups: list[tuple[list[int], torch.Tensor, torch.Tensor]]):
        self._n = n
        self._groups = []
        for idx, ints, floats in groups:
            if ints.is_cuda:
                # Start the device-to-host copy now, into pinned memory, without waiting.
                hi = torch.empty(ints.shape, dtype=ints.dtype, pin_memory=True)
                hf = torch.empty(floats.shape, dtype=floats.dtype, pin_memory=True)
                hi.copy_(ints, non_blocking=True)
                hf.copy_(floats, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._groups.append((idx, hi, hf, event))
            else:
                self._groups.append((idx, ints, floats, None))

    def ready(self) -> bool:
        """True when every result has reached the host (never blocks)."""
        return all(ev is None or ev.query() for _, _, _, ev in self._groups)

    def result(self) -> list[TensorStats]:
        """Wait for the pass and return one :class:`TensorStats` per input tensor, in order."""
        out: list[Optional[TensorStats]] = [None] * self._n
        for idx, ints, floats, ev in self._groups:
            if ev is not None:
                ev.synchronize()
            for i, s in zip(idx, _unpack(ints, floats)):
                out[i] = s
        return out  # type: ignore[return-value]


def _launch(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    launched = []
    for idx in groups.values():
        ints, floats = torch.ops.trainsan.tensor_stats([tensors[i].detach() for i in idx])
        launched.append((idx, ints, floats))
    return launched


def tensor_stats_async(tensors: Iterable[torch.Tensor]) -> PendingStats:
    """Start one fused pass per device over ``tensors`` and return without waiting.

    On CUDA the pass and the copy of its results to pinned host memory are queued on the current
    stream; call :meth:`PendingStats.result` later (e.g. one training step later) to read them.
    """
    ts = _check(tensors, "tensor_stats_async")
    return PendingStats(len(ts), _launch(ts))


def tensor_stats(tensors: Iterable[torch.Tensor]) -> list[TensorStats]:
    """Statistics of every tensor in one fused pass per device.

    Parameters
    ----------
    tensors : iterable of torch.Tensor
        Any mix of dtypes (float32/16, bfloat16, float64, int8/16/32/64, uint8, bool), sizes,
        strides (non-contiguous and expanded views) and devices (CPU, CUDA).

    Returns
    -------
    list of TensorStats
        One per tensor, in order.

    Raises
    ------
    TypeError
        For a non-tensor element or an unsupported dtype, naming the element.
    ValueError
        For a sparse, quantized or meta tensor, or one on an unsupported device.
    """
    ts = _check(tensors, "tensor_stats")
    return PendingStats(len(ts), _launch(ts)).result()


def gradient_stats(tensors: Iterable[torch.Tensor]) -> list[TensorStats]:
    """The every-step tier's pass over ``tensors`` (all on one device): what the sanitizer reads of
    the gradients at every step.

    Only the counts (numel, nan, posinf, neginf, zero, subnormal, fp16_overflow), ``sum``,
    ``l2`` and ``absmax`` are computed, with the same values as :func:`tensor_stats`; ``min`` and
    ``max`` are None and ``hash`` is 0. Blocks until the results are on the host.
    """
    ts = _check(tensors, "gradient_stats")
    ints, floats = torch.ops.trainsan.gradient_stats(ts)
    return _unpack(ints.cpu(), floats.cpu())
