"""Gradient accumulation (accumulation_mismatch, Note [Accumulation windows] in
host/checks/accumulation.cpp), on loops written as public projects write them:

* a declared window (``accumulation_steps=4``) kept is silent, and the summary shows it;
* a loop that steps every 3 micro-batches with 4 declared is an error;
* an epoch shorter than the window, stepped at each epoch's last batch as the frameworks do, is an
  error (accumulation silently changed); an epoch's last partial window is a warning that gives the
  effective batch and the k/N scaling of a loss divided by the full factor;
* undeclared accumulation is no finding, but the summary, coverage() and the trace show it;
* closures (LBFGS: several backwards inside one step), a GAN (two models, two optimizers), several
  losses summed and several backwards of one forward stay silent;
* the Hugging Face Trainer and Lightning declare their window (skipped without the packages);
* ``python -m trainsan run --accumulation-steps N``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainsan
from trainsan import TrainingBugError, TrainingBugWarning

BATCH = 8


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def loader(batches, batch=BATCH, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch * batches, 6, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch,
                      shuffle=True, generator=g)


def train(san_kw, *, batches=16, epochs=2, every=4, at_epoch_end=True, divide=None):
    """The usual accumulation loop: step after every `every` micro-batches (and at each epoch's
    last batch when `at_epoch_end`), the loss divided by `divide` (default `every`)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    san = trainsan.attach(model, opt, **san_kw)
    data = loader(batches)
    try:
        for _ in range(epochs):
            for i, (x, y) in enumerate(data):
                loss = F.mse_loss(model(x), y) / (divide or every)
                loss.backward()
                if (i + 1) % every == 0 or (at_epoch_end and i + 1 == len(data)):
                    opt.step()
                    opt.zero_grad()
    finally:
        san.close()
    return san


def of_kind(san, kind="accumulation_mismatch"):
    return [f for f in san.findings if f.kind == kind]


# -- declared windows ----------------------------------------------------------------------------


def test_declared_window_kept_is_silent_and_summarised(tmp_path):
    san = train(dict(policy="raise", accumulation_steps=4, trace=str(tmp_path / "t.jsonl")))
    assert san.findings == [], [f.message for f in san.findings]
    c = san.coverage()
    assert (c["window_declared"], c["windows"], c["window_backwards"], c["window_steps"]) == (
        4, 8, 4, 8)
    assert c["window_samples"] == 4 * BATCH
    assert ("accumulation: 8 of 8 optimizer step(s) followed 4 backward passes, effective batch "
            "32 (declared: accumulation_steps=4)") in san.summary()
    records = [json.loads(line) for line in open(tmp_path / "t.jsonl", encoding="utf-8")]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["backwards"] for r in steps] == [4] * 8
    summary = [r for r in records if r["type"] == "summary"][0]
    assert summary["coverage"]["window_backwards"] == 4


def test_stepping_every_three_with_four_declared_raises():
    with pytest.raises(TrainingBugError) as e:
        train(dict(policy="raise", accumulation_steps=4), every=3, divide=4)
    f = e.value.finding
    assert f.kind == "accumulation_mismatch" and f.severity == "error" and f.step == 0
    assert "after 3 backward passes in the middle of a data loader pass" in f.message
    assert "accumulation_steps=4 was declared" in f.message
    assert "effective batch 24 samples instead of 4 x 8 = 32 samples" in f.message
    assert "3/4 of its size" in f.message


def test_window_that_runs_over_the_epoch_end_is_an_error():
    # No step at the epoch's end: its remainder (2 micro-batches) is carried into the next epoch,
    # whose first step then follows 6 backwards.
    san = train(dict(policy="record", accumulation_steps=4), batches=10, at_epoch_end=False)
    found = of_kind(san)
    assert len(found) == 1 and found[0].severity == "error", [f.message for f in found]
    assert "after 6 backward passes" in found[0].message
    assert "ran on past its end" in found[0].message


def test_epoch_shorter_than_the_window_is_an_error():
    # 3 batches per epoch, window 8: stepped at each epoch's last batch, i.e. every 3.
    san = train(dict(policy="record", accumulation_steps=8), batches=3, epochs=4, every=8)
    errors = [f for f in of_kind(san) if f.severity == "error"]
    assert len(errors) == 1, [f.message for f in san.findings]
    m = errors[0].message
    assert "no optimizer step followed 8 backward passes: the run steps every 3" in m
    assert "an epoch of 3 batches is shorter than the window" in m
    assert "effective batch 24 samples instead of 8 x 8 = 64 samples" in m
    assert "3/8 of its size" in m


def test_epoch_shorter_than_the_window_raises_under_policy_raise():
    with pytest.raises(TrainingBugError, match="no optimizer step followed 8 backward passes"):
        train(dict(policy="raise", accumulation_steps=8), batches=3, epochs=4, every=8)


def test_last_partial_window_of_an_epoch_is_a_warning_with_the_effective_batch():
    # 10 batches per epoch, window 4: windows of 4, 4 and 2 (the remainder), stepped at the end.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        san = train(dict(policy="warn", accumulation_steps=4), batches=10, epochs=2)
    found = of_kind(san)
    assert [f.severity for f in found] == ["warning"], [f.message for f in found]
    f = found[0]
    assert f.step == 2 and f.count == 2  # each epoch's last window (the second at the run's end)
    assert "the last window of an epoch (a data loader pass) ended with 2 of the " \
           "accumulation_steps=4 backward passes" in f.message
    assert "effective batch 16 samples instead of 32 samples" in f.message
    assert "loss / 4" in f.message and "2/4 of its size" in f.message
    assert "drop_last=True" in f.message
    assert any(issubclass(w.category, TrainingBugWarning) and "accumulation_mismatch" in
               str(w.message) for w in caught)


def test_last_partial_window_does_not_raise_under_policy_raise():
    san = train(dict(policy="raise", accumulation_steps=4), batches=10, epochs=2)
    assert [f.severity for f in of_kind(san)] == ["warning"]


def test_switched_off():
    san = train(dict(policy="raise", accumulation_steps=4,
                     checks={"accumulation_mismatch": False}), every=3, divide=4)
    assert of_kind(san) == []


def test_window_discarded_by_a_guard_starts_again():
    # A guard clears the window's gradients without a step (a bad micro-batch) and counts anew:
    # every step still follows 4 kept micro-batches.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    san = trainsan.attach(model, opt, policy="raise", accumulation_steps=4)
    kept = 0
    for i, (x, y) in enumerate(loader(24)):
        (F.mse_loss(model(x), y) / 4).backward()
        if i == 5:  # pretend its loss was bad: drop the window so far
            opt.zero_grad()
            kept = 0
            continue
        kept += 1
        if kept == 4:
            opt.step()
            opt.zero_grad()
            kept = 0
    san.close()
    assert of_kind(san) == [], [f.message for f in san.findings]
    assert san.coverage()["window_backwards"] == 4


# -- undeclared windows --------------------------------------------------------------------------


def test_undeclared_accumulation_is_silent_and_shown_in_the_summary():
    san = train(dict(policy="raise"), batches=16, every=4)
    assert san.findings == []
    assert ("accumulation: 8 of 8 optimizer step(s) followed 4 backward passes, effective batch "
            "32 (not declared: accumulation_steps=4 would check the window)") in san.summary()
    assert san.coverage()["window_declared"] == 0


def test_undeclared_stepping_every_three_is_silent():
    san = train(dict(policy="raise"), every=3)
    assert san.findings == []
    assert "followed 3 backward passes" in san.summary()


def test_no_accumulation_no_summary_line():
    san = train(dict(policy="raise"), every=1)
    assert san.findings == [] and "accumulation:" not in san.summary()
    assert san.coverage()["window_backwards"] == 1


# -- look-alikes ----------------------------------------------------------------------------------


def test_lbfgs_closure_steps_are_one_backward_each():
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    san = trainsan.attach(model, opt, policy="raise", accumulation_steps=1)
    calls = []
    for x, y in loader(4):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            calls.append(1)
            return loss

        opt.step(closure)
    san.close()
    assert len(calls) > 8  # several backwards inside each step
    assert san.findings == [], [f.message for f in san.findings]
    c = san.coverage()
    # The first step's first closure run precedes the step (Note [Closure steps]): one backward;
    # a line-search optimizer's later steps run every evaluation inside the step: no window.
    assert c["window_backwards"] == 1 and c["windows"] <= 4
    assert "accumulation:" not in san.summary()


def test_lbfgs_undeclared_is_silent():
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4)
    san = trainsan.attach(model, opt, policy="raise")
    for x, y in loader(3):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    san.close()
    assert san.findings == [] and "accumulation:" not in san.summary()


@pytest.mark.parametrize("accum", [1, 2])
def test_gan_two_models_two_optimizers(accum):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    D = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    kw = dict(policy="record", accumulation_steps=accum) if accum > 1 else dict(policy="record")
    san_g = trainsan.attach(G, opt_g, **kw)
    san_d = trainsan.attach(D, opt_d, **kw)
    bce = nn.BCEWithLogitsLoss()
    real_data = loader(8 * accum)
    batches = iter(real_data)
    for _ in range(8):
        opt_d.zero_grad()  # also the discriminator's gradients the generator's backward left
        for _ in range(accum):  # the discriminator's window
            real, _ = next(batches)
            fake = G(torch.randn(BATCH, 4))
            d_loss = (bce(D(real), torch.ones(BATCH, 1))
                      + bce(D(fake.detach()), torch.zeros(BATCH, 1))) / accum
            d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        for _ in range(accum):  # the generator's window
            g_loss = bce(D(G(torch.randn(BATCH, 4))), torch.ones(BATCH, 1)) / accum
            g_loss.backward()
        opt_g.step()
    san_g.close()
    san_d.close()
    for san in (san_g, san_d):
        assert of_kind(san) == [], [f.message for f in san.findings]
        assert san.coverage()["window_backwards"] == accum


@pytest.mark.parametrize("how", ["summed", "two_backwards"])
def test_several_losses_per_micro_batch_count_once(how):
    torch.manual_seed(0)
    body = nn.Linear(6, 16)
    heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    model = nn.ModuleDict({"body": body, "heads": heads})

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            h = torch.relu(self.m["body"](x))
            return self.m["heads"][0](h), self.m["heads"][1](h)

    net = TwoHeads()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    san = trainsan.attach(net, opt, policy="raise", accumulation_steps=4)
    for i, (x, y) in enumerate(loader(16)):
        a, b = net(x)
        la, lb = F.mse_loss(a, y) / 4, F.l1_loss(b, y) / 4
        if how == "summed":
            (la + lb).backward()
        else:
            la.backward(retain_graph=True)
            lb.backward()
        if (i + 1) % 4 == 0:
            opt.step()
            opt.zero_grad()
    san.close()
    assert san.findings == [], [f.message for f in san.findings]
    assert san.coverage()["window_backwards"] == 4


# -- the launcher ---------------------------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher",
                      "accumulation_script.py")


def _launch(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *args], capture_output=True,
                          text=True, timeout=180, env=env)


def test_launcher_declared_window_kept_is_clean():
    r = _launch("--accumulation-steps", "4", SCRIPT, "--every", "4")
    assert r.returncode == 0, r.stderr
    assert "no findings" in r.stderr and "done" in r.stdout, r.stderr
    assert "followed 4 backward passes, effective batch 32 (declared: accumulation_steps=4)" \
        in r.stderr, r.stderr


def test_launcher_window_not_kept_stops_the_script():
    r = _launch("--accumulation-steps", "4", SCRIPT, "--every", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    # Attached at the first forward (the launcher's pairing), inside the first loader pass,
    # whose iterator the launcher numbered before the attach (Note [Ignored batches]): the
    # first short window in the middle of that pass is the error, at step 0 (it was step 1 while
    # that pass was unknown to the sanitizer).
    assert "TrainingBugError: accumulation_mismatch at step 0" in r.stderr, r.stderr
    assert "optimizer step after 3 backward passes in the middle of a data loader pass" in (
        r.stderr)
    assert "done" not in r.stdout


def test_launcher_undeclared_window_is_in_the_summary():
    r = _launch(SCRIPT, "--every", "4")
    assert r.returncode == 0, r.stderr
    assert "no findings" in r.stderr
    assert "not declared: accumulation_steps=4 would check the window" in r.stderr, r.stderr


# -- frameworks -----------------------------------------------------------------------------------

HF_SKIP = ("transformers (with accelerate) is not installed or does not import: the test-only "
           "dependency of scripts/install_deps.sh")
PL_SKIP = "lightning is not installed: the test-only dependency of scripts/install_deps.sh"


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.x[i].sum(dim=0, keepdim=True)}


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


def _hf_train(tmp_path, *, samples, accum, **args):
    tf = pytest.importorskip("transformers", reason=HF_SKIP, exc_type=ImportError)
    pytest.importorskip("accelerate", reason=HF_SKIP, exc_type=ImportError)
    tf.logging.set_verbosity_error()
    from trainsan.integrations.hf import TrainSanCallback

    cb = TrainSanCallback(policy="record", summary=False)
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
              gradient_accumulation_steps=accum, learning_rate=1e-3, report_to=[],
              save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
              dataloader_num_workers=0, seed=0)
    kw.update(args)
    trainer = tf.Trainer(model=Regression(), args=tf.TrainingArguments(**kw),
                         train_dataset=Pairs(samples), callbacks=[cb])
    trainer.train()
    return cb


def test_hf_trainer_window_kept_is_silent(tmp_path):
    cb = _hf_train(tmp_path, samples=4 * 2 * 4, accum=2, num_train_epochs=2)
    assert of_kind(cb.sanitizer) == [], [f.message for f in cb.findings]
    c = cb.sanitizer.coverage()
    assert (c["window_declared"], c["window_backwards"], c["windows"]) == (2, 2, 8)


def test_hf_trainer_epoch_shorter_than_the_window(tmp_path):
    # 3 batches per epoch, gradient_accumulation_steps=8: the Trainer steps at each epoch's end.
    cb = _hf_train(tmp_path, samples=12, accum=8, num_train_epochs=3)
    c = cb.sanitizer.coverage()
    assert c["window_backwards"] == 3, c
    errors = [f for f in of_kind(cb.sanitizer) if f.severity == "error"]
    assert len(errors) == 1, [f.message for f in cb.findings]
    assert "the run steps every 3" in errors[0].message


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning", reason=PL_SKIP)
    return pl


def _pl_fit(*, batches, accum, epochs, manual=False):
    pl = _lightning()
    from trainsan.integrations.lightning import TrainSan

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            if manual:
                opt = self.optimizers()
                self.manual_backward(loss)
                opt.step()
                opt.zero_grad()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cb = TrainSan(policy="record", summary=False)
    trainer = pl.Trainer(max_epochs=epochs, accumulate_grad_batches=accum, accelerator="cpu",
                         devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[cb])
    trainer.fit(Module(), loader(batches))
    return cb


def test_lightning_window_kept_is_silent():
    cb = _pl_fit(batches=8, accum=2, epochs=2)
    assert of_kind(cb.sanitizer) == [], [f.message for f in cb.findings]
    c = cb.sanitizer.coverage()
    assert (c["window_declared"], c["window_backwards"], c["windows"]) == (2, 2, 8)


def test_lightning_epoch_shorter_than_the_window():
    cb = _pl_fit(batches=3, accum=8, epochs=3)
    assert cb.sanitizer.coverage()["window_backwards"] == 3
    errors = [f for f in of_kind(cb.sanitizer) if f.severity == "error"]
    assert len(errors) == 1, [f.message for f in cb.findings]
    assert "the run steps every 3" in errors[0].message


def test_lightning_manual_optimization_declares_nothing():
    cb = _pl_fit(batches=4, accum=1, epochs=1, manual=True)
    assert cb.sanitizer.coverage()["window_declared"] == 0
    assert of_kind(cb.sanitizer) == []
