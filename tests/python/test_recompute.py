"""nondeterminism of activation checkpointing (Note [Recompute checks]): a checkpointed block
with dropout recomputed in the backward without its RNG state (preserve_rng_state=False) is
found on the first sampled step, named, with the cause; the legitimate look-alikes are silent:
the default preserve_rng_state=True, no dropout, eval mode, checkpoint_sequential, BatchNorm in
the region, closures, a region called several times a step, a region whose output needs no
gradient, transformers' gradient_checkpointing_enable(), and the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import trainsan
from trainsan import recompute as _rc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Block(nn.Module):
    """A pre-norm transformer block; `p` the dropout of its attention and MLP."""

    def __init__(self, d: int = 16, p: float = 0.1, bn: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p),
                                 nn.Linear(4 * d, d))
        self.bn = nn.BatchNorm1d(d) if bn else None

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(x)
        if self.bn is not None:
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        return x


class Net(nn.Module):
    """Embedding, checkpointed blocks, head. `how`: how each block is checkpointed."""

    def __init__(self, how="module", reentrant=False, preserve=True, p=0.1, bn=False, n=3,
                 repeat=1):
        super().__init__()
        self.how, self.reentrant, self.preserve, self.repeat = how, reentrant, preserve, repeat
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block(16, p, bn) for _ in range(n))
        self.head = nn.Linear(16, 1)

    def _ckpt(self, fn, h):
        return checkpoint(fn, h, use_reentrant=self.reentrant, preserve_rng_state=self.preserve)

    def forward(self, x):
        h = self.embed(x)
        if self.how == "sequential":
            h = checkpoint_sequential(nn.Sequential(*self.layers), 2, h,
                                      use_reentrant=self.reentrant,
                                      preserve_rng_state=self.preserve)
        for layer in self.layers if self.how != "sequential" else ():
            for _ in range(self.repeat):
                if self.how == "module":
                    h = self._ckpt(layer, h)
                elif self.how == "closure":
                    h = self._ckpt(lambda t, _l=layer: _l(t) * 1.0, h)
                elif self.how == "method":
                    h = self._ckpt(layer.forward, h)
        return self.head(h).mean(dim=1)


def _train(model, steps=3, policy="record", eval_mode=False, closure=False, **options):
    torch.manual_seed(1)
    opt = (torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2) if closure
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    san = trainsan.attach(model, opt, policy=policy, **options)
    if eval_mode:
        model.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # reentrant without grad inputs
            for _ in range(steps):
                x, y = torch.randn(4, 6, 8), torch.randn(4, 1)
                if closure:
                    def step_closure():
                        opt.zero_grad()
                        loss = nn.functional.mse_loss(model(x), y)
                        loss.backward()
                        return loss
                    opt.step(step_closure)
                    continue
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        san.close()
    return [f for f in san.findings if f.kind == "nondeterminism"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_without_rng_preservation_is_found_at_the_first_step(reentrant):
    torch.manual_seed(0)
    model = Net(reentrant=reentrant, preserve=False)
    with pytest.raises(trainsan.TrainingBugError) as e:
        _train(model, policy="raise")
    f = e.value.finding
    assert f.kind == "nondeterminism" and f.step == 0, str(f)
    assert f.tensor == "layers.0", str(f)
    assert "activation-checkpointed region layers.0 (Block)" in f.message
    assert "RNG is not preserved" in f.message
    assert "preserve_rng_state=False" in f.message


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("twin", ["default", "no_dropout", "eval", "sequential", "batchnorm",
                                  "closure", "method", "repeated", "lbfgs"])
def test_legitimate_twins_are_silent(reentrant, twin):
    torch.manual_seed(0)
    kw = dict(reentrant=reentrant)
    train = {}
    if twin == "no_dropout":
        kw.update(preserve=False, p=0.0)
    elif twin == "eval":
        kw.update(preserve=False)
        train["eval_mode"] = True
    elif twin == "sequential":
        kw.update(how="sequential")
    elif twin == "batchnorm":
        kw.update(bn=True)
    elif twin in ("closure", "method"):
        kw.update(how=twin)
    elif twin == "repeated":
        kw.update(repeat=2)
    elif twin == "lbfgs":
        train["closure"] = True
    found = _train(Net(**kw), recompute_every=1, **train)
    assert found == [], [f.message for f in found]


@pytest.mark.parametrize("how,name", [("closure", "layers.0"), ("method", "layers.0"),
                                      ("sequential", "layers.0..layers.1")])
def test_each_way_of_calling_a_region_is_named(how, name):
    torch.manual_seed(0)
    found = _train(Net(how=how, preserve=False, n=4), steps=1)  # sequential: 2 segments of 2
    assert found and found[0].tensor == name, [f.message for f in found]


def test_every_repeated_call_is_compared():
    torch.manual_seed(0)
    found = _train(Net(preserve=False, repeat=2, n=1), steps=1)
    assert [f.tensor for f in found] == ["layers.0"]
    assert found[0].count == 2  # both calls of the block differed


def test_output_without_gradient_is_not_recomputed_and_silent():
    torch.manual_seed(0)
    frozen = Block(16, 0.1)
    frozen.requires_grad_(False)
    model = Net(preserve=False, n=1)
    model.frozen = frozen
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    try:
        x = torch.randn(4, 6, 16)
        for reentrant in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                out = checkpoint(frozen, x, use_reentrant=reentrant, preserve_rng_state=False)
            assert not out.requires_grad
            model.embed(torch.randn(2, 8)).sum().backward()  # a step of the attached model
        model(torch.randn(2, 6, 8)).sum()  # its training forward samples the step
        out = checkpoint(frozen, x, use_reentrant=False, preserve_rng_state=False)
        opt.step()
    finally:
        san.close()
    assert [f for f in san.findings if f.kind == "nondeterminism"] == []


def test_sampling_follows_recompute_every_and_can_be_switched_off():
    torch.manual_seed(0)
    assert _train(Net(preserve=False), steps=3, recompute_every=0) == []
    torch.manual_seed(0)
    found = _train(Net(preserve=False), steps=3, recompute_every=2)
    assert found and found[0].step == 0 and found[0].last_step == 2
    torch.manual_seed(0)
    assert _train(Net(preserve=False), steps=3, checks={"nondeterminism": False}) == []


def test_unsampled_steps_leave_the_function_unwrapped():
    seen = []

    def fn(t):
        seen.append(type(t))
        return t * 2

    torch.manual_seed(0)
    model = Net(n=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record", recompute_every=0)
    try:
        assert torch.utils.checkpoint.checkpoint is _rc.checkpoint
        model(torch.randn(2, 6, 8)).sum().backward()
        assert _rc._sampling[0] == 0 and _rc._regions == []
    finally:
        san.close()


def test_training_is_unchanged_by_the_check():
    """The same seeds give the same weights with and without the sampled recompute checks."""

    def weights(check):
        torch.manual_seed(0)
        model = Net(preserve=True)
        _train(model, steps=2, recompute_every=1 if check else 0)
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(weights(True), weights(False)):
        assert torch.equal(a, b)


def test_rerun_every_and_recompute_on_the_same_step():
    """The re-runs (rerun_every) of a checkpointed model with the RNG preserved agree, and the
    recompute checks of the same step stay silent."""
    torch.manual_seed(0)
    found = _train(Net(preserve=True), steps=2, rerun_every=1, recompute_every=1)
    assert found == [], [f.message for f in found]


# --- transformers ---------------------------------------------------------------------------

_HF_SKIP = "transformers is not installed or does not import (pip install transformers==5.24.0)"


def _bert(tf, **kwargs):
    cfg = tf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, **kwargs)
    return tf.BertForSequenceClassification(cfg)


@pytest.mark.parametrize("preserve", [True, False])
def test_transformers_gradient_checkpointing_enable(preserve):
    tf = pytest.importorskip("transformers", reason=_HF_SKIP, exc_type=ImportError)
    try:
        from transformers import BertConfig  # noqa: F401  (imports lazily)
    except ImportError as e:
        pytest.skip(f"{_HF_SKIP}: {e}")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = _bert(tf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated alias in transformers 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "preserve_rng_state": preserve})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    try:
        for _ in range(2):
            ids = torch.randint(0, 64, (4, 12))
            out = model(input_ids=ids, labels=torch.randint(0, 2, (4,)))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    finally:
        san.close()
    found = [f for f in san.findings if f.kind == "nondeterminism"]
    if preserve:
        assert found == [], [f.message for f in found]
    else:
        assert found and found[0].tensor == "bert.encoder.layer.0", [f.message for f in found]
        assert found[0].step == 0
        assert "RNG is not preserved" in found[0].message


_HF_BEFORE_TRAINSAN = r"""
import warnings
import torch
from transformers import BertConfig, BertForSequenceClassification
import transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=32, num_labels=2)
model = BertForSequenceClassification(cfg)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": True, "preserve_rng_state": False})
model.train()
import trainsan  # after transformers stored the checkpoint function
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
san = trainsan.attach(model, opt, policy="record")
ids = torch.randint(0, 64, (4, 12))
out = model(input_ids=ids, labels=torch.randint(0, 2, (4,)))
opt.zero_grad()
out.loss.backward()
opt.step()
san.close()
print([(f.kind, f.tensor) for f in san.findings if f.kind == "nondeterminism"])
"""


def test_transformers_imported_and_enabled_before_trainsan():
    pytest.importorskip("transformers", reason=_HF_SKIP, exc_type=ImportError)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _HF_BEFORE_TRAINSAN], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "('nondeterminism', 'bert.encoder.layer.0')" in r.stdout, r.stdout + r.stderr


# --- the launcher -----------------------------------------------------------------------------

def _launch(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.parametrize("reentrant", [False, True])
def test_launcher(reentrant):
    script = os.path.join(HERE, "launcher", "checkpointed_script.py")
    flags = ["--reentrant"] if reentrant else []
    clean = _launch(script, *flags)
    assert clean.returncode == 0, clean.stderr
    assert "no findings" in clean.stderr, clean.stderr
    bug = _launch(script, *flags, "--bug", "rng")
    assert bug.returncode == 1, bug.stdout + bug.stderr
    assert "TrainingBugError: nondeterminism at step 0" in bug.stderr, bug.stderr
    assert "activation-checkpointed region layers.0 (Block)" in bug.stderr
    assert "RNG is not preserved" in bug.stderr
