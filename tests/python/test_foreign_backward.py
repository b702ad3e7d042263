"""Foreign backwards (Note [Foreign backwards], host/checks/gradient_flow.cpp): a loss wrapper that
still holds the model from before a resume or a copy trains that one while the optimizer steps the
new one — missing_grad naming the wrapper's model and what to do, explicit attach and through
``python -m trainsan run``; the legitimate loops with other models' backwards stay silent (the
wrapper rebuilt, MoE top-1 routing, a GAN, distillation from a frozen teacher, a frozen backbone,
two models with two optimizers, a probe on detached features)."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainsan

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


class Net(nn.Module):
    def __init__(self, din=16, classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(din, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.body(x)


class LossWrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


def _batch(n=32, din=16, classes=4):
    return torch.randn(n, din), torch.randint(0, classes, (n,))


class Trainer:
    """A trainer that rebuilds its model on resume (load_state_dict into a fresh one)."""

    def __init__(self, rebuild_wrapper):
        self.rebuild_wrapper = rebuild_wrapper
        self.model = Net()
        self.criterion = LossWrapper(self.model)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def resume(self, state):
        self.model = Net()
        self.model.load_state_dict(state)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        if self.rebuild_wrapper:
            self.criterion = LossWrapper(self.model)

    def fit(self, steps):
        for _ in range(steps):
            x, y = _batch()
            loss = self.criterion(x, y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


def _resumed_trainer(rebuild_wrapper):
    torch.manual_seed(0)
    trainer = Trainer(rebuild_wrapper)
    trainer.fit(3)
    trainer.resume(copy.deepcopy(trainer.model.state_dict()))
    return trainer


def _foreign(findings):
    return [f for f in findings if f.kind == "missing_grad" and not f.tensor]


def test_trainer_rebuilding_its_model_on_resume_but_not_its_loss_wrapper():
    trainer = _resumed_trainer(rebuild_wrapper=False)
    with trainsan.attach(trainer.model, trainer.optimizer, policy="record") as san:
        trainer.fit(10)
    found = _foreign(san.findings)
    assert len(found) == 1, [str(f) for f in san.findings]
    f = found[0]
    assert f.severity == "error" and f.step <= 2, str(f)
    assert "none of the 4 trainable parameters optimizer 0 steps got a gradient" in f.message
    assert "reached 4 requires-grad tensors (676 elements) outside this model" in f.message
    assert "held by self.criterion.model (Net, 4 parameters)" in f.message, f.message
    assert "rebuild it around the model the optimizer steps" in f.message
    # no per-parameter missing_grad with the wrong advice, nothing else
    assert {g.kind for g in san.findings} == {"missing_grad"}, [str(g) for g in san.findings]


def test_policy_raise_stops_at_the_third_step():
    trainer = _resumed_trainer(rebuild_wrapper=False)
    with trainsan.attach(trainer.model, trainer.optimizer) as san:
        with pytest.raises(trainsan.TrainingBugError, match="missing_grad at step 2: none of"):
            trainer.fit(10)
    assert san.step == 3  # raised from the third step of the rebuilt model's optimizer


def test_trainer_rebuilding_its_wrapper_too_is_silent():
    trainer = _resumed_trainer(rebuild_wrapper=True)
    with trainsan.attach(trainer.model, trainer.optimizer, policy="record") as san:
        trainer.fit(10)
    assert san.findings == [], [str(f) for f in san.findings]


@pytest.mark.parametrize("bug", [True, False])
def test_deepcopy_after_building_the_criterion_wrapper(bug):
    torch.manual_seed(0)
    model = Net()
    criterion = LossWrapper(model)
    model = copy.deepcopy(model)  # e.g. to keep the pretrained weights apart
    if not bug:
        criterion = LossWrapper(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with trainsan.attach(model, optimizer, policy="record") as san:
        for _ in range(10):
            x, y = _batch()
            loss = criterion(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    found = _foreign(san.findings)
    if bug:
        assert len(found) == 1, [str(f) for f in san.findings]
        assert "held by criterion.model (Net, 4 parameters)" in found[0].message, found[0].message
    else:
        assert san.findings == [], [str(f) for f in san.findings]


def test_closure_over_the_old_model():
    torch.manual_seed(0)
    model = Net()

    def make_loss(m):
        return lambda x, y: F.cross_entropy(m(x), y)

    loss_fn = make_loss(model)
    model = Net()
    model.load_state_dict(copy.deepcopy(loss_fn.__closure__[0].cell_contents.state_dict()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, optimizer, policy="record") as san:
        for _ in range(5):
            x, y = _batch()
            optimizer.zero_grad()
            loss_fn(x, y).backward()
            optimizer.step()
    found = _foreign(san.findings)
    assert len(found) == 1, [str(f) for f in san.findings]
    assert "held by loss_fn (its closure's m) (Net, 4 parameters)" in found[0].message


def test_holder_prefers_the_attached_models_class_then_the_outermost_module():
    from trainsan import _foreign

    criterion = LossWrapper(Net())  # Net and its Sequential hold the same 4 parameters
    leaves = list(criterion.parameters())
    named = _foreign.holder(leaves, Net)
    assert named == {"holder": "criterion.model", "holder_type": "Net", "holder_params": 4}
    named = _foreign.holder(leaves)
    assert named == {"holder": "criterion", "holder_type": "LossWrapper", "holder_params": 4}
    assert _foreign.holder([torch.zeros(2, requires_grad=True)]) == {}


# --- the legitimate twins, each with other models' backwards in the loop ------------------------


class MoE(nn.Module):
    """Top-1 routing over 8 experts: few experts get a gradient per step."""

    def __init__(self, d=16, experts=8, classes=4):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        gate = self.router(x).softmax(-1).max(-1).values.unsqueeze(-1)
        out = torch.zeros_like(x)
        for k, e in enumerate(self.experts):
            sel = choice == k
            if sel.any():
                out[sel] = e(x[sel])
        return self.head(out * gate)


def test_moe_top1_with_a_probe_trained_on_detached_features_is_silent():
    torch.manual_seed(0)
    model = MoE()
    probe = nn.Linear(16, 4)  # attached nowhere, its own optimizer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(12):
            x, y = _batch(n=2)  # two tokens: at most two experts reached
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            probe_opt.zero_grad()
            F.cross_entropy(probe(x.detach()), y).backward()
            probe_opt.step()
    assert not _foreign(san.findings), [str(f) for f in san.findings]


@pytest.mark.parametrize("sanitizers", ["generator", "both"])
def test_gan_with_one_or_two_sanitizers_is_silent(sanitizers):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
    D = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
    sans = [trainsan.attach(G, opt_g, policy="record")]
    if sanitizers == "both":
        sans.append(trainsan.attach(D, opt_d, policy="record"))
    for _ in range(12):
        real = torch.randn(16, 16)
        fake = G(torch.randn(16, 8))
        for _ in range(2):  # n_critic discriminator steps
            opt_d.zero_grad()
            d_loss = F.softplus(D(fake.detach())).mean() + F.softplus(-D(real)).mean()
            d_loss.backward()
            opt_d.step()
        opt_g.zero_grad()
        F.softplus(-D(fake)).mean().backward()
        opt_g.step()
    for s in sans:
        s.close()
        assert not _foreign(s.findings), [str(f) for f in s.findings]
        assert not [f for f in s.findings if f.kind == "missing_grad"]


def test_distillation_from_a_frozen_teacher_and_a_frozen_backbone_are_silent():
    torch.manual_seed(0)
    teacher = Net().eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    backbone = nn.Linear(16, 16)
    for p in backbone.parameters():
        p.requires_grad_(False)
    student = nn.Sequential(backbone, nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.1)
    with trainsan.attach(student, opt, policy="record") as san:
        for _ in range(10):
            x, _ = _batch()
            with torch.no_grad():
                soft = teacher(x).softmax(-1)
            loss = F.kl_div(student(x).log_softmax(-1), soft, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert san.findings == [], [str(f) for f in san.findings]


def test_two_models_with_two_optimizers_in_alternating_phases_are_silent():
    torch.manual_seed(0)
    a, b = Net(), Net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    san = trainsan.attach(a, opt_a, policy="record")
    for phase in range(4):  # a trains, then b (a's optimizer idle), then a again...
        model, opt = (a, opt_a) if phase % 2 == 0 else (b, opt_b)
        for _ in range(4):
            x, y = _batch()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    san.close()
    assert san.findings == [], [str(f) for f in san.findings]


def test_ema_eval_accumulation_and_lbfgs_beside_a_probe_are_silent():
    """An EMA copy updated under no_grad, an evaluation pass, gradient accumulation over 4
    backwards, then LBFGS with its closure; a probe (attached nowhere) trains alongside."""
    torch.manual_seed(0)
    model, probe = Net(), nn.Linear(16, 4)
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe_opt = torch.optim.SGD(probe.parameters(), lr=0.1)

    def probe_step(x, y):
        probe_opt.zero_grad()
        F.cross_entropy(probe(x), y).backward()
        probe_opt.step()

    with trainsan.attach(model, opt, policy="record") as san:
        for _ in range(6):
            opt.zero_grad()
            for _ in range(4):
                x, y = _batch()
                (F.cross_entropy(model(x), y) / 4).backward()
                probe_step(x, y)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.mul_(0.9).add_(pm, alpha=0.1)
                model.eval()
                ema(x), model(x)
                model.train()
    assert san.findings == [], [str(f) for f in san.findings]

    torch.manual_seed(0)
    model = Net()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    with trainsan.attach(model, lbfgs, policy="record") as san:
        for _ in range(5):
            x, y = _batch()
            probe_step(x, y)

            def closure():
                lbfgs.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss

            lbfgs.step(closure)
    assert not _foreign(san.findings), [str(f) for f in san.findings]


def test_reptile_outer_step_over_an_inner_copy_is_silent():
    """The inner copy's backwards reach none of the meta-model's parameters, whose .grad the
    outer step sets by hand: a gradient, though no hook saw it."""
    torch.manual_seed(0)
    meta = Net()
    outer = torch.optim.SGD(meta.parameters(), lr=0.5)
    with trainsan.attach(meta, outer, policy="record") as san:
        for _ in range(6):
            fast = copy.deepcopy(meta)
            inner = torch.optim.SGD(fast.parameters(), lr=0.1)
            for _ in range(3):
                x, y = _batch()
                inner.zero_grad()
                F.cross_entropy(fast(x), y).backward()
                inner.step()
            outer.zero_grad()
            for p, q in zip(meta.parameters(), fast.parameters()):
                p.grad = p.detach() - q.detach()
            outer.step()
    assert not _foreign(san.findings), [str(f) for f in san.findings]


# --- the launcher ---------------------------------------------------------------------------------


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *args], capture_output=True,
                          text=True, timeout=180, cwd=HERE, env=ENV)


def test_launcher_finds_the_stale_wrapper_after_a_resume(tmp_path):
    trace = str(tmp_path / "stale.jsonl")
    r = _launch("--policy", "record", "--trace", trace, "stale_wrapper_script.py", "--bug",
                "stale_wrapper")
    assert r.returncode == 0, r.stderr
    # the model before the resume is paired first (its trace clean), the rebuilt one second
    assert "trainsan run: Net (model 2) with SGD, trace " + trace[:-6] + ".1.jsonl" in r.stderr
    recs = []
    for path in (trace, trace[:-6] + ".1.jsonl"):
        with open(path, encoding="utf-8") as fh:
            recs += [json.loads(line) for line in fh if line.strip()]
    found = [x for x in recs if x.get("type") == "finding"]
    assert len(found) == 1 and found[0]["kind"] == "missing_grad", found
    assert "none of the 4 trainable parameters" in found[0]["message"], found[0]
    assert "held by self.criterion.model (Net, 4 parameters)" in found[0]["message"], found[0]


def test_launcher_clean_resume_is_silent():
    r = _launch("stale_wrapper_script.py")
    assert r.returncode == 0, r.stderr
    assert "no findings" in r.stderr, r.stderr
