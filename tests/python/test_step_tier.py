"""The every-step tier (Note [Every-step tier], Note [Lean rows]): what every step reads, what is
sampled and how late a sampled finding may come; option device_stop (Note [Device stop]) on CPU."""

import math

import pytest
import torch
import torch.nn.functional as F

import trainsan


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model, opt, i):
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _dense_permutation(t):
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return t.permute(order).is_contiguous()


def _reference_rows(tensors):
    """Float64 reference of the lean columns, independent of the pass."""
    out = []
    for t in tensors:
        d = t.detach().double().reshape(-1)
        fin = d.isfinite()
        f = d[fin]
        out.append(dict(
            numel=d.numel(), nan=int(d.isnan().sum()), posinf=int((d == math.inf).sum()),
            neginf=int((d == -math.inf).sum()), zero=int((d == 0).sum()),
            l2=float(f.norm()) if f.numel() else 0.0,
            absmax=float(f.abs().max()) if f.numel() else None,
        ))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_gradient_stats_lean_columns_against_float64(dtype):
    g = torch.Generator().manual_seed(7)
    ts = [
        torch.randn(70_000, generator=g).to(dtype),                  # two chunks, ordinary blocks
        torch.randn(300, 50, generator=g).to(dtype).t(),             # a strided view
        torch.tensor([0.0, -0.0, 1.0, float("nan"), float("inf"), -float("inf"), 1e-40]).to(dtype),
        torch.zeros(0, dtype=dtype),
        torch.full((5000,), 3.0, dtype=dtype) * (torch.rand(5000, generator=g) > 0.5),
    ]
    lean = trainsan.gradient_stats(ts)
    full = trainsan.tensor_stats(ts)
    for t, s, f, r in zip(ts, lean, full, _reference_rows(ts)):
        for k in ("numel", "nan", "posinf", "neginf", "zero"):
            assert getattr(s, k) == r[k], k
        assert (s.subnormal, s.fp16_overflow) == (f.subnormal, f.fp16_overflow)
        if t.is_contiguous() or not _dense_permutation(t):
            assert s.l2 == f.l2 and s.sum == f.sum  # the same additions in the same order
        else:  # a transpose: read in memory order (Note [Lean rows])
            assert s.l2 == pytest.approx(f.l2, rel=1e-12) and s.sum == pytest.approx(f.sum, abs=1e-9)
        assert s.l2 == pytest.approx(r["l2"], rel=1e-12, abs=0.0)
        assert s.absmax == r["absmax"] == f.absmax
        assert s.min is None and s.max is None and s.hash == 0


def test_gradient_stats_bad_input_names_it():
    with pytest.raises(TypeError, match="gradient_stats"):
        trainsan.gradient_stats([torch.zeros(3), "x"])


def test_steady_steps_read_gradients_lean_and_sample_the_parameters():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record", overhead_warmup=3) as san:
        for i in range(3):
            _step(model, opt, i)
            st = san.last_stats()
            (w,) = trainsan.tensor_stats([model[0].weight])
            # Warm-up: the parameters are read at every step (with their update statistics).
            assert (st["0.weight"].l2, st["0.weight"].min) == (w.l2, w.min)
            assert "0.weight.update" in st
        stale = 0
        for i in range(3, 60):
            _step(model, opt, i)
            st = san.last_stats()
            grad = st["0.weight.grad"]
            (ref,) = trainsan.tensor_stats([model[0].weight.grad])
            # Every step: the gradients, lean (no min/max/sum), the same l2 bits.
            assert grad.l2 == ref.l2 and grad.nan == ref.nan and grad.zero == ref.zero
            assert grad.absmax == ref.absmax
            assert grad.min is None and grad.sum == ref.sum
            (w,) = trainsan.tensor_stats([model[0].weight])
            stale += st["0.weight"].l2 != w.l2  # the latest measurement, not this step's
        cov = san.coverage()
        assert cov["steps_checked"] == 60
        # The parameters and their updates only on the sampled steps.
        assert stale > 0 and 3 <= cov["update_steps"] < 60
    assert san.findings == []


def test_nan_weight_is_found_at_the_next_step_and_nonfinite_param_within_the_period():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record", overhead_warmup=2) as san:
        for i in range(12):
            _step(model, opt, i)
        bad_step = san.step  # the step whose forward first sees the NaN weight
        with torch.no_grad():
            model[2].bias[0] = float("nan")
        for i in range(12, 12 + 60):
            _step(model, opt, i)
        period = san.coverage()["update_period"]
    kinds = {}
    for f in san.findings:
        kinds.setdefault(f.kind, f.step)
    # Never sampled: the loss and the gradients of the very next step.
    assert kinds.get("nonfinite_loss") == bad_step or kinds.get("nonfinite_grad") == bad_step
    # nonfinite_param: at most period - 1 steps later (Note [Every-step tier]).
    assert "nonfinite_param" in kinds
    assert bad_step - 1 <= kinds["nonfinite_param"] <= bad_step - 1 + period


def test_device_stop_on_cpu_raises_before_the_update():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record", device_stop=True) as san:
        for i in range(3):
            _step(model, opt, i)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
        (F.cross_entropy(model(x), y) * float("nan")).backward()
        with pytest.raises(RuntimeError, match="device_stop: .* non-finite gradient elements"):
            opt.step()
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[n]), n  # the update was not applied
    assert san.step == 3


def test_device_stop_off_by_default_and_silent_on_clean_steps():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record", device_stop=True) as san:
        for i in range(6):
            _step(model, opt, i)
    assert san.findings == []
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record") as san:
        opt.zero_grad()
        (F.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long))
         * float("nan")).backward()
        opt.step()  # no device_stop: reported, not stopped
    assert any(f.kind == "nonfinite_grad" for f in san.findings)


def _swap_to_copies(model, opt):
    """The bug "the optimizer holds other tensors than the model's": its groups now hold copies."""
    for group in opt.param_groups:
        group["params"] = [p.detach().clone().requires_grad_() for p in group["params"]]


def _leave_out_one_weight(model, opt):
    """A custom step that silently leaves one weight out (it steps a copy of 2.weight)."""
    group = opt.param_groups[0]
    group["params"] = [p if p is not model[2].weight else p.detach().clone().requires_grad_()
                       for p in group["params"]]


def _skipped_after(sabotage):
    """skipped_step findings of a run whose updates are sampled every 50 steps, `sabotage`d after
    23 steps, and the step it was done at."""
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record", overhead_warmup=2,
                         overhead_budget=1e-9) as san:
        for i in range(23):
            _step(model, opt, i)
        assert san.coverage()["update_period"] == 50
        sabotage(model, opt)
        bad_step = san.step
        for i in range(23, 27):
            _step(model, opt, i)
    return [f for f in san.findings if f.kind == "skipped_step"], bad_step


def test_a_step_that_writes_no_parameter_makes_the_next_step_an_update_step():
    # Note [Version trigger]: with a budget so small that updates are sampled every 50 steps,
    # "changed no parameter" still comes at most one step after the step that wrote nothing.
    skipped, bad_step = _skipped_after(_swap_to_copies)
    assert skipped and "changed no parameter" in skipped[0].message, skipped
    assert bad_step <= skipped[0].step <= bad_step + 1


def test_a_parameter_left_unwritten_is_found_one_step_later():
    left, bad_step = _skipped_after(_leave_out_one_weight)
    assert left and "2.weight" in left[0].message, left
    assert bad_step <= left[0].step <= bad_step + 1


class _DataSGD(torch.optim.Optimizer):
    """An update through .data (no version counter moves), as old optimizers and LibTorch's SGD
    write: healthy, and must not make every step an update step."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])


def test_updates_through_data_cost_one_extra_update_step_not_every_step():
    model, _ = _setup()
    opt = _DataSGD(model.parameters(), lr=0.05)
    with trainsan.attach(model, opt, policy="record", overhead_warmup=2,
                         overhead_budget=1e-9) as san:
        for i in range(120):
            _step(model, opt, i)
        cov = san.coverage()
    assert cov["update_period"] == 50
    # warm-up 2, the sampled ones (every 50th) and the one trigger at the first unmoved step.
    assert cov["update_steps"] <= 2 + 3 + 1, cov
    assert [f for f in san.findings if f.severity == "error"] == []


@pytest.mark.parametrize("fused", [True, False])
def test_gradients_a_fused_step_unscales_are_read_after_it(fused):
    """Note [Gradients read at the step's beginning]: a fused optimizer stepped by a GradScaler
    unscales the gradients inside its step, in place and without moving their versions, so the
    read at the step's begin would see them scaled (x 2^16 here); they are read at the step end.
    The recorded gradient norm is the unscaled one, as torch computes it after the step (float64)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    san = trainsan.attach(model, opt, policy="record")
    try:
        for i in range(4):
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            stats = san.last_stats()
            for name, p in model.named_parameters():
                want = p.grad.double().norm().item()
                assert stats[name + ".grad"].l2 == pytest.approx(want, rel=1e-9), (i, name)
        assert not san.findings
    finally:
        san.close()
