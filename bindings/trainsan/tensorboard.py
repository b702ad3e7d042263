"""TensorBoard export of a trace: ``python -m trainsan tensorboard run.jsonl --logdir DIR``.

Writes, per step record, the global figures (``global/grad_norm``, ``param_norm``,
``update_norm``, ``update_ratio``, ``nonfinite_grad``), TrainSan's own time
(``trainsan/overhead_ms``), the per-tensor figures the record holds (``grad_norm/<tensor>``,
``param_norm/<tensor>``, ``update_ratio/<tensor>`` = ‖Δθ‖/‖θ‖, ``nonfinite_grad/<tensor>``, the
number of NaN/±Inf gradient elements), the AMP skips (``amp/skipped``: 1 at each skipped step),
and every finding as text (``findings``) at its step, with the run's provenance header as text
at step 0 (``header``). Needs the ``tensorboard`` package (``torch.utils.tensorboard``).
Several traces (one per rank) go to one sub-directory each, named after the file.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .report import TraceError, read_trace

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


def export(path: str, logdir: str) -> dict:
    """Write the TensorBoard events of one trace into `logdir`; returns counts of what was
    written ({"steps", "scalars", "findings", "amp_skips"})."""
    records = list(read_trace(path))  # validated before anything is written
    os.makedirs(logdir, exist_ok=True)
    w = _writer(logdir)
    counts = {"steps": 0, "scalars": 0, "findings": 0, "amp_skips": 0}

    def scalar(tag: str, value, step: int) -> None:
        if value is None:
            return
        w.add_scalar(tag, float(value), step)
        counts["scalars"] += 1

    try:
        for rec in records:
            t = rec["type"]
            if t == "header":
                w.add_text("header", "```\n" + json.dumps(rec, indent=1) + "\n```", 0)
            elif t == "step":
                step = int(rec["step"])
                counts["steps"] += 1
                g = rec.get("global") or {}
                for name in _GLOBAL:
                    scalar(f"global/{name}", g.get(name), step)
                if "nonfinite_grad" in g:
                    scalar("global/nonfinite_grad", int(bool(g["nonfinite_grad"])), step)
                scalar("trainsan/overhead_ms", rec.get("overhead_ms"), step)
                for name, ts in (rec.get("tensors") or {}).items():
                    grad, param, upd = ts.get("grad"), ts.get("param"), ts.get("update")
                    if grad:
                        scalar(f"grad_norm/{name}", grad.get("l2"), step)
                        scalar(f"nonfinite_grad/{name}", _nonfinite(grad), step)
                    if param:
                        scalar(f"param_norm/{name}", param.get("l2"), step)
                    if upd and param and param.get("l2"):
                        scalar(f"update_ratio/{name}", upd["l2"] / param["l2"], step)
            elif t == "amp_skip":
                counts["amp_skips"] += 1
                scalar("amp/skipped", 1, int(rec["step"]))
            elif t == "scaler":
                scalar(f"amp/scale/{rec.get('optimizer', 0)}", rec.get("scale"), int(rec["step"]))
            elif t == "finding":
                counts["findings"] += 1
                text = f"**[{rec.get('severity')}] {rec.get('kind')}** {rec.get('message', '')}"
                w.add_text("findings", text, int(rec.get("step", 0)))
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
