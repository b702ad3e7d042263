"""Checkpoint loads judged by the checkpoint's own keys (issue 38): a strict=False load that drops a
renamed output layer beside a new one (Note [Renamed layers], the place rule:
host/checks/resume_data.cpp), and optimizer state restored by position onto another parameter of
the same shape, named through the saved state dict's key order (Note [Optimizer slots by name],
host/checks/resume_slots.cpp).

Written as training scripts write resumes and fine-tunes: `torch.save({"model", "optimizer",
"epoch"})`, torch.load, load_state_dict of each, attached before or after the loads, and through
`python -m trainsan run` (launcher/resume_keys_script.py). Each bug with its legitimate twins
silent: a head replaced by nn.Identity() beside a new classifier, a new head of another shape, an
added head, LoRA adapters, a dropped projector, BERT's pretraining heads for a classifier; the
same model resumed with one group or decay/no-decay groups (nanoGPT's, timm's no-decay first),
groups by module, minGPT's name-sorted groups, a frozen part, tied weights; compiled models
(`_orig_mod.`) and DDP's `module.` keys (a wrapper with DDP's key layout: no process group).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainsan
from _watched import _watched_loads  # noqa: F401 - autouse: the loads are journaled
from _launch import run_script


HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launcher", "resume_keys_script.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def messages(san):
    return [f"{f.kind}/{f.severity}: {f.message}" for f in san.findings]


def errors(san, kind):
    return [f for f in san.findings if f.kind == kind and f.severity == "error"]


class Wrapper(nn.Module):
    """DistributedDataParallel's key layout (`module.`), without a process group."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def train(model, opt, steps, seed, classes=4, inputs=8):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, inputs, generator=g), torch.randint(0, classes, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def run(model, opt, load, attach="after", steps=2, classes=4):
    """The loads (`load()`), attached before or after them, then a few training steps."""
    san = trainsan.attach(model, opt, policy="record") if attach == "before" else None
    out = load()
    san = san or trainsan.attach(model, opt, policy="record")
    train(model, opt, steps, seed=1, classes=classes)
    san.close()
    return san, out


# -- a renamed layer beside a new one (strict=False) ---------------------------------------------

class Net(nn.Module):
    """v1: embed, two blocks, head. v2 (the refactor): a LayerNorm before the head, and `head`
    called `classifier` — the same shapes."""

    def __init__(self, v2=False, classes=4, width=16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        if v2:
            self.norm = nn.LayerNorm(width)
            self.classifier = nn.Linear(width, classes)
        else:
            self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        for b in self.blocks:
            h = h + torch.relu(b(h))
        feats = self.norm(h) if hasattr(self, "norm") else h
        out = self.head(feats) if hasattr(self, "head") else feats  # Identity: removed
        if hasattr(self, "classifier"):
            out = self.classifier(out)
        if hasattr(self, "aux_head"):
            out = out + self.aux_head(feats)
        return out


def pretrain(path, model, classes=4, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, steps, seed=0, classes=classes)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    return path


@pytest.fixture(scope="module")
def v1(tmp_path_factory):
    torch.manual_seed(0)
    return pretrain(tmp_path_factory.mktemp("keys") / "v1.pt", Net())


def strict_false(model, path, edit=lambda sd: sd):
    return lambda: model.load_state_dict(edit(torch.load(path)["model"]), strict=False)


@pytest.mark.parametrize("attach", ["before", "after"])
@pytest.mark.parametrize("classes", [4, 16], ids=["4_classes", "classes_as_wide_as_the_norm"])
def test_head_renamed_beside_a_new_layer_is_an_error(tmp_path, attach, classes):
    torch.manual_seed(0)
    path = pretrain(tmp_path / "v1.pt", Net(classes=classes), classes=classes)
    model = Net(v2=True, classes=classes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san, result = run(model, opt, strict_false(model, path), attach=attach, classes=classes)
    assert result.missing_keys == ["norm.weight", "norm.bias", "classifier.weight",
                                   "classifier.bias"]
    assert result.unexpected_keys == ["head.weight", "head.bias"]  # torch says nothing more
    (f,) = errors(san, "bad_checkpoint")
    assert f.step == 0 and f.tensor == "classifier.weight", f.message
    assert ("left 2 parameter(s) at their initial values while the state dict holds tensors of "
            "the same shape under other names: classifier.weight (checkpoint: head.weight), "
            "classifier.bias (checkpoint: head.bias)") in f.message, f.message
    assert "map the old keys to the new names" in f.message
    assert [x.kind for x in san.findings] == ["bad_checkpoint"], messages(san)


def test_head_replaced_by_identity_beside_a_new_classifier_is_silent(v1):
    model = Net()
    model.head = nn.Identity()  # timm's reset_classifier(0), torchvision's fc = Identity()
    model.classifier = nn.Linear(16, 4)  # a new head of the same shape, started fresh
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san, result = run(model, opt, strict_false(model, v1))
    assert result.unexpected_keys == ["head.weight", "head.bias"]
    assert san.findings == [], messages(san)


@pytest.mark.parametrize("how", ["other_shape", "added_head", "old_keys_dropped"])
def test_new_heads_are_silent(v1, how):
    if how == "other_shape":  # a new classifier of 10 classes; the old head left over
        model = Net(v2=True, classes=10)
        load = strict_false(model, v1)
    elif how == "added_head":  # multi-task: the head kept, an auxiliary head added
        model = Net()
        model.aux_head = nn.Linear(16, 4)
        load = strict_false(model, v1)
    else:  # the message's advice: the old head's keys dropped from the state dict
        model = Net(v2=True)
        load = strict_false(model, v1, lambda sd: {k: v for k, v in sd.items()
                                                   if not k.startswith("head.")})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san, _ = run(model, opt, load, classes=10 if how == "other_shape" else 4)
    assert san.findings == [], messages(san)


class LoRA(nn.Module):
    """A PEFT-style adapter: the pretrained Linear as `base_layer`, two new low-rank factors."""

    def __init__(self, base, r=2):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_lora_adapters_with_the_keys_mapped_are_silent(v1):
    model = Net()
    for k, b in enumerate(model.blocks):
        model.blocks[k] = LoRA(b)
    load = strict_false(model, v1, lambda sd: {
        k.replace("blocks.0.", "blocks.0.base_layer.").replace("blocks.1.", "blocks.1.base_layer."):
            v for k, v in sd.items()})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    san, result = run(model, opt, load)
    assert result.unexpected_keys == [] and "blocks.0.lora_A.weight" in result.missing_keys
    assert san.findings == [], messages(san)


class SimCLR(nn.Module):
    """A self-supervised encoder with its projector (Linear, ReLU, Linear(16, 4)); the linear
    evaluation model drops the projector for fc = Linear(16, 4): the projector's last layer has
    the new head's shape."""

    def __init__(self, probe=False):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        if probe:
            self.fc = nn.Linear(16, 4)
        else:
            self.projector = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        h = self.encoder(x)
        return self.fc(h) if hasattr(self, "fc") else self.projector(h)


class Bert(nn.Module):
    """BERT's layout: an encoder and the pretraining heads (`cls.predictions`: a transform and the
    vocabulary bias; `cls.seq_relationship`: 2 classes); the classification model replaces them
    with `classifier`, 2 classes: the shape of seq_relationship."""

    def __init__(self, classify=False):
        super().__init__()
        self.bert = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        if classify:
            self.classifier = nn.Linear(16, 2)
        else:
            self.cls = nn.Module()
            self.cls.predictions = nn.Module()
            self.cls.predictions.transform = nn.Linear(16, 16)
            self.cls.predictions.bias = nn.Parameter(torch.zeros(50))
            self.cls.seq_relationship = nn.Linear(16, 2)

    def forward(self, x):
        h = self.bert(x)
        if hasattr(self, "classifier"):
            return self.classifier(h)
        return self.cls.seq_relationship(self.cls.predictions.transform(h)) + \
            self.cls.predictions.bias[:2]


@pytest.mark.parametrize("cls,classes", [(SimCLR, 4), (Bert, 2)], ids=["projector", "bert"])
def test_pretraining_heads_dropped_for_a_head_of_one_of_their_shapes_are_silent(
        tmp_path, cls, classes):
    torch.manual_seed(0)
    path = pretrain(tmp_path / "pre.pt", cls(), classes=classes)
    model = cls(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san, result = run(model, opt, strict_false(model, path), classes=classes)
    assert result.unexpected_keys and result.missing_keys
    assert san.findings == [], messages(san)


@pytest.mark.parametrize("renamed", [False, True], ids=["same_model", "renamed"])
def test_compiled_and_ddp_keys(tmp_path, renamed):
    """Checkpoints saved from a torch.compile'd model (`_orig_mod.`) and from DDP (`module.`)
    loaded into the same wrapping of the same model (silent) and of the refactored one (found)."""
    for wrap in (lambda m: torch.compile(m, backend="eager"), Wrapper):
        torch.manual_seed(0)
        path = pretrain(tmp_path / "wrapped.pt", wrap(Net()))
        model = wrap(Net(v2=renamed))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if not renamed:  # a full resume, with strict=False
            def load():
                ckpt = torch.load(path)
                opt.load_state_dict(ckpt["optimizer"])
                return model.load_state_dict(ckpt["model"], strict=False)
            san, result = run(model, opt, load)
            assert result.missing_keys == result.unexpected_keys == []
            assert san.findings == [], messages(san)
            continue
        san, result = run(model, opt, strict_false(model, path))
        prefix = result.unexpected_keys[0][: -len("head.weight")]
        assert prefix in ("_orig_mod.", "module."), result.unexpected_keys
        (f,) = errors(san, "bad_checkpoint")
        assert (f"{prefix}classifier.weight (checkpoint: {prefix}head.weight)"
                in f.message), f.message


# -- optimizer state restored by position (Note [Optimizer slots by name]) -----------------------

class Branches(nn.Module):
    """Two parallel branches of one shape over the same features: their gradient scales are
    alike. `reordered`: the branches declared in the other order (a refactor)."""

    def __init__(self, reordered=False, tied=False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        if reordered:
            self.right = nn.Linear(16, 16)
            self.left = nn.Linear(16, 16)
        else:
            self.left = nn.Linear(16, 16)
            self.right = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.tied = tied
        if tied:  # an output projection tied to the head, as a language model's
            self.out = nn.Linear(16, 4)
            self.out.weight = self.head.weight

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = self.norm(torch.relu(self.left(h)) + torch.relu(self.right(h)))
        return self.head(h) + (self.out(h) if self.tied else 0)


def no_decay_split(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return decay, no_decay


GROUPS = {
    "one_group": lambda m: m.parameters(),
    # nanoGPT's configure_optimizers: decay (matrices), then no decay, by named_parameters()
    "decay_no_decay": lambda m: [{"params": no_decay_split(m)[0], "weight_decay": 0.1},
                                 {"params": no_decay_split(m)[1], "weight_decay": 0.0}],
    # timm's param_groups_weight_decay: no decay first
    "no_decay_first": lambda m: [{"params": no_decay_split(m)[1], "weight_decay": 0.0},
                                 {"params": no_decay_split(m)[0], "weight_decay": 0.1}],
    # a frozen embedding: the optimizer over what trains
    "frozen_part": lambda m: [p for p in m.parameters() if p.requires_grad],
}


def make(groups, reordered=False, tied=False, wrap=None):
    model = Branches(reordered, tied)
    if groups == "frozen_part":
        model.embed.requires_grad_(False)
    outer = wrap(model) if wrap else model
    return outer, torch.optim.AdamW(GROUPS[groups](outer), lr=1e-3)


def save_run(path, groups="one_group", tied=False, wrap=None, layout="dict"):
    torch.manual_seed(0)
    model, opt = make(groups, tied=tied, wrap=wrap)
    train(model, opt, 6, seed=0)
    if layout == "lightning":  # Lightning's checkpoint: state_dict and a list of optimizer states
        ckpt = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                "epoch": 6}
    else:
        ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 6}
    torch.save(ckpt, path)
    return path


def resume(path, model, opt, attach="after", layout="dict"):
    def load():
        ckpt = torch.load(path)
        if layout == "lightning":
            model.load_state_dict(ckpt["state_dict"])
            opt.load_state_dict(ckpt["optimizer_states"][0])
        else:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
    san, _ = run(model, opt, load, attach=attach)
    return san


def moved(san):
    return [f for f in errors(san, "optimizer_reset")
            if "took the state of another of the same shape" in f.message]


@pytest.mark.parametrize("attach", ["before", "after"])
def test_reordered_branches_of_alike_scales_are_an_error(tmp_path, attach):
    path = save_run(tmp_path / "ck.pt")
    san = resume(path, *make("one_group", reordered=True), attach=attach)
    (f,) = moved(san)
    assert f.step == 0 and f.tensor == "right.weight", f.message
    assert ("optimizer 0 (AdamW)'s restored state does not fit its parameters: the checkpoint's "
            "model state dict orders them otherwise than the model does now") in f.message
    assert ("4 parameter(s) took the state of another of the same shape: right.weight [16, 16] "
            "(the state of left.weight), right.bias [16] (the state of left.bias), left.weight "
            "[16, 16] (the state of right.weight), left.bias [16] (the state of right.bias)"
            ) in f.message, f.message
    assert "restored by position after the parameter order changed" in f.message
    assert [x.kind for x in san.findings] == ["optimizer_reset"], messages(san)


def test_without_the_models_keys_the_moment_scales_alone_cannot_tell(tmp_path):
    """The model and the optimizer in files of their own: no saved key order, so the moment-scale
    rule alone judges, and these branches' gradient scales are alike (its documented limit)."""
    torch.manual_seed(0)
    model, opt = make("one_group")
    train(model, opt, 6, seed=0)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    model, opt = make("one_group", reordered=True)
    san, _ = run(model, opt, lambda: (model.load_state_dict(torch.load(tmp_path / "model.pt")),
                                      opt.load_state_dict(torch.load(tmp_path / "optimizer.pt"))))
    assert san.findings == [], messages(san)


@pytest.mark.parametrize("groups", list(GROUPS))
def test_param_groups_resumed_are_silent_and_reordered_found(tmp_path, groups):
    path = save_run(tmp_path / "ck.pt", groups)
    san = resume(path, *make(groups))
    assert san.findings == [], messages(san)
    san = resume(path, *make(groups, reordered=True))
    (f,) = moved(san)
    assert "right.weight [16, 16] (the state of left.weight)" in f.message, f.message


def test_groups_by_module_bind_by_module_and_are_silent(tmp_path):
    """Groups listed by module (a learning rate per branch): a reordered declaration changes
    nothing in them, and nothing is reported."""
    def build(reordered):
        model = Branches(reordered)
        rest = [p for n, p in model.named_parameters() if not n.startswith(("left.", "right."))]
        return model, torch.optim.AdamW([{"params": model.left.parameters(), "lr": 1e-3},
                                         {"params": model.right.parameters(), "lr": 2e-3},
                                         {"params": rest}], lr=1e-3)

    torch.manual_seed(0)
    model, opt = build(False)
    train(model, opt, 6, seed=0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "m.pt")
    for reordered in (False, True):
        san = resume(tmp_path / "m.pt", *build(reordered))
        assert san.findings == [], messages(san)


def test_min_gpt_name_sorted_groups_are_silent(tmp_path):
    """minGPT's configure_optimizers lists each group's parameters sorted by name: they bind by
    name, and a reordered declaration is no bug."""
    def build(reordered):
        model = Branches(reordered)
        params = dict(model.named_parameters())
        decay = sorted(n for n, p in params.items() if p.dim() >= 2)
        no_decay = sorted(n for n, p in params.items() if p.dim() < 2)
        return model, torch.optim.AdamW(
            [{"params": [params[n] for n in decay], "weight_decay": 0.1},
             {"params": [params[n] for n in no_decay], "weight_decay": 0.0}], lr=1e-3)

    torch.manual_seed(0)
    model, opt = build(False)
    train(model, opt, 6, seed=0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "g.pt")
    for reordered in (False, True):
        san = resume(tmp_path / "g.pt", *build(reordered))
        assert san.findings == [], messages(san)


@pytest.mark.parametrize("variant", ["tied", "compiled", "ddp", "lightning"])
def test_wrappings_and_layouts_resumed_are_silent_and_reordered_found(tmp_path, variant):
    wrap = {"compiled": lambda m: torch.compile(m, backend="eager"), "ddp": Wrapper}.get(variant)
    tied, layout = variant == "tied", "lightning" if variant == "lightning" else "dict"
    path = save_run(tmp_path / "ck.pt", tied=tied, wrap=wrap, layout=layout)
    san = resume(path, *make("one_group", tied=tied, wrap=wrap), layout=layout)
    assert san.findings == [], messages(san)
    san = resume(path, *make("one_group", reordered=True, tied=tied, wrap=wrap), layout=layout)
    (f,) = moved(san)
    prefix = {"compiled": "_orig_mod.", "ddp": "module."}.get(variant, "")
    assert f"{prefix}right.weight [16, 16] (the state of {prefix}left.weight)" in f.message, \
        f.message


# -- through the launcher ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launched_keys")
    runs = {}
    for groups in ([], ["--groups"]):
        ckpt = str(tmp / f"run{len(groups)}.pt")
        r = run_script(SCRIPT, "--save", ckpt, *groups, launcher=False, env=ENV)
        assert r.returncode == 0, r.stderr
        cases = [("resume", []), ("reorder", ["--bug", "reorder"])]
        if not groups:
            cases += [("rename", ["--bug", "rename"]), ("finetune", ["--finetune"])]
        for name, extra in cases:
            trace = str(tmp / f"{name}{len(groups)}.jsonl")
            r = run_script("--trace", trace, SCRIPT, "--resume", ckpt, *groups, *extra,
                           launcher=True, env=ENV)
            with open(trace, encoding="utf-8") as fh:
                found = [x for x in (json.loads(line) for line in fh if line.strip())
                         if x["type"] == "finding"]
            runs[name + ("_groups" if groups else "")] = (r, found)
    return runs


@pytest.mark.parametrize("name", ["resume", "finetune", "resume_groups"])
def test_launcher_legitimate_runs_are_silent(launched, name):
    r, found = launched[name]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert found == [], found


@pytest.mark.parametrize("name,kind,needle", [
    ("rename", "bad_checkpoint", "classifier.weight (checkpoint: head.weight)"),
    ("reorder", "optimizer_reset", "right.weight [16, 16] (the state of left.weight)"),
    ("reorder_groups", "optimizer_reset", "right.weight [16, 16] (the state of left.weight)"),
])
def test_launcher_finds_the_bugs(launched, name, kind, needle):
    r, found = launched[name]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert [(x["kind"], x["severity"], x["step"]) for x in found] == [(kind, "error", 0)], found
    assert needle in found[0]["message"], found[0]["message"]
