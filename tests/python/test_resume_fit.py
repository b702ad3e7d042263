"""What a resume restores against what it resumes (issue 22; Note [Resume checks] in
host/checks/resume.cpp, the facts in bindings/trainsan/_resume_fit.py).

Bugs, each found:
* optimizer state restored by position after a refactor registered two layers of one shape in
  the other order (their gradient scales 1000x apart): optimizer_reset naming both, for AdamW,
  Adam with weight decay and SGD with momentum, attached before or after the loads;
* a scheduler not restored while the learning rate already jumped (a warm-up scheduler built
  after optimizer.load_state_dict): optimizer_reset, an error;
* the forgotten optimizer of the same model: still an error.
Legitimate, silent: the same resumes in the saved order — after a warm-up, under a GradScaler
(also a fused optimizer, whose gradients are still scaled at its step), with weight decay, with a
frozen layer, with parameters without a gradient at the first step or with sparse gradients
(SparseAdam) — and fine-tunes from a
checkpoint that holds the pretraining's optimizer (and scheduler): a torchvision-style new head
(model.fc = nn.Linear(...)), an HF-style strict=False load under a new classifier, a frozen
backbone with an optimizer over the head, a frozen backbone under an optimizer over everything,
a new optimizer type. The same through ``python -m trainsan run`` (launcher/resume_fit_script.py).
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
SCRIPT = os.path.join(HERE, "launcher", "resume_fit_script.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def errors(san, kind="optimizer_reset"):
    return [f for f in san.findings if f.kind == kind and f.severity == "error"]


def messages(san):
    return [f.message for f in san.findings]


# -- optimizer state restored by position --------------------------------------------------------

class Fusion(nn.Module):
    """Numeric features in raw units (thousands) and normalised text features, each projected by a
    Linear of the same shape, summed, classified. `refactored`: the two projections registered in
    the other order (the state dict's keys, by name, are the same)."""

    def __init__(self, refactored=False, frozen_text=False):
        super().__init__()
        if refactored:
            self.text_proj = nn.Linear(16, 32)
            self.numeric_proj = nn.Linear(16, 32)
        else:
            self.numeric_proj = nn.Linear(16, 32)
            self.text_proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 4)  # used on some steps only (its grad is None on the others)
        if frozen_text:
            self.text_proj.requires_grad_(False)

    def forward(self, numeric, text, aux=False):
        h = torch.relu(self.numeric_proj(numeric) + self.text_proj(text))
        return self.head(h) + (self.aux(h) if aux else 0)


def fusion_batch(g):
    return (torch.randn(32, 16, generator=g) * 1000, torch.randn(32, 16, generator=g),
            torch.randint(0, 4, (32,), generator=g))


OPTIMIZERS = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "Adam+wd": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1),
    "SGD+momentum": lambda ps: torch.optim.SGD(ps, lr=1e-7, momentum=0.9, weight_decay=1e-4),
}


def fusion_steps(model, opt, g, steps, sched=None, scaler=None, aux_every=2, start=0):
    for i in range(start, start + steps):
        num, txt, y = fusion_batch(g)
        opt.zero_grad()
        loss = F.cross_entropy(model(num, txt, aux=i % aux_every == 1), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if sched is not None:
            sched.step()


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 8))


def fusion_run(tmp_path, make_opt, *, refactored, attach="before", frozen_text=False,
               scaler=False, sched=False, steps=12):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = Fusion(frozen_text=frozen_text)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(params)
    sc = warmup(opt) if sched else None
    amp = torch.amp.GradScaler("cpu") if scaler else None
    fusion_steps(model, opt, g, steps, sc, amp)
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps}
    if sc is not None:
        ck["scheduler"] = sc.state_dict()
    if amp is not None:
        ck["scaler"] = amp.state_dict()
    torch.save(ck, tmp_path / "fusion.pt")

    model = Fusion(refactored=refactored, frozen_text=frozen_text)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    sc = warmup(opt) if sched else None
    amp = torch.amp.GradScaler("cpu") if scaler else None
    san = trainsan.attach(model, opt, policy="record") if attach == "before" else None
    ck = torch.load(tmp_path / "fusion.pt")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    if sc is not None:
        sc.load_state_dict(ck["scheduler"])
    if amp is not None:
        amp.load_state_dict(ck["scaler"])
    if san is None:
        san = trainsan.attach(model, opt, policy="record")
    fusion_steps(model, opt, g, 3, sc, amp, start=ck["step"])
    san.close()
    return san


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_restored_by_position_after_a_refactor_is_found(tmp_path, name):
    san = fusion_run(tmp_path, OPTIMIZERS[name], refactored=True)
    (f,) = errors(san)
    assert f.step == 0 and f.tensor == "text_proj.weight", f.message
    assert "restored state does not fit its parameters" in f.message
    assert "text_proj.weight [32, 16]" in f.message and "numeric_proj.weight [32, 16]" \
        in f.message, f.message
    assert "restored by position after the parameter order changed" in f.message
    assert "head.weight" not in f.message


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_in_the_saved_order_is_silent(tmp_path, name):
    san = fusion_run(tmp_path, OPTIMIZERS[name], refactored=False)
    assert san.findings == [], messages(san)


def test_state_restored_by_position_found_after_attach(tmp_path):
    san = fusion_run(tmp_path, OPTIMIZERS["AdamW"], refactored=True, attach="after")
    (f,) = errors(san)
    assert "restored by position after the parameter order changed" in f.message
    assert fusion_run(tmp_path, OPTIMIZERS["AdamW"], refactored=False,
                      attach="after").findings == []


@pytest.mark.parametrize("variant", ["warmup", "grad_scaler", "fused_grad_scaler", "frozen"])
def test_legitimate_resumes_stay_silent_and_the_swap_is_still_found(tmp_path, variant):
    make = OPTIMIZERS["AdamW"]
    kw = {}
    if variant == "warmup":
        kw = {"sched": True, "steps": 4}  # resumed inside the warm-up
    elif variant == "grad_scaler":
        kw = {"scaler": True}
    elif variant == "fused_grad_scaler":
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)  # noqa: E731
        kw = {"scaler": True}
    elif variant == "frozen":
        kw = {"frozen_text": True}
    san = fusion_run(tmp_path, make, refactored=False, **kw)
    assert san.findings == [], messages(san)
    san = fusion_run(tmp_path, make, refactored=True, **kw)
    if variant == "frozen":  # nothing of one shape left to swap: the state still fits
        assert san.findings == [], messages(san)
    else:
        (f,) = errors(san)
        assert "restored by position after the parameter order changed" in f.message


class FusionUsers(Fusion):
    """Fusion with a sparse user embedding, trained by SparseAdam next to AdamW (its gradients
    are sparse: not compared)."""

    def __init__(self, refactored=False):
        super().__init__(refactored)
        self.users = nn.Embedding(100, 32, sparse=True)

    def forward(self, numeric, text, aux=False):
        uid = (numeric[:, 0].abs() % 100).long()
        return self.head(torch.relu(self.numeric_proj(numeric) + self.text_proj(text)
                                    + self.users(uid)))


@pytest.mark.parametrize("refactored", [False, True], ids=["saved_order", "refactored"])
def test_sparse_gradients_are_skipped(tmp_path, refactored):
    def build(refactored=False):
        model = FusionUsers(refactored)
        dense = [p for n, p in model.named_parameters() if not n.startswith("users.")]
        return model, [torch.optim.SparseAdam([model.users.weight], lr=1e-2),
                       torch.optim.AdamW(dense, lr=1e-3)]

    def steps(model, opts, g, n):
        for _ in range(n):
            num, txt, y = fusion_batch(g)
            for o in opts:
                o.zero_grad()
            F.cross_entropy(model(num, txt), y).backward()
            for o in opts:
                o.step()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model, opts = build()
    steps(model, opts, g, 10)
    torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in opts],
                "step": 10}, tmp_path / "users.pt")
    model, opts = build(refactored)
    ck = torch.load(tmp_path / "users.pt")
    model.load_state_dict(ck["model"])
    for o, sd in zip(opts, ck["optimizers"]):
        o.load_state_dict(sd)
    san = trainsan.attach(model, opts, policy="record")
    steps(model, opts, g, 2)
    san.close()
    if not refactored:
        assert san.findings == [], messages(san)
    else:
        (f,) = errors(san)
        assert "optimizer 1 (AdamW)'s restored state does not fit" in f.message, f.message


def test_rollback_within_a_run_is_silent():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = Fusion()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    fusion_steps(model, opt, g, 4)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict()}
    fusion_steps(model, opt, g, 3)
    opt.load_state_dict(saved["optimizer"])  # a loss spike: back to the last good state
    model.load_state_dict(saved["model"])
    fusion_steps(model, opt, g, 3)
    san.close()
    assert san.findings == [], messages(san)


# -- a scheduler not restored ---------------------------------------------------------------------

def make_mlp(head=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, head))


def mlp_steps(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(16, 8, generator=g)),
                        torch.randint(0, model[-1].out_features, (16,), generator=g)).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A run's checkpoint as torchvision's and HF's scripts save it: model, optimizer, scheduler
    and epoch."""
    model = make_mlp(head=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = warmup(opt)
    mlp_steps(model, opt, sched, 5, seed=0)
    path = tmp_path_factory.mktemp("pre") / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "epoch": 5}, path)
    return path


@pytest.mark.parametrize("restored", [False, True], ids=["forgotten", "restored"])
def test_scheduler_built_after_the_optimizer_load(pretrained, restored):
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    ck = torch.load(pretrained)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched = warmup(opt)  # sets the warm-up's first rate over the restored one
    if restored:
        sched.load_state_dict(ck["scheduler"])
    mlp_steps(model, opt, sched, 3, seed=1)
    san.close()
    if restored:
        assert san.findings == [], messages(san)
        return
    (f,) = san.findings
    assert f.kind == "optimizer_reset" and f.severity == "error", f
    assert "scheduler's state at epoch 5" in f.message
    assert "the learning rate jumped from 0.00075 when saved to 0.000125 at this step" \
        in f.message, f.message


def test_scheduler_forgotten_with_the_rate_restored_is_a_warning_then_an_error(pretrained):
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = warmup(opt)
    ck = torch.load(pretrained)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])  # after the scheduler: the saved rate comes back
    san = trainsan.attach(model, opt, policy="record")
    mlp_steps(model, opt, sched, 3, seed=1)
    san.close()
    f, g = san.findings
    assert f.severity == "warning" and f.step == 0 and "the learning rate is 0.00075 at this " \
        "step, 0.00075 when saved" in f.message, f.message
    # Note [Restarted schedule]: the scheduler's next step restarts the warm-up (epoch 1: 2/8 of
    # 1e-3), where the checkpoint's schedule is at epoch 6 (7/8 of it).
    assert (g.kind, g.severity, g.step) == ("optimizer_reset", "error", 1)
    assert "it set the learning rate to 0.00025 (its epoch 1), where the checkpoint's schedule " \
        "is at epoch 6 with 0.000875" in g.message, g.message


# -- fine-tuning from a checkpoint that holds the pretraining's optimizer -------------------------

class TinyResNet(nn.Module):
    def __init__(self, num_classes=100):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 1).flatten(1))


def image_steps(model, opt, steps, classes, seed, sched=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 3, 8, 8, generator=g)),
                        torch.randint(0, classes, (8,), generator=g)).backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """The pretraining checkpoint of torchvision's reference script: {model, optimizer,
    lr_scheduler, epoch}, SGD with momentum."""
    torch.manual_seed(0)
    model = TinyResNet(100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    image_steps(model, opt, 5, 100, seed=0, sched=sched)
    path = tmp_path_factory.mktemp("imagenet") / "model_89.pth"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "lr_scheduler": sched.state_dict(), "epoch": 89}, path)
    return path


def test_torchvision_new_head_is_silent(imagenet):
    model = TinyResNet(100)
    checkpoint = torch.load(imagenet, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    model.fc = nn.Linear(8, 10)  # a new head for the new task
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    san = trainsan.attach(model, opt, policy="record")
    image_steps(model, opt, 3, 10, seed=1, sched=sched)
    san.close()
    assert san.findings == [], messages(san)


def test_same_model_without_its_optimizer_is_still_an_error(imagenet):
    model = TinyResNet(100)
    checkpoint = torch.load(imagenet, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = trainsan.attach(model, opt, policy="record")
    image_steps(model, opt, 3, 100, seed=1)
    san.close()
    (f,) = errors(san)
    assert "optimizer 0 (SGD) was not restored" in f.message


class HFClassifier(nn.Module):
    """A pretrained encoder and a task head, as HF's *ForSequenceClassification: the
    pretraining's head is `lm_head`, the task's `classifier`."""

    def __init__(self, task_head=True):
        super().__init__()
        self.embeddings = nn.Embedding(50, 16)
        self.encoder = nn.Linear(16, 16)
        if task_head:
            self.classifier = nn.Linear(16, 3)
        else:
            self.lm_head = nn.Linear(16, 50)

    def forward(self, ids):
        h = torch.tanh(self.encoder(self.embeddings(ids))).mean(1)
        return self.classifier(h) if hasattr(self, "classifier") else self.lm_head(h)


@pytest.fixture(scope="module")
def hf_pretrained(tmp_path_factory):
    torch.manual_seed(0)
    model = HFClassifier(task_head=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = warmup(opt)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 50, (4, 6), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(ids), ids[:, 0]).backward()
        opt.step()
        sched.step()
    path = tmp_path_factory.mktemp("hf") / "pretrain.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": 4}, path)
    return path


def classify_steps(model, opt, steps=3):
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 6), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(ids), ids[:, 0] % 3).backward()
        opt.step()


@pytest.mark.parametrize("attach", ["before", "after"])
def test_hf_strict_false_new_classifier_is_silent(hf_pretrained, attach):
    model = HFClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    san = trainsan.attach(model, opt, policy="record") if attach == "before" else None
    state = torch.load(hf_pretrained)["model"]
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["classifier.weight", "classifier.bias"]
    san = san or trainsan.attach(model, opt, policy="record")
    classify_steps(model, opt)
    san.close()
    assert san.findings == [], messages(san)


def test_frozen_backbone_new_head_optimizer_over_the_head_is_silent(hf_pretrained):
    model = HFClassifier(task_head=False)
    model.load_state_dict(torch.load(hf_pretrained)["model"])
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head = nn.Linear(16, 50)  # re-initialised, same shape, the only part that trains
    opt = torch.optim.AdamW(model.lm_head.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    classify_steps(model, opt)
    san.close()
    assert san.findings == [], messages(san)


def test_frozen_backbone_under_an_optimizer_over_everything_is_silent(hf_pretrained):
    # Linear probing with the pretrained head kept: nothing new, the optimizer has the saved
    # groups — but the backbone, trained then, is frozen now.
    model = HFClassifier(task_head=False)
    model.load_state_dict(torch.load(hf_pretrained)["model"])
    model.embeddings.requires_grad_(False)
    model.encoder.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    classify_steps(model, opt)
    san.close()
    assert san.findings == [], messages(san)


def test_a_new_optimizer_type_is_silent(hf_pretrained):
    model = HFClassifier(task_head=False)
    model.load_state_dict(torch.load(hf_pretrained)["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # pretrained with AdamW
    san = trainsan.attach(model, opt, policy="record")
    classify_steps(model, opt)
    san.close()
    assert san.findings == [], messages(san)


# -- through the launcher --------------------------------------------------------------------------

def _run(*args, launcher=True):
    return run_script(*args, launcher=launcher, env=ENV)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launched_fit")
    ckpt = str(tmp / "run.pt")
    r = _run(SCRIPT, "--save", ckpt, launcher=False)
    assert r.returncode == 0, r.stderr
    runs = {}
    for name, extra in (("resume", []), ("reordered", ["--bug", "reorder"]),
                        ("finetune", ["--finetune"]), ("forgot", ["--bug", "forget_optimizer"]),
                        ("sched_after", ["--bug", "scheduler_after"])):
        trace = str(tmp / f"{name}.jsonl")
        r = _run("--trace", trace, SCRIPT, "--resume", ckpt, *extra)
        with open(trace, encoding="utf-8") as fh:
            found = [x for x in (json.loads(line) for line in fh if line.strip())
                     if x["type"] == "finding"]
        runs[name] = (r, found)
    return runs


@pytest.mark.parametrize("name", ["resume", "finetune"])
def test_launcher_legitimate_runs_are_silent(launched, name):
    r, found = launched[name]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert found == [], found


@pytest.mark.parametrize("name,needle", [
    ("reordered", "restored by position after the parameter order changed"),
    ("forgot", "optimizer 0 (AdamW) was not restored"),
    ("sched_after", "the learning rate jumped from"),
])
def test_launcher_finds_the_bugs(launched, name, needle):
    r, found = launched[name]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert [(x["kind"], x["severity"], x["step"]) for x in found] == [
        ("optimizer_reset", "error", 0)], found
    assert needle in found[0]["message"], found[0]["message"]
