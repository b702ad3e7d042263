"""A self-contained HTML report of TrainSan traces: ``python -m trainsan report T --html P``.

One page, no network: no scripts, no external fonts or style sheets; the plots are inline SVG
drawn here (no matplotlib). Per trace, what went wrong first: a line on the trace (and a banner
where writing it failed mid-run, or where it continues a rotated file), the findings (a table
coloured by severity under the first error, and a timeline), the loss over steps with each
finding marked at its step, the global norms and the update ratio over steps (log scale),
per-layer heat maps (tensor x step) of the gradient norm and of the update ratio (update.l2 /
param.l2) from the step records that carry per-tensor rows, the summary's coverage, and last the
provenance (the header's fields) folded in a closed ``<details>``.

Non-finite or missing values (the trace writes ``null`` for NaN/Inf, and a value measured on some
steps only is null or, for update statistics, off on the others) are gaps: a line breaks there,
and a value with no measured neighbour is drawn as a dot. A trace without per-tensor statistics,
without step records or without a summary (the run ended early) gets a note in place of what it
lacks. All text is escaped.
"""

from __future__ import annotations

import html
import json
import math
import os
from typing import Optional

from .report import has_rows, load_trace, rotated_from, trace_error

_SEVERITY_COLOURS = {"error": "#d62728", "warning": "#ff7f0e", "info": "#1f77b4"}
_SEVERITY_TINTS = {"error": "#fdecea", "warning": "#fff3e0", "info": "#e8f1fa"}
_SERIES_COLOURS = {"grad_norm": "#1f77b4", "param_norm": "#2ca02c", "update_norm": "#9467bd",
                   "update_ratio": "#d62728", "loss": "#333333"}
# viridis at 0, .25, .5, .75, 1
_PALETTE = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]
_MISSING = "#e6e6e6"
_MAX_POINTS = 4000   # line charts: more points than this are thinned (Note [Thinned lines])
_MAX_COLUMNS = 400   # heat maps: more steps than this are binned (max per bin)
_MAX_ROWS = 300      # heat maps: more tensors than this are cut (noted on the page)

_CSS = """
body{font-family:sans-serif;margin:1.5em;color:#222;background:#fff}
h1{font-size:1.5em}h2{font-size:1.25em;border-bottom:2px solid #888;margin-top:2em}
h3{font-size:1.05em;margin-top:1.5em}
table{border-collapse:collapse;font-size:.85em;margin:.3em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f2f2f2}td.k{font-weight:bold;white-space:nowrap}
.note{color:#666;font-style:italic}.sev{font-weight:bold}
.msg{max-width:70em}svg{display:block;margin:.3em 0}
code{word-break:break-all}
.alert{border:2px solid #d62728;background:#fdecea;padding:.4em .8em;margin:.5em 0;font-weight:bold}
.rotated{border-left:4px solid #1f77b4;background:#e8f1fa;padding:.3em .8em;margin:.5em 0}
.first-error{border:2px solid #d62728;background:#fdecea;padding:.5em .8em;margin:.5em 0}
.first-error .what{font-size:1.1em;font-weight:bold;color:#b71c1c}
details.provenance{margin-top:2em}details.provenance summary{cursor:pointer}
details.provenance summary h3{display:inline}
"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _num(v) -> Optional[float]:
    """A finite float, or None (missing, null, NaN, Inf, not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _pos(v) -> Optional[float]:
    """A finite positive float (plottable on a log scale), or None."""
    v = _num(v)
    return v if v is not None and v > 0 else None


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.4g}"


def _step(x) -> str:
    """A step number as text (an integer without exponent or decimals)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# ---------------------------------------------------------------- small table helpers

def _value_html(v) -> str:
    if isinstance(v, dict):
        if not v:
            return "<code>{}</code>"
        rows = "".join(f"<tr><td class='k'>{_esc(k)}</td><td>{_value_html(x)}</td></tr>"
                       for k, x in v.items())
        return f"<table>{rows}</table>"
    if isinstance(v, list):
        return f"<code>{_esc(json.dumps(v))}</code>"
    if v is None or isinstance(v, bool):
        return f"<code>{json.dumps(v)}</code>"
    return _esc(v)


def _kv_table(d: dict, skip=()) -> str:
    rows = "".join(f"<tr><td class='k'>{_esc(k)}</td><td>{_value_html(v)}</td></tr>"
                   for k, v in d.items() if k not in skip)
    return f"<table>{rows}</table>"


# ---------------------------------------------------------------- SVG helpers

def _log_ticks(lo: float, hi: float) -> list:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    step = max(1, (b - a) // 8)
    mults = (1, 2, 5) if b - a <= 2 else (1,)
    return [m * 10.0 ** e for e in range(a, b + 1, step) for m in mults]


def _log_range(values: list) -> tuple:
    lo, hi = min(values), max(values)
    llo, lhi = math.log10(lo), math.log10(hi)
    if lhi - llo < 1e-9:
        llo, lhi = llo - 0.5, lhi + 0.5
    pad = 0.05 * (lhi - llo)
    return llo - pad, lhi + pad


def _lin_ticks(lo: float, hi: float) -> list:
    """About six round tick values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    raw = (hi - lo) / 6
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step)
    return [k * step for k in range(first, int(math.floor(hi / step)) + 1)]


def _runs(xs: list, ys: list) -> list:
    """The runs of consecutive measured values of a series: lists of (x, y), split at every None
    (a step record without the value), in record order."""
    runs, cur = [], []
    for x, y in zip(xs, ys):
        if y is None:
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append((x, y))
    if cur:
        runs.append(cur)
    return runs


# Note [Thinned lines]: a line chart of many steps keeps, per pixel column of each run of
# measured values, the run's first and last point there and its lowest and highest: what a line
# of every point would show at that width, spikes included. Runs are thinned each on its own, so
# a thinned line never joins two points across a gap.
def _thin(run: list, px, budget: int) -> list:
    """The points of `run` to draw (all of them where there are at most `budget`); px maps a
    step to its x pixel."""
    if len(run) <= max(budget, 4):
        return run
    cols: dict = {}
    for i, (x, y) in enumerate(run):
        cols.setdefault(int(px(x)), []).append(i)
    keep = set()
    for idx in cols.values():
        keep.update((idx[0], idx[-1], min(idx, key=lambda i: run[i][1]),
                     max(idx, key=lambda i: run[i][1])))
    return [run[i] for i in sorted(keep)]


def _line_chart(title: str, xs: list, series: dict, width=820, height=300, log=True,
                domain=None, markers=()) -> str:
    """A line chart (log scale unless `log` is false) of series {name: [y or None]} over the
    steps xs. None values are gaps: each run of measured values is its own polyline, and a value
    with no measured neighbour is a dot. `domain`: the (first, last) step of the x axis (default:
    those of xs); `markers`: findings drawn as vertical lines at their steps, coloured by
    severity, each with a tooltip."""
    vals = [y for ys in series.values() for y in ys if y is not None]
    if not vals:
        what = "finite positive values" if log else "finite values"
        return f"<p class='note'>{_esc(title)}: no {what} to plot.</p>"
    left, right, top, bottom = 70, 150, 20, 40
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = domain if domain else (min(xs), max(xs))
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if log:
        lo, hi = _log_range(vals)
        ticks = [t for t in _log_ticks(10 ** lo, 10 ** hi) if lo <= math.log10(t) <= hi]

        def f(y):
            return math.log10(y)
    else:
        lo, hi = min(vals), max(vals)
        if hi - lo < 1e-12 * max(1.0, abs(hi)):
            lo, hi = lo - max(0.5, abs(lo) * 0.1), hi + max(0.5, abs(hi) * 0.1)
        pad = 0.05 * (hi - lo)
        lo, hi = lo - pad, hi + pad
        ticks = _lin_ticks(lo, hi)

        def f(y):
            return y

    def sx(x):
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y):
        return top + (hi - f(y)) / (hi - lo) * ph

    out = [f"<svg class='chart' width='{width}' "
           f"height='{height}' viewBox='0 0 {width} {height}' role='img' "
           f"aria-label='{_esc(title)}'><title>{_esc(title)}</title>",
           f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='#fafafa' "
           f"stroke='#999'/>"]
    for t in ticks:
        y = sy(t)
        out.append(f"<line x1='{left}' x2='{left + pw}' y1='{y:.1f}' y2='{y:.1f}' "
                   f"stroke='#ddd'/><text x='{left - 5}' y='{y + 4:.1f}' font-size='11' "
                   f"text-anchor='end'>{_esc(f'{t:.3g}')}</text>")
    xticks = (_lin_ticks(x0, x1) if x1 - x0 >= 5
              else [x0 + (x1 - x0) * i / 5 for i in range(6)])
    for xv in xticks:
        out.append(f"<text x='{sx(xv):.1f}' y='{top + ph + 15}' font-size='11' "
                   f"text-anchor='middle'>{_esc(_step(xv))}</text>")
    out.append(f"<text x='{left + pw / 2}' y='{height - 5}' font-size='12' "
               f"text-anchor='middle'>step</text>")
    for m in markers:  # behind the lines, so that they stay readable
        sev = str(m.get("severity"))
        colour = _SEVERITY_COLOURS.get(sev, "#555")
        x = sx(_num(m["step"]))
        tip = (f"step {m.get('step')} [{sev}] {m.get('kind')}"
               + (f" {m['tensor']}" if m.get("tensor") else ""))
        out.append(f"<g class='finding-marker' data-step='{_esc(m.get('step'))}'><title>"
                   f"{_esc(tip)}</title><line x1='{x:.1f}' x2='{x:.1f}' y1='{top}' "
                   f"y2='{top + ph}' stroke='{colour}' stroke-width='2' stroke-opacity='0.7' "
                   f"stroke-dasharray='4 2'/><path d='M{x - 5:.1f},{top - 8} h10 l-5,8 z' "
                   f"fill='{colour}'/></g>")
    budget = max(50, _MAX_POINTS // max(1, len(series)))
    legend = list(series)
    for name, ys in series.items():
        colour = _SERIES_COLOURS.get(name, "#333")
        runs = _runs(xs, ys)
        dots = [r[0] for r in runs if len(r) == 1]
        if len(dots) > budget:  # thinned as one run: dots are not joined
            dots = _thin(dots, sx, budget)
        for x, y in dots:
            out.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='{colour}'>"
                       f"<title>{_esc(name)} at step {_esc(_step(x))}: {_esc(_fmt(y))}</title>"
                       f"</circle>")
        lines = [r for r in runs if len(r) > 1]
        total = sum(len(r) for r in lines)
        for run in lines:
            pts = _thin(run, sx, max(2, budget * len(run) // max(1, total)))
            out.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' "
                       f"data-from='{_esc(_step(run[0][0]))}' "
                       f"data-to='{_esc(_step(run[-1][0]))}' points='"
                       + " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
                       + f"'><title>{_esc(name)}</title></polyline>")
    sevs = []
    for m in markers:
        if str(m.get("severity")) not in sevs:
            sevs.append(str(m.get("severity")))
    for k, name in enumerate(legend + [f"finding: {v}" for v in sevs]):
        ly = top + 15 + 18 * k
        colour = (_SERIES_COLOURS.get(name, "#333") if k < len(legend)
                  else _SEVERITY_COLOURS.get(sevs[k - len(legend)], "#555"))
        dash = "" if k < len(legend) else " stroke-dasharray='4 2'"
        out.append(f"<line x1='{left + pw + 10}' x2='{left + pw + 30}' y1='{ly}' y2='{ly}' "
                   f"stroke='{colour}' stroke-width='3'{dash}/><text x='{left + pw + 35}' "
                   f"y='{ly + 4}' font-size='12'>{_esc(name)}</text>")
    out.append("</svg>")
    return "".join(out)


def _colour(f: float) -> str:
    f = min(1.0, max(0.0, f)) * (len(_PALETTE) - 1)
    i = min(int(f), len(_PALETTE) - 2)
    t = f - i
    c = [round(a + (b - a) * t) for a, b in zip(_PALETTE[i], _PALETTE[i + 1])]
    return "#%02x%02x%02x" % tuple(c)


def _heat_map(title: str, steps: list, names: list, value) -> str:
    """A tensor x step heat map; value(step_record, name) -> finite positive float or None."""
    if not names or not steps:
        return f"<p class='note'>{_esc(title)}: no per-tensor statistics in this trace.</p>"
    note = ""
    if len(names) > _MAX_ROWS:
        note = (f"<p class='note'>showing the first {_MAX_ROWS} of {len(names)} "
                f"tensors</p>")
        names = names[:_MAX_ROWS]
    ncol = min(len(steps), _MAX_COLUMNS)
    bins = [steps[i * len(steps) // ncol:(i + 1) * len(steps) // ncol] for i in range(ncol)]
    grid = []
    for name in names:
        row = []
        for b in bins:
            vs = [v for v in (value(s, name) for s in b) if v is not None]
            row.append(max(vs) if vs else None)
        grid.append(row)
    vals = [v for row in grid for v in row if v is not None]
    if not vals:
        return f"<p class='note'>{_esc(title)}: no finite positive values to plot.</p>"
    llo, lhi = _log_range(vals)
    label_w = min(300, 12 + 7 * max(len(n) for n in names))
    cw = max(2.0, min(24.0, 700.0 / ncol))
    ch = 14 if len(names) <= 60 else 8
    top, legend_w = 10, 120
    width = int(label_w + cw * ncol + legend_w + 20)
    height = int(top + ch * len(names) + 40)
    out = [f"<svg class='heatmap' width='{width}' "
           f"height='{height}' viewBox='0 0 {width} {height}' role='img' "
           f"aria-label='{_esc(title)}'><title>{_esc(title)}</title>"]
    for r, name in enumerate(names):
        y = top + r * ch
        shown = name if len(name) <= 42 else "…" + name[-41:]
        out.append(f"<text x='{label_w - 6}' y='{y + ch - 3}' font-size='{min(11, ch)}' "
                   f"text-anchor='end'><title>{_esc(name)}</title>{_esc(shown)}</text>")
        for c, v in enumerate(grid[r]):
            x = label_w + c * cw
            fill = _MISSING if v is None else _colour((math.log10(v) - llo) / (lhi - llo))
            first, last = bins[c][0].get("step"), bins[c][-1].get("step")
            where = f"step {first}" if first == last else f"steps {first}–{last}"
            out.append(f"<rect x='{x:.2f}' y='{y}' width='{cw + 0.3:.2f}' height='{ch}' "
                       f"fill='{fill}'><title>{_esc(name)}, {_esc(where)}: "
                       f"{_esc(_fmt(v))}</title></rect>")
    yb = top + ch * len(names) + 14
    out.append(f"<text x='{label_w}' y='{yb}' font-size='11'>step "
               f"{_esc(steps[0].get('step'))}</text><text x='{label_w + cw * ncol}' y='{yb}' "
               f"font-size='11' text-anchor='end'>step {_esc(steps[-1].get('step'))}</text>")
    lx = label_w + cw * ncol + 20
    lh = max(60, ch * len(names))
    for i in range(20):
        out.append(f"<rect x='{lx:.1f}' y='{top + lh * (19 - i) / 20:.1f}' width='14' "
                   f"height='{lh / 20 + 0.5:.1f}' fill='{_colour(i / 19)}'/>")
    out.append(f"<text x='{lx + 18:.1f}' y='{top + 10}' font-size='11'>"
               f"{_esc(_fmt(10 ** lhi))}</text><text x='{lx + 18:.1f}' y='{top + lh}' "
               f"font-size='11'>{_esc(_fmt(10 ** llo))}</text><rect x='{lx:.1f}' "
               f"y='{top + lh + 8}' width='14' height='10' fill='{_MISSING}'/><text "
               f"x='{lx + 18:.1f}' y='{top + lh + 17}' font-size='11'>no value</text>")
    out.append("</svg>")
    return note + "".join(out)


def _timeline(findings: list, steps: list, width=820) -> str:
    placed = [f for f in findings if _num(f.get("step")) is not None]
    if not placed:
        return ""
    xs = [_num(f["step"]) for f in placed] + [_num(s.get("step")) for s in steps
                                              if _num(s.get("step")) is not None]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    sevs = ["error", "warning", "info"]
    sevs += sorted({str(f.get("severity")) for f in placed} - set(sevs))
    left, pw, top, lane = 70, width - 90, 10, 22
    height = top + lane * len(sevs) + 30
    out = [f"<svg class='timeline' width='{width}' "
           f"height='{height}' viewBox='0 0 {width} {height}' role='img' "
           f"aria-label='findings timeline'><title>findings by step</title>"]
    for i, sev in enumerate(sevs):
        y = top + lane * i + lane / 2
        out.append(f"<text x='{left - 6}' y='{y + 4}' font-size='11' text-anchor='end'>"
                   f"{_esc(sev)}</text><line x1='{left}' x2='{left + pw}' y1='{y}' y2='{y}' "
                   f"stroke='#ddd'/>")
    for f in placed:
        sev = str(f.get("severity"))
        x = left + (_num(f["step"]) - x0) / (x1 - x0) * pw
        y = top + lane * sevs.index(sev) + lane / 2
        colour = _SEVERITY_COLOURS.get(sev, "#555")
        out.append(f"<circle cx='{x:.1f}' cy='{y}' r='6' fill='{colour}' fill-opacity='0.8' "
                   f"stroke='#333'><title>step {_esc(f.get('step'))} [{_esc(sev)}] "
                   f"{_esc(f.get('kind'))}: {_esc(f.get('message'))}</title></circle>")
    yb = top + lane * len(sevs) + 15
    out.append(f"<text x='{left}' y='{yb}' font-size='11'>step {_esc(f'{x0:g}')}</text>"
               f"<text x='{left + pw}' y='{yb}' font-size='11' text-anchor='end'>step "
               f"{_esc(f'{x1:g}')}</text></svg>")
    return "".join(out)


# ---------------------------------------------------------------- sections

def _by_step(findings: list) -> list:
    """The findings in step order (those without a step last)."""
    return sorted(findings, key=lambda f: (_num(f.get("step")) is None, _num(f.get("step")) or 0))


def _findings_section(t: dict) -> str:
    findings, summary = t["findings"], t["summary"]
    parts = ["<h3>Findings</h3>"]
    if not findings:
        parts.append("<p class='note'>no findings</p>")
        return "".join(parts)
    ordered = _by_step(findings)
    first = next((f for f in ordered if f.get("severity") == "error"), None)
    if first is not None:
        errors = sum(f.get("severity") == "error" for f in findings)
        parts.append(f"<div class='first-error'><span class='what'>first error: "
                     f"{_esc(first.get('kind'))} at step {_esc(first.get('step'))}"
                     + (f", tensor {_esc(first['tensor'])}" if first.get("tensor") else "")
                     + f"</span> ({errors} distinct error finding(s) in all)<br>"
                     f"<span class='msg'>{_esc(first.get('message'))}</span></div>")
    else:
        parts.append(f"<p>no error findings; {len(findings)} finding(s) of lower severity</p>")
    counts = (summary or {}).get("findings") or {}
    rows = []
    for f in ordered:
        sev = str(f.get("severity"))
        colour = _SEVERITY_COLOURS.get(sev, "#555")
        tint = _SEVERITY_TINTS.get(sev, "#fff")
        n = counts.get(f.get("kind")) if isinstance(counts, dict) else None
        rows.append(f"<tr style='background:{tint}'><td>{_esc(f.get('step'))}</td><td "
                    f"class='sev' style='color:{colour}'>{_esc(sev)}</td>"
                    f"<td>{_esc(f.get('kind'))}</td><td>{_esc(f.get('tensor') or '')}</td>"
                    f"<td>{_esc(n or '')}</td><td class='msg'>{_esc(f.get('message'))}</td></tr>")
    parts.append("<table class='findings'><tr><th>step</th><th>severity</th><th>kind</th>"
                 "<th>tensor</th><th>kind total</th><th>message</th></tr>"
                 + "".join(rows) + "</table>")
    parts.append(_timeline(findings, t["steps"]))
    return "".join(parts)


def _tensor_names(steps: list) -> list:
    names = {}
    for s in steps:
        tensors = s.get("tensors")
        if isinstance(tensors, dict):
            for n in tensors:
                names.setdefault(n, None)
    return list(names)


def _tensor_field(s: dict, name: str, kind: str, field: str = "l2"):
    rec = (s.get("tensors") or {}).get(name)
    if not isinstance(rec, dict) or not isinstance(rec.get(kind), dict):
        return None
    return rec[kind].get(field)


def _grad_norm(s: dict, name: str):
    return _pos(_tensor_field(s, name, "grad"))


def _update_ratio(s: dict, name: str):
    u, p = _pos(_tensor_field(s, name, "update")), _pos(_tensor_field(s, name, "param"))
    return u / p if u is not None and p is not None else None


def _glob(key: str, s: dict):
    """A global figure of a step record, or None (a gap): null, not positive (log scale), or an
    update figure of a step without update statistics."""
    g = s.get("global") if isinstance(s.get("global"), dict) else {}
    if key in ("update_norm", "update_ratio") and s.get("update_stats") is False:
        return None
    return _pos(g.get(key))


def _metrics_section(t: dict) -> str:
    steps = [s for s in t["steps"] if _num(s.get("step")) is not None]
    if not steps:
        return ("<h3>Norms</h3><p class='note'>no step records in this trace (nothing was "
                "recorded, or the run ended before its first step)</p>")
    xs = [_num(s["step"]) for s in steps]
    placed = [f for f in _by_step(t["findings"]) if _num(f.get("step")) is not None]
    every = xs + [_num(f["step"]) for f in placed]
    domain = (min(every), max(every))

    parts = ["<h3>Loss</h3>"]
    losses = [_num(s.get("loss")) for s in steps]
    marked = ", findings marked at their steps" if placed else ""
    if any(v is not None for v in losses):
        log = all(v > 0 for v in losses if v is not None)
        parts.append(_line_chart(f"training loss per step ({'log' if log else 'linear'} scale)"
                                 + marked, xs, {"loss": losses}, log=log, domain=domain,
                                 markers=placed))
        placed, marked = [], ""
    else:  # the findings are marked on the global norms instead
        parts.append("<p class='note'>no loss in the step records (none was seen, or the trace "
                     "predates the loss field)"
                     + ("; the findings are marked on the global norms" if placed else "")
                     + "</p>")
    parts += ["<h3>Global norms</h3>",
              _line_chart("global norms (log scale)" + marked, xs,
                          {k: [_glob(k, s) for s in steps]
                           for k in ("grad_norm", "param_norm", "update_norm")}, domain=domain,
                          markers=placed),
              "<h3>Update ratio</h3>",
              _line_chart("update ratio = update_norm / param_norm (log scale)", xs,
                          {"update_ratio": [_glob("update_ratio", s) for s in steps]},
                          domain=domain)]
    rows = [s for s in steps if has_rows(s)]
    names = _tensor_names(rows)
    where = ""
    if rows:
        shown = ", ".join(_step(_num(s["step"])) for s in rows[:12])
        where = (f"<p class='note'>from the {len(rows)} of {len(steps)} step records with "
                 f"per-tensor rows (steps {_esc(shown)}{' …' if len(rows) > 12 else ''}); the "
                 "columns are those records in order, not to scale</p>")
    parts.append("<h3>Per-layer gradient norm</h3>" + where)
    parts.append(_heat_map("gradient L2 norm per tensor (log colour scale)", rows, names,
                           _grad_norm))
    parts.append("<h3>Per-layer update ratio</h3>" + where)
    parts.append(_heat_map("update ratio update.l2 / param.l2 per tensor (log colour scale)",
                           rows, names, _update_ratio))
    return "".join(parts)


def _coverage_section(t: dict) -> str:
    summary = t["summary"]
    if summary is None:
        return ("<h3>Coverage</h3><p class='note'>no summary record: the run ended early "
                "(killed, crashed, or still running), so there is no coverage</p>")
    cov = summary.get("coverage")
    head = (f"<p>{_esc(summary.get('steps'))} steps, {_esc(summary.get('amp_skips', 0))} "
            f"AMP-skipped, sanitizer overhead {_esc(_fmt(_num(summary.get('overhead_ms_total'))))}"
            f" ms in all</p>")
    if not isinstance(cov, dict):
        return f"<h3>Coverage</h3>{head}<p class='note'>the summary has no coverage</p>"
    unchecked = cov.get("unchecked") or {}
    body = _kv_table(cov, skip=("unchecked",))
    if unchecked:
        body += ("<p><b>Unchecked</b> (enabled checks that never had what they need):</p>"
                 + _kv_table(unchecked))
    else:
        body += "<p>every enabled check had what it needs (nothing unchecked)</p>"
    return f"<h3>Coverage</h3>{head}{body}"


def _trace_section(t: dict, index: int) -> str:
    name = os.path.basename(t["path"])
    header = t["header"] or {}
    done = (f"{t['summary'].get('steps')} steps" if t["summary"]
            else "no summary (ended early)")
    rows = sum(has_rows(s) for s in t["steps"])
    banners = ""
    err = trace_error(t)
    if err:
        banners += (f"<div class='alert'>Trace incomplete: writing the trace failed during the "
                    f"run ({_esc(err)}); the records after the failure are missing, so this page "
                    f"shows only part of the run.</div>")
    earlier = rotated_from(t)
    if earlier:
        banners += (f"<p class='rotated'>This trace continues <code>{_esc(earlier)}</code> "
                    f"(rotation {_esc(header.get('rotated'))}, trace_max_mb): the steps before "
                    "this file's first are there, not on this page.</p>")
    if t["unmatched_rows"]:
        banners += (f"<p class='note'>{len(t['unmatched_rows'])} late per-tensor record(s) "
                    "belong to steps whose step record is not in this file.</p>")
    return (f"<section class='trace' id='trace-{index}'><h2>{_esc(name)}</h2>"
            f"<p><code>{_esc(t['path'])}</code>: {len(t['steps'])} step records ({rows} with "
            f"per-tensor rows), {len(t['findings'])} distinct finding(s), {_esc(done)}"
            + (f", {len(t['amp'])} AMP-skipped steps" if t["amp"] else "") + "</p>"
            + banners + _findings_section(t) + _metrics_section(t) + _coverage_section(t)
            + "<details class='provenance'><summary><h3>Provenance</h3> (the header: versions, "
            "options, environment)</summary>" + _kv_table(header, skip=("type",))
            + "</details></section>")


def render(paths: list) -> str:
    """The HTML page of one or more traces (one section per trace)."""
    traces = [load_trace(p) for p in paths]
    title = "TrainSan report: " + ", ".join(os.path.basename(p) for p in paths)
    toc = ""
    if len(traces) > 1:
        toc = "<ul>" + "".join(f"<li><a href='#trace-{i}'>{_esc(os.path.basename(t['path']))}"
                               f"</a></li>" for i, t in enumerate(traces)) + "</ul>"
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{_esc(title)}</h1>{toc}"
            + "".join(_trace_section(t, i) for i, t in enumerate(traces))
            + "</body></html>\n")


def write_html(paths: list, out: str) -> str:
    """Write the page of `paths` to `out`; returns a line saying so."""
    page = render(paths)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return f"HTML report written to {out}"
