"""bad_custom_grad at the defaults: every custom autograd.Function is checked at its first use, on
small float64 copies of its inputs (Note [First-use gradcheck inputs], autograd_checks.py), with
deliberate surrogate gradients told apart (Note [Surrogate gradients], host/checks/autograd.cpp).
The Functions are written the way public code writes them: a memory-efficient Swish (EfficientNet
implementations), a tanh-GELU, a straight-through estimator, a gradient reversal layer (DANN), a
clamp with a straight-through backward, an LSQ fake-quantiser, an embedding lookup with integer
indices."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan
from trainsan.autograd_checks import _fn_users

# --- the Functions -------------------------------------------------------------------------------


class SwishFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class DoubledSwish(SwishFn):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return 2 * g * (s * (1 + x * (1 - s)))  # bug: a factor 2


class TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        c = math.sqrt(2 / math.pi)
        return 0.5 * x * (1 + torch.tanh(c * (x + 0.044715 * x**3)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (x + 0.044715 * x**3))
        dt = (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
        return g * (0.5 * (1 + t) + 0.5 * x * dt)


class SignFlippedGelu(TanhGelu):
    @staticmethod
    def backward(ctx, g):
        return -TanhGelu.backward(ctx, g)  # bug: the wrong sign


class ScaleShift(torch.autograd.Function):
    """Non-tensor arguments, a ctx attribute, a tuple of outputs (one marked non-differentiable:
    the argmax), once_differentiable."""

    @staticmethod
    def forward(ctx, x, w, scale, mode="affine"):
        ctx.scale, ctx.mode = scale, mode
        ctx.save_for_backward(x, w)
        y = scale * x * w
        idx = y.argmax(-1)
        ctx.mark_non_differentiable(idx)
        return y, idx, y.sum(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gidx, gs):
        x, w = ctx.saved_tensors
        g = gy + gs.unsqueeze(-1)
        return ctx.scale * g * w, (ctx.scale * g * x).sum(0), None, None


class Lookup(torch.autograd.Function):
    """An embedding lookup: the weight first, integer indices second."""

    @staticmethod
    def forward(ctx, weight, idx):
        ctx.save_for_backward(idx)
        ctx.rows = weight.shape[0]
        return weight[idx]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        gw = torch.zeros(ctx.rows, g.shape[-1], dtype=g.dtype, device=g.device)
        return gw.index_add_(0, idx.reshape(-1), g.reshape(-1, g.shape[-1])), None


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g  # straight through


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.neg() * ctx.alpha, None


class ClampSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-0.5, 0.5)

    @staticmethod
    def backward(ctx, g):
        return g.clone()


class LsqQuant(torch.autograd.Function):
    """Learned step size quantisation (Esser et al.): round(x/s)·s, straight through in x."""

    @staticmethod
    def forward(ctx, x, s, qmax):
        ctx.save_for_backward(x, s)
        ctx.qmax = qmax
        return torch.round((x / s).clamp(-qmax, qmax)) * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        q = x / s
        inside = (q.abs() <= ctx.qmax).to(g.dtype)
        gs = torch.where(inside > 0, torch.round(q) - q, q.clamp(-ctx.qmax, ctx.qmax))
        return g * inside, (g * gs).sum().reshape(s.shape), None


class MyReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0).to(g.dtype)


class DoubledReLU(MyReLU):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * (x > 0).to(g.dtype)  # bug: a factor 2


class NoisyDropout(torch.autograd.Function):
    """Stochastic: the RNG must be left as it was."""

    @staticmethod
    def forward(ctx, x, p):
        mask = (torch.rand_like(x) > p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask, None


# --- the loop ------------------------------------------------------------------------------------


class Net(nn.Module):
    """`act`: a Function (its apply looked up at each call, as code that writes Fn.apply(x) in
    forward does), or any callable."""

    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        self.act = act

    def forward(self, x):
        h = self.fc1(x)
        act = self.act
        h = act.apply(h) if isinstance(act, type) else act(h)
        return self.fc2(h)


def _train(model, steps=3, seed=1, **opts):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(seed)
    with trainsan.attach(model, opt, policy="record", **opts) as san:
        for _ in range(steps):
            x, y = torch.randn(32, 8), torch.randn(32, 1)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return [f for f in san.findings if f.kind == "bad_custom_grad"], san


def _found(fn, **opts):
    return _train(Net(fn), **opts)[0]


def test_a_doubled_swish_is_found_at_its_first_use():
    fs = _found(DoubledSwish)
    assert len(fs) == 1, [f.message for f in fs]
    f = fs[0]
    assert f.step == 0 and f.count == 1 and f.severity == "error"
    assert f.tensor == f"{__name__}.DoubledSwish:input 0"
    assert f.value == pytest.approx(2.0, rel=1e-3)
    assert "(2x)" in f.message


def test_a_sign_flipped_gelu_is_found_at_its_first_use():
    fs = _found(SignFlippedGelu)
    assert [f.step for f in fs] == [0], [f.message for f in fs]
    assert "(the opposite sign)" in fs[0].message


def test_a_doubled_relu_is_found_on_its_positive_side():
    fs = _found(DoubledReLU)
    assert [f.tensor for f in fs] == [f"{__name__}.DoubledReLU:input 0"], [f.message for f in fs]


@pytest.mark.parametrize("fn", [SwishFn, TanhGelu, MyReLU, RoundSTE, ClampSTE])
def test_correct_and_straight_through_functions_are_silent(fn):
    fs, san = _train(Net(fn))
    assert fs == [], [f.message for f in fs]
    assert not san.errors()


def test_gradient_reversal_is_silent():
    class DANN(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.features = nn.Linear(8, 16)
            self.label = nn.Linear(16, 1)
            self.domain = nn.Linear(16, 1)

        def forward(self, x):
            h = torch.relu(self.features(x))
            return self.label(h) + self.domain(GradReverse.apply(h, 0.3))

    assert _train(DANN())[0] == []


def test_lsq_quantiser_is_silent():
    class QNet(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc1 = nn.Linear(8, 16)
            self.step = nn.Parameter(torch.tensor(0.05))
            self.fc2 = nn.Linear(16, 1)

        def forward(self, x):
            return self.fc2(LsqQuant.apply(self.fc1(x), self.step, 7))

    assert _train(QNet())[0] == []


def test_non_tensor_arguments_tuples_and_integer_inputs_are_checked():
    class Many(nn.Module):
        def __init__(self, bug=False):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Parameter(torch.randn(50, 8) * 0.1)
            self.w = nn.Parameter(torch.randn(8))
            self.fc = nn.Linear(8, 1)
            self.bug = bug

        def forward(self, x):
            idx = (x[:, 0].abs() * 10).long() % 50  # integer indices into the table
            h = Lookup.apply(self.emb, idx) + x
            y, top, s = ScaleShift.apply(h, self.w, 0.5, "affine")
            assert top.dtype == torch.int64 and not top.requires_grad
            return self.fc(y) + s.unsqueeze(-1)

    fs, san = _train(Many())
    assert fs == [], [f.message for f in fs]
    assert not san.errors()

    # The same Functions with a slip each: the lookup's table gradient doubled (checked on full
    # copies: its indices do not fit 2 rows of the table), ScaleShift's weight gradient negated.
    class DoubledLookup(Lookup):
        @staticmethod
        def backward(ctx, g):
            gw, gi = Lookup.backward(ctx, g)
            return 2 * gw, gi

    class NegatedScaleShift(ScaleShift):
        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, gy, gidx, gs):
            x, w = ctx.saved_tensors
            g = gy + gs.unsqueeze(-1)
            return ctx.scale * g * w, -(ctx.scale * g * x).sum(0), None, None

    class Buggy(Many):
        def forward(self, x):
            idx = (x[:, 0].abs() * 10).long() % 50
            h = DoubledLookup.apply(self.emb, idx) + x
            y, _, s = NegatedScaleShift.apply(h, self.w, 0.5, "affine")
            return self.fc(y) + s.unsqueeze(-1)

    fs = _train(Buggy())[0]
    assert sorted(f.tensor.split(".")[-1] for f in fs) == [
        "DoubledLookup:input 0", "NegatedScaleShift:input 1"], [f.message for f in fs]


def test_switched_off_nothing_and_no_wrapper():
    orig = torch.autograd.Function.__dict__["apply"]
    model = Net(DoubledSwish)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with trainsan.attach(model, opt, policy="record", checks={"bad_custom_grad": False}) as san:
        assert torch.autograd.Function.__dict__["apply"] is orig and not _fn_users
        F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1)).backward()
        opt.step()
    assert not [f for f in san.findings if f.kind == "bad_custom_grad"]
    assert torch.autograd.Function.__dict__["apply"] is orig


def test_re_checked_on_gradcheck_every_steps_and_once_with_zero():
    fs = _found(DoubledSwish, steps=5, gradcheck_every=2)
    assert [(f.step, f.count) for f in fs] == [(0, 3)]  # steps 0, 2 and 4
    fs = _found(DoubledSwish, steps=5, gradcheck_every=0)
    assert [(f.step, f.count) for f in fs] == [(0, 1)]


def test_a_function_first_used_later_is_checked_then():
    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc0, self.fc = nn.Linear(8, 8), nn.Linear(8, 1)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            # Applied to the raw input first (nothing differentiable: not checked, not marked).
            x = DoubledSwish.apply(x) if self.calls == 2 else x
            h = self.fc0(x)
            return self.fc(DoubledSwish.apply(h) if self.calls > 2 else h)

    fs = _train(Late(), steps=4)[0]
    assert [(f.step, f.count) for f in fs] == [(2, 1)]


@pytest.mark.parametrize("fn", [SwishFn, DoubledSwish, NoisyDropout])
def test_the_first_use_check_changes_nothing(fn):
    """Parameters, .grad and the RNG stream after the steps are those of a run without it."""

    def run(check):
        act = (lambda h: NoisyDropout.apply(h, 0.2)) if fn is NoisyDropout else fn
        model = Net(act)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(3)
        with trainsan.attach(model, opt, policy="record",
                             checks={"bad_custom_grad": check}) as san:
            for _ in range(3):
                x, y = torch.randn(32, 8), torch.randn(32, 1)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            grads = [p.grad.clone() for p in model.parameters()]
        params = [p.detach().clone() for p in model.parameters()]
        return params, grads, torch.get_rng_state(), san

    p0, g0, rng0, _ = run(False)
    p1, g1, rng1, san = run(True)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert torch.equal(rng0, rng1)
    found = [f for f in san.findings if f.kind == "bad_custom_grad"]
    assert bool(found) == (fn is DoubledSwish)


def test_an_apply_bound_before_attach_is_not_seen():
    """The documented limit: `swish = SwishFn.apply` taken before attach() calls the unwrapped
    apply (the wrapper is installed while a sanitizer is open)."""
    bound = DoubledSwish.apply
    assert _train(Net(lambda h: bound(h)))[0] == []


def test_the_check_runs_on_small_copies():
    """The Function sees 2-row float64 copies on the CPU, never the real tensors."""
    seen = []

    class Spy(SwishFn):
        @staticmethod
        def forward(ctx, x):
            seen.append((x.dtype, tuple(x.shape), x.data_ptr()))
            return SwishFn.forward(ctx, x)

    model = Net(Spy)
    _train(model, steps=1)
    assert seen[0][0] == torch.float32 and seen[0][1] == (32, 16)
    assert {s[:2] for s in seen[1:]} == {(torch.float64, (2, 16))}, seen
    assert seen[0][2] not in {s[2] for s in seen[1:]}
