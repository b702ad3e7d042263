"""Issue 39's torture suite: odd but legal models and loops under policy "record", through
attach() and through the launcher, and bad API inputs.

Each case builds a model, its optimizers and a step; run under "record" it must raise nothing out
of TrainSan, report no error finding, not stop checking (no fault, Note [Faults]) and leave no hook
or patch behind after close(). The bad inputs must each be refused at attach with a message that
names what was wrong."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan

# --- the cases --------------------------------------------------------------------------------
# Each returns (model, optimizers (a list, maybe empty), step(i) -> None).


def _xy(n=16, d=8, classes=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=g) if classes else torch.randn(n, 1,
                                                                                  generator=g,
                                                                                  dtype=dtype)
    return x, y


def _plain(model, opt, x, y, loss_fn=F.mse_loss):
    def step(i):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    return step


class _Complex(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=dtype) * 0.3)
        self.head = nn.Linear(8, 1, dtype=torch.float64 if dtype == torch.cdouble else None)

    def forward(self, x):
        z = x.to(self.w.dtype) @ self.w
        return self.head(z.abs())


def case_complex64():
    m = _Complex(torch.cfloat)
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return m, [opt], _plain(m, opt, *_xy())


def case_complex128_sgd():
    m = _Complex(torch.cdouble)
    opt = torch.optim.SGD(m.parameters(), 1e-2, momentum=0.9)
    return m, [opt], _plain(m, opt, *_xy(dtype=torch.float64))


def case_float64():
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    return m, [opt], _plain(m, opt, *_xy(dtype=torch.float64))


def case_bfloat16():
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(torch.bfloat16)
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    return m, [opt], _plain(m, opt, *_xy(dtype=torch.bfloat16))


def case_float16_params():
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    return m, [opt], _plain(m, opt, *_xy(dtype=torch.float16))


def case_sparse_embedding_sparseadam():
    m = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(32, 1))
    opt_s = torch.optim.SparseAdam(list(m[0].parameters()), 1e-2)
    opt_d = torch.optim.Adam(list(m[2].parameters()), 1e-2)
    x = torch.randint(0, 50, (16, 4), generator=torch.Generator().manual_seed(0))
    y = torch.randn(16, 1)

    def step(i):
        opt_s.zero_grad()
        opt_d.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt_s.step()
        opt_d.step()
    return m, [opt_s, opt_d], step


class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.empty = nn.Parameter(torch.zeros(0, 4))  # a zero-size weight the forward uses

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def case_zero_size_parameter():
    m = _WithEmpty()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return m, [opt], _plain(m, opt, *_xy())


def case_noncontiguous_leaf():
    m = nn.Linear(8, 4)
    m.weight = nn.Parameter(torch.randn(8, 4).t())  # a transposed (non-contiguous) leaf
    assert not m.weight.is_contiguous()
    head = nn.Linear(4, 1)
    model = nn.Sequential(m, head)
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    return model, [opt], _plain(model, opt, *_xy())


def case_channels_last_conv():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(8, 4)).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), 1e-2, momentum=0.9)
    x = torch.randn(8, 3, 12, 12).to(memory_format=torch.channels_last)
    y = torch.randint(0, 4, (8,))
    return m, [opt], _plain(m, opt, x, y, F.cross_entropy)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def case_tied_weights():
    m = _Tied()
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    x = torch.randint(0, 32, (8, 5))
    y = torch.randint(0, 32, (8,))
    return m, [opt], _plain(m, opt, x, y, F.cross_entropy)


def case_parametrizations():
    from torch.nn.utils import parametrizations as P
    m = nn.Sequential(P.weight_norm(nn.Linear(8, 8)), nn.ReLU(), P.orthogonal(nn.Linear(8, 8)),
                      P.spectral_norm(nn.Linear(8, 1)))
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return m, [opt], _plain(m, opt, *_xy())


def case_functional_call():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    x, y = _xy()

    def step(i):
        opt.zero_grad()
        out = torch.func.functional_call(m, dict(m.named_parameters()), (x,))
        F.mse_loss(out, y).backward()
        opt.step()
    return m, [opt], step


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.head(h)


def case_checkpoint_dropout():
    m = _Checkpointed()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return m, [opt], _plain(m, opt, *_xy())


def case_inference_mode_eval_every_step():
    m = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    x, y = _xy()
    train = _plain(m, opt, x, y)

    def step(i):
        m.train()
        train(i)
        m.eval()
        with torch.inference_mode():
            m(x)
        m.train()
    return m, [opt], step


def case_fake_quant_activations():
    fq = torch.ao.quantization.FakeQuantize()
    m = nn.Sequential(nn.Linear(8, 16), fq, nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    return m, [opt], _plain(m, opt, *_xy())


def case_odd_dtype_parameters_and_buffers():
    m = nn.Linear(8, 1)
    m.register_buffer("f8", torch.zeros(4, dtype=torch.float8_e4m3fn))
    m.frozen_f8 = nn.Parameter(torch.zeros(4, dtype=torch.float8_e5m2), requires_grad=False)
    m.frozen_i64 = nn.Parameter(torch.arange(4), requires_grad=False)
    m.frozen_u16 = nn.Parameter(torch.zeros(4, dtype=torch.uint16), requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        m.frozen_chalf = nn.Parameter(torch.zeros(4, dtype=torch.complex32), requires_grad=False)
    opt = torch.optim.Adam([m.weight, m.bias], 1e-3)
    return m, [opt], _plain(m, opt, *_xy())


class _UnreadFirst(nn.Module):
    """A parameter the pass does not read registered before every other: the indices the
    package gives C++ (mode modules, ...) must still name the right parameters."""

    def __init__(self):
        super().__init__()
        self.codebook = nn.Parameter(torch.zeros(4, dtype=torch.float8_e4m3fn),
                                     requires_grad=False)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


def case_unread_parameter_first():
    m = _UnreadFirst()
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], 1e-3)
    return m, [opt], _plain(m, opt, *_xy())


def case_no_optimizer_manual_update():
    m = nn.Linear(8, 1)
    x, y = _xy()

    def step(i):
        m.zero_grad()
        F.mse_loss(m(x), y).backward()
        with torch.no_grad():
            for p in m.parameters():
                p -= 0.01 * p.grad
    return m, [], step


def case_several_optimizers_and_groups():
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_a = torch.optim.SGD([{"params": m[0].weight, "lr": 1e-2}, {"params": m[0].bias}], 1e-3)
    opt_b = torch.optim.Adam(m[2].parameters(), 1e-3)
    x, y = _xy()

    def step(i):
        opt_a.zero_grad()
        opt_b.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt_a.step()
        opt_b.step()
    return m, [opt_a, opt_b], step


class _Functional(nn.Module):
    """A model holding no parameter: its forward reads an external weight."""

    def __init__(self, w):
        super().__init__()
        self._w = [w]

    def forward(self, x):
        return torch.tanh(x @ self._w[0])


def case_optimizer_outside_the_module():
    w = torch.randn(8, 1, requires_grad=True)
    m = _Functional(w)
    opt = torch.optim.Adam([w], 1e-2)
    return m, [opt], _plain(m, opt, *_xy())


def case_lbfgs_closure():
    m = nn.Linear(8, 1)
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4)
    x, y = _xy()

    def step(i):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(m(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    return m, [opt], step


CASES = {name[len("case_"):]: fn for name, fn in sorted(globals().items())
         if name.startswith("case_")}

# --- what "nothing left behind" means ---------------------------------------------------------

_PATCHED = [(torch.Tensor, "backward"), (torch.autograd, "backward"), (torch, "save"),
            (torch, "load"), (torch.optim.Optimizer, "zero_grad"), (nn.Module, "zero_grad"),
            (nn.Module, "__getstate__"), (nn.Module, "load_state_dict"),
            (torch.utils.data.DataLoader, "__iter__"), (torch.autograd.Function, "apply")]


def _patch_state():
    return {f"{getattr(o, '__name__', o)}.{a}": getattr(o, a, None) for o, a in _PATCHED}


def _hooks_of(model, opts):
    n = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
            for m in model.modules())
    n += sum(len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks) for o in opts)
    return n


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_odd_loop_under_record(name):
    torch.manual_seed(0)
    model, opts, step = CASES[name]()
    patches, hooks = _patch_state(), _hooks_of(model, opts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        san = trainsan.attach(model, opts or None, policy="record")
        for i in range(12):
            step(i)
        cov = san.coverage()
        summary = san.summary()
        san.close()
    faults = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
              and "trainsan" in str(w.message)]
    assert cov["fault"] is None and not faults, (cov["fault"], faults)
    errors = [f for f in san.findings if f.severity == "error"]
    assert not errors, summary
    assert cov["steps_checked"] > 0 or not opts, summary
    assert _hooks_of(model, opts) == hooks
    assert _patch_state() == patches


def test_complex_parameters_are_read_as_real_and_imaginary_parts():
    """Note [Dtypes the pass reads]: a complex tensor's statistics are those of its real view:
    the norm is the complex Frobenius norm, NaN counts count parts."""
    z = torch.randn(5, 7, dtype=torch.cdouble)
    z[1, 2] = complex(math.nan, 1.0)
    z[3, 4] = complex(math.inf, math.inf)
    st = trainsan.tensor_stats([z])[0]
    parts = torch.view_as_real(z)
    finite = parts[torch.isfinite(parts)]
    assert st.numel == 2 * z.numel()
    assert st.nan == 1 and st.posinf == 2
    assert st.l2 == pytest.approx(float(finite.norm()), rel=1e-12)
    conj = trainsan.tensor_stats([z.conj()])[0]  # a conjugate view: resolved, imaginary negated
    assert conj.l2 == pytest.approx(st.l2, rel=1e-12) and conj.nan == 1


def test_unread_dtypes_are_named_never_guessed():
    with pytest.raises(TypeError, match="float8_e4m3fn|Float8_e4m3fn"):
        trainsan.tensor_stats([torch.zeros(3, dtype=torch.float8_e4m3fn)])
    model, opts, step = case_odd_dtype_parameters_and_buffers()
    san = trainsan.attach(model, opts, policy="record")
    step(0)
    unread = san.coverage()["unread"]
    assert "frozen_f8 (float8_e5m2)" in unread and "frozen_u16 (uint16)" in unread, unread
    assert "not read: " in san.summary()
    san.close()


def test_rules_that_name_modules_still_do_with_an_unread_parameter_first():
    model, opts, step = case_unread_parameter_first()
    san = trainsan.attach(model, opts, policy="record")
    model.eval()  # the bug: training in eval mode (Dropout off)
    for i in range(4):
        step(i)
    san.close()
    assert san.coverage()["fault"] is None
    assert san.coverage()["unread"] == ["codebook (float8_e4m3fn)"]
    found = [f for f in san.findings if f.kind == "eval_mode"]
    assert found, san.summary()


def test_tensors_the_optimizer_trains_outside_the_module_are_watched():
    model, opts, step = case_optimizer_outside_the_module()
    w = opts[0].param_groups[0]["params"][0]
    san = trainsan.attach(model, opts, policy="raise")
    for i in range(3):
        step(i)
    stats = san.last_stats()
    assert any(k.endswith(".grad") for k in stats), stats
    assert any("does not hold" in n for n in san.coverage().get("notes", [])), san.coverage()
    assert not san.coverage()["outside_model"]
    san.close()
    # A bug it then finds there: NaN in the external weight's gradient.
    model, opts, step = case_optimizer_outside_the_module()
    san = trainsan.attach(model, opts, policy="record")
    with torch.no_grad():
        opts[0].param_groups[0]["params"][0][0, 0] = math.nan
    step(0)
    step(1)
    san.close()
    assert any(f.kind in ("nonfinite_grad", "nonfinite_loss", "nonfinite_param")
               for f in san.findings), san.summary()
    del w


def test_a_replaced_submodules_old_parameters_are_not_watched():
    """Note [Tensors outside the model]: the optimizer's tensors that a replaced submodule left
    behind are the bug param_not_in_optimizer names, not external weights to watch."""
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    m[2] = nn.Linear(8, 1)  # after the optimizer was built
    san = trainsan.attach(m, opt, policy="record")
    x, y = _xy()
    for i in range(5):
        _plain(m, opt, x, y)(i)
    san.close()
    kinds = {f.kind for f in san.findings}
    assert "param_not_in_optimizer" in kinds, san.summary()
    assert "missing_grad" not in kinds, san.summary()
    assert san.coverage()["outside_model"][0]["count"] == 2


def test_an_internal_error_under_record_is_told_once_and_the_loop_goes_on(monkeypatch):
    """Note [Faults]: TrainSan's own exception in a hook ends nothing under "record"."""
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), 1e-2)
    x, y = _xy()
    san = trainsan.attach(m, opt, policy="record")

    def broken(*a, **k):
        raise RuntimeError("boom inside trainsan")

    monkeypatch.setattr(san._ctx.hot, "step_end", broken)
    before = m.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="internal error in post_step.*boom inside trainsan"):
        for i in range(3):
            _plain(m, opt, x, y)(i)
    assert not torch.equal(before, m.weight)  # the optimizer stepped every time
    assert "boom" in san.coverage()["fault"]
    assert "stopped: " in san.summary()
    san.close()
    # Under "raise" the same error is the run's.
    m2 = nn.Linear(8, 1)
    opt2 = torch.optim.SGD(m2.parameters(), 1e-2)
    san2 = trainsan.attach(m2, opt2, policy="raise")
    monkeypatch.setattr(san2._ctx.hot, "step_end", broken)
    with pytest.raises(RuntimeError, match="boom inside trainsan"):
        _plain(m2, opt2, x, y)(0)
    san2._ctx.fault = "test"  # stop it: its close would meet the same broken handle state
    san2.close()


# --- bad API inputs ---------------------------------------------------------------------------

_OUT_OF_RANGE = [
    ("trace_every", 0, r"\[1, inf\)"), ("loss_spike_factor", -5, r"\(0, inf\)"),
    ("grad_explosion_factor", 0, r"\(1, inf\)"), ("update_underflow_fraction", 2.0, r"\(0, 1\]"),
    ("overhead_budget", -1, r"\[0, 1\]"), ("desync_timeout", -1, r"\(0, inf\]"),
    ("amp_skip_fraction", 0.0, r"\(0, 1\]"), ("grad_vanishing_ratio", 1.0, r"\[0, 1\)"),
    ("trivial_loss_ratio", math.nan, r"\[0, 1\)"), ("audit_every", -3, r"\[0, inf\)"),
    ("loss_spike_window", 3, r"\[4, inf\)"), ("trace_max_mb", -0.5, r"\[0, inf\)"),
]


@pytest.mark.parametrize("name,value,range_", _OUT_OF_RANGE)
def test_an_option_outside_its_range_is_refused_naming_it(name, value, range_):
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with pytest.raises(ValueError, match=rf"option {name} must be in {range_}, got"):
        trainsan.attach(m, opt, policy="record", **{name: value})
    assert not m._forward_pre_hooks and trainsan.attached(m) is None


def _just_outside():
    """(option, value just outside its range, range) for every numeric option of the table, at
    each finite end: computed here from the range text, independently of the C++ parser."""
    names, types, _defaults, ranges, _docs = torch.ops.trainsan.options()
    out = []
    for name, typ, r in zip(names, types, ranges):
        if typ not in ("int", "float"):
            continue
        lo, hi = (float(x) for x in r[1:-1].split(","))
        step = 1 if typ == "int" else 1e-6
        if math.isfinite(lo):
            out.append((name, lo if r[0] == "(" else lo - step, r))
        if math.isfinite(hi):
            out.append((name, hi if r[-1] == ")" else hi + step, r))
        elif r[-1] == ")":
            out.append((name, math.inf, r))
    return [(n, int(v) if types[names.index(n)] == "int" and math.isfinite(v) else v, r)
            for n, v, r in out]


@pytest.mark.parametrize("name,value,range_", _just_outside())
def test_every_numeric_option_is_refused_just_outside_its_range(name, value, range_):
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    err = TypeError if isinstance(value, float) and isinstance(trainsan.OPTIONS[name], int) \
        else ValueError  # inf for an int option is a float: the wrong type
    with pytest.raises(err, match=re.escape(name)):
        trainsan.attach(m, opt, policy="record", **{name: value})
    assert trainsan.attached(m) is None


def test_the_launcher_refuses_an_option_outside_its_range_before_the_script_runs(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("print('SCRIPT RAN')\n")
    r = subprocess.run([sys.executable, "-m", "trainsan", "run", "--loss-spike-factor", "-5",
                        str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "loss_spike_factor must be in (0, inf), got -5" in r.stderr, r.stderr
    assert "SCRIPT RAN" not in r.stdout


@pytest.mark.parametrize("kwargs,pattern", [
    ({"trace_every": "3"}, "trace_every takes an int"),
    ({"trace_every": 2.0}, "trace_every takes an int"),
    ({"loss_spike_factor": "10"}, "loss_spike_factor takes a number"),
    ({"track_updates": 1}, "track_updates takes a bool"),
    ({"trace_tensors": 3}, "trace_tensors takes a str"),
    ({"checks": {"stale_grad": "yes"}}, r"checks\['stale_grad'\] must be True or False"),
    ({"checks": {"stale_grad": 1}}, r"checks\['stale_grad'\] must be True or False"),
])
def test_an_option_of_the_wrong_type_is_refused_naming_it(kwargs, pattern):
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with pytest.raises(TypeError, match=pattern):
        trainsan.attach(m, opt, policy="record", **kwargs)
    assert trainsan.attached(m) is None


def test_update_ratio_band_must_be_a_band():
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with pytest.raises(ValueError, match="update_ratio_low"):
        trainsan.attach(m, opt, update_ratio_low=0.5, update_ratio_high=0.1)


def test_range_limits_are_accepted():
    m = nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    san = trainsan.attach(m, opt, policy="record", overhead_budget=None, trace_every=1,
                          update_underflow_fraction=1.0, desync_timeout=math.inf,
                          grad_vanishing_ratio=0.0, loss_spike_factor=1e-3)
    san.close()


# --- through the launcher ---------------------------------------------------------------------

_LAUNCHED = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {here!r})
    import test_torture as T
    torch.set_num_threads(1)
    for name in sorted(T.CASES):
        model, opts, step = T.CASES[name]()
        for i in range(6):
            step(i)
    print("ALL CASES RAN")
""")


def test_the_cases_through_the_launcher(tmp_path):
    script = tmp_path / "torture_script.py"
    script.write_text(_LAUNCHED.format(here=os.path.dirname(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "trainsan", "run", "--policy", "record",
                        str(script)], capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "ALL CASES RAN" in out, out[-4000:]
    assert "internal error" not in out, out[-4000:]
    assert "[error]" not in out, out[-4000:]
