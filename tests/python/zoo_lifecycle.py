"""Bug-zoo cases of mixed precision (issue 12), checkpoints, resumes and determinism (issue 13):
``amp_scale_collapse``, ``update_underflow``, ``low_precision_loss``, ``bad_checkpoint``,
``optimizer_reset``, ``nondeterminism``, with their legitimate look-alikes (a healthy fp16 run
with occasional scaler skips, bf16 compute over fp32 weights, a full resume, EMA weights saved next
to the model, a backbone loaded under a new head, a deterministic loop re-run).

Registered into the zoo (zoo.py imports this module before it builds ``BUGGY``/``CLEAN``).
"""

from __future__ import annotations

import copy
import io

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from zoo import (STEPS, SmallCNN, TinyTransformer, case, image_batch, make_mlp, regression_batch,
                 token_batch)

def _train(model, opt, batch, loss_fn, after_step=None):
    """The plain loop of most cases: STEPS steps of zero_grad, loss, backward, step."""
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if after_step is not None:
            after_step(step)


# -- mixed precision ---------------------------------------------------------------------------


def _fp16_scaler_loop(ctx, model, opt, batch, loss_fn, plant):
    scaler = torch.amp.GradScaler("cpu")
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x).float(), y)
        scaler.scale(plant(step, loss)).backward()
        scaler.step(opt)
        scaler.update()


@case("amp_scale_collapse/overflowing_loss_term_mlp", "amp_scale_collapse", 2, "mlp", "SGD",
      "an auxiliary loss term switched on at loop iteration 3 (optimizer step 2: the scaler's "
      "first step skips) overflows every backward under fp16: the scaler skips from then on")
def _asc_mlp(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _fp16_scaler_loop(ctx, model, opt, regression_batch, F.mse_loss,
                      lambda s, loss: loss * 1e30 if s >= 3 else loss)


@case("amp_scale_collapse/exploding_logits_cnn", "amp_scale_collapse", 2, "cnn", "AdamW",
      "a logit temperature that drops to 1e-30 at step 2: every fp16 backward overflows")
def _asc_cnn(ctx):
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _fp16_scaler_loop(ctx, model, opt, image_batch, F.cross_entropy,
                      lambda s, loss: loss / 1e-30 if s >= 2 else loss)


@case("clean/fp16_scaler_occasional_skips_mlp", None, None, "mlp", "Adam",
      "a healthy fp16 run whose scaler skips two isolated steps (gradient spikes)")
def _c_fp16_skips(ctx):
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _fp16_scaler_loop(ctx, model, opt, regression_batch, F.mse_loss,
                      lambda s, loss: loss * 1e30 if s in (2, 7) else loss)


def _bf16_loop(ctx, model, opt, batch, loss_fn):
    ctx.attach(model, opt)
    for _ in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        loss_fn(model(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()


@case("update_underflow/pure_bf16_adamw_mlp", "update_underflow", 0, "mlp", "AdamW",
      "pure bf16 weights with AdamW at lr 1e-4: most updates are below half a bf16 ulp")
def _uu_mlp(ctx):
    model = make_mlp().to(torch.bfloat16)
    _bf16_loop(ctx, model, torch.optim.AdamW(model.parameters(), lr=1e-4), regression_batch,
               F.mse_loss)


@case("update_underflow/bf16_batchnorm_gain_cnn", "update_underflow", 0, "cnn", "Adam",
      "a bf16 CNN at lr 1e-3: its BatchNorm gains of 1.0 never move (|dw| < 1/256)")
def _uu_cnn(ctx):
    model = SmallCNN().to(torch.bfloat16)
    _bf16_loop(ctx, model, torch.optim.Adam(model.parameters(), lr=1e-3), image_batch,
               F.cross_entropy)


@case("clean/bf16_autocast_fp32_master_cnn", None, None, "cnn", "AdamW",
      "bf16 autocast over fp32 weights (master weights): updates land")
def _c_bf16_master(ctx):
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ctx.attach(model, opt)
    for _ in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()


@case("low_precision_loss/half_mse_mlp", "low_precision_loss", 0, "mlp", "SGD",
      "a hand-written MSE on fp16 autocast outputs against targets cast to the outputs' dtype: "
      "the loss is an fp16 scalar")
def _lpl_mlp(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt)
    for _ in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = ((out - y.to(out.dtype)) ** 2).mean()
        loss.backward()
        opt.step()


@case("low_precision_loss/bf16_model_loss_cnn", "low_precision_loss", 0, "cnn", "Adam",
      "a bf16 model whose cross-entropy is taken on its bf16 logits")
def _lpl_cnn(ctx):
    model = SmallCNN().to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx.attach(model, opt)
    for _ in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        F.cross_entropy(model(x.to(torch.bfloat16)), y).backward()
        opt.step()


# -- checkpoints and resumes -------------------------------------------------------------------


def _save(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@case("bad_checkpoint/diverged_weights_saved_mlp", "bad_checkpoint", 4, "mlp", "SGD",
      "a weight goes NaN at step 4 (a corrupt update) and the epoch-end save writes it")
def _bc_nan(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt)

    def after(step):
        if step == 3:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        if step >= 3:
            _save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})

    _train(model, opt, regression_batch, F.mse_loss, after)


@case("bad_checkpoint/fresh_optimizer_state_cnn", "bad_checkpoint", 5, "cnn", "Adam",
      "the checkpoint at step 5 saves the state_dict() of a freshly built optimizer (a typo: "
      "`torch.optim.Adam(model.parameters()).state_dict()`), not the one that trained")
def _bc_fresh(ctx):
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    _train(model, opt, image_batch, F.cross_entropy, lambda step: step == 4 and _save(
        {"model": model.state_dict(),
         "optimizer": torch.optim.Adam(model.parameters()).state_dict()}))


@case("clean/ema_and_full_checkpoint_mlp", None, None, "mlp", "AdamW",
      "saves model, EMA copy, optimizer, scheduler and RNG state every other step")
def _c_checkpoints(ctx):
    model = make_mlp()
    ema = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 0.1)
        if step % 2:
            _save({"model": model.state_dict(), "ema": ema.state_dict(),
                   "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                   "rng": torch.get_rng_state(), "step": step})


def _resume_loop(ctx, make_model, make_opt, batch, loss_fn, restore_opt, at=4):
    """Train `at` steps, checkpoint, then resume a fresh model/optimizer from it (attached)."""
    model, opt = make_model(), None
    opt = make_opt(model)
    for _ in range(at):
        x, y = batch()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    buf = _save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1})
    model2 = make_model()
    opt2 = make_opt(model2)
    ctx.attach(model2, opt2)
    ck = torch.load(buf)
    model2.load_state_dict(ck["model"])
    if restore_opt:
        opt2.load_state_dict(ck["optimizer"])
    for _ in range(STEPS - at):
        x, y = batch()
        opt2.zero_grad()
        loss_fn(model2(x), y).backward()
        opt2.step()


@case("optimizer_reset/adam_not_restored_mlp", "optimizer_reset", 0, "mlp", "Adam",
      "the resume loads the model's state but not the optimizer's: Adam restarts from zero")
def _or_mlp(ctx):
    _resume_loop(ctx, make_mlp, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                 regression_batch, F.mse_loss, restore_opt=False)


@case("optimizer_reset/momentum_not_restored_cnn", "optimizer_reset", 0, "cnn", "SGD+momentum",
      "the resume loads the model's state but not the optimizer's: momentum restarts from zero")
def _or_cnn(ctx):
    _resume_loop(ctx, SmallCNN, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                 image_batch, F.cross_entropy, restore_opt=False)


@case("clean/full_resume_cnn", None, None, "cnn", "SGD+momentum",
      "a resume that restores the model and the optimizer")
def _c_resume(ctx):
    _resume_loop(ctx, SmallCNN, lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
                 image_batch, F.cross_entropy, restore_opt=True)


@case("clean/backbone_new_head_mlp", None, None, "mlp", "Adam",
      "fine-tuning: a pretrained backbone loaded with strict=False under a new, trainable head")
def _c_new_head(ctx):
    pre = make_mlp(dout=5)
    model = make_mlp(dout=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    sd = {k: v for k, v in pre.state_dict().items() if not k.startswith("2.")}
    model.load_state_dict(sd, strict=False)
    _train(model, opt, regression_batch, F.mse_loss)


class _Branches(nn.Module):
    """Two branches of one shape over the same features (their gradient scales alike) and a head.
    `reordered`: the branches declared in the other order; `v2`: a LayerNorm added before the
    head, which is called `classifier` (same shape); `identity_head`: the head replaced by
    nn.Identity() beside a new classifier of its shape (a fine-tune)."""

    def __init__(self, reordered=False, v2=False, identity_head=False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        names = ("right", "left") if reordered else ("left", "right")
        for n in names:
            setattr(self, n, nn.Linear(16, 16))
        if v2:
            self.norm = nn.LayerNorm(16)
        else:
            self.head = nn.Identity() if identity_head else nn.Linear(16, 1)
        if v2 or identity_head:
            self.classifier = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = torch.relu(self.left(h)) + torch.relu(self.right(h))
        h = self.norm(h) if hasattr(self, "norm") else h
        h = self.head(h) if hasattr(self, "head") else h
        return self.classifier(h) if hasattr(self, "classifier") else h


def _resume_into(ctx, new, make_opt, strict=True, restore_opt=True, at=4):
    """Train a _Branches `at` steps, checkpoint it, and load it into `new` (attached first)."""
    old = _Branches()
    opt = make_opt(old)
    _train_steps(old, opt, at)
    buf = _save({"model": old.state_dict(), "optimizer": opt.state_dict(), "epoch": 1})
    opt2 = make_opt(new)
    ctx.attach(new, opt2)
    ck = torch.load(buf)
    new.load_state_dict(ck["model"], strict=strict)
    if restore_opt:
        opt2.load_state_dict(ck["optimizer"])
    _train_steps(new, opt2, STEPS - at)


def _train_steps(model, opt, n):
    for _ in range(n):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _by_module(m):
    rest = [p for n, p in m.named_parameters() if not n.startswith(("left.", "right."))]
    return torch.optim.AdamW([{"params": m.left.parameters()},
                              {"params": m.right.parameters(), "lr": 2e-3}, {"params": rest}],
                             lr=1e-3)


@case("optimizer_reset/reordered_branches_mlp", "optimizer_reset", 0, "mlp", "AdamW",
      "a refactor declared two branches of one shape in the other order: the resumed moments "
      "swap by position (their gradient scales alike; the checkpoint's keys name the slots)")
def _or_reordered(ctx):
    _resume_into(ctx, _Branches(reordered=True),
                 lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))


@case("clean/reordered_branches_groups_by_module_mlp", None, None, "mlp", "AdamW",
      "the same refactor with a parameter group per branch: the state binds by module")
def _c_reordered_by_module(ctx):
    _resume_into(ctx, _Branches(reordered=True), _by_module)


@case("bad_checkpoint/head_renamed_beside_a_new_norm_mlp", "bad_checkpoint", 0, "mlp", "Adam",
      "strict=False into v2 of the model (a LayerNorm added, `head` renamed `classifier`): the "
      "trained output layer is dropped and a random one trains")
def _bc_renamed_head(ctx):
    _resume_into(ctx, _Branches(v2=True), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                 strict=False, restore_opt=False)


@case("clean/identity_head_new_classifier_mlp", None, None, "mlp", "Adam",
      "fine-tuning: the old head replaced by nn.Identity() beside a new classifier of its shape")
def _c_identity_head(ctx):
    _resume_into(ctx, _Branches(identity_head=True),
                 lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                 strict=False, restore_opt=False)


# -- determinism ---------------------------------------------------------------------------------

_unseeded = torch.Generator().manual_seed(7)  # never re-seeded by the run


class _Jitter(nn.Module):
    def forward(self, x):
        return x + 1e-3 * torch.randn(x.shape, generator=_unseeded)


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * (1.0 + 1e-4 * self.calls)


@case("nondeterminism/unseeded_jitter_mlp", "nondeterminism", 0, "mlp", "SGD",
      "input jitter drawn from a generator of its own (never re-seeded); rerun_every=1")
def _nd_mlp(ctx):
    model = nn.Sequential(_Jitter(), make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt, rerun_every=1)
    _train(model, opt, regression_batch, F.mse_loss)


@case("nondeterminism/call_counter_cnn", "nondeterminism", 0, "cnn", "Adam",
      "a module that scales by its own call count; rerun_every=2")
def _nd_cnn(ctx):
    model = nn.Sequential(_Counter(), SmallCNN())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt, rerun_every=2)
    _train(model, opt, image_batch, F.cross_entropy)


@case("clean/deterministic_rerun_cnn", None, None, "cnn", "SGD+momentum",
      "dropout, BatchNorm and data augmentation from the global RNG, re-run every step "
      "(rerun_every=1): deterministic")
def _c_rerun(ctx):
    model = nn.Sequential(nn.Dropout(0.1), SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctx.attach(model, opt, rerun_every=1)
    _train(model, opt, image_batch, F.cross_entropy)


# Activation checkpointing (Note [Recompute checks]): the backward recomputes a region; without
# its RNG state, dropout draws another mask than the forward applied.
class _CheckpointedTransformer(TinyTransformer):
    def __init__(self, reentrant: bool, preserve: bool):
        super().__init__(dropout=0.1)
        self.reentrant, self.preserve = reentrant, preserve

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos[:, : tokens.shape[1]]
        h = checkpoint(self.enc, h, use_reentrant=self.reentrant,
                       preserve_rng_state=self.preserve)
        return self.head(h.mean(1))


@case("nondeterminism/checkpoint_rng_not_preserved_transformer", "nondeterminism", 0,
      "transformer", "AdamW",
      "the encoder layer (dropout 0.1) runs under checkpoint(..., use_reentrant=False, "
      "preserve_rng_state=False): its recompute draws other dropout masks")
def _nd_ckpt_transformer(ctx):
    model = _CheckpointedTransformer(reentrant=False, preserve=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    _train(model, opt, token_batch, F.cross_entropy)


@case("nondeterminism/checkpoint_sequential_rng_mlp", "nondeterminism", 0, "mlp",
      "SGD+momentum",
      "an MLP's dropout layers under checkpoint_sequential(..., use_reentrant=True, "
      "preserve_rng_state=False)")
def _nd_ckpt_mlp(ctx):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 32)  # outside: a reentrant region needs an input with grad
            self.layers = nn.Sequential(nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(),
                                        nn.Dropout(0.2), nn.Linear(32, 1))

        def forward(self, x):
            return checkpoint_sequential(self.layers, 2, self.inp(x), use_reentrant=True,
                                         preserve_rng_state=False)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctx.attach(model, opt)
    _train(model, opt, regression_batch, F.mse_loss)


@case("clean/checkpoint_dropout_rng_preserved_transformer", None, None, "transformer", "Adam",
      "the encoder layer (dropout 0.1) under checkpoint(..., use_reentrant=True), the RNG state "
      "preserved (the default): recomputed with the same masks, checked at every step")
def _c_ckpt_preserved(ctx):
    model = _CheckpointedTransformer(reentrant=True, preserve=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt, recompute_every=1)
    _train(model, opt, token_batch, F.cross_entropy)

