"""Bug-zoo cases of the mode and input rules: ``no_grad_leak``, ``eval_mode``, ``duplicate_batch``
(Note [Mode rules] in host/checks/mode.cpp, Note [Stuck data] in host/checks/inputs.cpp).

Registered into the zoo (zoo.py imports this module before it builds ``BUGGY``/``CLEAN``). The
clean loops are the legitimate look-alikes of each bug, from real code: a prediction under
no_grad between LBFGS steps, RL rollouts, an EMA teacher, GAN fakes generated under no_grad,
frozen backbones with frozen BatchNorm, full-batch graph and physics-informed fits, a GAN
discriminator that sees the same fake before and after its step. ``SILENT`` lists the clean loops
that must produce no finding at all of these kinds (tests/python/test_mode_rules.py), not only no
error.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import (
    STEPS,
    GRUClassifier,
    SmallCNN,
    TinyTransformer,
    case,
    image_batch,
    make_gan,
    make_mlp,
    real_batch,
    regression_batch,
    token_batch,
)

# Clean loops that must be silent for the kinds of this module (not just free of errors).
SILENT = []


def silent(fn):
    SILENT.append(fn.__name__)
    return fn


# =============================================================================================
# Buggy loops
# =============================================================================================

# --- no_grad_leak -----------------------------------------------------------------------------


@case("no_grad_leak/inference_helper_reused_transformer", "no_grad_leak", 0, "transformer",
      "AdamW x2",
      "an `@torch.no_grad()` encode() helper written for inference is reused in the training "
      "step: the encoder (train mode, own optimizer, with dropout) never gets a gradient — an "
      "error at its step, and a warning at the forward (dropout active under no_grad)")
def _ngl_inference_helper(ctx):
    class Encoder(TinyTransformer):
        def forward(self, tokens):
            return self.enc(self.emb(tokens) + self.pos[:, : tokens.shape[1]]).mean(1)

    enc, head = Encoder(), nn.Linear(16, 3)
    opt_e = torch.optim.AdamW(enc.parameters(), lr=1e-3)
    opt_h = torch.optim.AdamW(head.parameters(), lr=1e-3)
    ctx.attach(enc, opt_e, label="encoder")
    san_h = ctx.attach(head, opt_h, label="head")

    @torch.no_grad()
    def encode(t):  # meant for inference only
        return enc(t)

    for step in range(STEPS):
        t, y = token_batch()
        opt_e.zero_grad()
        opt_h.zero_grad()
        loss = san_h.watch_loss(F.cross_entropy(head(encode(t)), y))  # bug: encode() in training
        loss.backward()
        opt_e.step()
        opt_h.step()


# --- eval_mode --------------------------------------------------------------------------------


class NoisyLinear(nn.Linear):
    """NoisyNet layer (RL exploration): weight noise in train mode only — a module reading
    self.training that no class list knows."""

    def __init__(self, din, dout, sigma=0.1):
        super().__init__(din, dout)
        self.sigma = nn.Parameter(torch.full((dout, din), sigma))

    def forward(self, x):
        w = self.weight
        if self.training:
            w = w + self.sigma * torch.randn_like(w)
        return F.linear(x, w, self.bias)


@case("eval_mode/greedy_act_never_train_noisy_mlp", "eval_mode", 2, "mlp", "Adam",
      "a NoisyNet policy (no Dropout, no BatchNorm) calls policy.eval() to act greedily after "
      "update 1 and never policy.train(): every later update trains it in eval mode, without "
      "the weight noise")
def _em_noisy_greedy(ctx):
    policy = nn.Sequential(NoisyLinear(8, 16), nn.ReLU(), NoisyLinear(16, 4))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    san = ctx.attach(policy, opt)
    for step in range(STEPS):
        s = torch.randn(16, 8)
        a = torch.randint(0, 4, (16,))
        ret = torch.randn(16)
        opt.zero_grad()
        logp = F.log_softmax(policy(s), 1).gather(1, a[:, None]).squeeze(1)
        loss = san.watch_loss(-(logp * ret).mean())
        loss.backward()
        opt.step()
        if step == 1:
            policy.eval()  # bug: greedy evaluation, policy.train() forgotten
            with torch.no_grad():
                policy(torch.randn(4, 8)).argmax(1)


@case("eval_mode/pretrained_loader_returns_eval_gru", "eval_mode", 0, "gru", "RMSprop",
      "a load_pretrained() helper returns model.eval() (as inference code does); the 2-layer "
      "GRU with dropout is then fine-tuned in eval mode from the first step")
def _em_loader_eval(ctx):
    class Stacked(GRUClassifier):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(8, 16, num_layers=2, dropout=0.3, batch_first=True)

    def load_pretrained():
        m = Stacked()
        m.load_state_dict(Stacked().state_dict())
        return m.eval()  # bug for fine-tuning: nobody calls train() afterwards

    model = load_pretrained()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- duplicate_batch --------------------------------------------------------------------------


@case("duplicate_batch/exhausted_iterator_keeps_last_batch_gru", "duplicate_batch", 3, "gru",
      "Adam",
      "`try: t, y = next(it) except StopIteration: pass` — once the 3-batch loader is "
      "exhausted the loop keeps training on its last batch")
def _db_exhausted(ctx):
    from torch.utils.data import DataLoader, TensorDataset

    t_all, y_all = token_batch(n=24)
    loader = DataLoader(TensorDataset(t_all, y_all), batch_size=8, shuffle=True)
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    it = iter(loader)
    for step in range(STEPS):
        try:
            t, y = next(it)
        except StopIteration:
            pass  # bug: should restart the iterator (it = iter(loader))
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


@case("duplicate_batch/first_batch_helper_cnn", "duplicate_batch", 1, "cnn", "Adam",
      "a get_batch() helper returns next(iter(loader)) of an unshuffled loader of 4 batches: "
      "every step trains on its first batch")
def _db_first_batch_helper(ctx):
    from torch.utils.data import DataLoader, TensorDataset

    x_all, y_all = image_batch(n=32)
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=8)

    def get_batch():
        return next(iter(loader))  # bug: a fresh iterator each call

    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = get_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


# =============================================================================================
# Clean loops
# =============================================================================================

# --- no_grad in train mode that costs no training ---------------------------------------------


@case("clean/lbfgs_lstm_no_grad_prediction", None, None, "lstm", "LBFGS",
      "PyTorch's time-sequence-prediction example: an LSTM fitted with LBFGS and a closure, and "
      "after each step a prediction under torch.no_grad() with the model still in train mode")
@silent
def _c_lbfgs_lstm_predict(ctx):
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(1, 16, batch_first=True)
            self.out = nn.Linear(16, 1)

        def forward(self, x, future=0):
            h, state = self.lstm(x)
            ys = [self.out(h)]
            y = ys[-1][:, -1:]
            for _ in range(future):
                h, state = self.lstm(y, state)
                y = self.out(h)
                ys.append(y)
            return torch.cat(ys, 1)

    t = torch.linspace(0, 4 * math.pi, 21)
    wave = torch.sin(t[None, :, None] + torch.rand(4, 1, 1) * 6)
    x, target = wave[:, :-1], wave[:, 1:]
    model = Seq()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    san = ctx.attach(model, opt)
    for step in range(6):
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            return loss

        san.watch_loss(opt.step(closure))
        with torch.no_grad():  # prediction of the next 5 points, model left in train mode
            model(x[:1], future=5)


@case("clean/rl_rollout_no_grad_policy_mlp", None, None, "mlp", "Adam",
      "REINFORCE: episodes are rolled out under torch.no_grad() with the policy in train mode, "
      "then the update recomputes the log-probabilities with gradients")
@silent
def _c_rl_rollout(ctx):
    policy = make_mlp(din=4, dh=16, dout=2)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    san = ctx.attach(policy, opt)
    for update in range(STEPS):
        states, actions, rewards = [], [], []
        s = torch.randn(8, 4)
        with torch.no_grad():  # rollout
            for _ in range(5):
                a = torch.distributions.Categorical(logits=policy(s)).sample()
                states.append(s)
                actions.append(a)
                rewards.append((a == (s[:, 0] > 0).long()).float())
                s = s + 0.1 * torch.randn_like(s)
        S, A = torch.cat(states), torch.cat(actions)
        R = torch.cat(rewards)
        opt.zero_grad()
        logp = F.log_softmax(policy(S), 1).gather(1, A[:, None]).squeeze(1)
        loss = san.watch_loss(-(logp * (R - R.mean())).mean())
        loss.backward()
        opt.step()


@case("clean/ema_teacher_mlp", None, None, "mlp", "SGD+momentum + EMA",
      "mean teacher: the student trains on its loss plus a consistency term against an EMA "
      "teacher (frozen copy, train mode, run under no_grad, updated by hand); both attached")
@silent
def _c_ema_teacher(ctx):
    student = make_mlp()
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(student.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(student, opt, label="student")
    ctx.attach(teacher, label="teacher")
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        out = student(x)
        with torch.no_grad():
            target = teacher(x + 0.05 * torch.randn_like(x))
        loss = san.watch_loss(F.mse_loss(out, y) + 0.1 * F.mse_loss(out, target))
        loss.backward()
        opt.step()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.mul_(0.99).add_(ps, alpha=0.01)


@case("clean/gan_no_grad_fakes_bn_generator", None, None, "gan", "Adam x2",
      "DCGAN-style: the discriminator's fakes are generated under torch.no_grad() by a generator "
      "with BatchNorm in train mode (a warning names the BatchNorm statistics), the generator "
      "step runs it again with gradients")
def _c_gan_no_grad_fakes(ctx):
    G = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    _, D = make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    san_g = ctx.attach(G, opt_g, label="G")
    ctx.attach(D, opt_d, label="D")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for step in range(STEPS):
        with torch.no_grad():
            fake = G(torch.randn(16, 4))
        opt_d.zero_grad()
        loss_d = F.binary_cross_entropy_with_logits(D(real_batch()), ones) + \
            F.binary_cross_entropy_with_logits(D(fake), zeros)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = san_g.watch_loss(
            F.binary_cross_entropy_with_logits(D(G(torch.randn(16, 4))), ones))
        loss_g.backward()
        opt_g.step()


# --- modules in eval mode on purpose, with frozen parameters ----------------------------------


@case("clean/frozen_bn_backbone_cnn", None, None, "cnn", "SGD+momentum",
      "transfer learning: the convolutional backbone and its BatchNorm are frozen "
      "(requires_grad False, eval mode, kept so by a train() override); only the new head trains")
@silent
def _c_frozen_bn_backbone(ctx):
    class Finetune(SmallCNN):
        def train(self, mode=True):
            super().train(mode)
            for m in (self.conv1, self.bn, self.conv2):
                m.eval()  # frozen BatchNorm statistics
            return self

    model = Finetune(bn=True)
    for m in (model.conv1, model.bn, model.conv2):
        for p in m.parameters():
            p.requires_grad_(False)
    model.train()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("clean/frozen_encoder_dropout_eval_transformer", None, None, "transformer", "AdamW",
      "linear probe: the encoder (embedding, attention, dropout) is frozen and in eval mode, "
      "the model itself in train mode; only the head trains — the Dropout in eval mode sits in "
      "frozen parameters")
@silent
def _c_frozen_encoder(ctx):
    model = TinyTransformer(dropout=0.2)
    for p in list(model.emb.parameters()) + list(model.enc.parameters()) + [model.pos]:
        p.requires_grad_(False)
    model.train()
    model.enc.eval()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- repeated inputs that are meant -----------------------------------------------------------


@case("clean/full_batch_gcn", None, None, "gcn", "Adam",
      "a two-layer graph convolutional network trained full-batch (the whole graph every step, "
      "a training mask on the nodes), after a shape-check forward on a dummy graph")
@silent
def _c_full_batch_gcn(ctx):
    n, f, c = 40, 8, 3
    feats = torch.randn(n, f)
    adj = (torch.rand(n, n) < 0.1).float()
    adj = ((adj + adj.T) > 0).float() + torch.eye(n)
    d = adj.sum(1).rsqrt()
    a_hat = d[:, None] * adj * d[None, :]
    labels = torch.randint(0, c, (n,))
    train_mask = torch.rand(n) < 0.5

    class GCN(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(f, 16), nn.Linear(16, c)

        def forward(self, x, a):
            return a @ self.l2(F.relu(a @ self.l1(x)))

    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    san = ctx.attach(model, opt)
    model(torch.zeros(2, f), torch.eye(2))  # shape check (with grad, no backward)
    for step in range(STEPS):
        opt.zero_grad()
        out = model(feats, a_hat)
        loss = san.watch_loss(F.cross_entropy(out[train_mask], labels[train_mask]))
        loss.backward()
        opt.step()


@case("clean/full_batch_pinn_mlp", None, None, "mlp", "Adam",
      "physics-informed fit of u'' = -pi^2 sin(pi x) on fixed collocation points (the same "
      "inputs every step), the derivatives taken with torch.autograd.grad")
@silent
def _c_full_batch_pinn(ctx):
    model = make_mlp(din=1, dh=16, dout=1, act=nn.Tanh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    xs = torch.linspace(0, 1, 32)[:, None]
    xb = torch.tensor([[0.0], [1.0]])
    for step in range(STEPS):
        opt.zero_grad()
        x = xs.clone().requires_grad_(True)
        u = model(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        d2u = torch.autograd.grad(du.sum(), x, create_graph=True)[0]
        residual = d2u + math.pi ** 2 * torch.sin(math.pi * x)
        loss = san.watch_loss(residual.pow(2).mean() + model(xb).pow(2).mean())
        loss.backward()
        opt.step()


@case("clean/full_batch_reused_tensor_gru", None, None, "gru", "Adam",
      "one fixed batch built before the loop and fed at every step: full-batch training on a "
      "small data set (formerly the buggy duplicate_batch/reused_tensor_gru; a loop that repeats "
      "the same inputs from step 0 cannot be told from full-batch training, so it is clean)")
@silent
def _c_full_batch_gru(ctx):
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    t, y = token_batch()
    for step in range(STEPS):
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


@case("clean/gan_discriminator_sees_fake_twice", None, None, "gan", "Adam x2",
      "GAN whose discriminator step starts with D(fake.detach()); the generator step then "
      "calls D(fake) on the same tensor right after D's step (the same inputs at two "
      "consecutive D steps)")
@silent
def _c_gan_fake_twice(ctx):
    G, D = make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    san_g = ctx.attach(G, opt_g, label="G")
    ctx.attach(D, opt_d, label="D")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for step in range(STEPS):
        fake = G(torch.randn(16, 4))
        opt_d.zero_grad()
        loss_d = F.binary_cross_entropy_with_logits(D(fake.detach()), zeros) + \
            F.binary_cross_entropy_with_logits(D(real_batch()), ones)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = san_g.watch_loss(F.binary_cross_entropy_with_logits(D(fake), ones))
        loss_g.backward()
        opt_g.step()


@case("clean/loader_epochs_and_val_sample_mlp", None, None, "mlp", "SGD+momentum",
      "ordinary epochs over an unshuffled 2-batch DataLoader (batches alternate), and a fresh "
      "iterator of a 1-batch validation loader every step")
@silent
def _c_loader_epochs(ctx):
    from torch.utils.data import DataLoader, TensorDataset

    x_all, y_all = regression_batch(n=32)
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=16)
    val = DataLoader(TensorDataset(*regression_batch(n=8)), batch_size=8)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for epoch in range(5):
        for x, y in loader:
            opt.zero_grad()
            loss = san.watch_loss(F.mse_loss(model(x), y))
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                xv, yv = next(iter(val))
                F.mse_loss(model(xv), yv)
            model.train()
