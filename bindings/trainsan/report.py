"""Reading TrainSan traces: ``python -m trainsan report`` and ``python -m trainsan diff``."""

from __future__ import annotations

import glob
import json
import math
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
    (what the sanitizer did about its own preconditions under warn/record).

    ``steps`` holds the step records only, in file order. A late per-tensor record
    (``{"type":"tensors",...}``: the rows of an earlier step, written when a finding was made) is
    merged into the step record of the same (optimizer, step), which then carries its ``tensors``
    and ``rows``; a step record that already has rows keeps its own. ``late_rows`` counts the late
    records merged, ``unmatched_rows`` lists the (optimizer, step) of those whose step record is
    not in this file (after a rotation it is in ``<path>.1``). Every reader of step records goes
    through this merge."""
    t = {"path": path, "header": None, "steps": [], "findings": [], "summary": None, "amp": [],
         "scaler": [], "ranges": [], "notes": [], "late_rows": 0, "unmatched_rows": []}
    lists = {"step": "steps", "finding": "findings", "amp_skip": "amp", "scaler": "scaler",
             "range": "ranges", "note": "notes"}
    late = []
    for rec in read_trace(path):
        kind = rec["type"]
        if kind in ("header", "summary"):
            t[kind] = rec
        elif kind in lists:
            t[lists[kind]].append(rec)
        elif kind == "tensors":
            late.append(rec)
    # Merged after the whole file is read, so that the order of the two records does not matter.
    by_key = {}
    for s in t["steps"]:
        by_key.setdefault((s.get("optimizer"), s.get("step")), s)
    for rec in late:
        s = by_key.get((rec.get("optimizer"), rec.get("step")))
        if s is None:
            t["unmatched_rows"].append((rec.get("optimizer"), rec.get("step")))
            continue
        if not s.get("tensors") and rec.get("tensors"):
            t["late_rows"] += 1
            s["tensors"] = rec["tensors"]
            s["rows"] = rec.get("rows", "before_finding")
    return t


def has_rows(step: dict) -> bool:
    """Whether a (merged) step record carries per-tensor rows."""
    return bool(step.get("tensors"))


def earlier_part(path, header: Optional[dict]) -> Optional[str]:
    """The file the earlier part of the trace at `path` is in (``<path>.1``, trace_max_mb's
    rotation), or None: `header` (its first record) is not that of a rotation."""
    rotated = isinstance(header, dict) and header.get("type") == "header" and header.get("rotated")
    return f"{os.fspath(path)}.1" if rotated else None


def rotated_from(t: dict) -> Optional[str]:
    """earlier_part of a loaded trace."""
    return earlier_part(t["path"], t["header"])


def trace_error(t: dict) -> Optional[str]:
    """The summary's ``coverage.trace_error``: why writing the trace failed mid-run, or None."""
    cov = (t["summary"] or {}).get("coverage")
    err = cov.get("trace_error") if isinstance(cov, dict) else None
    return str(err) if err else None


def _rows_line(t: dict) -> str:
    """How many step records of a loaded trace carry per-tensor rows, and why, in words."""
    steps = t["steps"]
    with_rows = [s for s in steps if has_rows(s)]
    out = f"{len(with_rows)} of {len(steps)} step records with per-tensor rows"
    why: dict = {}
    for s in with_rows:
        why[s.get("rows")] = why.get(s.get("rows"), 0) + 1
    if any(w is not None for w in why):
        out += " (" + ", ".join(f"{n} {w or 'unmarked'}" for w, n in why.items()) + ")"
    if t["late_rows"]:
        out += f"; {t['late_rows']} late per-tensor record(s) merged into their steps"
    if t["unmatched_rows"]:
        out += (f"; {len(t['unmatched_rows'])} late per-tensor record(s) of steps not in this "
                "file")
    cov = (t["summary"] or {}).get("coverage")
    n = cov.get("trace_rows_steps") if isinstance(cov, dict) else None
    if n is not None and n != len(with_rows):
        out += f"; the summary counts {n} over the whole run"
    return out


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
            n: _part(v, "param").get("hash") for n, v in (r.get("tensors") or {}).items()
            if _part(v, "param").get("hash") not in (None, "0")} for r in t["steps"]})
    common = sorted(set.intersection(*(set(b) for b in by_step)), key=lambda k: (k[1], k[0] or 0))
    replicas, last = None, None
    for key in common:
        rows = [b[key] for b in by_step]
        names = set.intersection(*(set(r) for r in rows))
        if not names:  # a step without per-tensor rows (or without parameter fingerprints)
            continue
        if replicas is None:  # the first traced step: the tensors all ranks hold alike
            replicas = {n for n in names if len({r[n] for r in rows}) == 1}
            last = key
            continue
        bad = sorted(n for n in names & replicas if len({r[n] for r in rows}) > 1)
        if bad:
            who = ", ".join(f"rank{k}" for k, r in enumerate(rows) if r[bad[0]] != rows[0][bad[0]])
            # Per-tensor rows are written on some steps only: say so where steps between the
            # last step compared and this one had no fingerprints (it may have begun there).
            unseen = any(last[1] < k[1] < key[1] for k in common)
            lines.append(f"  fingerprints first differ at step {key[1]}: {', '.join(bad[:4])}"
                         f"{' …' if len(bad) > 4 else ''} ({who} differ from rank0's trace)"
                         + (f"; no step between step {last[1]} (where they agreed) and this one "
                            "has parameter fingerprints in per-tensor rows" if unseen else ""))
            break
        last = key
    return lines


def _part(row, part: str) -> dict:
    """One part ("param", "grad", "update") of a per-tensor row; {} where it is absent or null
    (values measured less often are null on some steps)."""
    v = row.get(part) if isinstance(row, dict) else None
    return v if isinstance(v, dict) else {}


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
    err = trace_error(t)
    if err:
        lines.append(f"  TRACE INCOMPLETE: writing the trace failed during the run ({err}); the "
                     "records after the failure are missing, so what follows is partial")
    earlier = rotated_from(t)
    if earlier:
        k = (header or {}).get("rotated")
        lines.append(f"  this trace continues {earlier} (rotation {k}, trace_max_mb): the steps "
                     f"before this file's first are there"
                     + ("" if os.path.isfile(earlier) else ", which does not exist")
                     + ("; older parts were replaced by later rotations" if isinstance(k, int)
                        and not isinstance(k, bool) and k > 1 else ""))
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
        lines.append("  " + _rows_line(t))
        oh = [s.get("overhead_ms") or 0.0 for s in steps]
        gn = [g for g in (_global(s).get("grad_norm") for s in steps) if g]
        losses = [s["loss"] for s in steps if _finite(s.get("loss"))]
        lines.append(
            f"  sanitizer overhead: {sum(oh) / len(oh):.3f} ms per recorded step (max {max(oh):.3f})"
        )
        if gn:
            lines.append(f"  global grad norm: first {gn[0]:.4g}, last {gn[-1]:.4g}, "
                         f"max {max(gn):.4g}")
        if losses:
            lines.append(f"  loss: first {losses[0]:.4g}, last {losses[-1]:.4g}, "
                         f"min {min(losses):.4g} ({len(losses)} step records with a loss)")
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


def _global(s: dict) -> dict:
    g = s.get("global")
    return g if isinstance(g, dict) else {}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
        ys = [_plotted(s, key) for s in steps]
        # NaN breaks the line at a step without the value (update statistics are measured on
        # some steps only, parameter norms may be null); a point with no measured neighbour is
        # drawn as a marker, since a line of one point does not show.
        (line,) = ax.plot(xs, ys, label=key)
        alone = [i for i, y in enumerate(ys) if y == y and (i == 0 or ys[i - 1] != ys[i - 1])
                 and (i == len(ys) - 1 or ys[i + 1] != ys[i + 1])]
        if alone:
            ax.plot([xs[i] for i in alone], [ys[i] for i in alone], ".",
                    color=line.get_color())
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


def _plotted(s: dict, key: str) -> float:
    """A global figure of a step record for a log-scale plot: NaN (a gap) where it was not
    measured (null, or update statistics off at that step) or is not positive."""
    if key in ("update_norm", "update_ratio") and s.get("update_stats") is False:
        return float("nan")
    v = _global(s).get(key)
    return float(v) if _finite(v) and v > 0 else float("nan")


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
    """The first step and tensor where two runs' traces differ (by fingerprint). Where both
    traces have per-tensor rows at a step, the tensors' fingerprints are compared; elsewhere the
    step's global figures (its gradient-statistics ``digest`` first, where both have one). A
    difference found in the global figures only is named by step, and the first tensor that
    differs at a later step with rows in both traces is named as seen there."""
    ta, tb = load_trace(path_a), load_trace(path_b)
    a, b = _by_key(ta["steps"]), _by_key(tb["steps"])
    common = sorted(set(a) & set(b), key=lambda k: (k[1], k[0] or 0))
    if not common:
        return "no step recorded in both traces" + _caveats(ta, tb)
    numerics = _numeric_divergence(a, b, common)
    # Data or numerics: the first step whose inputs' fingerprints differ, against the first
    # numeric divergence (a step's tensors reflect its own inputs: a data difference at or
    # before it explains it).
    with_inputs = [k for k in common if "inputs" in a[k] and "inputs" in b[k]]

    def data_differs(k) -> str:
        for key, what in (("inputs", "training inputs"), ("targets", "targets")):
            if key in a[k] and key in b[k] and a[k][key] != b[k][key]:
                return f"the {what} differ (fingerprint {a[k][key]} vs {b[k][key]})"
        return ""

    data = next((k for k in with_inputs if data_differs(k)), None)
    if data is not None and (numerics is None or data[1] <= numerics[0]):
        return (f"runs first differ in their data at step {data[1]}: {data_differs(data)} — "
                "data order, "
                "content or augmentation (seed the loader and its workers, restore the "
                "sampler's state)" + (f"; numerics follow from step {numerics[0]}: "
                                      f"{numerics[1]}" if numerics else "")
                + _caveats(ta, tb))
    if numerics is None:
        steps = sorted({k[1] for k in common})
        return (f"no difference in {len(steps)} common steps (steps {steps[0]}..{steps[-1]})"
                + _caveats(ta, tb))
    same = (f"; the inputs agree through step {numerics[0]}: the numerics differ, not the data"
            if any(k[1] <= numerics[0] for k in with_inputs) else "")
    return f"runs diverge at step {numerics[0]}: {numerics[1]}{same}" + _caveats(ta, tb)


def _by_key(steps: list) -> dict:
    """(optimizer, step) -> the step record (the first of a repeated key, as load_trace merges)."""
    out: dict = {}
    for s in steps:
        if s.get("step") is not None:
            out.setdefault((s.get("optimizer"), s["step"]), s)
    return out


def _caveats(*traces: dict) -> str:
    """What limits a comparison of these traces: a rotated trace (its earlier steps are in
    another file, not compared) or a trace whose writing failed mid-run."""
    out = []
    for t in traces:
        name = os.path.basename(t["path"])
        if rotated_from(t):
            out.append(f"{name} continues {os.path.basename(rotated_from(t))}: its earlier steps "
                       "are not compared")
        if trace_error(t):
            out.append(f"writing {name} failed during the run ({trace_error(t)}): its later "
                       "steps are missing")
    return "".join(f" (note: {x})" for x in out)


_UPDATE_KEYS = ("update_norm", "update_ratio", "changed")


def _global_difference(sa: dict, sb: dict) -> str:
    """How two step records' global figures differ ("" where they agree): the digest of the
    gradient statistics first, where both have one, then the figures both records hold (update
    figures only where both measured update statistics)."""
    ga, gb = _global(sa), _global(sb)
    da, db = ga.get("digest"), gb.get("digest")
    if da is not None and db is not None and da != db:
        return f"the gradient statistics differ (digest {da} vs {db})"
    no_update = sa.get("update_stats") is False or sb.get("update_stats") is False
    # A figure not measured at a step (null: the parameters are read on sampled steps only) is
    # not compared there.
    keys = [k for k in ga if k in gb and k != "digest" and ga[k] != gb[k]
            and ga[k] is not None and gb[k] is not None
            and not (no_update and k in _UPDATE_KEYS)]
    if not keys:
        return ""
    shown = ", ".join(f"{k} {ga[k]} vs {gb[k]}" for k in keys[:3])
    return f"global statistics differ ({shown}{', …' if len(keys) > 3 else ''})"


def _tensor_difference(ta: dict, tb: dict) -> str:
    """The first tensor (by name) whose fingerprint differs between two steps' per-tensor rows,
    in words; "" where none does. A parameter fingerprint is compared where both rows hold one
    (parameter statistics are measured on some steps only)."""
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb:
            return f"tensor {name} is in only one trace"
        for part in ("grad", "param"):
            ha, hb = _part(ta[name], part).get("hash"), _part(tb[name], part).get("hash")
            if part == "param" and (ha is None or hb is None):
                continue
            if ha != hb:
                return f"{name}{'.grad' if part == 'grad' else ''} differs (hash {ha} vs {hb})"
    return ""


def _numeric_divergence(a: dict, b: dict, common: list) -> Optional[tuple]:
    """(step, what) of the first common step whose statistics differ; None when none does.

    At a step with per-tensor rows in both traces, what names the first tensor whose fingerprint
    differs. At other steps (per-tensor rows are written on some steps only) the global figures
    are compared, and what then adds the first tensor that differs at a later step with rows in
    both traces, said to be seen there: it may have begun differing at an earlier step."""
    for i, key in enumerate(common):
        sa, sb = a[key], b[key]
        rows = has_rows(sa) and has_rows(sb)
        if rows:
            what = _tensor_difference(sa["tensors"], sb["tensors"])
            if what:
                return key[1], what
        what = _global_difference(sa, sb)
        if what:
            if rows:  # the rows agree: the difference is in tensors they do not hold
                what += " in tensors outside this step's per-tensor rows"
            return key[1], what + _later_tensor(a, b, common[i + 1:])
    return None


def _later_tensor(a: dict, b: dict, later: list) -> str:
    """The words naming the first tensor that differs at a later common step with per-tensor
    rows in both traces, or saying that none could be named."""
    compared = 0
    for key in later:
        if has_rows(a[key]) and has_rows(b[key]):
            compared += 1
            what = _tensor_difference(a[key]["tensors"], b[key]["tensors"])
            if what:
                return (f"; first differing tensor seen at step {key[1]}: {what} (the first later "
                        "step with per-tensor rows in both traces where a tensor differs; it may "
                        "have begun differing earlier, at steps without rows)")
    if compared:
        return (f"; the per-tensor rows of the {compared} later step(s) that have them in both "
                "traces agree, so no tensor can be named")
    return ("; no later step has per-tensor rows in both traces to name the tensor (see the "
            "options trace_rows_every and trace_tensors)")
