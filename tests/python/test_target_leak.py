"""target_leak (Note [Target leak], host/audit/leaks.cpp) and label_dtype at the loss, on loops
written as public training code writes them (tests/python/launcher/target_leak_loops.py), each
through an explicit trainsan.attach and through the launcher (`python -m trainsan run`):

* the answer among the inputs: a nanoGPT get_batch that takes y = x, a masked-LM collator that
  leaves the inputs unmasked, a seq2seq decoder fed its targets unshifted, a Titanic-like table
  and a house-price table with the label column left among the features — an error at step 0;
* their honest twins stay silent: shifted targets, Hugging Face's labels=input_ids (shifted in
  the model), a masked LM, copy and reverse tasks with teacher forcing (the target equals the
  encoder's input by design), a PixelCNN prior over VQ codes (the target is the input, masked
  type A), the tables without the label, a feature that agrees with the label on 90% of the
  rows, an autoencoder, AC-GANs conditioned on a one-hot code or an embedding of the label;
* label_dtype: uint8 labels of 300 classes passed to cross_entropy as they are (torch accepts
  them) are found; uint8 labels of 10 classes are silent.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainsan
from _launch import LAUNCHER_DIR, load_loops, run_script
from _launch import run_attached as run_loop

loops = load_loops("target_leak_loops.py")
SCRIPT = os.path.join(LAUNCHER_DIR, "target_leak_loops.py")

HONEST = [n for n in loops.LOOPS if n not in loops.BUGGY]


def run_attached(name):
    return run_loop(loops.LOOPS[name])


@pytest.mark.parametrize("name", loops.BUGGY)
def test_leak_is_an_error_at_the_first_step(name):
    findings = run_attached(name)
    leaks = [f for f in findings if f.kind == "target_leak"]
    assert len(leaks) == 1, [(f.kind, f.message) for f in findings]
    (f,) = leaks
    assert f.severity == "error" and f.step == 0, f
    assert "target_leak_loops.py" in f.message  # the user's line
    if name in ("survival_label_left", "prices_label_left"):
        assert "column 5 of the model's input [64, 6]" in f.message or \
            "column 3 of the model's input [32, 4]" in f.message, f.message
        assert "label column was left among the features" in f.message
    else:
        assert "equals, position by position, the token ids" in f.message, f.message
    assert [g for g in findings if g.severity == "error"] == [f]


@pytest.mark.parametrize("name", HONEST)
def test_honest_twin_is_silent(name):
    findings = run_attached(name)
    assert [(f.kind, f.message) for f in findings if f.kind == "target_leak"] == []
    assert [(f.kind, f.message) for f in findings if f.severity == "error"] == []


@pytest.mark.parametrize("name", ["lm_unshifted", "survival_label_left", "lm_shifted",
                                  "pixelcnn_prior", "acgan_onehot"])
def test_through_the_launcher(name):
    r = run_script(SCRIPT, name)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    if name in loops.BUGGY:
        assert "target_leak" in r.stderr, r.stderr
    else:
        assert "target_leak" not in r.stderr, r.stderr


def test_a_leak_raises_under_policy_raise():
    sans = []
    with pytest.raises(trainsan.TrainingBugError) as e:
        loops.lm_unshifted(lambda m, o: sans.append(trainsan.attach(m, o, policy="raise")) or
                           sans[-1])
    sans[0].close()
    assert e.value.finding.kind == "target_leak"


def test_off_when_disabled():
    sans = []
    loops.survival_label_left(
        lambda m, o: sans.append(trainsan.attach(m, o, policy="record",
                                                 checks={"target_leak": False})) or sans[-1])
    sans[0].close()
    assert not [f for f in sans[0].findings if f.kind == "target_leak"]


def test_gradient_is_unchanged_and_the_hook_is_gone():
    """The confirming hook reads the gradient and returns nothing: the same step with and without
    the sanitizer gives the same parameter gradients; after the step no hook is left."""
    grads = []
    for attached in (False, True):
        torch.manual_seed(0)
        model = loops.TinyGPT()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, policy="record") if attached else None
        x, y = loops.get_batch(loops.corpus(), 0)
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if san is not None:
            san.close()
            assert [f.kind for f in san.findings] == ["target_leak"]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# label_dtype at the loss: the narrow target passed as it is


def test_torch_takes_a_uint8_class_target():
    """The fact the rule rests on (torch 2.11): cross_entropy and nll_loss accept uint8 targets
    of an [N, C] input and compute the loss of the stored (wrapped) values; int8, int16 and the
    [N, C, d] form raise."""
    x = torch.randn(4, 300)
    y = torch.tensor([1, 200, 255, 44])
    assert torch.equal(F.cross_entropy(x, y.to(torch.uint8)), F.cross_entropy(x, y))
    assert torch.equal(F.nll_loss(x.log_softmax(1), y.to(torch.uint8)),
                       F.nll_loss(x.log_softmax(1), y))
    for dt in (torch.int8, torch.int16):
        with pytest.raises(RuntimeError, match="expected scalar type Long"):
            F.cross_entropy(x, y.to(dt))
    with pytest.raises(RuntimeError, match="expected scalar type Long"):
        F.cross_entropy(torch.randn(4, 300, 5), torch.zeros(4, 5, dtype=torch.uint8))


def _uint8_direct(classes, head, steps=3):
    torch.manual_seed(0)
    labels = torch.randint(0, classes, (256,))
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), labels.to(torch.uint8))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, head))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with trainsan.attach(model, opt, policy="record") as san:
        for i, (x, y) in enumerate(loader):
            if i == steps:
                break
            opt.zero_grad()
            loss = nn.CrossEntropyLoss()(model(x), y)  # y is uint8: accepted as it is
            loss.backward()
            opt.step()
    return san


def test_uint8_target_at_the_loss_of_300_classes_is_found():
    san = _uint8_direct(300, 300)
    (f,) = [f for f in san.findings if f.kind == "label_dtype"]
    assert f.step == 0 and f.severity == "error"
    assert "is a uint8 tensor [32], but the loss has 300 classes" in f.message, f.message
    assert "class 300 became 44" in f.message


@pytest.mark.parametrize("classes,head", [(10, 10), (10, 300)], ids=["fits", "wide_head"])
def test_uint8_target_that_fits_is_silent(classes, head):
    san = _uint8_direct(classes, head)
    assert not san.findings, [(f.kind, f.message) for f in san.findings]
