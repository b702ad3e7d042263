"""The loss without watch_loss (Note [Loss roots], bindings/trainsan/_patches.py) and the loss
family (loss_spike, trivial_loss): the root of a training backward is watched automatically,
once per step, attributed to the right sanitizer, unscaled under a GradScaler; the clean loops
of the zoo stay silent on the loss kinds."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import trainsan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402

LOSS_KINDS = {"loss_spike", "trivial_loss", "empty_loss"}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _kinds(san):
    return {f.kind: f for f in san.findings}


def test_nonfinite_loss_without_watch_loss_raises_at_the_backward():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="raise")
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    x[0, 0] = float("nan")
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    with pytest.raises(trainsan.TrainingBugError) as e:
        loss.backward()
    assert e.value.finding.kind == "nonfinite_loss"
    assert e.value.finding.step == 1
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    san.close()


def test_explicit_watch_loss_of_the_same_tensor_counts_once():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        x[0, 0] = float("nan")
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()  # the same tensor: not watched again
        san.watch_loss(loss)  # nor here
        opt.step()
    san.close()
    f = _kinds(san)["nonfinite_loss"]
    assert f.count == 3  # once per step


def test_backward_patch_is_removed_on_the_last_close():
    orig_backward, orig_scale = torch.autograd.backward, torch.amp.GradScaler.scale
    a, b = _mlp(), _mlp()
    sa = trainsan.attach(a, torch.optim.SGD(a.parameters(), lr=0.1), policy="record")
    sb = trainsan.attach(b, torch.optim.SGD(b.parameters(), lr=0.1), policy="record")
    assert torch.autograd.backward is not orig_backward
    sa.close()
    assert torch.autograd.backward is not orig_backward
    sb.close()
    assert torch.autograd.backward is orig_backward
    assert torch.amp.GradScaler.scale is orig_scale


def test_closed_sanitizer_and_non_scalar_roots_are_ignored():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="raise")
    out = model(torch.randn(8, 4))
    out.backward(torch.full_like(out, float("nan")))  # not a loss: no finding
    san.close()
    loss = model(torch.full((1, 4), float("nan"))).sum()
    loss.backward()  # after close: nothing watches it
    assert not san.findings


def test_grad_scaler_root_is_unscaled():
    # A scale of 2**100 would make every loss look like a spike (and overflow float16 stats);
    # the sanitizer must see the unscaled loss: exactly 0 stays exactly 0, finite stays finite.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    san = trainsan.attach(model, opt, policy="record")
    for step in range(25):
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    san.close()
    assert not (LOSS_KINDS & set(_kinds(san))), san.summary()

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    san = trainsan.attach(model, opt, policy="record")
    out = model(torch.randn(4, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(F.mse_loss(out, out)).backward()  # loss exactly 0: the scaled root is 0 too
    scaler.step(opt)
    scaler.update()
    san.close()
    f = _kinds(san)["trivial_loss"]
    assert "exactly 0" in f.message


def test_gan_generator_loss_goes_to_the_generator():
    torch.manual_seed(0)
    G, D = zoo.make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    san_g = trainsan.attach(G, opt_g, policy="record")
    san_d = trainsan.attach(D, opt_d, policy="record")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    seen = {"G": [], "D": []}
    for name, san in (("G", san_g), ("D", san_d)):
        orig = san._ctx.auto_loss  # the entry the backward patch calls (Note [Context])
        san._ctx.auto_loss = lambda t, _o=orig, _l=seen[name]: (_l.append(t), _o(t))[1]
    for step in range(3):
        fake = G(torch.randn(16, 4))
        opt_d.zero_grad()
        loss_d = F.binary_cross_entropy_with_logits(D(zoo.real_batch()), ones) + (
            F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        )
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = F.binary_cross_entropy_with_logits(D(fake), ones)
        loss_g.backward()
        opt_g.step()
        assert seen["D"][-1] is loss_d and all(t is not loss_d for t in seen["G"])
        assert seen["G"][-1] is loss_g and all(t is not loss_g for t in seen["D"])
    san_g.close()
    san_d.close()


def test_loss_closure_evaluations_only_feed_nonfinite_loss():
    # LBFGS: every closure evaluation is a backward inside optimizer.step(); its line-search
    # trials are not the step's loss, so they feed nonfinite_loss only (no spike, no trivial).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=20)
    x = torch.randn(64, 4)
    y = x @ torch.randn(4, 1)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(5):

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    san.close()
    assert not (LOSS_KINDS & set(_kinds(san))), san.summary()


# Clean loops with batches whose every loss term is masked (all labels ignore_index): their loss
# is exactly 0 there, and trivial_loss is the warning the issue asks for ("a loss whose every term
# is masked"); the step itself is legitimate, so these loops stay clean (no error).
MASKED_BATCH_LOOPS = {
    "clean/all_labels_ignored_batch_clipped_transformer",
    "clean/fully_masked_batches_clipped_in_place_gru",
}


@pytest.mark.parametrize("case", zoo.CLEAN, ids=lambda c: c.name)
def test_clean_zoo_loops_are_silent_on_the_loss_kinds(case):
    r = zoo.run_case(case)
    assert r.exception is None, r.report()
    allowed = {"trivial_loss"} if case.name in MASKED_BATCH_LOOPS else set()
    loud = [f for f in r.findings if f.kind in LOSS_KINDS - allowed]
    assert not loud, r.report()
    if case.name in MASKED_BATCH_LOOPS:
        assert any(f.kind == "trivial_loss" for f in r.findings), r.report()
