"""probs_as_logits (Note [Probabilities as logits], host/audit/probs.cpp) on classifier heads as
libraries and public examples write them (tests/python/launcher/probs_loops.py), each through an
explicit trainsan.attach and through the launcher (`python -m trainsan run`):

* probabilities into a loss that applies softmax or sigmoid itself: pytorch/examples' MNIST net
  ending in softmax with nn.CrossEntropyLoss or F.nll_loss, a Keras-style Dense(activation=
  "softmax") with cross_entropy, Dense(activation="sigmoid") with BCEWithLogitsLoss, a
  segmentation head's softmax over [N, C, H, W] with an ignore_index border, a Hugging Face-style
  classifier computing CrossEntropyLoss inside forward on a softmax head — an error;
* their honest twins stay silent: log_softmax with nll_loss or cross_entropy, probabilities
  turned into log-probabilities before nll_loss, sigmoid with BCELoss, logits (pos_weight) and a
  ReLU head with BCEWithLogitsLoss, a torchvision-style ResNet with label smoothing or a
  zero-initialised fc, segmentation logits, the Hugging Face-style classifier on its logits.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import trainsan
from _launch import LAUNCHER_DIR, load_loops, run_script
from _launch import run_attached as run_loop

loops = load_loops("probs_loops.py")
SCRIPT = os.path.join(LAUNCHER_DIR, "probs_loops.py")

HONEST = [n for n in loops.LOOPS if n not in loops.BUGGY]
BINARY = {"keras_sigmoid_bce_with_logits"}  # found at the third audited step


def run_attached(name, **options):
    torch.manual_seed(0)
    return run_loop(loops.LOOPS[name], **options)


@pytest.mark.parametrize("name", loops.BUGGY)
def test_probabilities_into_the_loss_are_an_error(name):
    findings = run_attached(name)
    found = [f for f in findings if f.kind == "probs_as_logits"]
    assert len(found) == 1, [(f.kind, f.message) for f in findings]
    (f,) = found
    assert f.severity == "error"
    assert f.step == (2 if name in BINARY else 0), f
    assert "probs_loops.py:" in f.message, f.message  # the user's line
    if name in BINARY:
        assert "aten::binary_cross_entropy_with_logits" in f.message
        assert "looks like probabilities, not logits" in f.message
        assert "on 3 audited steps in a row" in f.message
        assert "pass the logits to BCEWithLogitsLoss" in f.message
        assert "or use BCELoss on probabilities" in f.message
    elif name == "mnist_softmax_nll_loss":
        assert "aten::nll_loss_nd" in f.message
        assert "holds probabilities, not log-probabilities" in f.message
        assert "use log_softmax / nn.LogSoftmax before nll_loss" in f.message
    else:
        assert "aten::cross_entropy_loss" in f.message
        assert "holds probabilities, not logits" in f.message
        assert "pass the logits, not softmax(logits)" in f.message
    if name == "segmentation_softmax":
        assert "the input [8, 4, 12, 12]" in f.message and "each of its 1152 rows" in f.message
    assert [g for g in findings if g.severity == "error"] == [f]


@pytest.mark.parametrize("name", HONEST)
def test_honest_twin_is_silent(name):
    findings = run_attached(name)
    assert [(f.kind, f.message) for f in findings if f.severity == "error"] == []


@pytest.mark.parametrize("name", ["mnist_softmax_cross_entropy", "keras_sigmoid_bce_with_logits",
                                  "hf_style_softmax_head", "mnist_log_softmax_cross_entropy",
                                  "keras_sigmoid_bce", "keras_relu_bce_with_logits",
                                  "hf_style_logits"])
def test_through_the_launcher(name):
    r = run_script(SCRIPT, name)
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    if name in loops.BUGGY:
        assert "probs_as_logits" in r.stderr, r.stderr
    else:
        assert "probs_as_logits" not in r.stderr, r.stderr


def test_raises_under_policy_raise_and_off_when_disabled():
    sans = []
    with pytest.raises(trainsan.TrainingBugError) as e:
        loops.mnist_softmax_cross_entropy(
            lambda m, o: sans.append(trainsan.attach(m, o, policy="raise")) or sans[-1])
    sans[0].close()
    assert e.value.finding.kind == "probs_as_logits"
    assert not [f for f in run_attached("mnist_softmax_cross_entropy",
                                        checks={"probs_as_logits": False})
                if f.kind == "probs_as_logits"]


def test_gradients_are_unchanged():
    grads = []
    for attached in (False, True):
        torch.manual_seed(0)
        model = loops.MnistNet("softmax")
        san = trainsan.attach(model, policy="record") if attached else None
        x = torch.randn(16, 1, 12, 12)
        y = torch.randint(0, 10, (16,))
        p = model(x)
        (F.cross_entropy(p, y) + F.binary_cross_entropy_with_logits(p, torch.ones_like(p))
         ).backward()
        grads.append([q.grad.clone() for q in model.parameters()])
        if san is not None:
            san.close()
            assert [f.kind for f in san.findings] == ["probs_as_logits"]
    for a, b in zip(*grads):
        assert torch.equal(a, b)
