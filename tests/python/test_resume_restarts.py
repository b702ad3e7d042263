"""Resumes that restart (issue 38; Note [Restarted schedule] in host/checks/resume.cpp, Note
[Replayed order] in host/checks/resume_data.cpp), written as training scripts write resumes and
attached explicitly (the loads journaled: trainsan.watch_loads()) and through
`python -m trainsan run` (launcher/resume_restart_script.py).

Bugs, each found:
* the model and optimizer restored, the scheduler rebuilt but not restored: a warning at the first
  step (the restored rate still holds), and an error naming the scheduler at the step where the
  fresh schedule takes effect — an HF-style linear warm-up (LambdaLR, stepped per batch), a
  torchvision-style SequentialLR(LinearLR warm-up, CosineAnnealingLR) stepped per epoch, a
  OneCycleLR, and a CosineAnnealingLR stepped per batch (found where it has drifted off);
* the RNG seeded at the top and not restored, with a shuffling DataLoader: the resumed run draws
  the first epoch's order again — duplicate_batch (warning) at its first step; also when the
  run's seed is set again after the load.
Legitimate twins, silent (or today's first-step warning alone): a restored scheduler; one rebuilt
with last_epoch at the checkpoint's; a fine-tune with a new optimizer and schedule; a
ReduceLROnPlateau; a constant schedule; ExponentialLR (it continues the restored rate); a rate set
by hand after the resume. The RNG restored (a checkpoint's "rng", HF's rng_state.pth through
torch.random.set_rng_state), the seed per epoch (torch.manual_seed(seed + epoch)), a loader with a
generator of its own, a DistributedSampler with set_epoch, torch.seed(), a fine-tune, an explicit
attach without the journal (the seeding not seen).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as L
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trainsan
from _launch import run_script

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launcher", "resume_restart_script.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
SEED = 42


def found(san):
    return [(f.kind, f.severity, f.step) for f in san.findings]


def set_seed(seed):  # transformers.set_seed / accelerate.utils.set_seed, without numpy
    random.seed(seed)
    torch.manual_seed(seed)


def make_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


DATA = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
                     torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2)))


# -- a schedule that restarts ----------------------------------------------------------------------

def hf_linear(opt, warmup=4, total=64, last_epoch=-1):
    """transformers.get_linear_schedule_with_warmup."""
    def lr_lambda(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return L.LambdaLR(opt, lr_lambda, last_epoch)


def tv_warmup_cosine(opt, epochs=10):
    """torchvision's references/classification/train.py with --lr-warmup-epochs 2."""
    warm = L.LinearLR(opt, start_factor=0.01, total_iters=2)
    main = L.CosineAnnealingLR(opt, T_max=epochs - 2)
    return L.SequentialLR(opt, schedulers=[warm, main], milestones=[2])


def one_cycle(opt):
    return L.OneCycleLR(opt, max_lr=1e-2, total_steps=64)


SCHEDULES = {
    # name: (factory, stepped per batch (else per epoch), the step its restart takes effect at)
    "hf_linear_warmup": (hf_linear, True, 1),
    "torchvision_sequential": (tv_warmup_cosine, False, 8),
    "one_cycle": (one_cycle, True, 1),
    # CosineAnnealingLR per batch over 1000 steps, resumed at step 16: its recursive form continues
    # from the restored rate and leaves the checkpoint's cosine gradually (the 13th change is the
    # first more than 1e-3 off; hand-computed from the two formulas)
    "cosine_per_batch": (lambda o: L.CosineAnnealingLR(o, T_max=1000), True, 13),
    "constant": (lambda o: L.LambdaLR(o, lambda e: 1.0), True, None),
    "exponential": (lambda o: L.ExponentialLR(o, gamma=0.9), True, None),
    "plateau": (lambda o: L.ReduceLROnPlateau(o, patience=0, factor=0.5), False, None),
}


def sched_step(sched, loss):
    if isinstance(sched, L.ReduceLROnPlateau):
        sched.step(1.0)  # a loss that never improves: the rate halves each epoch
    else:
        sched.step()


def epochs(model, opt, sched, per_batch, n, start=0, hook=None):
    g = torch.Generator().manual_seed(start)
    loader = DataLoader(DATA, batch_size=8, shuffle=True, generator=g)
    for epoch in range(start, start + n):
        for i, (x, y) in enumerate(loader):
            if hook is not None:
                hook(epoch, i)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if per_batch:
                sched_step(sched, loss)
        if not per_batch:
            sched_step(sched, loss)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per schedule: a run's checkpoint after 2 epochs of 8 batches, saved as torchvision's and
    HF's scripts save it (model, optimizer, lr_scheduler, epoch)."""
    out = {}
    tmp = tmp_path_factory.mktemp("sched")
    for name, (make, per_batch, _) in SCHEDULES.items():
        set_seed(SEED)
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = make(opt)
        epochs(model, opt, sched, per_batch, 2)
        path = tmp / f"{name}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "lr_scheduler": sched.state_dict(), "epoch": 2}, path)
        out[name] = path
    return out


def resume(path, name, how="forget", attach="before", hand_lr=None):
    """The resume as HF's Trainer orders it: optimizer and scheduler built, then the model, the
    optimizer and (unless forgotten) the scheduler restored; two more epochs."""
    make, per_batch, _ = SCHEDULES[name]
    with trainsan.watch_loads():
        set_seed(SEED)
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = make(opt)
        san = trainsan.attach(model, opt, policy="record") if attach == "before" else None
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        if how != "fine_tune":
            opt.load_state_dict(ckpt["optimizer"])
        if how == "restored":
            sched.load_state_dict(ckpt["lr_scheduler"])
        elif how == "last_epoch":
            sched = hf_linear(opt, last_epoch=ckpt["lr_scheduler"]["last_epoch"] - 1)
        if san is None:
            san = trainsan.attach(model, opt, policy="record")

        def by_hand(epoch, i):
            if hand_lr is not None and i == 1:
                for group in opt.param_groups:
                    group["lr"] = hand_lr  # the documented new rate of the rest of the run

        epochs(model, opt, sched, per_batch, 2, start=ckpt.get("epoch", 0), hook=by_hand)
        san.close()
    return san


@pytest.mark.parametrize("attach", ["before", "after"])
@pytest.mark.parametrize("name", ["hf_linear_warmup", "torchvision_sequential", "one_cycle",
                                  "cosine_per_batch"])
def test_a_restarted_schedule_is_an_error_where_it_takes_effect(trained, name, attach):
    at = SCHEDULES[name][2]
    san = resume(trained[name], name, attach=attach)
    assert found(san) == [("optimizer_reset", "warning", 0), ("optimizer_reset", "error", at)], \
        [f.message for f in san.findings]
    warning, error = san.findings
    assert "the schedule restarts" in warning.message and "restore the scheduler" in warning.message
    kind = {"hf_linear_warmup": "LambdaLR", "torchvision_sequential": "SequentialLR",
            "one_cycle": "OneCycleLR", "cosine_per_batch": "CosineAnnealingLR"}[name]
    assert f"the learning-rate scheduler {kind} of optimizer 0 (AdamW) was rebuilt but not " \
           "restored" in error.message, error.message
    assert "scheduler.load_state_dict" in error.message


def test_the_hf_warmup_restart_names_the_rates(trained):
    san = resume(trained["hf_linear_warmup"], "hf_linear_warmup")
    error = san.findings[1]
    # The warm-up of 4 steps restarts: epoch 1 of LambdaLR is 1e-3 * 1/4; the checkpoint's
    # schedule, saved at step 16 (1e-3 * 48/60 = 0.0008), is at step 17: 1e-3 * 47/60.
    assert "it set the learning rate to 0.00025 (its epoch 1), where the checkpoint's schedule " \
           "is at epoch 17 with 0.0007833 (it was saved at epoch 16 with 0.0008)" \
           in error.message, error.message
    assert "16 epoch(s) behind the checkpoint" in error.message
    assert error.value == pytest.approx(2.5e-4)


@pytest.mark.parametrize("name", ["hf_linear_warmup", "torchvision_sequential", "one_cycle",
                                  "cosine_per_batch", "plateau", "exponential"])
def test_a_restored_scheduler_is_silent(trained, name):
    san = resume(trained[name], name, how="restored")
    assert san.findings == [], [f.message for f in san.findings]


def test_a_scheduler_rebuilt_at_the_checkpoints_epoch_is_silent(trained):
    san = resume(trained["hf_linear_warmup"], "hf_linear_warmup", how="last_epoch")
    assert san.findings == [], [f.message for f in san.findings]


def test_a_fine_tune_from_weights_is_silent(trained, tmp_path):
    ckpt = torch.load(trained["hf_linear_warmup"])
    path = tmp_path / "weights.pt"
    torch.save({"model": ckpt["model"]}, path)
    san = resume(path, "hf_linear_warmup", how="fine_tune")
    assert san.findings == [], [f.message for f in san.findings]


def test_a_fine_tune_with_a_new_head_optimizer_and_schedule_is_silent(trained):
    """torchvision's fine-tuning: the training checkpoint's weights, a new head, a new optimizer
    and schedule on purpose (the pretraining's optimizer and lr_scheduler left in the file)."""
    with trainsan.watch_loads():
        set_seed(SEED)
        model = make_model()
        ckpt = torch.load(trained["hf_linear_warmup"])
        model.load_state_dict(ckpt["model"])
        model[3] = nn.Linear(32, 10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sched = hf_linear(opt)
        san = trainsan.attach(model, opt, policy="record")
        g = torch.Generator().manual_seed(0)
        for x, _ in DataLoader(DATA, batch_size=8, shuffle=True, generator=g):
            opt.zero_grad()
            F.cross_entropy(model(x), torch.randint(0, 10, (8,), generator=g)).backward()
            opt.step()
            sched.step()
        san.close()
    assert san.findings == [], [f.message for f in san.findings]


@pytest.mark.parametrize("name", ["constant", "exponential", "plateau"])
def test_schedules_that_continue_the_restored_rate_keep_the_warning_alone(trained, name):
    san = resume(trained[name], name)
    assert found(san) == [("optimizer_reset", "warning", 0)], [f.message for f in san.findings]


def test_a_rate_set_by_hand_after_the_resume_keeps_the_warning_alone(trained):
    # Per epoch: the scheduler has not stepped when the rate is set by hand at the second batch.
    san = resume(trained["torchvision_sequential"], "torchvision_sequential", hand_lr=5e-4)
    assert found(san) == [("optimizer_reset", "warning", 0)], [f.message for f in san.findings]


def test_the_scheduler_is_never_changed(trained):
    """Computing the checkpoint's schedule leaves the scheduler and the optimizer as they were."""
    make, per_batch, _ = SCHEDULES["one_cycle"]
    runs = []
    for on in (False, True):
        set_seed(SEED)
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = make(opt)
        with trainsan.watch_loads():
            san = trainsan.attach(model, opt, policy="record") if on else None
            ckpt = torch.load(trained["one_cycle"])
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            epochs(model, opt, sched, per_batch, 1, start=2)
            if san is not None:
                san.close()
        runs.append(([g["lr"] for g in opt.param_groups], [g["betas"] for g in opt.param_groups],
                     sched.state_dict()["last_epoch"], [p.detach().clone() for p in
                                                        model.parameters()]))
    assert runs[0][:3] == runs[1][:3]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][3], runs[1][3]))


# -- a data order that restarts --------------------------------------------------------------------

def first_run(path, loader_kw=None, seed_per_epoch=False):
    """Seeded at the top (set_seed), two epochs over a shuffled loader; saves model, optimizer,
    epoch and step, and the RNG state."""
    set_seed(SEED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(DATA, batch_size=8, **(loader_kw or {"shuffle": True}))
    orders, step = [], 0
    for epoch in range(2):
        if seed_per_epoch:
            torch.manual_seed(SEED + epoch)
        batches = []
        for x, y in loader:
            batches.append(x)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
        orders.append(torch.cat(batches))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2,
                "step": step, "rng": torch.get_rng_state()}, path)
    torch.save({"cpu": torch.get_rng_state()}, str(path) + ".rng_state.pth")  # HF Trainer's
    return orders


def resumed(path, how="top_seed", loader_kw=None, watch=True, restore_optimizer=True):
    """The resume: seeded at the top as always, then model and optimizer (and whatever `how`
    restores), then one epoch. Returns (sanitizer, the epoch's inputs in order)."""
    holder = trainsan.watch_loads() if watch else None
    set_seed(SEED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = loader_kw.get("sampler") if loader_kw else None
    ckpt = torch.load(path)
    model.load_state_dict(ckpt["model"])
    if restore_optimizer:
        opt.load_state_dict(ckpt["optimizer"])
    start = ckpt["epoch"]
    if how == "rng":
        torch.set_rng_state(ckpt["rng"])
    elif how == "hf_rng_file":
        torch.random.set_rng_state(torch.load(str(path) + ".rng_state.pth")["cpu"])
    elif how == "reseed":
        set_seed(SEED)  # the run's seed again, after the load
    elif how == "random":
        torch.seed()
    loader = DataLoader(DATA, batch_size=8, **(loader_kw or {"shuffle": True}))
    san = None
    batches = []
    for epoch in range(start, start + 1):
        if how == "seed_per_epoch":
            torch.manual_seed(SEED + epoch)
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            if san is None:  # the launcher's attach, at the first training forward
                san = trainsan.attach(model, opt, policy="record")
            batches.append(x)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    san.close()
    if holder is not None:
        holder.close()
    return san, torch.cat(batches)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    path = tmp_path_factory.mktemp("order") / "run.pt"
    return path, first_run(path)


def test_a_replayed_first_epoch_order_is_reported(seeded):
    path, orders = seeded
    san, order = resumed(path)
    assert torch.equal(order, orders[0])  # the bug itself: epoch 0's order at epoch 2
    assert found(san) == [("duplicate_batch", "warning", 0)], [f.message for f in san.findings]
    msg = san.findings[0].message
    assert "after the resume from the checkpoint (epoch=2, step=16), the data loader's " \
           "RandomSampler drew this pass's order from the global RNG, which was seeded " \
           "(torch.manual_seed(42)) and not restored" in msg, msg
    assert "torch.set_rng_state" in msg and "torch.manual_seed(seed + epoch)" in msg


def test_the_runs_seed_set_again_after_the_load_is_reported(seeded):
    san, _ = resumed(seeded[0], how="reseed")
    assert found(san) == [("duplicate_batch", "warning", 0)], [f.message for f in san.findings]
    assert "again after the checkpoint's load" in san.findings[0].message


@pytest.mark.parametrize("how", ["rng", "hf_rng_file", "seed_per_epoch", "random"])
def test_restored_or_reseeded_orders_are_silent(seeded, how):
    path, orders = seeded
    san, order = resumed(path, how=how)
    assert san.findings == [], [f.message for f in san.findings]
    assert not torch.equal(order, orders[0])


def test_a_loader_with_its_own_generator_is_silent(seeded):
    g = torch.Generator().manual_seed(SEED + 2)  # seeded with the epoch
    san, _ = resumed(seeded[0], loader_kw={"shuffle": True, "generator": g})
    assert san.findings == [], [f.message for f in san.findings]


def test_a_distributed_sampler_with_set_epoch_is_silent(tmp_path):
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=0)
    path = tmp_path / "ddp.pt"
    first_run(path, loader_kw={"sampler": sampler})
    sampler = DistributedSampler(DATA, num_replicas=1, rank=0, shuffle=True, seed=0)
    san, _ = resumed(path, loader_kw={"sampler": sampler})
    assert san.findings == [], [f.message for f in san.findings]


def test_a_fine_tune_is_not_this_warning(seeded):
    san, _ = resumed(seeded[0], restore_optimizer=False)
    assert [f.kind for f in san.findings] == ["optimizer_reset"]  # that one, not the data


def test_a_first_run_is_silent():
    with trainsan.watch_loads():
        set_seed(SEED)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        san = trainsan.attach(model, opt, policy="record")
        for x, y in DataLoader(DATA, batch_size=8, shuffle=True):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        san.close()
    assert san.findings == []


def test_without_the_journal_the_seeding_is_not_seen(seeded):
    san, _ = resumed(seeded[0], watch=False)
    assert san.findings == [], [f.message for f in san.findings]


def test_the_rng_watch_changes_no_draw():
    """torch.manual_seed, get/set_rng_state and the draws are the same under the watch."""
    def draws():
        torch.manual_seed(3)
        a = torch.rand(4)
        s = torch.get_rng_state()
        b = torch.rand(4)
        torch.random.set_rng_state(s)
        with torch.random.fork_rng():
            torch.rand(7)
        return torch.cat([a, b, torch.rand(4)])
    plain = draws()
    before = (torch.manual_seed, torch.random.set_rng_state, torch.get_rng_state, torch.seed)
    with trainsan.watch_loads():
        assert torch.manual_seed is not before[0]
        watched = draws()
    assert torch.equal(plain, watched)
    assert (torch.manual_seed, torch.random.set_rng_state, torch.get_rng_state,
            torch.seed) == before  # put back at close


# -- through the launcher --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launched")
    ckpt = str(tmp / "run.pt")
    r = run_script(SCRIPT, "--save", ckpt, launcher=False, env=ENV)
    assert r.returncode == 0, r.stderr
    runs = {}
    for name, extra in (("clean", []), ("scheduler", ["--bug", "forget_scheduler"]),
                        ("rng", ["--bug", "forget_rng"]),
                        ("seed_per_epoch", ["--bug", "forget_rng", "--twin", "seed_per_epoch"]),
                        ("last_epoch", ["--bug", "forget_scheduler", "--twin", "last_epoch"])):
        trace = str(tmp / f"{name}.jsonl")
        r = run_script("--trace", trace, SCRIPT, "--resume", ckpt, *extra, env=ENV)
        with open(trace, encoding="utf-8") as fh:
            records = [json.loads(line) for line in fh if line.strip()]
        runs[name] = (r, [x for x in records if x["type"] == "finding"])
    return runs


@pytest.mark.parametrize("name", ["clean", "seed_per_epoch", "last_epoch"])
def test_launcher_legitimate_resumes_are_silent(launched, name):
    r, findings = launched[name]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert findings == [], findings


def test_launcher_finds_the_restarted_schedule(launched):
    r, findings = launched["scheduler"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert [(x["kind"], x["severity"], x["step"]) for x in findings] == [
        ("optimizer_reset", "warning", 0), ("optimizer_reset", "error", 1)], findings
    assert "the learning-rate scheduler LambdaLR of optimizer 0 (AdamW)" in findings[1]["message"]


def test_launcher_finds_the_replayed_order(launched):
    r, findings = launched["rng"]
    assert r.returncode == 0 and "done" in r.stdout, r.stderr
    assert [(x["kind"], x["severity"], x["step"]) for x in findings] == [
        ("duplicate_batch", "warning", 0)], findings
    assert "torch.manual_seed(42)) and not restored" in findings[0]["message"]

