"""The autograd family from Python: inplace_before_backward (saved-tensor hooks on sampled steps)
and bad_custom_grad (the custom-Function gradcheck, gradcheck_every). The rules themselves are
unit-tested in tests/cpp/test_checks_autograd.cpp."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch():
    return torch.randn(8, 4), torch.randn(8, 1)


def _hooks_top():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _train(model, opt, steps, write_at=(), write=None):
    for step in range(steps):
        x, y = _batch()
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if step in write_at:
            write(model)
        loss.backward()
        opt.step()


def _data_write(model):
    model[2].weight.data.mul_(0.5)  # saved by the second Linear, needed for the input gradient


def test_data_write_between_forward_and_backward_is_caught_on_a_sampled_step():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record", audit_first_steps=2, audit_every=0) as san:
        _train(model, opt, 6, write_at=(4,), write=_data_write)  # step 4: not sampled
        assert not [f for f in san.findings if f.kind == "inplace_before_backward"]
        _train(model, opt, 1, write_at=(0,), write=_data_write)  # step 6: not sampled either
        assert not [f for f in san.findings if f.kind == "inplace_before_backward"]
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record", audit_first_steps=2, audit_every=0) as san:
        _train(model, opt, 3, write_at=(1,), write=_data_write)
        fs = [f for f in san.findings if f.kind == "inplace_before_backward"]
    assert len(fs) == 1, san.summary()
    f = fs[0]
    assert f.step == 1 and f.severity == "error" and f.tensor == "2.weight"
    assert "parameter 2.weight ([1, 16] float32), saved for backward by" in f.message
    assert "between the forward and its backward" in f.message


def test_policy_raise_raises_from_backward_and_every_audit_every_step_is_sampled():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, audit_first_steps=0, audit_every=3)
    try:
        _train(model, opt, 2, write_at=(1,), write=_data_write)  # step 1: not sampled
        x, y = _batch()
        _train(model, opt, 1)  # step 2
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)  # step 3: sampled
        model[2].weight.detach().numpy()[:] = 0.0  # a NumPy view: no version bump either
        with pytest.raises(trainsan.TrainingBugError) as ei:
            loss.backward()
        assert ei.value.finding.kind == "inplace_before_backward"
    finally:
        san.close()
    assert _hooks_top() is None


@pytest.mark.parametrize("sampled", [True, False])
def test_ordinary_inplace_op_still_gets_torchs_own_error(sampled):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = 10 if sampled else 0
    with trainsan.attach(model, opt, policy="record", audit_first_steps=first, audit_every=0):
        x, y = _batch()
        h = model[1](model[0](x))  # relu saves its result
        out = model[2](h)
        loss = F.mse_loss(model(x), y) + out.sum()
        h.add_(1.0)  # an in-place op on a saved tensor: autograd's version check
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_detach_alias_write_is_torchs_error_not_a_finding():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        x, y = _batch()
        loss = F.mse_loss(model(x), y)
        with torch.no_grad():
            model[2].weight.detach().mul_(0.5)  # shares the version counter
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        assert not [f for f in san.findings if f.kind == "inplace_before_backward"]


def test_the_check_changes_no_gradient_and_no_parameter():
    def run(attach):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(1)
        san = trainsan.attach(model, opt, policy="record", gradcheck_every=1) if attach else None
        _train(model, opt, 4)
        if san is not None:
            san.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


def test_user_saved_tensor_hooks_are_left_alone():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(3):
            x, y = _batch()
            opt.zero_grad()
            with torch.autograd.graph.save_on_cpu():
                loss = F.mse_loss(model(x), y)
                loss.backward()
            assert _hooks_top() is None  # ours are popped at the step; theirs by their exit
            opt.step()
        assert not san.errors()
    assert _hooks_top() is None


def test_shared_memory_parameters_are_left_to_other_processes():
    """Hogwild (model.share_memory()): other processes' steps rewrite the shared weights between a
    forward and its backward, by design. Such a write has the facts of an own-process .data write
    (no version bump): on a shared parameter neither is reported (Note [Shared-memory
    parameters]); the same write on the unshared twin is (the test above)."""
    model = _mlp()
    model.share_memory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record", audit_first_steps=3) as san:
        _train(model, opt, 3, write_at=(1,), write=_data_write)
        assert not [f for f in san.findings if f.kind == "inplace_before_backward"]
    # A NumPy write into a batch that is itself in shared memory is still found (not a parameter).
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        x, y = _batch()
        x.share_memory_()
        loss = F.mse_loss(model(x), y)
        x.numpy()[:] *= 2.0  # saved by the first Linear (for its weight's gradient)
        loss.backward()
        fs = [f for f in san.findings if f.kind == "inplace_before_backward"]
    assert len(fs) == 1 and "a tensor [8, 4]" in fs[0].message, [f.message for f in fs]


def test_inplace_check_can_be_switched_off():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record", checks={"inplace_before_backward": False}):
        x, y = _batch()
        model(x)
        assert _hooks_top() is None


# --- bad_custom_grad ----------------------------------------------------------------------------


class MyExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class DoubledExp(MyExp):
    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return 2 * g * y  # bug: off by a factor 2


class MyLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x, g.sum(0)


class NegatedWeightLinear(MyLinear):
    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, -(g.t() @ x), g.sum(0)  # bug: wrong sign of the weight gradient


class Net(nn.Module):
    def __init__(self, lin, act):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(6, 4) * 0.3)
        self.b = nn.Parameter(torch.zeros(6))
        self.out = nn.Linear(6, 1)
        self.lin, self.act = lin, act

    def forward(self, x):
        return self.out(self.act.apply(self.lin.apply(x, self.w, self.b)))


def _custom_run(lin, act, steps=3, **opts):
    model = Net(lin, act)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with trainsan.attach(model, opt, policy="record", **opts) as san:
        _train(model, opt, steps)
    return [f for f in san.findings if f.kind == "bad_custom_grad"]


def test_correct_custom_functions_pass():
    assert _custom_run(MyLinear, MyExp, gradcheck_every=1) == []


def test_buggy_custom_functions_are_named_with_their_input():
    fs = _custom_run(NegatedWeightLinear, DoubledExp, gradcheck_every=1)
    by_tensor = {f.tensor: f for f in fs}
    assert set(by_tensor) == {
        f"{__name__}.NegatedWeightLinear:input 1",
        f"{__name__}.DoubledExp:input 0",
    }, [f.message for f in fs]
    f = by_tensor[f"{__name__}.DoubledExp:input 0"]
    assert f.severity == "error" and f.step == 0
    assert f.value == pytest.approx(2.0, rel=1e-3)
    assert "custom autograd.Function" in f.message and "(2x)" in f.message
    assert "(the opposite sign)" in by_tensor[f"{__name__}.NegatedWeightLinear:input 1"].message


def test_gradcheck_at_first_use_by_default_then_sampled():
    fs = _custom_run(MyLinear, DoubledExp, steps=5)  # at its first use (gradcheck_every 1000)
    assert [(f.step, f.count) for f in fs] == [(0, 1)]
    fs = _custom_run(MyLinear, DoubledExp, steps=5, gradcheck_every=4)
    assert [(f.step, f.count) for f in fs] == [(0, 2)]  # steps 0 and 4


def test_opt_out_attribute_and_function_apply_restored():
    class StraightThrough(torch.autograd.Function):
        trainsan_gradcheck = False  # deliberately not the derivative

        @staticmethod
        def forward(ctx, x):
            return x.round()

        @staticmethod
        def backward(ctx, g):
            return g

    orig = torch.autograd.Function.__dict__["apply"]
    assert _custom_run(MyLinear, StraightThrough, gradcheck_every=1) == []
    assert torch.autograd.Function.__dict__["apply"] is orig


def test_gradcheck_keeps_the_users_random_stream():
    model = Net(MyLinear, MyExp)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with trainsan.attach(model, opt, policy="record", gradcheck_every=1):
        torch.manual_seed(5)
        x, y = _batch()
        F.mse_loss(model(x), y).backward()
        after = torch.rand(3)
    torch.manual_seed(5)
    _batch()
    assert torch.equal(torch.rand(3), after)
