"""Findings as Python sees them, and the exception and warning the policy's answers map to."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

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
    reproduces : bool or None
        Re-run attribution (option ``rerun_on_error``): whether a re-run of the step from its
        saved inputs, RNG state and buffers reproduced it (a data or code fault) or not (a
        transient fault); None when not re-run or the re-run could not tell.
    """

    kind: str
    step: int
    severity: str
    tensor: Optional[str]
    message: str
    value: Optional[float] = None
    count: int = 1
    last_step: int = 0
    reproduces: Optional[bool] = None

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any]) -> "Finding":
        """A finding as the op library reports it: trainsan::Finding by field name (its table,
        host/include/trainsan/finding.def, has this class's fields; tests/python/
        test_facts_seam.py pins them). An empty tensor is None, and so is a NaN value."""
        f = dict(d)
        value = f.get("value")
        f["tensor"] = f.get("tensor") or None
        f["value"] = None if value is None or math.isnan(value) else float(value)
        return cls(**f)

    def __str__(self) -> str:
        return f"[{self.severity}] {self.message}"


def merge_findings(before: list, now: list) -> list:
    """Findings before a re-binding and after it, one per kind and tensor (the first seen, with
    the counts added and the latest step); new Finding objects."""
    out = [dataclasses.replace(f) for f in before]
    index = {(f.kind, f.tensor): f for f in out}
    for f in now:
        e = index.get((f.kind, f.tensor))
        if e is None:
            out.append(dataclasses.replace(f))
            index[(f.kind, f.tensor)] = out[-1]
        else:
            e.count += f.count
            e.last_step = max(e.last_step, f.last_step)
    return out


def summary_text(step: int, findings: list, c: dict) -> str:
    """Sanitizer.summary(): the findings, what was checked (coverage `c`), what was not."""
    if not findings:
        lines = [f"trainsan: {step} steps, no findings"]
    else:
        lines = [f"trainsan: {step} steps, {len(findings)} distinct finding(s):"]
    for f in findings:
        rep = f" (x{f.count}, last at step {f.last_step})" if f.count > 1 else ""
        lines.append(f"  [{f.severity}] {f.message}{rep}")
    period = c["update_period"]
    lines.append(
        f"  checked: {c['steps_checked']} step(s) ({c['update_steps']} with update statistics"
        + (f", now every {period}th" if period > 1 else "")
        + f"), {c['training_forwards']} training forward(s), {c['losses_checked']} loss(es), "
        f"inputs at {c['inputs_fingerprinted']} step(s), {c['audited_forwards']} audited "
        f"forward(s) ({c['ops_audited']} ops)"
    )
    n, k = c.get("window_declared", 0), c.get("window_backwards", 0)
    if c.get("windows", 0) and (k > 1 or n > 1):
        samples = c.get("window_samples", -1)
        batch = f", effective batch {samples}" if samples >= 0 else ""
        lines.append(
            f"  accumulation: {c['window_steps']} of {c['windows']} optimizer step(s) followed "
            f"{k} backward passes{batch} ("
            + (f"declared: accumulation_steps={n})" if n > 0 else
               f"not declared: accumulation_steps={k} would check the window)")
        )
    for kind, why in c["unchecked"].items():
        lines.append(f"  not checked: {kind}: {why}")
    if c.get("fault"):
        lines.append(f"  stopped: {c['fault']}")
    if c.get("unread"):
        lines.append("  not read: " + ", ".join(c["unread"]) + " (a dtype the statistics pass "
                     "does not read: no value check covers them)")
    if c.get("trace_error"):
        lines.append(f"  trace: {c['trace_error']}")
    for o in c["outside_model"]:
        shapes = ", ".join(str(x) for x in o["shapes"]) + (", ..." if o["count"] > 3 else "")
        lines.append(f"  not checked: {o['count']} of the {o['of']} parameter(s) of optimizer "
                     f"{o['optimizer']} ({o['type']}; shapes {shapes}): {o['why']}")
    for note in c.get("notes", ()):
        lines.append(f"  note: {note}")
    return "\n".join(lines)
