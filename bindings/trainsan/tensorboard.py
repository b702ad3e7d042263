"""TensorBoard export of a trace: ``python -m trainsan tensorboard run.jsonl --logdir DIR``.

Writes, per step record, the global figures (``global/grad_norm``, ``param_norm``,
``update_norm``, ``update_ratio``, ``nonfinite_grad``) and the loss (``global/loss``),
TrainSan's own time (``trainsan/overhead_ms``), the per-tensor figures the record holds
(``grad_norm/<tensor>``, ``param_norm/<tensor>``, ``update_ratio/<tensor>`` = ‖Δθ‖/‖θ‖,
``nonfinite_grad/<tensor>``, the number of NaN/±Inf gradient elements), the AMP skips
(``amp/skipped``: 1 at each skipped step), and every finding as text (``findings``) at its
step, with the run's provenance header as text at step 0 (``header``). Needs the
``tensorboard`` package (``torch.utils.tensorboard``).
Several traces (one per rank) go to one sub-directory each, named after the file.

The step records are read as report.load_trace merges them (late per-tensor records into their
steps). A value a step record does not hold is not written: per-tensor series have no point at
the steps without per-tensor rows, and the update figures none at steps without update
statistics (rather than a zero).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .report import TraceError, load_trace

_GLOBAL = ("grad_norm", "param_norm", "update_norm", "update_ratio")


def _writer(logdir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard not installed
        raise TraceError(
            "TensorBoard export needs the tensorboard package: pip install tensorboard "
            f"({exc})"
        ) from None
    return SummaryWriter(log_dir=logdir)


def _nonfinite(stats: Optional[dict]) -> Optional[int]:
    if not stats:
        return None
    return int(stats.get("nan", 0)) + int(stats.get("posinf", 0)) + int(stats.get("neginf", 0))


def _value(v) -> Optional[float]:
    """A number to write, or None (absent, null or not a number): nothing is written."""
    return float(v) if isinstance(v, (int, float)) else None


def export(path: str, logdir: str) -> dict:
    """Write the TensorBoard events of one trace into `logdir`; returns counts of what was
    written ({"steps", "scalars", "findings", "amp_skips"})."""
    t = load_trace(path)  # validated before anything is written
    os.makedirs(logdir, exist_ok=True)
    w = _writer(logdir)
    counts = {"steps": 0, "scalars": 0, "findings": 0, "amp_skips": 0}

    def scalar(tag: str, value, step: int) -> None:
        value = _value(value)
        if value is None:
            return
        w.add_scalar(tag, value, step)
        counts["scalars"] += 1

    try:
        if t["header"] is not None:
            w.add_text("header", "```\n" + json.dumps(t["header"], indent=1) + "\n```", 0)
        for rec in t["steps"]:
            step = int(rec["step"])
            counts["steps"] += 1
            g = rec.get("global") or {}
            for name in _GLOBAL:
                if name in ("update_norm", "update_ratio") and rec.get("update_stats") is False:
                    continue  # not measured at this step
                scalar(f"global/{name}", g.get(name), step)
            if "nonfinite_grad" in g:
                scalar("global/nonfinite_grad", int(bool(g["nonfinite_grad"])), step)
            scalar("global/loss", rec.get("loss"), step)
            scalar("trainsan/overhead_ms", rec.get("overhead_ms"), step)
            for name, ts in (rec.get("tensors") or {}).items():
                grad, param, upd = ts.get("grad"), ts.get("param"), ts.get("update")
                if grad:
                    scalar(f"grad_norm/{name}", grad.get("l2"), step)
                    scalar(f"nonfinite_grad/{name}", _nonfinite(grad), step)
                if param:
                    scalar(f"param_norm/{name}", param.get("l2"), step)
                u = _value((upd or {}).get("l2"))
                p = _value((param or {}).get("l2"))
                if u is not None and p:
                    scalar(f"update_ratio/{name}", u / p, step)
        for rec in t["amp"]:
            counts["amp_skips"] += 1
            scalar("amp/skipped", 1, int(rec["step"]))
        for rec in t["scaler"]:
            scalar(f"amp/scale/{rec.get('optimizer', 0)}", rec.get("scale"), int(rec["step"]))
        for rec in t["findings"]:
            counts["findings"] += 1
            text = f"**[{rec.get('severity')}] {rec.get('kind')}** {rec.get('message', '')}"
            w.add_text("findings", text, int(rec.get("step") or 0))
    finally:
        w.close()
    return counts


def export_many(paths: list, logdir: str) -> str:
    """Export one or several traces (several: a sub-directory each); a line per trace."""
    lines = []
    for p in paths:
        sub = logdir
        if len(paths) > 1:
            sub = os.path.join(logdir, os.path.splitext(os.path.basename(p))[0])
        c = export(p, sub)
        lines.append(
            f"{p} -> {sub}: {c['steps']} step records, {c['scalars']} scalars, "
            f"{c['findings']} findings, {c['amp_skips']} AMP skips"
        )
    return "\n".join(lines)
