"""Mixed-precision debugging (issue 12), on the CPU: fp16 and bf16 autocast with
``torch.amp.GradScaler("cpu")``, pure bf16 weights.

Planted, each found and named: an activation overflowing fp16 (between modules and inside one;
with and without a scaler; auto-watched and with watch_loss), weights beyond the fp16 range, a
scaler collapsing after its warm-up and one that never finds a scale, Inf kept in uncleared
gradients, bf16 updates rounding away (the whole model, and only a LayerNorm gain), a loss reduced
in fp16, a NaN born in a middle layer (forward) and one born in a backward. Clean, silent at error
level: fp16 + scaler with occasional legitimate skips, bf16 autocast, fp32 master weights with
bf16 compute. And the machinery: provenance never changes a gradient, its hooks are gone after
each pass and after close, the trace records the scaler.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan


class Boost(nn.Module):
    """Multiplies by a factor (an fp16 overflow inside a module when large)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Net(nn.Module):
    def __init__(self, boost_between=1.0, boost_module=1.0, act=None):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.boost = Boost(boost_module)
        self.act = act if act is not None else nn.ReLU()
        self.fc2 = nn.Linear(32, 4)
        self.between = boost_between

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = self.boost(self.mid(h)) * self.between
        return self.fc2(self.act(h))


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative inputs


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x * 0.0) + x  # finite; its backward: Inf (d sqrt at 0) times 0 -> NaN


def train(model, steps=8, amp=None, scaler=False, lr=0.01, optim="sgd", loss_fn=None,
          plant=None, zero_grad=True, watch=False, **attach):
    torch.manual_seed(1)
    x = torch.randn(64, 16)
    y = torch.randint(0, 4, (64,))
    params = list(model.parameters())
    dtype = params[0].dtype
    opt = (torch.optim.AdamW(params, lr=lr) if optim == "adamw"
           else torch.optim.SGD(params, lr=lr))
    gs = torch.amp.GradScaler("cpu") if scaler else None
    attach.setdefault("policy", "record")
    san = trainsan.attach(model, opt, **attach)
    for i in range(steps):
        if zero_grad:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = model(x.to(dtype))
            loss = loss_fn(out, y) if loss_fn else F.cross_entropy(out.float(), y)
        if plant is not None:
            loss = plant(i, loss)
        if watch:
            san.watch_loss(loss)
        if gs is not None:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        else:
            loss.backward()
            opt.step()
    san.close()
    return san


def of(san, kind):
    return [f for f in san.findings if f.kind == kind]


def errors(san):
    return [(f.kind, f.tensor, f.message) for f in san.findings if f.severity == "error"]


# -- overflow provenance ---------------------------------------------------------------------


@pytest.mark.parametrize("scaler", [True, False], ids=["scaler", "no_scaler"])
@pytest.mark.parametrize("watch", [False, True], ids=["auto", "watch_loss"])
def test_activation_overflow_between_modules_is_located(scaler, watch):
    san = train(Net(boost_between=1e6), amp=torch.float16, scaler=scaler, watch=watch)
    (f,) = of(san, "nonfinite_loss")
    assert f.step == 0
    assert "It first appeared in the forward at the input of act (ReLU, float16" in f.message
    assert "made by the forward code of the model itself" in f.message
    assert "fp16 overflow" in f.message


def test_activation_overflow_inside_a_module_is_located():
    san = train(Net(boost_module=1e6), amp=torch.float16, scaler=True)
    (f,) = of(san, "nonfinite_loss")
    assert "at the output of boost (Boost, float16 under float16 autocast" in f.message
    assert "±Inf only: an fp16 overflow (a value beyond ±65504) in this module" in f.message


def test_weights_beyond_fp16_are_the_named_cause_before_the_loss():
    model = Net()
    with torch.no_grad():
        model.mid.weight[0, :3] = 1e5
    san = train(model, amp=torch.float16, scaler=True)
    kinds = [f.kind for f in san.findings]
    assert kinds.index("fp16_overflow") < kinds.index("nonfinite_loss")
    (cause,) = of(san, "fp16_overflow")
    assert cause.tensor == "mid.weight" and cause.step == 0 and cause.value == 3
    (loss,) = of(san, "nonfinite_loss")
    assert "at the output of mid (Linear" in loss.message
    assert "mid.weight (3)" in loss.message


class Float32Big(nn.Module):
    """A block kept in float32 under autocast whose output leaves the fp16 range."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return x.float() * 1e5


def test_float32_activation_beyond_fp16_is_the_named_cause():
    model = Net()
    model.boost = Float32Big()
    san = train(model, amp=torch.float16, scaler=True, steps=2)
    kinds = [f.kind for f in san.findings]
    assert kinds.index("fp16_overflow") < kinds.index("nonfinite_loss")
    (cause,) = of(san, "fp16_overflow")
    assert cause.tensor == "boost"
    assert "the output of boost (Float32Big, float32) reaches" in cause.message
    assert "the next op that autocast runs in float16 turns it into Inf" in cause.message


def test_nan_born_in_a_middle_layer_names_that_layer_not_the_loss():
    san = train(Net(act=Log()))
    (f,) = of(san, "nonfinite_loss")
    assert "at the output of act (Log, float32" in f.message
    grads = of(san, "nonfinite_grad")
    assert grads and "at the output of act (Log" in grads[0].message


def test_nan_born_in_the_backward_names_the_gradient():
    san = train(Net(act=Sqrt()), steps=1)  # (the next step would start from NaN weights)
    assert not of(san, "nonfinite_loss")
    (f,) = [g for g in of(san, "nonfinite_grad") if g.tensor == "mid.weight"] or [None]
    assert f is not None, san.findings
    first = of(san, "nonfinite_grad")[0].message
    assert "The forward's" in first and "(module inputs and outputs) were all finite" in first
    assert "It first appeared in the backward at the gradient of the output of" in first


def test_provenance_never_changes_gradients_or_weights():
    def run(attached):
        torch.manual_seed(3)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, policy="record",
                              provenance_every=1) if attached else None
        x = torch.randn(8, 16)
        grads = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), torch.arange(8) % 4)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        if san is not None:
            hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                        for m in model.modules())
            san.close()
            after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                        for m in model.modules())
            assert after == 0, "hooks left after close()"
            assert hooks <= 1, "provenance hooks left after the step read them"
        return grads, [p.detach().clone() for p in model.parameters()]

    g0, w0 = run(False)
    g1, w1 = run(True)
    for a, b in zip(sum(g0, []) + w0, sum(g1, []) + w1):
        assert torch.equal(a, b)


def test_provenance_off_between_samples():
    # Healthy run: armed only at the sampled steps (0, 5), not at the others.
    model = Net()
    seen = []
    orig = model.fc1.register_forward_hook

    def spy(*a, **k):
        seen.append(1)
        return orig(*a, **k)

    model.fc1.register_forward_hook = spy
    train(model, steps=8, provenance_every=5)
    assert len(seen) == 2


# -- the gradient scaler ---------------------------------------------------------------------


def test_scaler_collapse_after_warm_up_is_found_with_the_origin():
    san = train(Net(), amp=torch.float16, scaler=True, steps=12,
                plant=lambda i, loss: loss * 1e30 if i >= 4 else loss)
    (f,) = of(san, "amp_scale_collapse")
    assert f.severity == "error"
    assert "skipped the last 5 steps in a row" in f.message
    assert "65536* 32768* 16384* 8192* 4096*" in f.message
    assert "It first appeared in the backward at the gradient of the output of fc2" in f.message
    assert not of(san, "skipped_step") and not of(san, "nonfinite_grad")


def test_scaler_that_never_finds_a_scale_is_found():
    san = train(Net(), amp=torch.float16, scaler=True, steps=20,
                plant=lambda i, loss: loss * 1e30)
    (f,) = of(san, "amp_scale_collapse")
    assert "its scale fell to 0.5 (below 1" in f.message


def test_inf_kept_in_uncleared_gradients_collapses_the_scaler():
    san = train(Net(), amp=torch.float16, scaler=True, steps=10, zero_grad=False,
                plant=lambda i, loss: loss * 1e30 if i == 2 else loss)
    kinds = {f.kind for f in san.findings}
    assert {"stale_grad", "amp_scale_collapse"} <= kinds


def test_healthy_fp16_with_occasional_skips_is_silent():
    san = train(Net(), amp=torch.float16, scaler=True, steps=40,
                plant=lambda i, loss: loss * 1e30 if i in (5, 20) else loss)
    assert errors(san) == []


def test_trace_records_the_scaler(tmp_path):
    path = tmp_path / "run.jsonl"
    train(Net(), amp=torch.float16, scaler=True, steps=6, trace=str(path),
          plant=lambda i, loss: loss * 1e30 if i == 3 else loss)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    sc = [r for r in recs if r["type"] == "scaler"]
    assert len(sc) == 6
    assert [r["skipped"] for r in sc] == [False, False, False, True, False, False]
    assert sc[0]["scale"] == 65536.0 and sc[4]["scale"] == 32768.0


# -- bf16 ------------------------------------------------------------------------------------


def test_bf16_updates_rounding_away_everywhere():
    model = Net().to(torch.bfloat16)
    san = train(model, optim="adamw", lr=1e-4, steps=8)
    names = {f.tensor for f in of(san, "update_underflow")}
    assert {"fc1.weight", "mid.weight", "fc2.weight"} <= names
    f = of(san, "update_underflow")[0]
    assert f.severity == "warning" and "(bfloat16)" in f.message and "master weights" in f.message
    assert errors(san) == []


def test_bf16_layernorm_gain_rounding_away_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(),
                          nn.Linear(32, 4)).to(torch.bfloat16)
    san = train(model, optim="adamw", lr=1e-3, steps=8)
    assert {f.tensor for f in of(san, "update_underflow")} == {"1.weight"}


def test_bf16_autocast_and_fp32_master_weights_are_silent():
    san = train(Net(), amp=torch.bfloat16, optim="adamw", lr=1e-4, steps=10)
    assert san.findings == [], [(f.kind, f.message) for f in san.findings]


def test_loss_reduced_in_fp16_is_named():
    san = train(Net(), amp=torch.float16, scaler=True,
                loss_fn=lambda out, y: ((out - 1.0) ** 2).mean())
    (f,) = of(san, "low_precision_loss")
    assert f.severity == "warning" and "float16 tensor" in f.message and f.count == 8
    assert errors(san) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp16_overflow_is_located():
    torch.manual_seed(0)
    model = Net(boost_module=1e6).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gs = torch.amp.GradScaler("cuda")
    san = trainsan.attach(model, opt, policy="record", sync=True)
    x = torch.randn(64, 16, device="cuda")
    y = torch.randint(0, 4, (64,), device="cuda")
    for _ in range(4):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        gs.scale(loss).backward()
        gs.step(opt)
        gs.update()
    san.close()
    (f,) = of(san, "nonfinite_loss")
    assert "at the output of boost (Boost, float16" in f.message
