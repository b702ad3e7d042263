"""Cost at scale (issue 35): update statistics without a copy of the weights (Note [Update
statistics without a snapshot]), a trace bounded per step (Note [Bounded trace]), and a trace that
cannot be written told, never raised into the loop."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan
from trainsan.report import diff, load_trace


@pytest.fixture(autouse=True)
def _one_thread():
    """Hundreds of tiny steps: one torch thread, so that a loaded machine (CTest runs two suites
    at once on two cores) does not make every parallel region wait for a descheduled thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _pair(seed=0, big=512):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, big), nn.ReLU(), nn.Linear(big, big), nn.ReLU(),
                          nn.Linear(big, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _steps(model, opt, n, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


# --- update statistics from the sample ------------------------------------------------------


def test_sampled_update_estimates_agree_with_the_exact_copy():
    """The same run twice, exact copy and sample: every tensor's changed count and ||dtheta||
    within a few percent (tensors of <= 4096 elements exactly), max |dtheta| a lower bound."""
    stats = []
    for exact in (True, False):
        model, opt = _pair()
        with trainsan.attach(model, opt, policy="record", overhead_budget=0,
                             exact_updates=exact) as san:
            _steps(model, opt, 4)
            stats.append(san.last_stats())
            assert san.findings == []
    ex, sa = stats
    for name, s in ex.items():
        if not name.endswith(".update"):
            continue
        e, a = s, sa[name]
        assert e.l2 > 0
        if e.numel <= 4096:
            assert (a.l2, a.zero, a.absmax) == (e.l2, e.zero, e.absmax), name
            continue
        assert abs(a.l2 - e.l2) <= 0.05 * e.l2, (name, a.l2, e.l2)
        assert abs((e.numel - a.zero) - (e.numel - e.zero)) <= 0.03 * e.numel, name
        assert 0 < a.absmax <= e.absmax, name


def test_a_tensor_the_step_skips_is_found_exactly_and_sparse_updates_are_not():
    """A custom step that leaves one large tensor unchanged: skipped_step names it from the
    fingerprints; an embedding whose few rows change (most sampled elements do not) is never
    called unchanged, and its update ratio is never judged too low from the sample alone."""

    class SkipsOne(torch.optim.Optimizer):  # an off-by-one over its group's list
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for k, p in enumerate(group["params"]):
                    if k != 1 and p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 4))
    params = [model[2].bias, model[2].weight] + [p for n, p in model.named_parameters()
                                                 if not n.startswith("2.")]
    opt = SkipsOne(params, lr=0.1)
    with trainsan.attach(model, opt, policy="record", overhead_budget=0) as san:
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(8, 32)), torch.randint(0, 4, (8,))).backward()
            opt.step()
    hits = [f for f in san.findings if f.kind == "skipped_step"]
    assert [f.tensor for f in hits] == ["2.weight"], san.findings

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50_000, 64)
            self.head = nn.Linear(64, 4)

        def forward(self, idx):
            return self.head(self.emb(idx).mean(1))

    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # sparse rows: no momentum, no decay
    with trainsan.attach(model, opt, policy="record", overhead_budget=0) as san:
        for _ in range(8):
            opt.zero_grad()
            F.cross_entropy(model(torch.randint(0, 50_000, (4, 3))),
                            torch.randint(0, 4, (4,))).backward()
            opt.step()
        upd = san.last_stats()["emb.weight.update"]
        assert upd.numel - upd.zero >= 1  # changed, whatever the sample saw
    kinds = {f.kind for f in san.findings}
    assert "skipped_step" not in kinds and "update_ratio" not in kinds, san.findings


def _wide_mlp_run(opt_factory, steps=12, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 6000), nn.ReLU(), nn.Linear(6000, 1))
    opt = opt_factory(model.parameters())
    with trainsan.attach(model, opt, policy="record", **kw) as san:
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(16, 32)), torch.randn(16, 1)).backward()
            opt.step()
    return san.findings


class _EmbLM(nn.Module):
    def __init__(self, vocab=50_000, dim=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 8)
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, t):
        return self.head(self.emb(t).mean(1))


def _emb_run(opt_factory, tokens=4, dtype=torch.float32, steps=12, seed=0):
    torch.manual_seed(seed)
    model = _EmbLM().to(dtype)
    opt = opt_factory(model.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(steps):
            t = torch.randint(0, 50_000, (2, tokens // 2), generator=g)
            y = torch.randint(0, 8, (2,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(t), y).backward()
            opt.step()
    return san.findings


def test_a_learning_rate_that_rounds_every_update_away_is_found_from_the_sample():
    """SGD at 1e-10 on 192k-element weights: only a few near-zero weights change a step, which
    no sampled element sees; the gradient is dense, so the update ratio's estimate (~0) is judged
    (and found, as with the exact copy)."""
    for exact in (True, False):
        found = _wide_mlp_run(lambda p: torch.optim.SGD(p, lr=1e-10), exact_updates=exact)
        assert "update_ratio" in {f.kind for f in found}, (exact, found)


def test_sparse_updates_are_not_judged_from_a_sample_that_cannot_see_them():
    """A bf16 embedding under SGD whose few rows do change: no update_underflow from the sample
    (4 of 5 seeds reported one before the gradient's density was required); and a step without a
    learning rate that skips a tensor is found at once although the embedding's change is unseen."""
    for seed in range(3):
        found = _emb_run(lambda p: torch.optim.SGD(p, lr=1.0), dtype=torch.bfloat16, seed=seed)
        assert "update_underflow" not in {f.kind for f in found}, (seed, found)

    class NoLr(torch.optim.Optimizer):  # no "lr" in its groups; skips 1-d tensors
        def __init__(self, params, step_size):
            super().__init__(params, {"step_size": step_size})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.dim() > 1:
                        p.add_(p.grad, alpha=-group["step_size"])

    for seed in range(3):
        found = _emb_run(lambda p: NoLr(p, 0.5), steps=4, seed=seed)
        hit = [f for f in found if f.kind == "skipped_step" and f.tensor == "head.bias"]
        assert hit and hit[0].step == 0, (seed, found)


def test_update_outside_step_from_fingerprints():
    model, opt = _pair(big=128)
    with trainsan.attach(model, opt, policy="record", checks={"update_outside_step": True}) as san:
        _steps(model, opt, 3)
        with torch.no_grad():
            model[2].weight[7, 3] += 1.0  # one element of a 16k-element tensor, outside a step
        _steps(model, opt, 2, seed=1)
    hits = [f for f in san.findings if f.kind == "update_outside_step"]
    assert [f.tensor for f in hits] == ["2.weight"], san.findings


def test_the_sample_costs_no_copy_of_the_weights():
    """A 64 MiB parameter: the exact copy costs its size in resident memory, the sample
    (at most 4096 elements a tensor) next to nothing."""
    grown = {}
    for exact in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(4096, 4096, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model(torch.randn(2, 4096)).sum().backward()  # the gradient exists before the mark
        before = _rss_mib()
        with trainsan.attach(model, opt, policy="record", exact_updates=exact):
            grown[exact] = _rss_mib() - before
        del model, opt
    assert grown[True] > 48, grown
    assert grown[False] < 8, grown


# --- the bounded trace ----------------------------------------------------------------------


def _many_tensors(layers=24, width=32):
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*mods, nn.Linear(width, 4))


def _train_traced(path, steps, nan_at=None, **kw):
    model = _many_tensors()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sizes = {}
    with trainsan.attach(model, opt, policy="record", trace=path, **kw) as san:
        for s in range(steps):
            opt.zero_grad()
            x = torch.randn(4, 32)
            if s == nan_at:
                x[0, 0] = float("nan")
            F.cross_entropy(model(x), torch.randint(0, 4, (4,))).backward()
            opt.step()
            sizes[s] = os.path.getsize(path)
    return san, sizes


def test_trace_grows_at_most_1_kib_a_step_and_rows_go_where_they_matter(tmp_path):
    path = tmp_path / "t.jsonl"
    n_tensors = len(list(_many_tensors().parameters()))
    # Steady state between steps 300 and 600: the magnitude rules, which this random data can
    # trip (a grad_explosion there brings 17 records of rows, by design), are off.
    san, sizes = _train_traced(path, 662, nan_at=650,
                               checks={"grad_explosion": False, "loss_spike": False})
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    window = [r for r in recs if 300 < r.get("step", -1) <= 600]
    assert (sizes[600] - sizes[300]) / 300 <= 1024, (
        (sizes[600] - sizes[300]) / 300, [(r["kind"], r["step"], r["tensor"], r["message"][:150]) for r in window
                                          if r["type"] == "finding"][:40])
    t = load_trace(str(path))
    steps = {s["step"]: s for s in t["steps"]}
    assert len(steps) == 662
    assert all("loss" in s and len(s["global"]["digest"]) == 16 for s in steps.values())
    rows = {st: s["rows"] for st, s in steps.items() if "tensors" in s}
    assert {st for st, why in rows.items() if why == "first"} == set(range(10))
    sampled = [st for st, why in rows.items() if why == "sampled"]
    assert sampled and all(st % 100 == 0 for st in sampled), rows  # within the bytes' budget
    assert all(len(steps[st]["tensors"]) == n_tensors for st in rows)
    # The NaN at step 450: the ring's 8 steps before it (written late) and 8 after it.
    nan = min(f["step"] for f in t["findings"] if f["kind"] == "nonfinite_grad")
    assert nan == 650
    assert all(rows.get(st) == "before_finding" for st in range(642, 650)), rows
    assert all(rows.get(st) == "finding" for st in range(650, 659)), rows
    assert t["summary"]["coverage"]["trace_rows_steps"] == sum(
        1 for s in t["steps"] if s.get("rows") in ("first", "sampled", "finding"))
    assert san.coverage()["trace_error"] is None


def test_diff_of_bounded_traces_finds_the_first_differing_step(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    torch.manual_seed(0)
    _train_traced(a, 250)
    torch.manual_seed(0)
    _train_traced(b, 250)
    assert diff(str(a), str(b)).startswith("no difference")
    torch.manual_seed(0)
    model = _many_tensors()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    c = tmp_path / "c.jsonl"
    with trainsan.attach(model, opt, policy="record", trace=c):
        for s in range(250):
            opt.zero_grad()
            x = torch.randn(4, 32)
            y = torch.randint(0, 4, (4,))
            if s == 137:
                with torch.no_grad():
                    model[4].weight.mul_(1.0 + 2 ** -20)  # numerics differ from step 137 on
            F.cross_entropy(model(x), y).backward()
            opt.step()
    out = diff(str(a), str(c))
    assert "137" in out, out


def test_rows_every_step_is_the_old_full_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    _train_traced(path, 30, trace_rows_every=1)
    t = load_trace(str(path))
    assert all(s.get("rows") == "all" and s["tensors"] for s in t["steps"])


def test_rotation_keeps_the_newest_part_with_a_header(tmp_path):
    path = tmp_path / "t.jsonl"
    _train_traced(path, 400, trace_max_mb=0.05)
    assert path.with_name("t.jsonl.1").exists()
    first = json.loads(path.read_text().splitlines()[0])
    assert first["type"] == "header" and first["rotated"] >= 1
    assert os.path.getsize(path) <= 0.05 * 1048576 + 64 * 1024


# --- a trace that cannot be written ---------------------------------------------------------


def test_unwritable_trace_is_told_once_and_the_run_goes_on():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    model, opt = _pair(big=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with trainsan.attach(model, opt, trace="/dev/full") as san:  # policy raise
            _steps(model, opt, 200)
    told = [w for w in caught if "/dev/full" in str(w.message)]
    assert len(told) == 1, [str(w.message) for w in caught]
    assert "No space left on device" in str(told[0].message)
    assert san.step == 200
    assert "/dev/full" in (san.coverage()["trace_error"] or "")
    assert "trace: " in san.summary()


def test_trace_that_cannot_be_opened(tmp_path):
    model, opt = _pair(big=64)
    bad = tmp_path / "no" / "such" / "dir" / "t.jsonl"
    with pytest.raises(ValueError, match="No such file or directory"):
        trainsan.attach(model, opt, trace=bad)
    with pytest.warns(UserWarning, match="cannot open the trace file"):
        san = trainsan.attach(model, opt, policy="warn", trace=bad)
    with san:
        _steps(model, opt, 3)
    assert san.step == 3 and "cannot open" in san.summary()


def test_kill_9_keeps_every_record_before_the_step_in_flight(tmp_path):
    path = tmp_path / "k.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, torch, torch.nn as nn, torch.nn.functional as F, trainsan
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, trace={str(path)!r})
        for s in range(100):
            opt.zero_grad()
            F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 3, (4,))).backward()
            opt.step()
            if s == 50:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in recs if r["type"] == "step"] == list(range(51))


def test_every_trace_tool_on_a_long_bounded_trace(tmp_path):
    """2,000 steps of a real run (a NaN planted at step 1,500), trace at the defaults: report,
    report --html, diff, tensorboard, precision and --resume-trace each still find what they are
    for on the bounded trace, which stays small."""
    from trainsan.__main__ import main as cli
    from trainsan.report import precision, report

    path = tmp_path / "long.jsonl"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(2000)]
    with trainsan.attach(model, opt, policy="record", trace=path, headroom_every=500) as san:
        for s, (x, y) in enumerate(batches):
            opt.zero_grad()
            if s == 1500:
                x = x.clone()
                x[0, 0] = float("nan")
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert os.path.getsize(path) / 2000 < 1024
    t = load_trace(str(path))
    assert len(t["steps"]) == 2000 and t["summary"]["steps"] == 2000
    text = report(str(path))
    assert "nonfinite" in text and "per-tensor rows" in text, text
    # The rows around the NaN's step are there to read (ring before, records after).
    rows = {s["step"] for s in t["steps"] if s.get("tensors")}
    assert {1495, 1499, 1500, 1505} <= rows
    html = tmp_path / "r.html"
    assert cli(["report", str(path), "--html", str(html)]) == 0
    page = html.read_text()
    assert page.index("nonfinite") < page.index("<details")
    assert "no difference" in diff(str(path), str(path))
    assert "float16" in precision(str(path), None)
    if __import__("importlib").util.find_spec("tensorboard"):
        from trainsan.tensorboard import export
        assert export(str(path), str(tmp_path / "tb"))["steps"] == 2000
    # A resumed run that replays the first batches is told so from the bounded trace.
    model2 = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    with trainsan.attach(model2, opt2, policy="record", resume_trace=str(path)) as san2:
        for x, y in batches[:3]:
            opt2.zero_grad()
            F.cross_entropy(model2(x), y).backward()
            opt2.step()
    assert "duplicate_batch" in {f.kind for f in san2.findings}, san2.findings
