"""Reading TrainSan traces: ``python -m trainsan report`` and ``python -m trainsan diff``."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterator, Optional

from .precision import FORMATS


class TraceError(ValueError):
    """A trace file is missing or malformed; the message names the file and line."""


def read_trace(path: str) -> Iterator[dict]:
    """Yield the records of a JSON Lines trace, checking that it starts with a header."""
    if not os.path.isfile(path):
        raise TraceError(f"trace file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from None
            if not isinstance(rec, dict) or "type" not in rec:
                raise TraceError(f"{path}:{lineno}: a trace record needs a 'type' field")
            if lineno == 1 and rec["type"] != "header":
                raise TraceError(f"{path}:1: a TrainSan trace starts with a header record")
            yield rec


def rank_traces(path: str) -> list:
    """The traces one run wrote: `path` itself if it exists, else the per-rank traces the
    launcher writes under torchrun (``run.jsonl`` -> ``run.rank0.jsonl``, ``run.rank1.jsonl``,
    ...), in rank order; a clear error when there is neither."""
    if os.path.isfile(path):
        return [path]
    stem, ext = os.path.splitext(path)
    found = []
    for p in glob.glob(glob.escape(stem) + ".rank*" + glob.escape(ext)):
        m = re.fullmatch(re.escape(stem) + r"\.rank(\d+)" + re.escape(ext), p)
        if m:
            found.append((int(m.group(1)), p))
    if not found:
        raise TraceError(f"trace file {path!r} does not exist (nor per-rank traces "
                         f"{stem}.rankN{ext})")
    return [p for _, p in sorted(found)]


def load_trace(path: str) -> dict:
    """The records of one trace, by type: ``path``, ``header`` (or None), ``steps``,
    ``findings``, ``summary`` (None: the run ended early), ``amp`` (the AMP-skip records),
    ``scaler`` (every gradient-scaler step), ``ranges`` (precision-headroom counts) and ``notes``
    (what the sanitizer did about its own preconditions under warn/record)."""
    t = {"path": path, "header": None, "steps": [], "findings": [], "summary": None, "amp": [],
         "scaler": [], "ranges": [], "notes": []}
    lists = {"step": "steps", "finding": "findings", "amp_skip": "amp", "scaler": "scaler",
             "range": "ranges", "note": "notes"}
    for rec in read_trace(path):
        kind = rec["type"]
        if kind in ("header", "summary"):
            t[kind] = rec
        elif kind in lists:
            t[lists[kind]].append(rec)
    return t


def _rank_line(t: dict) -> tuple:
    """(one line for this loaded trace, {kind: severity} of its findings)."""
    kinds = {f["kind"]: f.get("severity") for f in t["findings"]}
    first = next((f for f in t["findings"] if f.get("severity") == "error"), None)
    first_error = f"first error: {first['kind']} at step {first.get('step')}" if first else None
    summary = t["summary"]
    done = f"{summary['steps']} steps" if summary else "no summary (ended early)"
    return (f"  {os.path.basename(t['path'])}: {done}, {len(t['steps'])} step records, "
            f"{len(kinds)} distinct kind(s){', ' + first_error if first_error else ''}"), kinds


def _divergence(traces: list) -> list:
    """Where the ranks' replicas first differ: the first rank_desync finding, and from the
    traced fingerprints the first step where a tensor whose fingerprints all ranks shared at the
    first traced step differs (tensors that never agreed — shards — are left out)."""
    lines = []
    firsts = [min((f for f in t["findings"] if f["kind"] == "rank_desync"),
                  key=lambda f: f.get("step") or 0, default=None) for t in traces]
    seen = [(f.get("step") or 0, f["message"]) for f in firsts if f is not None]
    if seen:
        step, msg = min(seen)
        lines.append(f"  first rank_desync: step {step}: {msg[:300]}")
    by_step = []
    for t in traces:
        by_step.append({(r.get("optimizer"), r["step"]): {
            n: v["param"].get("hash") for n, v in (r.get("tensors") or {}).items()
            if v.get("param", {}).get("hash") not in (None, "0")} for r in t["steps"]})
    common = sorted(set.intersection(*(set(b) for b in by_step)), key=lambda k: (k[1], k[0] or 0))
    replicas = None
    for key in common:
        rows = [b[key] for b in by_step]
        names = set.intersection(*(set(r) for r in rows))
        if not names:
            continue
        if replicas is None:  # the first traced step: the tensors all ranks hold alike
            replicas = {n for n in names if len({r[n] for r in rows}) == 1}
            continue
        bad = sorted(n for n in names & replicas if len({r[n] for r in rows}) > 1)
        if bad:
            who = ", ".join(f"rank{k}" for k, r in enumerate(rows) if r[bad[0]] != rows[0][bad[0]])
            lines.append(f"  fingerprints first differ at step {key[1]}: {', '.join(bad[:4])}"
                         f"{' …' if len(bad) > 4 else ''} ({who} differ from rank0's trace)")
            break
    return lines


def report_many(paths: list, png: Optional[str] = None) -> str:
    """The report of each trace of one run (one per rank, or several given), then the ranks side
    by side: a line each, and the finding kinds that only some of them report."""
    if len(paths) == 1:
        return report(paths[0], png)
    if png:
        raise TraceError("--png plots one trace; give one trace file")
    traces = [load_trace(p) for p in paths]
    parts = [_report_text(t, None) for t in traces]
    lines, per = [f"{len(paths)} traces read together:"], []
    for t in traces:
        line, kinds = _rank_line(t)
        lines.append(line)
        per.append(kinds)
    lines += _divergence(traces)
    every = set.intersection(*(set(k) for k in per))
    for kind in sorted(set().union(*per) - every):
        where = [os.path.basename(p) for p, k in zip(paths, per) if kind in k]
        lines.append(f"  {kind}: only in {', '.join(where)}")
    return "\n\n".join(parts + ["\n".join(lines)])


def report(path: str, png: Optional[str] = None) -> str:
    """A text report of one trace; with ``png``, also a plot of the global norms."""
    return _report_text(load_trace(path), png)


def _report_text(t: dict, png: Optional[str]) -> str:
    path, header, steps, findings, summary = (
        t["path"], t["header"], t["steps"], t["findings"], t["summary"])
    amp = len(t["amp"])
    lines = [f"trace {path}"]
    if header:
        lines.append(
            f"  trainsan {header.get('trainsan')}, torch {header.get('torch')}, "
            f"device {header.get('device')}, seed {header.get('seed')}, "
            f"git {header.get('git_commit') or '-'}"
        )
    lines.append(
        f"  {len(steps)} step records"
        + (f", {summary['steps']} steps in all" if summary else " (no summary: the run ended early)")
        + (f", {amp} AMP-skipped steps" if amp else "")
    )
    if steps:
        oh = [s.get("overhead_ms") or 0.0 for s in steps]
        gn = [s["global"].get("grad_norm") for s in steps if s["global"].get("grad_norm")]
        lines.append(
            f"  sanitizer overhead: {sum(oh) / len(oh):.3f} ms per recorded step (max {max(oh):.3f})"
        )
        if gn:
            lines.append(f"  global grad norm: first {gn[0]:.4g}, last {gn[-1]:.4g}, "
                         f"max {max(gn):.4g}")
    if t["scaler"]:
        lines.append("  " + _scaler_line(t["scaler"]))
    if t["ranges"]:
        lines.append("  " + headroom_summary(t["ranges"]))
    for n in t["notes"]:
        lines.append(f"  note at step {n.get('step')}: {n.get('message')}")
    counts = summary.get("findings", {}) if summary else {}
    if findings:
        lines.append(f"  {len(findings)} distinct finding(s):")
        for f in findings:
            n = counts.get(f["kind"])
            lines.append(f"    [{f['severity']}] {f['message']}" + (f" (kind total {n})" if n else ""))
    else:
        lines.append("  no findings")
    if png:
        _plot(steps, png, t["scaler"])
        lines.append(f"  plot written to {png}")
    return "\n".join(lines)


def _scaler_line(recs: list) -> str:
    skipped = [r for r in recs if r.get("skipped")]
    scales = [r["scale"] for r in recs if r.get("scale") is not None]
    out = f"gradient scaler: {len(recs)} steps, {len(skipped)} skipped"
    if scales:
        out += (f"; scale first {scales[0]:.6g}, last {scales[-1]:.6g}, "
                f"min {min(scales):.6g}")
    return out


# -- precision headroom (Note [Precision headroom], precision.py) ----------------------------

HEADROOM_ZERO = 0.001  # a format is safe for a tensor where at most 0.1% of its values round to 0
HEADROOM_SUB = 0.01  # ... at most 1% land in the subnormal range, and none overflows


def _headroom_cells(recs: list) -> dict:
    """format -> (safe, text) over a tensor's sampled records (the worst of each class)."""
    out = {}
    counted = [r for r in recs if r["nonzero"]]
    for fmt in FORMATS:
        ovf = max(r[fmt][2] for r in recs)
        zero = max((r[fmt][0] / r["nonzero"] for r in counted), default=0.0)
        sub = max((r[fmt][1] / r["nonzero"] for r in counted), default=0.0)
        if ovf:
            out[fmt] = (False, f"OVERFLOW {ovf}")
        elif zero > HEADROOM_ZERO:
            out[fmt] = (False, f"{zero * 100:.2g}% to 0")
        elif sub > HEADROOM_SUB:
            out[fmt] = (False, f"{sub * 100:.2g}% subn")
        else:
            out[fmt] = (True, "ok")
    return out


def _by_tensor(ranges: list) -> dict:
    out: dict = {}
    for r in ranges:
        out.setdefault((r["what"], r["tensor"]), []).append(r)
    return out


def headroom_summary(ranges: list) -> str:
    tensors = _by_tensor(ranges)
    steps = sorted({r["step"] for r in ranges})
    safe = {f: 0 for f in FORMATS}
    for recs in tensors.values():
        for f, (ok, _) in _headroom_cells(recs).items():
            safe[f] += ok
    parts = ", ".join(f"{f} {n}/{len(tensors)}" for f, n in safe.items())
    return (f"precision headroom ({len(tensors)} tensors at {len(steps)} sampled step(s)): safe in "
            f"{parts} (python -m trainsan precision <trace> for the table)")


def precision(path: str, what: Optional[str] = None) -> str:
    """The precision-headroom table of a trace: per tensor, whether its values fit each format."""
    ranges = load_trace(path)["ranges"]
    if not ranges:
        raise TraceError(f"{path} holds no precision-headroom records: they are written with a "
                         "trace every headroom_every-th step (default 200, from step 0); was "
                         "headroom_every=0, or did the run end before its first step?")
    tensors = _by_tensor(ranges)
    steps = sorted({r["step"] for r in ranges})
    short = {"float16": "float16", "bfloat16": "bfloat16", "float8_e4m3": "e4m3 (scaled)",
             "float8_e5m2": "e5m2 (scaled)"}
    width = max(len(t) for _, t in tensors) if tensors else 6
    lines = [f"precision headroom of {path}: {len(tensors)} tensors, sampled at step(s) "
             f"{', '.join(map(str, steps[:8]))}{' ...' if len(steps) > 8 else ''}; the worst "
             "sample per tensor",
             "  float16/bfloat16 as autocast casts them; FP8 under per-tensor amax scaling. ok: "
             f"no overflow, <= {HEADROOM_ZERO * 100:g}% rounded to 0, <= {HEADROOM_SUB * 100:g}% "
             "subnormal",
             f"  {'what':<7} {'tensor':<{width}} {'dtype':<9} {'amax':>9} {'NaN/Inf':>8} "
             + " ".join(f"{short[f]:>14}" for f in FORMATS)]
    safe = {f: 0 for f in FORMATS}
    for (kind, name), recs in sorted(tensors.items(), key=lambda kv: (
            ("weight", "grad", "output").index(kv[0][0]) if kv[0][0] in ("weight", "grad",
                                                                         "output") else 3,
            kv[0][1])):
        if what and kind != what:
            continue
        cells = _headroom_cells(recs)
        for f, (ok, _) in cells.items():
            safe[f] += ok
        amax = max(r["amax"] for r in recs)
        bad = max(r["nonfinite"] for r in recs)
        lines.append(f"  {kind:<7} {name:<{width}} {recs[-1]['dtype']:<9} {amax:>9.3g} "
                     f"{bad if bad else '':>8} "
                     + " ".join(f"{cells[f][1]:>14}" for f in FORMATS))
    n = sum(1 for k in tensors if not what or k[0] == what)
    lines.append("  safe: " + ", ".join(f"{f} {safe[f]}/{n}" for f in FORMATS))
    return "\n".join(lines)


def _plot(steps: list, png: str, scaler: Optional[list] = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TraceError("--png needs matplotlib: pip install matplotlib") from None
    xs = [s["step"] for s in steps]
    scaled = [r for r in (scaler or []) if r.get("scale") is not None]
    fig, axes = plt.subplots(2 if scaled else 1, 1, figsize=(8, 6 if scaled else 4),
                             sharex=True, squeeze=False)
    ax = axes[0][0]
    for key in ("grad_norm", "param_norm", "update_norm"):
        ys = [s["global"].get(key) for s in steps]
        ax.plot(xs, [float("nan") if y is None else y for y in ys], label=key)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.legend()
    if scaled:
        sx = axes[1][0]
        # Skips repeat a step number (the step is not taken): spread them by their order.
        order = list(range(len(scaled)))
        sx.step(order, [r["scale"] for r in scaled], where="post", label="scaler scale")
        skips = [i for i, r in enumerate(scaled) if r.get("skipped")]
        sx.plot(skips, [scaled[i]["scale"] for i in skips], "rx", label="skipped")
        sx.set_yscale("log", base=2)
        sx.set_xlabel("scaler step (in order; skips do not advance the optimizer step)")
        sx.legend()
    fig.tight_layout()
    fig.savefig(png)


def diff_runs(path_a: str, path_b: str) -> str:
    """diff of two runs, each one trace or one per rank (rank_traces): rank by rank."""
    a, b = rank_traces(path_a), rank_traces(path_b)
    if len(a) == 1 and len(b) == 1:
        return diff(a[0], b[0])
    if len(a) != len(b):
        raise TraceError(f"{path_a} has {len(a)} trace(s) and {path_b} {len(b)}: compare runs "
                         "with the same number of ranks (or name one trace file each)")
    return "\n".join(f"rank {r}: {diff(x, y)}" for r, (x, y) in enumerate(zip(a, b)))


def diff(path_a: str, path_b: str) -> str:
    """The first step and tensor where two runs' traces differ (by fingerprint)."""
    def steps(path):
        return {r["step"]: r for r in read_trace(path) if r["type"] == "step"}

    a, b = steps(path_a), steps(path_b)
    common = sorted(set(a) & set(b))
    if not common:
        return "no step recorded in both traces"
    numerics = _numeric_divergence(a, b, common)
    # Data or numerics: the first step whose inputs' fingerprints differ, against the first
    # numeric divergence (a step's tensors reflect its own inputs: a data difference at or
    # before it explains it).
    with_inputs = [st for st in common if "inputs" in a[st] and "inputs" in b[st]]

    def data_differs(st) -> str:
        for key, what in (("inputs", "training inputs"), ("targets", "targets")):
            if key in a[st] and key in b[st] and a[st][key] != b[st][key]:
                return f"the {what} differ (fingerprint {a[st][key]} vs {b[st][key]})"
        return ""

    data = next((st for st in with_inputs if data_differs(st)), None)
    if data is not None and (numerics is None or data <= numerics[0]):
        return (f"runs first differ in their data at step {data}: {data_differs(data)} — "
                "data order, "
                "content or augmentation (seed the loader and its workers, restore the "
                "sampler's state)" + (f"; numerics follow from step {numerics[0]}: "
                                      f"{numerics[1]}" if numerics else ""))
    if numerics is None:
        return f"no difference in {len(common)} common steps (steps {common[0]}..{common[-1]})"
    same = (f"; the inputs agree through step {numerics[0]}: the numerics differ, not the data"
            if any(st <= numerics[0] for st in with_inputs) else "")
    return f"runs diverge at step {numerics[0]}: {numerics[1]}{same}"


def _numeric_divergence(a: dict, b: dict, common: list) -> Optional[tuple]:
    """(step, what) of the first tensor whose fingerprint differs; None when none does."""
    for st in common:
        ta, tb = a[st].get("tensors", {}), b[st].get("tensors", {})
        if not ta or not tb:
            if a[st]["global"] != b[st]["global"]:
                return st, ("global statistics differ (trace per-tensor statistics with "
                            "trace_tensors='all' to name the tensor)")
            continue
        for name in sorted(set(ta) | set(tb)):
            if name not in ta or name not in tb:
                return st, f"tensor {name} is in only one trace"
            for part in ("grad", "param"):
                ha = ta[name].get(part, {}).get("hash")
                hb = tb[name].get(part, {}).get("hash")
                if ha != hb:
                    return st, (f"{name}{'.grad' if part == 'grad' else ''} differs (hash {ha} "
                                f"vs {hb})")
    return None
