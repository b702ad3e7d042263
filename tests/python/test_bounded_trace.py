"""Readers of the bounded trace (docs/trace.md): per-tensor rows on some step records only (the
first steps, every N-th, the steps after a finding), late ``tensors`` records of earlier steps,
a global gradient-statistics ``digest`` and ``loss`` on every step record, rotation and a trace
write error. The traces here are written by hand, thousands of steps each."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from trainsan.html_report import render

from _browser import headless_page
from trainsan.report import diff, load_trace, report

STEPS = 3000
FIRST, EVERY, RING = 10, 100, 8  # trace_first_steps, trace_rows_every, trace_ring
UPDATE_EVERY = 50  # update statistics measured on these steps only
FINDING = 2000  # a loss spike (warning) here, and a non-finite gradient (error) two steps on
LATE = (FINDING - 3, FINDING - 2, FINDING - 1)  # rows written late, from the ring
DIVERGE = 1234  # where run b's gradients start to differ (not a step with rows)
NAMES = ("layer0.weight", "layer0.bias", "layer1.weight")


def _stats(l2: float, h: str) -> dict:
    return {"numel": 64, "nan": 0, "posinf": 0, "neginf": 0, "zero": 0, "subnormal": 0,
            "fp16_overflow": 0, "min": -l2, "max": l2, "absmax": l2, "sum": 0.0, "l2": l2,
            "hash": h}


def _hex(*parts) -> str:
    """16 hex digits standing for a fingerprint of `parts`."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def _grad_hash(step: int, name: str, diverge) -> str:
    bad = diverge is not None and step >= diverge and name == "layer1.weight"
    return _hex(step, name, bad)


def _rows(step: int, diverge=None, l2_scale=1.0) -> dict:
    upd = step % UPDATE_EVERY == 0
    return {name: {"param": _stats(2.0 + k, "%016x" % (step * 7 + k)) if upd else None,
                   "grad": _stats(l2_scale * (0.5 + k) / (1 + step / 1000),
                                  _grad_hash(step, name, diverge)),
                   "update": ({"l2": 1e-3 * (1 + k), "max": 1e-4, "changed": 64} if upd
                              else None)}
            for k, name in enumerate(NAMES)}


def _why(step: int) -> str | None:
    if step < FIRST:
        return "first"
    if FINDING <= step < FINDING + RING:
        return "finding"
    if step % EVERY == 0:
        return "sampled"
    return None


def _step(step: int, diverge=None) -> dict:
    upd = step % UPDATE_EVERY == 0
    bad = diverge is not None and step >= diverge
    rec = {"type": "step", "step": step, "optimizer": 0, "lr_zero": False, "update_stats": upd,
           "overhead_ms": 0.05, "backwards": 1, "inputs": "%016x" % (step * 31 + 1),
           "targets": "%016x" % (step * 17 + 3),
           "global": {"grad_norm": 1.0 / (1 + step / 1000) + (1e-3 if bad else 0.0),
                      "param_norm": 3.7 if upd else None,
                      "update_norm": 2.2e-3 if upd else None,
                      "update_ratio": 6e-4 if upd else None, "changed": 192 if upd else 0,
                      "nonfinite_grad": step == FINDING + 2,
                      "digest": _hex(step, bad)},
           "loss": 2.0 / (1 + step / 500) if step != FINDING + 2 else None}
    why = _why(step)
    if why:
        rec["tensors"] = _rows(step, diverge)
        rec["rows"] = why
    return rec


def _findings() -> list:
    return [{"type": "finding", "kind": "loss_spike", "step": FINDING, "severity": "warning",
             "tensor": None, "message": "loss 9.1 is 6.2 sigma above its recent mean <b>x</b>",
             "value": 9.1},
            {"type": "finding", "kind": "nonfinite_grad", "step": FINDING + 2,
             "severity": "error", "tensor": "layer1.weight",
             "message": "layer1.weight.grad holds 3 NaN", "value": None}]


def _header(rotated=None) -> dict:
    h = {"type": "header", "trainsan": "0.1.0", "cuda_kernels": False, "num_params": 3,
         "options": {"trace_first_steps": FIRST, "trace_rows_every": EVERY, "trace_ring": RING,
                     "trace_max_mb": 0},
         "torch": "2.x", "packages": {f"pkg{i}": "1.0" for i in range(200)}}
    if rotated:
        h["rotated"] = rotated
    return h


def _summary(steps: int, rows: int, error=None) -> dict:
    return {"type": "summary", "steps": steps, "amp_skips": 0, "overhead_ms_total": 150.0,
            "findings": {"loss_spike": 1, "nonfinite_grad": 1},
            "unique_findings": [], "coverage": {"steps_checked": steps, "update_steps": 60,
                                                "update_period": UPDATE_EVERY,
                                                "trace_error": error,
                                                "trace_rows_steps": rows, "unchecked": {}}}


def _write(path, recs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _run(diverge=None, start=0, stop=STEPS, rotated=None, error=None, extra=()) -> list:
    recs = [_header(rotated)]
    for step in range(start, stop):
        recs.append(_step(step, diverge))
        if step in (FINDING, FINDING + 2):
            recs += [f for f in _findings() if f["step"] == step]
        if step == FINDING:  # the ring's rows of the steps before the finding, written late
            for s in LATE + (FINDING - 100,):  # the last one already has its sampled rows
                recs.append({"type": "tensors", "step": s, "optimizer": 0,
                             "rows": "before_finding", "tensors": _rows(s, diverge, 1e3)})
    recs += list(extra)
    rows = sum(1 for r in recs if r["type"] == "step" and "tensors" in r) + len(LATE)
    recs.append(_summary(stop - start, rows, error))
    return recs


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounded")
    poison = {"type": "poison_batch", "rank": 0, "fingerprint": "00000000000000aa",
              "tensors": ["00000000000000ab"], "kind": "nonfinite_loss"}
    full = _run()
    before = {"type": "tensors", "step": 1400, "optimizer": 0, "rows": "before_finding",
              "tensors": _rows(1400)}  # in the rotated file: its step record is in the .1
    part1 = [r for r in full if r["type"] != "summary" and r.get("step", 0) < 1500]
    _write(d / "rot.jsonl.1", part1 + [dict(poison, step=100)])
    return {
        "a": _write(d / "a.jsonl", full),
        "a2": _write(d / "a2.jsonl", _run()),
        "b": _write(d / "b.jsonl", _run(diverge=DIVERGE)),
        "rot": _write(d / "rot.jsonl", _run(start=1500, rotated=1,
                                            error="No space left on device",
                                            extra=[before, dict(poison, step=2500)])),
    }


def test_load_trace_merges_late_rows(traces):
    t = load_trace(traces["a"])
    assert [s["step"] for s in t["steps"]] == list(range(STEPS))  # step records only, in order
    by = {s["step"]: s for s in t["steps"]}
    for s in LATE:
        assert by[s]["rows"] == "before_finding" and set(by[s]["tensors"]) == set(NAMES)
    # A step that had its own rows keeps them (the late copy's gradients are 1000x larger).
    kept = by[FINDING - 100]
    assert kept["rows"] == "sampled"
    assert kept["tensors"]["layer0.weight"]["grad"]["l2"] == _rows(FINDING - 100)[
        "layer0.weight"]["grad"]["l2"]
    assert t["late_rows"] == len(LATE) and t["unmatched_rows"] == []
    with_rows = [s["step"] for s in t["steps"] if s.get("tensors")]
    assert len(with_rows) == FIRST + STEPS // EVERY - 1 + RING - 1 + len(LATE)
    assert "tensors" not in by[11] and "rows" not in by[11]


def test_report_text_names_rows_error_and_rotation(traces):
    text = report(traces["a"])
    n = sum(1 for s in load_trace(traces["a"])["steps"] if s.get("tensors"))
    assert f"{STEPS} step records" in text
    assert f"{n} of {STEPS} step records with per-tensor rows" in text
    assert "3 before_finding" in text and "late per-tensor record(s) merged" in text
    assert "TRACE INCOMPLETE" not in text and "continues" not in text
    assert "loss: first 2" in text
    rot = report(traces["rot"])
    lines = rot.splitlines()
    assert lines[1].startswith("  TRACE INCOMPLETE") and "No space left on device" in lines[1]
    assert f"this trace continues {traces['rot']}.1" in rot
    # The late records of steps before the rotation name steps not in this file.
    assert "late per-tensor record(s) of steps not in this file" in rot


def test_diff_by_digest_names_the_tensor_at_a_later_row_step(traces):
    out = diff(traces["a"], traces["b"])
    assert out.startswith(f"runs diverge at step {DIVERGE}: the gradient statistics differ "
                          "(digest "), out
    later = (DIVERGE // EVERY + 1) * EVERY
    assert f"first differing tensor seen at step {later}: layer1.weight.grad differs" in out, out
    assert "may have begun differing earlier" in out
    assert f"the inputs agree through step {DIVERGE}" in out


def test_diff_of_identical_traces(traces):
    assert diff(traces["a"], traces["a2"]) == (
        f"no difference in {STEPS} common steps (steps 0..{STEPS - 1})")
    out = diff(traces["a"], traces["rot"])
    assert out.startswith("no difference in 1500 common steps (steps 1500..2999)"), out
    assert "rot.jsonl continues rot.jsonl.1" in out and "No space left on device" in out


def test_diff_without_later_rows_says_so(traces, tmp_path):
    recs = [r for r in _run(diverge=DIVERGE) if not (r["type"] == "step" and r["step"] > DIVERGE)
            and r["type"] != "tensors"]
    short = _write(tmp_path / "short.jsonl", recs)
    out = diff(traces["a"], short)
    assert out.startswith(f"runs diverge at step {DIVERGE}: the gradient statistics differ")
    assert "no later step has per-tensor rows in both traces" in out, out


def _h3(page: str, title: str) -> int:
    i = page.find(f"<h3>{title}</h3>")
    assert i >= 0, title
    return i


def test_html_leads_with_findings(traces):
    page = render([traces["a"]])
    order = [_h3(page, h) for h in ("Findings", "Loss", "Global norms", "Update ratio",
                                    "Per-layer gradient norm", "Coverage", "Provenance")]
    assert order == sorted(order)
    assert page.index("class='first-error'") < _h3(page, "Loss")
    assert "first error: nonfinite_grad at step 2002, tensor layer1.weight" in page
    # The provenance (and its 200 packages) is folded at the end, closed.
    m = re.search(r"<details class='provenance'>(.*?)</details>", page, re.S)
    assert m and "<h3>Provenance</h3>" in m.group(1) and "pkg199" in m.group(1)
    assert "pkg0" not in page[:m.start()]
    assert not re.search(r"<details[^>]*\bopen\b", page)
    # Findings marked on the loss chart, coloured by severity, kind and tensor in the tooltip.
    loss = page[_h3(page, "Loss"):_h3(page, "Global norms")]
    marks = re.findall(r"<g class='finding-marker' data-step='(\d+)'><title>([^<]*)</title>"
                       r"<line [^>]*stroke='([^']+)'", loss)
    assert [(int(s), c) for s, _, c in marks] == [(FINDING, "#ff7f0e"), (FINDING + 2, "#d62728")]
    assert "nonfinite_grad layer1.weight" in marks[1][1]
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page  # escaped
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert f"from the {FIRST + STEPS // EVERY - 1 + RING - 1 + len(LATE)} of {STEPS} step " \
           "records with per-tensor rows" in page


def test_html_lines_never_span_a_gap(traces):
    t = load_trace(traces["a"])
    page = render([traces["a"]])
    charts = page[_h3(page, "Loss"):_h3(page, "Per-layer gradient norm")]

    def measured(name, s):
        if name == "loss":
            return s.get("loss") is not None
        if name in ("update_norm", "update_ratio") and not s["update_stats"]:
            return False
        return s["global"].get(name) is not None

    lines = re.findall(r"<polyline [^>]*data-from='(\d+)' data-to='(\d+)' points='[^']*'>"
                       r"<title>(\w+)</title>", charts)
    assert {n for _, _, n in lines} == {"loss", "grad_norm"}
    for a, b, name in lines:
        inside = [s for s in t["steps"] if int(a) <= s["step"] <= int(b)]
        assert inside and all(measured(name, s) for s in inside), (name, a, b)
    # The non-finite loss at FINDING + 2 breaks the loss line in two.
    assert sorted((int(a), int(b)) for a, b, n in lines if n == "loss") == [
        (0, FINDING + 1), (FINDING + 3, STEPS - 1)]
    # Update statistics measured every UPDATE_EVERY steps: dots, never a line (nor a zero).
    dots = re.findall(r"<circle [^>]*><title>update_norm at step (\d+):", charts)
    assert [int(s) for s in dots] == list(range(0, STEPS, UPDATE_EVERY))
    assert len(re.findall(r"<circle [^>]*><title>param_norm at step", charts)) == len(dots)


def test_html_headless_has_no_gap_lines_in_chromium(traces, tmp_path):
    """The rendered page, as a browser lays it out: the charts' polylines are where the data
    says (checked above); here only that it renders with the findings first on screen."""
    out = tmp_path / "page.html"
    out.write_text(render([traces["a"]]), encoding="utf-8")
    with headless_page() as page:
        page.goto(out.as_uri(), wait_until="load")
        table = page.locator("table.findings").bounding_box()
        assert table and table["y"] < 900  # on the first screen
        assert not page.locator("details.provenance table").first.is_visible()
        assert page.locator("svg.chart g.finding-marker").count() == 2


def test_tensorboard_export_has_gaps(traces, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainsan.tensorboard import export

    counts = export(traces["a"], str(tmp_path / "tb"))
    assert counts["steps"] == STEPS and counts["findings"] == 2
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    t = load_trace(traces["a"])
    rows = [s["step"] for s in t["steps"] if s.get("tensors")]
    assert [e.step for e in acc.Scalars("grad_norm/layer1.weight")] == rows
    assert [e.step for e in acc.Scalars("global/update_norm")] == list(
        range(0, STEPS, UPDATE_EVERY))
    assert len(acc.Scalars("global/grad_norm")) == STEPS
    assert len(acc.Scalars("global/loss")) == STEPS - 1  # the non-finite loss is null
    late = {e.step: e.value for e in acc.Scalars("grad_norm/layer0.weight")}
    assert late[LATE[0]] == pytest.approx(_rows(LATE[0], None, 1e3)["layer0.weight"]["grad"]["l2"])


def test_poison_batches_read_the_rotated_part(traces):
    from trainsan.attribution import poison_batches

    assert sorted(r["step"] for r in poison_batches(traces["rot"])) == [100, 2500]
    assert [r["step"] for r in poison_batches(traces["a"])] == []


def test_rank_fingerprints_compared_at_row_steps(traces, tmp_path):
    from trainsan.report import report_many

    def rank(r):
        recs = _run()
        for rec in recs:
            if r and rec["type"] in ("step", "tensors") and rec["step"] >= 57 and \
                    rec.get("tensors"):
                rec["tensors"]["layer0.bias"]["param"] = (
                    rec["tensors"]["layer0.bias"]["param"] and dict(
                        rec["tensors"]["layer0.bias"]["param"], hash="00000000000000ff"))
        return _write(tmp_path / f"run.rank{r}.jsonl", recs)

    text = report_many([rank(0), rank(1)])
    # Parameter fingerprints are in the rows of the update steps only (0, 100, 200, ...).
    assert ("fingerprints first differ at step 100: layer0.bias (rank1 differ from rank0's "
            "trace); no step between step 0 (where they agreed) and this one has parameter "
            "fingerprints in per-tensor rows") in text, text


def test_png_plots_measured_points_only(traces, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    import matplotlib.pyplot as plt

    report(traces["a"], str(tmp_path / "norms.png"))
    assert (tmp_path / "norms.png").stat().st_size > 1000
    ax = plt.gcf().axes[0]
    upd = [ln for ln in ax.lines if ln.get_label() == "update_norm"][0]
    ys = upd.get_ydata()
    measured = [int(x) for x, y in zip(upd.get_xdata(), ys) if y == y]
    assert measured == list(range(0, STEPS, UPDATE_EVERY))  # NaN between: no line, no zero
    dots = [ln for ln in ax.lines if ln.get_color() == upd.get_color() and ln is not upd]
    assert dots and list(dots[0].get_xdata()) == measured
    plt.close("all")


_PIPE_CHILD = r"""
import signal, sys, torch, trainsan
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a C++ program has it: SIGPIPE ends the process
m = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(m.parameters(), 0.1)
san = trainsan.attach(m, opt, policy="record", trace=sys.argv[1], trace_rows_every=1)
for i in range(200):
    opt.zero_grad()
    m(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
print("TRAINED", san.coverage()["trace_error"] is not None)
san.close()
"""


def test_a_trace_pipe_whose_reader_closed_ends_the_trace_not_the_job(tmp_path):
    """A trace written into a pipe (trace=/dev/stdout | head, a FIFO) whose reader went away:
    the write fails with EPIPE and is told (Note [Bounded trace]); SIGPIPE, which would end a
    process that does not ignore it (any C++ program), is kept from it."""
    import os
    import subprocess
    import sys
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    child = subprocess.Popen([sys.executable, "-c", _PIPE_CHILD, str(fifo)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fd = os.open(fifo, os.O_RDONLY)  # meets the child's open for writing
    try:
        assert os.read(fd, 64).startswith(b'{"type":"header"')
    finally:
        os.close(fd)  # the reader goes away
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, (child.returncode, err[-2000:])
    assert "TRAINED True" in out, out + err[-2000:]
    assert "could not be written" in err, err[-2000:]
