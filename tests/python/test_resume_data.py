"""Resumes judged in process (issue 22; host/checks/resume_data.cpp): a strict=False load of an old
checkpoint into a refactored model (Note [Renamed layers]: bad_checkpoint naming the layers left at
their initialisation) and a resume that does not restore the data position (Note [Data position]:
duplicate_batch, without the previous run's trace). Written as training scripts write resumes: a
`torch.save({"model", "optimizer", "epoch", "step"})` loop resumed in the same test, attached
explicitly (before or after the loads) and through `python -m trainsan run`. Each bug has its
legitimate twins silent: a new head, LoRA adapters, a dropped classifier; a skip of the consumed
batches by hand (islice, `if i < start: continue`), a resume at an epoch boundary with
set_epoch(restored epoch), a restored sampler, fine-tuning, a checkpoint without counters.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

import trainsan
from _watched import _watched_loads  # noqa: F401 - autouse: the loads are journaled
from _launch import run_script


HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launcher", "resume_data_script.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def findings(san):
    return [(f.kind, f.severity, f.step, f.message) for f in san.findings]


# -- renamed layers --------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return self.out(self.qkv(x))


class Block(nn.Module):
    def __init__(self, dim, v2):
        super().__init__()
        if v2:
            self.attention = Attention(dim)  # was `attn` before the refactor
        else:
            self.attn = Attention(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        a = self.attention if hasattr(self, "attention") else self.attn
        return x + self.mlp(torch.relu(a(x)))


class Transformer(nn.Module):
    def __init__(self, v2=False, classes=4):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        blocks = nn.ModuleList([Block(16, v2) for _ in range(2)])
        if v2:
            self.layers = blocks  # was `blocks`
        else:
            self.blocks = blocks
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        h = self.embed(x)
        for b in (self.layers if hasattr(self, "layers") else self.blocks):
            h = b(h)
        return self.head(h)


class LoRALinear(nn.Module):
    """A LoRA adapter around a pretrained Linear (its own parameters new to the checkpoint)."""

    def __init__(self, base, r=2):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.zeros(r, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("renamed") / "v1.pt"
    torch.save({"model": model.state_dict(), "epoch": 3}, path)  # the weights, to start from
    return path


def load_and_train(model, state, attach="after", steps=2):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    san = trainsan.attach(model, optimizer, policy="record") if attach == "before" else None
    result = model.load_state_dict(state, strict=False)
    if san is None:
        san = trainsan.attach(model, optimizer, policy="record")
    for _ in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    san.close()
    return san, result


@pytest.mark.parametrize("attach", ["before", "after"])
def test_refactored_model_left_at_init_is_an_error(pretrained, attach):
    state = torch.load(pretrained)["model"]
    san, result = load_and_train(Transformer(v2=True), state, attach=attach)
    assert result.missing_keys and result.unexpected_keys  # torch says nothing more
    (f,) = [f for f in san.findings if f.kind == "bad_checkpoint"]
    assert f.severity == "error" and f.step == 0
    assert "left 12 parameter(s) at their initial values" in f.message, f.message
    assert ("layers.0.attention.qkv.weight (checkpoint: blocks.0.attn.qkv.weight)"
            in f.message), f.message
    assert "map the old keys to the new names" in f.message


def test_new_head_is_silent(pretrained):
    state = torch.load(pretrained)["model"]
    del state["head.weight"], state["head.bias"]  # a new head of 10 classes
    san, _ = load_and_train(Transformer(classes=10), state)
    assert san.findings == [], findings(san)


def test_new_head_under_another_name_is_silent(pretrained):
    model = Transformer()
    model.head = nn.Identity()
    model.classifier = nn.Linear(16, 4)  # a new head; the old one (same shape) left over
    san, _ = load_and_train(model, torch.load(pretrained)["model"])
    assert san.findings == [], findings(san)


def test_lora_adapters_are_silent(pretrained):
    model = Transformer()
    for b in model.blocks:
        b.attn.qkv = LoRALinear(b.attn.qkv)
    state = {k.replace("attn.qkv.", "attn.qkv.base."): v
             for k, v in torch.load(pretrained)["model"].items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for b in model.blocks:
        b.attn.qkv.lora_a.requires_grad_(True)
        b.attn.qkv.lora_b.requires_grad_(True)
    san, _ = load_and_train(model, state)
    assert san.findings == [], findings(san)


def test_lora_over_a_plain_checkpoint_is_an_error(pretrained):
    """The adapters wrapped the layers, and the checkpoint's keys were not mapped: the trunk's
    attention weights stay random under the adapters."""
    model = Transformer()
    for b in model.blocks:
        b.attn.qkv = LoRALinear(b.attn.qkv)
    san, _ = load_and_train(model, torch.load(pretrained)["model"])
    (f,) = [f for f in san.findings if f.kind == "bad_checkpoint"]
    assert "blocks.0.attn.qkv.base.weight (checkpoint: blocks.0.attn.qkv.weight)" in f.message


def test_dropped_classifier_is_silent(pretrained):
    state = {k: v for k, v in torch.load(pretrained)["model"].items()
             if not k.startswith("head.")}
    san, _ = load_and_train(Transformer(), state)
    assert san.findings == [], findings(san)


# -- the data position -----------------------------------------------------------------------------

def build(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


DATA = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))  # 8 batches of 8


def train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def first_run(path, steps, sampler=None, save_loader=False):
    """Train `steps` batches (epochs of 8), then save model, optimizer, epoch and step, and the
    RNG state at the start of the epoch in progress (what its shuffle drew from: Note [Replayed
    order])."""
    model, optimizer = build()
    loader = DataLoader(DATA, batch_size=8, shuffle=sampler is None, sampler=sampler)
    step = 0
    while step < steps:
        if sampler is not None:
            sampler.set_epoch(step // len(loader))
        rng = torch.get_rng_state()
        for x, y in loader:
            train_step(model, optimizer, x, y)
            step += 1
            if step == steps:
                break
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": step // len(loader), "step": step,
             "rng": rng if step % len(loader) else torch.get_rng_state()}
    if save_loader:
        state["sampler"] = {"position": step % len(loader)}
    torch.save(state, path)
    return path


def resumed(path, how, sampler=None, attach="after", steps=3, restore_optimizer=True):
    """The resume: model and optimizer restored, then the loop from the checkpoint's epoch."""
    model, optimizer = build(seed=1)
    san = trainsan.attach(model, optimizer, policy="record") if attach == "before" else None
    ckpt = torch.load(path)
    model.load_state_dict(ckpt["model"])
    if restore_optimizer:
        optimizer.load_state_dict(ckpt["optimizer"])
    start_epoch, step = ckpt.get("epoch", 0), ckpt.get("step", 0)
    if "rng" in ckpt:
        torch.set_rng_state(ckpt["rng"])  # the order of the epoch in progress
    if how == "restored":
        sampler.load_state_dict(ckpt["sampler"])
    loader = DataLoader(DATA, batch_size=8, shuffle=sampler is None, sampler=sampler)
    done = 0
    for epoch in range(start_epoch, start_epoch + 2):
        if hasattr(sampler, "set_epoch") and how != "no_set_epoch":
            sampler.set_epoch(epoch)
        skip = step % len(loader) if epoch == start_epoch else 0
        if how == "islice":
            batches = itertools.islice(loader, skip, None)
        else:
            batches = loader
        for i, (x, y) in enumerate(batches):
            if how == "continue" and i < skip:
                continue
            if san is None:  # an attach at the first forward, as the launcher's
                san = trainsan.attach(model, optimizer, policy="record")
            train_step(model, optimizer, x, y)
            done += 1
            if done == steps:
                san.close()
                return san
    san.close()
    return san


@pytest.fixture(scope="module")
def mid_epoch(tmp_path_factory):
    return first_run(tmp_path_factory.mktemp("data") / "mid.pt", steps=13)  # epoch 1, batch 5


@pytest.mark.parametrize("attach", ["before", "after"])
def test_mid_epoch_restart_is_reported(mid_epoch, attach):
    san = resumed(mid_epoch, "restart", attach=attach)
    (f,) = san.findings
    assert (f.kind, f.severity, f.step) == ("duplicate_batch", "warning", 0)
    assert "the checkpoint (epoch=1, step=13) was saved inside an epoch (5 batches into a " \
           "pass of 8)" in f.message, f.message
    assert "the loader restarts at the epoch's first batch" in f.message


@pytest.mark.parametrize("how", ["islice", "continue"])
def test_skipping_the_consumed_batches_is_silent(mid_epoch, how):
    san = resumed(mid_epoch, how)
    assert san.findings == [], findings(san)


def test_epoch_boundary_is_silent(tmp_path):
    path = first_run(tmp_path / "boundary.pt", steps=16)  # two whole epochs
    assert torch.load(path)["step"] == 16
    san = resumed(path, "restart")
    assert san.findings == [], findings(san)


def test_fine_tuning_is_silent(mid_epoch, tmp_path):
    # The training checkpoint's weights with a fresh optimizer: the run's data is its own.
    san = resumed(mid_epoch, "restart", restore_optimizer=False)
    assert [f.kind for f in san.findings] == ["optimizer_reset"]  # that one, not the data
    weights = torch.load(mid_epoch)
    path = tmp_path / "weights.pt"
    torch.save({"model": weights["model"], "epoch": 1, "step": 13}, path)
    san = resumed(path, "restart", restore_optimizer=False)
    assert san.findings == [], findings(san)


def test_checkpoint_without_counters_is_silent(mid_epoch, tmp_path):
    ckpt = torch.load(mid_epoch)
    path = tmp_path / "plain.pt"
    torch.save({"model": ckpt["model"], "optimizer": ckpt["optimizer"]}, path)
    san = resumed(path, "restart")
    assert san.findings == [], findings(san)


class ResumableSampler(Sampler):
    """A sampler that saves and restores its position (as torchdata's stateful samplers do)."""

    def __init__(self, n):
        self.n, self.start = n, 0

    def __iter__(self):
        start, self.start = self.start, 0
        return iter(range(start, self.n))

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"position": self.start}

    def load_state_dict(self, state):
        self.start = state["position"] * 8


def test_restored_sampler_is_silent(tmp_path):
    path = first_run(tmp_path / "stateful.pt", steps=13, save_loader=True)
    san = resumed(path, "restored", sampler=ResumableSampler(64))
    assert san.findings == [], findings(san)


def test_unrestored_sampler_is_reported(tmp_path):
    path = first_run(tmp_path / "stateful.pt", steps=13, save_loader=True)
    san = resumed(path, "restart", sampler=ResumableSampler(64))
    (f,) = san.findings
    assert f.kind == "duplicate_batch" and "saved inside an epoch" in f.message, f.message


def test_unrestored_loader_state_is_reported(tmp_path):
    path = first_run(tmp_path / "stateful.pt", steps=13, save_loader=True)
    ckpt = torch.load(path)
    del ckpt["step"]  # only the loader's state tells the position
    torch.save(ckpt, path)
    san = resumed(path, "restart")
    (f,) = san.findings
    assert f.kind == "duplicate_batch"
    assert "holds the data loader's position ('sampler') but it was not restored" in f.message


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=0)
    return first_run(tmp_path_factory.mktemp("ddp") / "ddp.pt", steps=24, sampler=sampler)


def test_sampler_epoch_not_restored_is_reported(distributed):
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=0)
    san = resumed(distributed, "no_set_epoch", sampler=sampler)
    (f,) = san.findings
    assert f.kind == "duplicate_batch" and f.severity == "warning"
    assert "DistributedSampler is at epoch 0 while the checkpoint is from epoch=3, step=24" \
           in f.message, f.message
    assert "sampler.set_epoch(epoch)" in f.message


def test_sampler_set_epoch_restored_is_silent(distributed):
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=0)
    san = resumed(distributed, "set_epoch", sampler=sampler)
    assert san.findings == [], findings(san)


# -- through the launcher --------------------------------------------------------------------------

def _run(*args, launcher=True):
    return run_script(*args, launcher=launcher, env=ENV)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launched")
    ckpt = str(tmp / "run.pt")
    r = _run(SCRIPT, "--save", ckpt, "--steps", "13", launcher=False)
    assert r.returncode == 0, r.stderr
    runs = {}
    for name, bug in (("restart", ["--bug", "restart"]), ("refactor", ["--bug", "refactor"]),
                      ("clean", [])):
        trace = str(tmp / f"{name}.jsonl")
        r = _run("--trace", trace, SCRIPT, "--resume", ckpt, *bug)
        with open(trace, encoding="utf-8") as fh:
            runs[name] = (r, [json.loads(line) for line in fh if line.strip()])
    return runs


def test_launcher_finds_the_restarted_loader(launched):
    r, records = launched["restart"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    found = [x for x in records if x["type"] == "finding"]
    assert [(x["kind"], x["step"]) for x in found] == [("duplicate_batch", 0)], found
    assert "(epoch=1, step=13) was saved inside an epoch" in found[0]["message"]


def test_launcher_finds_the_renamed_layers(launched):
    r, records = launched["refactor"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    found = [x for x in records if x["type"] == "finding"]
    assert [x["kind"] for x in found] == ["bad_checkpoint"], found
    assert "layers.0.proj.weight (checkpoint: blocks.0.proj.weight)" in found[0]["message"]


def test_launcher_skipped_batches_silent(launched):
    r, records = launched["clean"]
    assert r.returncode == 0, r.stderr
    assert "no findings" in r.stderr, r.stderr
    assert not [x for x in records if x["type"] == "finding"]
