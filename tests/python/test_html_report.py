"""python -m trainsan report TRACE --html PAGE: a self-contained HTML page (inline SVG plots, no
network). Content checks without a browser, then a real headless browser (Debian's chromium
driven by Playwright; skipped when either is missing)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import pytest
import torch
import torch.nn.functional as F

import trainsan
from trainsan.__main__ import main
from trainsan.html_report import render

from _browser import headless_page

EVIL = "<script>alert('x')</script> & \"quoted\""


def _run(path, steps=12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with trainsan.attach(model, opt, trace=str(path), policy="record"):
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(16, 4, generator=g)),
                       torch.randn(16, 1, generator=g)).backward()
            opt.step()


def _records(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def _write(path, recs):
    # allow_nan: a trace from elsewhere may hold NaN/Infinity literals (trainsan writes null)
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("html")
    base = d / "run.jsonl"
    _run(base)
    recs = _records(base)
    header = recs[0]
    steps = [r for r in recs if r["type"] == "step"]
    # an injected finding with markup in its message, and NaN/Inf/null values
    bad = [dict(r) for r in recs[:-1]]
    bad.insert(3, {"type": "finding", "kind": "nonfinite_grad", "step": 2, "severity": "error",
                   "tensor": "0.weight", "message": EVIL})
    s = next(i for i, r in enumerate(bad) if r["type"] == "step" and r["step"] == 3)
    bad[s] = json.loads(json.dumps(bad[s]))
    bad[s]["global"]["grad_norm"] = float("nan")
    bad[s]["global"]["update_norm"] = float("inf")
    bad[s]["tensors"]["0.weight"]["grad"]["l2"] = None
    bad[s]["tensors"]["0.bias"]["grad"]["l2"] = float("nan")
    no_tensors = [header] + [{k: v for k, v in r.items() if k != "tensors"} for r in steps]
    return {
        "good": str(base),
        "bad": _write(d / "bad.jsonl", bad),  # also: no summary (ended early)
        "no_tensors": _write(d / "notensors.jsonl", no_tensors + [recs[-1]]),
        "empty": _write(d / "empty.jsonl", [header]),
    }


def _page(tmp_path, *paths):
    out = tmp_path / "report.html"
    assert main(["report", *paths, "--html", str(out)]) == 0
    return out, out.read_text(encoding="utf-8")


def test_page_sections_and_self_contained(traces, tmp_path):
    out, page = _page(tmp_path, traces["good"])
    assert page.startswith("<!DOCTYPE html>")
    order = ("Findings", "Loss", "Global norms", "Update ratio", "Per-layer gradient norm",
             "Per-layer update ratio", "Coverage", "Provenance")
    at = [page.find(f"<h3>{h}</h3>") for h in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))  # what went wrong first
    # The provenance (options, packages) is folded at the end, closed.
    assert "<details class='provenance'><summary><h3>Provenance</h3>" in page
    assert "<details class='provenance' open" not in page
    assert page.count("<svg") >= 4  # norms, ratio, two heat maps
    assert "class='heatmap'" in page and "0.weight" in page and "2.bias" in page
    assert "steps_checked" in page and "torch" in page and "git_commit" in page
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page and "@import" not in page


def test_escaping_nonfinite_and_missing_summary(traces, tmp_path):
    _, page = _page(tmp_path, traces["bad"])
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in page
    assert "class='timeline'" in page
    assert "first error: nonfinite_grad at step 2, tensor 0.weight" in page
    assert "no summary record: the run ended early" in page
    assert "NaN" not in page.replace("nonfinite", "") and "inf'" not in page


def test_no_tensors_empty_and_several_traces(traces, tmp_path):
    _, page = _page(tmp_path, traces["no_tensors"])
    assert "no per-tensor statistics" in page and "class='chart'" in page
    _, page = _page(tmp_path, traces["empty"])
    assert "no step records in this trace" in page and "no summary record" in page
    _, page = _page(tmp_path, traces["good"], traces["empty"], traces["bad"])
    assert page.count("<section class='trace'") == 3
    assert render([traces["good"]]) == render([traces["good"]])  # deterministic


# ---------------------------------------------------------------- headless browser

def _png_pixels(data):
    """(width, height, rows of RGB(A) tuples) of an 8-bit RGB/RGBA, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, prev, rows = zlib.decompress(idat), w * bpp, bytearray(w * bpp), []
    for y in range(h):
        start = y * (stride + 1)
        ftype, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, bpp, rows


def test_page_renders_in_headless_chromium(traces, tmp_path):
    out, _ = _page(tmp_path, traces["good"], traces["bad"])
    errors = []
    with headless_page() as page:
        page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: errors.append(f"requestfailed: {r.url}"))
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(out.as_uri(), wait_until="load")
        svgs = page.locator("svg")
        assert svgs.count() >= 8  # 2 traces x (norms, ratio, 2 heat maps) + a timeline
        for i in range(svgs.count()):
            box = svgs.nth(i).bounding_box()
            assert box and box["width"] > 50 and box["height"] > 20, (i, box)
        assert page.locator("svg.heatmap rect").count() > 50
        assert page.locator("svg.chart polyline").count() >= 4
        assert "<script>alert" in page.inner_text("table.findings")  # shown as text
        # The findings come before the first chart; the provenance is folded.
        bad = page.locator("section#trace-1")
        first = bad.locator("table.findings").bounding_box()
        assert first["y"] < bad.locator("svg.chart").first.bounding_box()["y"]
        assert not page.locator("details.provenance table").first.is_visible()
        shot = tmp_path / "report.png"
        data = page.screenshot(path=str(shot), full_page=True)
    assert not errors, errors
    assert all(u.startswith("file://") for u in requests), requests
    assert shot.stat().st_size > 5000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h, bpp, rows = _png_pixels(data)
    assert w >= 1000 and h > 900
    colours = {row[i:i + 3] for row in rows[::7] for i in range(0, w * bpp, bpp * 5)}
    assert len(colours) > 20, f"screenshot looks blank: {len(colours)} distinct colours"
