"""Objects around the loop while a sanitizer is attached: EMA / best-model copies
(copy.deepcopy), whole-module pickling (torch.save(model)), a sanitizer dropped without close(),
models built on the meta device, and wrapped optimizers (accelerate's AcceleratedOptimizer,
Lightning's LightningOptimizer: an object holding the torch optimizer in ``.optimizer``).
Note [Sanitizer lifetime] in bindings/trainsan/_hooks.py."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import trainsan


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model, opt, x, y, zero=True):
    if zero:
        opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _errors(san):
    return sorted({f.kind for f in san.findings if f.severity == "error"})


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "pickle"])
def test_copies_carry_no_sanitizer_and_both_keep_working(how):
    model, opt = _setup()
    san = trainsan.attach(model, opt, policy="record", checks={"nonfinite_activation": True})
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    _step(model, opt, x, y)
    hooks = _hook_count(model)
    assert hooks > 0
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    else:
        twin = pickle.loads(pickle.dumps(model))
    assert _hook_count(twin) == 0  # the copy carries no hook, so no sanitizer
    assert _hook_count(model) == hooks  # the original keeps all of its hooks
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    # EMA update of the copy, a forward of the copy in train mode: not the sanitizer's business.
    with torch.no_grad():
        for pe, p in zip(twin.parameters(), model.parameters()):
            pe.lerp_(p, 0.1)
    twin(x)
    for _ in range(3):
        _step(model, opt, torch.randn(32, 6), torch.randint(0, 3, (32,)))
    assert san.coverage()["training_forwards"] == 4
    _step(model, opt, x, y, zero=False)  # a planted bug after the copy is still found
    san.close()
    assert "stale_grad" in _errors(san)
    # The state of a pickled copy made after close() is an ordinary module state.
    assert _hook_count(copy.deepcopy(model)) == 0


def test_copy_of_an_attached_model_can_be_attached_too():
    model, opt = _setup()
    with trainsan.attach(model, opt, policy="record") as san:
        ema = copy.deepcopy(model)
        ema_opt = torch.optim.SGD(ema.parameters(), lr=0.1)
        with trainsan.attach(ema, ema_opt, policy="record") as san2:
            for _ in range(3):
                x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
                _step(model, opt, x, y)
                _step(ema, ema_opt, x, y)
    assert san.step == 3 and san2.step == 3
    assert _errors(san) == [] and _errors(san2) == []


def test_sanitizer_dropped_without_close_removes_its_hooks(tmp_path):
    model, opt = _setup()
    trace = tmp_path / "t.jsonl"
    san = trainsan.attach(model, opt, trace=str(trace))
    _step(model, opt, torch.randn(8, 6), torch.randint(0, 3, (8,)))
    with pytest.warns(UserWarning, match="garbage-collected without close"):
        del san
        gc.collect()
    assert _hook_count(model) == 0
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    assert '"summary"' in trace.read_text()  # the finalizer closed it: the trace is complete
    # ... so the model can be attached again, and the new sanitizer works.
    with trainsan.attach(model, opt, policy="record") as san:
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        _step(model, opt, x, y)
        _step(model, opt, x, y, zero=False)
    assert "stale_grad" in _errors(san)


def test_attach_statement_without_keeping_the_sanitizer_warns():
    model, opt = _setup()
    with pytest.warns(UserWarning, match="Keep the object attach"):
        trainsan.attach(model, opt)
        gc.collect()
    assert _hook_count(model) == 0


def test_closed_sanitizer_is_not_kept_alive_by_the_model():
    import weakref

    model, opt = _setup()
    san = trainsan.attach(model, opt)
    ref = weakref.ref(san)
    san.close()
    del san
    gc.collect()
    assert ref() is None


def test_meta_device_model_is_a_clear_error_and_works_after_to_empty():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"meta device.*to_empty"):
        trainsan.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model.to_empty(device="cpu")
    torch.nn.init.normal_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        x = torch.randn(8, 4)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), torch.zeros(8, 2)).backward()
            opt.step()
        x[0, 0] = float("nan")
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(8, 2)).backward()
        opt.step()
    assert san.step == 4
    assert "nonfinite_grad" in _errors(san) or "nonfinite_loss" in _errors(san)


class _AcceleratedLike(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: an Optimizer subclass that does not call
    Optimizer.__init__ (no step hooks of its own) and forwards to the optimizer it wraps."""

    def __init__(self, optimizer):  # noqa: D107 - deliberately no super().__init__
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self.optimizer.step(closure)


class _LightningLike:
    """Like Lightning's LightningOptimizer: not an Optimizer; the torch one in ``_optimizer``."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def param_groups(self):
        return self._optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self._optimizer.step(closure)


@pytest.mark.parametrize("wrap", [_AcceleratedLike, _LightningLike], ids=["accelerate", "lightning"])
def test_wrapped_optimizers_are_unwrapped(wrap):
    model, inner = _setup()
    opt = wrap(inner)
    with trainsan.attach(model, opt, policy="record") as san:
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        for _ in range(3):
            _step(model, opt, x, y)
        assert _errors(san) == []
        _step(model, opt, x, y, zero=False)
    assert san.step == 4
    assert "stale_grad" in _errors(san)
    assert len(inner._optimizer_step_pre_hooks) == 0  # closed: hooks gone from the inner one


def test_not_an_optimizer_is_still_a_clear_error():
    model, _ = _setup()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        trainsan.attach(model, object())
    broken = _AcceleratedLike.__new__(_AcceleratedLike)  # no .optimizer, no step hooks
    with pytest.raises(TypeError, match="did not call torch.optim.Optimizer.__init__"):
        trainsan.attach(model, [broken])


def test_lookahead_style_optimizer_subclass_is_hooked_itself():
    # A real Optimizer subclass that wraps another and adds its own update: its step is the update.
    class Lookahead(torch.optim.Optimizer):
        def __init__(self, base, alpha=0.5):
            self.optimizer = base
            super().__init__(base.param_groups, {})
            self.slow = [p.detach().clone() for g in base.param_groups for p in g["params"]]
            self.alpha = alpha

        @torch.no_grad()
        def step(self, closure=None):
            self.optimizer.step(closure)
            ps = [p for g in self.optimizer.param_groups for p in g["params"]]
            for s, p in zip(self.slow, ps):
                s.lerp_(p, self.alpha)
                p.copy_(s)

    model, base = _setup()
    opt = Lookahead(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with trainsan.attach(model, opt, policy="record") as san:
            for _ in range(4):
                _step(model, opt, torch.randn(16, 6), torch.randint(0, 3, (16,)))
    assert len(opt._optimizer_step_pre_hooks) == 0
    assert san.step == 4 and _errors(san) == []


def test_parameters_replaced_after_attach_are_a_clear_error_at_the_first_step():
    model, _ = _setup()
    san = trainsan.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="record")
    # load_state_dict(assign=True) replaces the Parameter objects; the optimizer is built anew on
    # them (correctly), but the sanitizer still holds the old ones.
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san.close()
    san = trainsan.attach(model, opt, policy="record")  # attached after: fine
    _step(model, opt, torch.randn(8, 6), torch.randint(0, 3, (8,)))
    san.close()
    model2, opt2 = _setup()
    # Policy "raise" (the default): an error. Under "warn" and "record" the sanitizer re-binds
    # instead (test_attach_order.py).
    san = trainsan.attach(model2, opt2)
    model2.load_state_dict({k: v.clone() for k, v in model2.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match=r"replaced after attach\(\).*attach\s+last"):
        _step(model2, opt2, torch.randn(8, 6), torch.randint(0, 3, (8,)))
    san.close()


def test_loss_of_an_unattached_model_is_not_charged_to_the_sanitizer():
    # One open sanitizer: the root of a backward that reaches none of its parameters (a probe
    # model, a fine-tuned copy) is another model's loss (Note [Loss roots]).
    model, opt = _setup()
    probe = torch.nn.Linear(6, 1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        for i in range(4):
            _step(model, opt, torch.randn(8, 6), torch.randint(0, 3, (8,)))
            x = torch.randn(8, 6)
            if i == 2:
                x[0, 0] = float("nan")  # the probe's problem, not the attached model's
            probe_opt.zero_grad()
            probe(x).sum().backward()
            probe_opt.step()
    assert _errors(san) == [], san.summary()
    assert san.coverage()["losses_checked"] == 4
