"""Findings as Python sees them, and the exception and warning the policy's answers map to."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

class TrainingBugError(RuntimeError):
    """Raised by policy ``"raise"`` on the first error-severity finding; ``.finding`` has it."""

    def __init__(self, finding: "Finding"):
        super().__init__(finding.message)
        self.finding = finding


class TrainingBugWarning(UserWarning):
    """Category of the warnings emitted by policy ``"warn"``."""


@dataclasses.dataclass
class Finding:
    """One thing TrainSan found wrong.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    step : int
        0-based optimizer step where it was first seen.
    severity : str
        ``"error"`` or ``"warning"``.
    tensor : str or None
        Parameter or module name, when the finding is about one.
    message : str
        What is wrong and what to look at.
    value : float or None
        The figure that triggered it.
    count : int
        How often it occurred; a repeat is reported once in full, then counted.
    last_step : int
        Step of the latest occurrence.
    """

    kind: str
    step: int
    severity: str
    tensor: Optional[str]
    message: str
    value: Optional[float] = None
    count: int = 1
    last_step: int = 0

    @classmethod
    def _from_tuple(cls, t: Sequence[Any]) -> "Finding":
        kind, step, severity, tensor, message, value, count, last_step = t
        return cls(
            kind=kind,
            step=int(step),
            severity=severity,
            tensor=tensor or None,
            message=message,
            value=None if value is None or math.isnan(value) else float(value),
            count=int(count),
            last_step=int(last_step),
        )

    def __str__(self) -> str:
        return f"[{self.severity}] {self.message}"

