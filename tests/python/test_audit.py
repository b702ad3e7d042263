"""The op audits from Python: broadcast, label_range, batch_mismatch (host/audit/).

* the zoo's audit cases (zoo_audit.py): each bug found with its kind at its onset step, with a
  message naming the op, the shapes and the user's source line; the clean loops silent;
* the broadcast rule, pattern by pattern: intentional broadcasts silent, bugs found;
* label_range and batch_mismatch on the class-index losses, before the op runs; sync=True with
  policy "raise" raising TrainingBugError from the loss call itself;
* the audit window (forward and loss of a training step; not no_grad code, not after backward
  has started) and the sampling options.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainsan  # noqa: E402
import zoo  # noqa: E402
import zoo_audit  # noqa: E402

AUDIT_KINDS = ("broadcast", "label_range", "label_dtype", "batch_mismatch", "target_leak",
               "probs_as_logits")
AUDIT_CASES = [c for c in zoo.CASES if c.fn.__module__ == "zoo_audit"]


def here() -> int:
    """Line number of the caller."""
    return inspect.currentframe().f_back.f_lineno


# ---------------------------------------------------------------------------------------------
# The zoo's audit cases


def test_zoo_has_the_required_audit_cases():
    bugs = [c for c in AUDIT_CASES if not c.clean]
    by_kind = {k: [c for c in bugs if c.kind == k] for k in AUDIT_KINDS}
    assert len(by_kind["broadcast"]) >= 3
    assert len(by_kind["label_range"]) >= 2
    assert len(by_kind["label_dtype"]) >= 2
    assert len(by_kind["batch_mismatch"]) >= 1
    assert len(by_kind["target_leak"]) >= 2
    assert len(by_kind["probs_as_logits"]) >= 3
    names = " ".join(c.name for c in by_kind["probs_as_logits"])
    assert "cross_entropy" in names and "nll_loss" in names and "bce_with_logits" in names
    names = " ".join(c.name for c in by_kind["broadcast"])
    assert "weight" in names and "handwritten" in names  # a loss weight, a hand-written loss
    assert len({c.model for c in bugs}) >= 3 and len({c.optimizer for c in bugs}) >= 3
    clean = " ".join(c.name + " " + c.description for c in AUDIT_CASES if c.clean)
    for pattern in ("bias", "scale", "attention", "pairwise", "positional", "timestep",
                    "label_smoothing", "ignore_index", "log_softmax", "BCELoss",
                    "soft targets"):
        assert pattern in clean, pattern
    assert all(c in zoo.BUGGY or c in zoo.CLEAN for c in AUDIT_CASES)


@pytest.mark.parametrize("case", [c for c in AUDIT_CASES if not c.clean], ids=lambda c: c.name)
def test_zoo_bug_found_with_op_shapes_and_source(case):
    r = zoo.run_case(case)
    assert r.status == "detected", r.report()
    f = next(f for f in r.findings if f.kind == case.kind)
    assert f.severity == "error"
    assert f.message.startswith(f"{case.kind} at step {f.step}: ")
    assert "aten::" in f.message and "aten::" in f.tensor
    src = os.path.join(os.path.dirname(os.path.abspath(zoo_audit.__file__)), "zoo_audit.py")
    assert src + ":" in f.message, f.message  # the user's source line
    assert "zoo_audit.py:" in f.tensor
    if case.kind not in ("label_range", "label_dtype"):
        assert f.message.count("[") >= 2, f.message  # both shapes


@pytest.mark.parametrize("case", [c for c in AUDIT_CASES if c.clean], ids=lambda c: c.name)
def test_zoo_intentional_broadcasts_stay_silent(case):
    r = zoo.run_case(case)
    assert r.exception is None, r.report()
    assert not [f for f in r.findings if f.severity == "error"], r.report()


# ---------------------------------------------------------------------------------------------
# The broadcast rule, pattern by pattern


class Probe(nn.Module):
    """A linear layer whose output [16, 4] goes through `fn` inside the training forward."""

    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        # prototypes / scales that require grad (frozen: not every pattern uses them)
        self.extra = nn.Parameter(torch.randn(5, 4), requires_grad=False)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x), self)


def probe(fn, steps=1, **options):
    """Runs `steps` training steps through `fn`; returns the findings. The probes' "loss" is the
    mean of whatever `fn` returns (often NaN or 0 for these shapes): the loss-value checks, which
    watch it automatically, are out of scope here and switched off."""
    checks = dict(options.pop("checks", {}))
    for kind in ("nonfinite_loss", "loss_spike", "trivial_loss", "empty_loss"):
        checks.setdefault(kind, False)
    options["checks"] = checks
    torch.manual_seed(0)
    model = Probe(fn)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            opt.zero_grad()
            out = model(torch.randn(16, 4))
            out.float().mean().backward()
            opt.step()
    san.close()
    return san.findings


y16 = torch.randn(16)  # a per-sample target / weight
T = 8


def _pe(d):
    pos = torch.arange(T)[:, None].float()
    div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
    return torch.cat([torch.sin(pos * div), torch.cos(pos * div)], -1)  # [T, d]


INTENTIONAL = {
    "bias_add": lambda h, m: h + torch.randn(4),
    "scale_vector": lambda h, m: h * torch.rand(4),
    "scale_scalar": lambda h, m: 2.0 * h - 1.0,
    "learned_scale": lambda h, m: h * m.extra[0],
    "film_per_sample": lambda h, m: h * h[:, :1].sigmoid(),  # [16, 4] * [16, 1]
    "sample_weight_shaped": lambda h, m: y16[:, None] * F.mse_loss(
        h[:, :1], y16[:, None], reduction="none"),
    "mse_same_shape": lambda h, m: F.mse_loss(h[:, 0], y16),
    "pairwise_explicit": lambda h, m: ((h[:, None, :] - h[None, :, :]) ** 2).sum(-1),
    "outer_explicit": lambda h, m: h[:, :1] * h[:, 1][None, :],  # [16, 1] * [1, 16]
    "to_prototypes": lambda h, m: ((h[:, None, :] - m.extra) ** 2).sum(-1),  # [16,1,4]-[5,4]
    "cdist": lambda h, m: torch.cdist(h, h),
    "causal_mask_add": lambda h, m: (h.view(2, T, 4) @ h.view(2, T, 4).transpose(1, 2))
    + torch.zeros(T, T).masked_fill(torch.ones(T, T).triu(1).bool(), -1e4),
    "mask_combination": lambda h, m: (h.view(2, T, 4) @ h.view(2, T, 4).transpose(1, 2))[:, None]
    + (torch.rand(2, 1, 1, T) * -1e4 + torch.triu(torch.full((T, T), -1e4), 1)),  # [B,1,T,T]
    "masked_fill_padding": lambda h, m: (h.view(2, T, 4) @ h.view(2, T, 4).transpose(1, 2))
    .masked_fill(torch.rand(2, 1, T) > 0.8, -1e4),
    "positional_encoding": lambda h, m: h.view(2, T, 4) + _pe(4),
    "timestep_encoding": lambda h, m: h * torch.cat(
        [torch.sin(torch.arange(16)[:, None] * torch.rand(2)),
         torch.cos(torch.arange(16)[:, None].float() * torch.rand(2)[None])], -1),
    "label_smoothing": lambda h, m: F.cross_entropy(h, torch.randint(0, 4, (16,)),
                                                    label_smoothing=0.1),
    "smoothed_one_hot": lambda h, m: -(
        (F.one_hot(torch.randint(0, 4, (16,)), 4) * 0.9 + 0.1 / 4) * h.log_softmax(-1)).sum(-1),
    "distribution": lambda h, m: torch.distributions.Normal(h, torch.ones(4)).log_prob(
        torch.zeros(16, 4)),
}

BUGS = {
    "sub_pred_n1_target_n": (lambda h, m: (h[:, :1] - y16) ** 2, "aten::sub"),
    "weight_times_loss": (lambda h, m: y16 * h[:, :1] ** 2, "aten::mul"),
    "loss_times_weight": (lambda h, m: F.l1_loss(h[:, :1], y16[:, None], reduction="none")
                          * y16, "aten::mul"),
    "div": (lambda h, m: h[:, :1] / (1 + y16.abs()), "aten::div"),
    "where": (lambda h, m: torch.where(h[:, :1] > 0, h[:, :1], y16), "aten::where"),
    "maximum": (lambda h, m: torch.maximum(h[:, :1], y16), "aten::maximum"),
    "image_4d": (lambda h, m: h.view(4, 1, 4, 4) - torch.randn(4, 4, 4), "aten::sub"),
    "mse_loss": (lambda h, m: F.mse_loss(h[:, :1], y16), "aten::mse_loss"),
    "l1_loss": (lambda h, m: F.l1_loss(h[:, :1], y16), "aten::l1_loss"),
    "smooth_l1_loss": (lambda h, m: F.smooth_l1_loss(h[:, :1], y16), "aten::smooth_l1_loss"),
    "huber_loss": (lambda h, m: nn.HuberLoss()(h[:, :1], y16), "aten::huber_loss"),
    "mse_loss_target_n1": (lambda h, m: F.mse_loss(h[:, 0], y16[:, None]), "aten::mse_loss"),
    "kl_div": (lambda h, m: F.kl_div(h[:, :1], y16, reduction="sum"), "aten::kl_div"),
}


@pytest.mark.parametrize("name", sorted(INTENTIONAL))
def test_intentional_broadcast_is_silent(name):
    fs = probe(INTENTIONAL[name])
    assert not fs, "\n".join(f.message for f in fs)


@pytest.mark.parametrize("name", sorted(BUGS))
def test_broadcast_bug_is_found(name):
    fn, op = BUGS[name]
    fs = probe(fn)
    assert [f.kind for f in fs] == ["broadcast"], "\n".join(f.message for f in fs)
    assert fs[0].tensor.startswith(op), fs[0].tensor
    assert fs[0].step == 0 and fs[0].severity == "error"


def test_broadcast_message_names_op_shapes_result_and_line():
    line = here() + 3

    def fn(h, m):
        return (h[:, :1] - y16) ** 2

    f = probe(fn)[0]
    assert f.tensor == f"aten::sub (test_audit.py:{line})"
    assert "aten::sub broadcast [16, 1] and [16] into [16, 16]" in f.message
    assert f"{os.path.abspath(__file__)}:{line} in fn" in f.message
    assert f.value == 16.0


def test_loss_message_names_the_functional():
    f = probe(lambda h, m: F.mse_loss(h[:, :1], y16))[0]
    assert "aten::mse_loss (from torch.nn.functional.mse_loss) got input [16, 1] and target " \
           "[16], which broadcast into [16, 16]" in f.message, f.message


def test_policy_raise_raises_at_the_next_event():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt)  # policy "raise"
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = F.mse_loss(model(torch.randn(16, 4)), y16)  # recorded, not raised: ops cannot
    with pytest.raises(trainsan.TrainingBugError) as e:
        san.watch_loss(loss)
    assert e.value.finding.kind == "broadcast"
    san.close()

    san = trainsan.attach(model, opt)
    opt.zero_grad()
    loss = (model(torch.randn(16, 4)) - y16).abs().mean()
    with pytest.raises(trainsan.TrainingBugError, match="aten::sub broadcast"):
        loss.backward()  # without watch_loss: the loss is watched as backward starts
    san.close()


# ---------------------------------------------------------------------------------------------
# The audit window and sampling


def test_no_grad_code_and_code_after_backward_are_not_audited():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(3):
        opt.zero_grad()
        pred = model(torch.randn(16, 4))
        with torch.no_grad():
            (pred - y16).abs().mean()  # a metric under no_grad
        loss = F.mse_loss(pred, y16[:, None])
        loss.backward()
        (pred - y16).abs().mean()  # after backward started: outside the window
        opt.step()
    san.close()
    assert not san.findings, [f.message for f in san.findings]


@pytest.mark.parametrize("first,every,steps,expected", [
    (10, 100, 12, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),  # the defaults
    (2, 5, 12, [0, 1, 5, 10]),
    (3, 0, 6, [0, 1, 2]),
    (0, 4, 9, [0, 4, 8]),
    (0, 0, 4, []),
])
def test_sampling(first, every, steps, expected):
    fs = probe(BUGS["sub_pred_n1_target_n"][0], steps=steps, audit_first_steps=first,
               audit_every=every)
    if not expected:
        assert not fs
        return
    assert len(fs) == 1
    assert (fs[0].step, fs[0].count, fs[0].last_step) == (expected[0], len(expected), expected[-1])


def test_options_and_switches():
    assert trainsan.OPTIONS["audit_first_steps"] == 10 and trainsan.OPTIONS["audit_every"] == 100
    for kind in AUDIT_KINDS:
        assert trainsan.KINDS[kind] == "error"
    assert not probe(BUGS["mse_loss"][0], checks={"broadcast": False})
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match="audit_every"):
        trainsan.attach(model, audit_every=-1)
    with pytest.raises(TypeError, match="audit_first_steps takes an int"):
        trainsan.attach(model, audit_first_steps="many")


def test_each_forward_of_a_step_is_audited_and_findings_reach_the_trace(tmp_path):
    trace = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record", trace=trace)
    opt.zero_grad()
    a = model(torch.randn(16, 4))
    b = model(torch.randn(16, 4))  # a second forward in the same step (e.g. two views)
    ((a - b.squeeze(1)) ** 2).mean().backward()
    opt.step()
    san.close()
    fs = [json.loads(line) for line in trace.read_text().splitlines()]
    found = [r for r in fs if r["type"] == "finding"]
    assert [r["kind"] for r in found] == ["broadcast"]
    assert found[0]["tensor"].startswith("aten::sub")


# ---------------------------------------------------------------------------------------------
# label_range and batch_mismatch


class Classifier(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.lin = nn.Linear(8, classes)

    def forward(self, x):
        return self.lin(x)


def one_step(loss_fn, labels, policy="record", **options):
    """One step; returns (sanitizer, exception raised by the loss or None)."""
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy=policy, **options)
    err = None
    opt.zero_grad()
    out = model(torch.randn(len(labels), 8))
    try:
        loss_fn(out, labels).backward()
        opt.step()
    except Exception as e:  # the op's own error, or TrainingBugError
        err = e
    try:
        san.close()
    except trainsan.TrainingBugError:
        pass
    return san, err


ONE_BASED = torch.tensor([1, 2, 3, 4, 5, 5, 1, 2])  # 5 classes, labelled 1..5
PAD_MINUS_ONE = torch.tensor([0, 4, 2, -1, -1, 3, -1, 1])
PAD_IGNORED = torch.tensor([0, 4, 2, -100, -100, 3, -100, 1])


@pytest.mark.parametrize("loss_fn,labels,hint", [
    (F.cross_entropy, ONE_BASED, "1-based"),
    (lambda o, y: F.nll_loss(o.log_softmax(-1), y), ONE_BASED, "1-based"),
    (nn.CrossEntropyLoss(), PAD_MINUS_ONE, "ignore_index=-1"),
    (lambda o, y: F.cross_entropy(o, y, label_smoothing=0.1), PAD_MINUS_ONE, "-100"),
    (lambda o, y: F.multi_margin_loss(o, y), ONE_BASED, "1-based"),
    (lambda o, y: (o * F.one_hot(y, 5)).sum(), ONE_BASED, "1-based"),
    (lambda o, y: (o * F.one_hot(y.clamp(min=-1))[:, :5]).sum(), PAD_MINUS_ONE, "one_hot"),
    (lambda o, y: F.cross_entropy(o[:, :, None].expand(-1, -1, 3), y[:, None].expand(-1, 3)),
     ONE_BASED, "1-based"),
], ids=["cross_entropy", "nll_loss", "CrossEntropyLoss_pad", "smoothing_pad", "multi_margin",
        "one_hot", "one_hot_negative", "cross_entropy_3d"])
def test_label_range_is_recorded_before_the_op(loss_fn, labels, hint):
    san, err = one_step(loss_fn, labels)
    assert err is not None  # on a CPU the op rejects the target itself, after the audit
    fs = [f for f in san.findings if f.kind == "label_range"]
    assert len(fs) == 1, [f.message for f in san.findings]
    assert hint in fs[0].message, fs[0].message
    assert fs[0].step == 0 and fs[0].value >= 1


@pytest.mark.parametrize("loss_fn,labels", [
    (F.cross_entropy, PAD_IGNORED),
    (lambda o, y: F.cross_entropy(o, y, ignore_index=-1), PAD_MINUS_ONE),
    (lambda o, y: F.nll_loss(o.log_softmax(-1), y, ignore_index=-1), PAD_MINUS_ONE),
    (lambda o, y: F.cross_entropy(o, y.clamp(min=0) % 5), ONE_BASED),
    (lambda o, y: F.cross_entropy(o, F.one_hot(y.clamp(0, 4), 5).float()), PAD_MINUS_ONE),
])
def test_valid_targets_and_ignored_padding_are_silent(loss_fn, labels):
    san, err = one_step(loss_fn, labels)
    assert err is None, err
    assert not san.findings, [f.message for f in san.findings]


def test_batch_mismatch_of_a_class_index_loss():
    san, err = one_step(lambda o, y: F.cross_entropy(o, y[: len(y) // 2]), PAD_IGNORED)
    assert err is not None  # ATen rejects it too, after the audit has named it
    fs = [f for f in san.findings if f.kind == "batch_mismatch"]
    assert len(fs) == 1
    assert "input of batch size 8 [8, 5] and target of batch size 4 [4]" in fs[0].message


def test_second_loss_on_the_same_target_is_checked_too():
    def two_losses(o, y):
        return F.cross_entropy(o, y) + F.cross_entropy(o[: len(y) // 2], y)  # batch 4 vs 8

    san, err = one_step(two_losses, PAD_IGNORED)
    assert err is not None
    assert [f.kind for f in san.findings] == ["batch_mismatch"], [f.message for f in san.findings]


def test_sync_raise_stops_the_loss_before_it_runs():
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    depth = torch._C._len_torch_function_stack()
    san = trainsan.attach(model, opt, policy="raise", sync=True)
    for step in range(2):  # a clean step first: nothing raised, the guard is taken off
        opt.zero_grad()
        out = model(torch.randn(8, 8))
        assert torch._C._len_torch_function_stack() == depth + 1  # audited window
        F.cross_entropy(out, PAD_IGNORED).backward()
        opt.step()
        assert torch._C._len_torch_function_stack() == depth
    opt.zero_grad()
    out = model(torch.randn(8, 8))
    with pytest.raises(trainsan.TrainingBugError) as e:  # not IndexError: the op never ran
        F.cross_entropy(out, ONE_BASED)
    f = e.value.finding
    assert f.kind == "label_range" and f.step == 2
    assert f.tensor.startswith("aten::cross_entropy_loss (test_audit.py:")
    with pytest.raises(trainsan.TrainingBugError, match="one_hot"):
        F.one_hot(PAD_MINUS_ONE, 5)
    with pytest.raises(trainsan.TrainingBugError, match="batch_mismatch"):
        nn.NLLLoss()(out.log_softmax(-1), PAD_IGNORED[:4])
    san.close()
    assert torch._C._len_torch_function_stack() == depth
    F.cross_entropy(model(torch.randn(8, 8)), PAD_IGNORED)  # closed: plain torch again


def test_sync_guard_is_only_used_with_policy_raise():
    depth = torch._C._len_torch_function_stack()
    model = Classifier()
    san = trainsan.attach(model, policy="warn", sync=True)
    model(torch.randn(8, 8))
    assert torch._C._len_torch_function_stack() == depth
    san.close()


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a device; not yet run on a GPU)

@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not trainsan.cuda_compiled(),
                    reason="no CUDA device visible or no CUDA build")
def test_cuda_label_range_flags(sync):
    # A class-index op with a bad target would trip its kernel's device-side assert and leave
    # the CUDA context unusable; a weight of the wrong size makes the op fail in its host-side
    # checks instead, after the audit has queued its device flag for the target. The flag
    # reaches the findings without sync at the next step end (lagged), with sync at once.
    model = Classifier().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record", sync=sync)
    for step in range(2):
        opt.zero_grad()
        out = model(torch.randn(8, 8, device="cuda"))
        if step == 0:
            with pytest.raises(RuntimeError, match="weight"):
                F.nll_loss(out.log_softmax(-1), PAD_MINUS_ONE.cuda(),
                           weight=torch.ones(3, device="cuda"))
            if sync:
                assert any(f.kind == "label_range" for f in san.findings)
        F.cross_entropy(out, PAD_IGNORED.cuda()).backward()  # clean
        opt.step()
        if step == 0 and not sync:
            assert not san.findings  # on its way to the host
    san.close()
    fs = [f for f in san.findings if f.kind == "label_range"]
    assert len(fs) == 1 and fs[0].step == 0, [f.message for f in san.findings]
    assert "ignore_index=-1" in fs[0].message
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not trainsan.cuda_compiled(),
                    reason="no CUDA device visible or no CUDA build")
def test_cuda_sync_raise_prevents_the_device_assert():
    model = Classifier().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="raise", sync=True)
    opt.zero_grad()
    out = model(torch.randn(8, 8, device="cuda"))
    with pytest.raises(trainsan.TrainingBugError, match="1-based"):
        F.cross_entropy(out, ONE_BASED.cuda())  # never reaches the kernel's assert
    torch.cuda.synchronize()  # the context is intact
    san.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not trainsan.cuda_compiled(),
                    reason="no CUDA device visible or no CUDA build")
def test_cuda_broadcast():
    model = nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F.mse_loss(model(torch.randn(16, 4, device="cuda")), y16.cuda()).backward()
    opt.step()
    san.close()
    assert [f.kind for f in san.findings] == ["broadcast"]
