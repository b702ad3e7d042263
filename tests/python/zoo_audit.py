"""Bug-zoo cases of the op audits: ``broadcast``, ``label_range``, ``label_dtype``,
``batch_mismatch``, ``target_leak``, ``probs_as_logits``.

Registered into the zoo (zoo.py imports this module before it builds ``BUGGY``/``CLEAN``), so
tests/python/test_zoo.py and bench/zoo_score.py run them with the others. The clean loops use
each broadcast that is meant — bias and scale adds, attention masks, pairwise distances written
with singleton dims on both sides, positional and timestep encodings, label smoothing, padding
marked with the ignore_index — and must produce no error.

On a CPU a class-index loss rejects an out-of-range label itself (IndexError), so a label bug
is loud there unless the loop swallows the error; the two label_range loops do what "robust"
loops do, skip any batch whose loss fails, which turns the bug silent: most batches are dropped
and the rest train on shifted labels. (On a GPU the op's device-side assert kills the process
instead.) TrainSan sees the target before the op runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import zoo
from zoo import STEPS, GRUClassifier, SmallCNN, TinyTransformer, case, make_mlp, regression_batch

# =============================================================================================
# Buggy loops
# =============================================================================================

# --- broadcast --------------------------------------------------------------------------------


@case("broadcast/mse_pred_n1_target_n_mlp", "broadcast", 0, "mlp", "SGD",
      "regression head outputs [N, 1], the target is [N]: F.mse_loss broadcasts to [N, N] and "
      "fits every prediction to the batch mean (PyTorch only warns)")
def _b_mse(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y.squeeze(1)))
        loss.backward()
        opt.step()


@case("broadcast/sample_weight_times_loss_cnn", "broadcast", 0, "cnn", "Adam",
      "class-balancing per-sample weights [N] times the per-sample BCE [N, 1] "
      "(reduction='none') gives an [N, N] matrix: every sample is weighted by every weight")
def _b_weight(ctx):
    model = SmallCNN(classes=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x = torch.randn(8, 1, 8, 8)
        y = (x.mean((1, 2, 3)) > 0).float()[:, None]  # [N, 1]
        w = torch.where(y[:, 0] > 0, 2.0, 1.0)  # [N]
        opt.zero_grad()
        per_sample = F.binary_cross_entropy_with_logits(model(x), y, reduction="none")
        loss = san.watch_loss((per_sample * w).mean())
        loss.backward()
        opt.step()


@case("broadcast/handwritten_huber_gru", "broadcast", 0, "gru", "RMSprop",
      "hand-written Huber loss on a [N, 1] prediction and a [N] target: pred - y is [N, N]")
def _b_huber(ctx):
    model = GRUClassifier(classes=1)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t = torch.randint(0, 20, (8, 8))
        y = t.float().mean(1) / 10.0  # [N]
        opt.zero_grad()
        d = model(t) - y
        loss = san.watch_loss(torch.where(d.abs() < 1, 0.5 * d**2, d.abs() - 0.5).mean())
        loss.backward()
        opt.step()


@case("broadcast/huber_module_transformer", "broadcast", 0, "transformer", "AdamW",
      "nn.HuberLoss() on a [N, 1] score and a [N] target: [N, N] inside the loss module")
def _b_huber_module(ctx):
    model = TinyTransformer(classes=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    criterion = nn.HuberLoss(delta=0.5)
    for step in range(STEPS):
        t = torch.randint(0, 20, (8, 8))
        y = (t[:, 0] % 5).float() / 5.0  # [N]
        opt.zero_grad()
        loss = san.watch_loss(criterion(model(t), y))
        loss.backward()
        opt.step()


# --- label_range ------------------------------------------------------------------------------


def _train_skipping_failures(model, opt, san, batch_fn, loss_fn):
    """The 'robust' loop: a batch whose loss raises is skipped, silently."""
    for step in range(STEPS):
        x, y = batch_fn()
        opt.zero_grad()
        try:
            loss = loss_fn(model(x), y)
        except (IndexError, RuntimeError):
            continue  # "corrupt batch"
        san.watch_loss(loss).backward()
        opt.step()


@case("label_range/one_based_labels_cnn", "label_range", 0, "cnn", "SGD+momentum",
      "labels are 1..C (from a 1-based annotation file) for C=3 classes; the loop skips batches "
      "whose loss fails, so it trains on the few batches without class C, on shifted labels")
def _lr_one_based(ctx):
    model = SmallCNN(classes=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    san = ctx.attach(model, opt)

    def batch():
        x, y = zoo.image_batch(n=8, classes=3)
        return x, y + 1  # 1-based

    _train_skipping_failures(model, opt, san, batch, F.cross_entropy)


@case("label_range/padding_minus_one_gru_lm", "label_range", 0, "gru", "Adam",
      "token targets padded with -1 while cross_entropy's ignore_index is the default -100; the "
      "loop skips the batches whose loss fails")
def _lr_padding(ctx):
    model = zoo.TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)

    def batch():
        t = torch.randint(0, 20, (8, 9))
        lengths = torch.randint(4, 10, (8,))
        tgt = t[:, 1:].clone()
        tgt[torch.arange(8)[None, :] >= lengths[:, None] - 1] = -1  # padding
        return t[:, :-1], tgt

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.reshape(-1, 20), tgt.reshape(-1))

    _train_skipping_failures(model, opt, san, batch, loss_fn)


# --- label_dtype ------------------------------------------------------------------------------


class _StoredLabels(torch.utils.data.Dataset):
    """Features and labels as a data set file holds them: NumPy arrays, the labels in the type
    the writer chose."""

    def __init__(self, classes, label_dtype, n=128, shape=(8,)):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((n, *shape)).astype(np.float32)
        self.y = rng.integers(0, classes, n).astype(label_dtype)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), self.y[i]


def _train_on_stored_labels(model, opt, san, loader):
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y.long())  # cross_entropy takes int64 targets
        san.watch_loss(loss).backward()
        opt.step()


@case("label_dtype/uint8_labels_300_classes_mlp", "label_dtype", 0, "mlp", "Adam",
      "300 class labels saved as a uint8 NumPy array: classes 256..299 wrapped to 0..43, and "
      "y.long() at the loss hides it (every value is in range)")
def _ld_uint8(ctx):
    model = make_mlp(dout=300)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    loader = torch.utils.data.DataLoader(_StoredLabels(300, np.uint8), batch_size=16,
                                         shuffle=True)
    _train_on_stored_labels(model, opt, san, loader)


@case("label_dtype/torch_uint8_labels_400_classes_cnn", "label_dtype", 0, "cnn", "SGD",
      "labels of 400 classes kept as torch.uint8 to save memory (torch.tensor(labels, "
      "dtype=torch.uint8) wraps them silently), trained from a TensorDataset")
def _ld_tensor(ctx):
    model = SmallCNN(classes=400)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = ctx.attach(model, opt)
    labels = [int(v) for v in torch.randint(0, 400, (96,))]
    y = torch.tensor([v % 256 for v in labels], dtype=torch.uint8)  # what uint8 storage keeps
    data = torch.utils.data.TensorDataset(torch.randn(96, 1, 8, 8), y)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    _train_on_stored_labels(model, opt, san, loader)


# --- batch_mismatch ---------------------------------------------------------------------------


@case("batch_mismatch/target_unsqueeze0_mlp", "batch_mismatch", 0, "mlp", "SGD+momentum",
      "the [N] target is made 2-D with unsqueeze(0) instead of unsqueeze(1): [1, N] against the "
      "[N, 1] prediction")
def _bm_unsqueeze0(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        y = y.squeeze(1)
        opt.zero_grad()
        loss = san.watch_loss(F.smooth_l1_loss(model(x), y.unsqueeze(0)))
        loss.backward()
        opt.step()


@case("batch_mismatch/slice_typo_transformer", "batch_mismatch", 0, "transformer", "AdamW",
      "hand-rolled mini-batching with a slicing typo, Y[i:i + 1] for Y[i:i + bs]: one target "
      "row is broadcast over the batch")
def _bm_slice(ctx):
    model = TinyTransformer(classes=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    X = torch.randint(0, 20, (STEPS * 8, 8))
    Y = F.one_hot(X[:, 0] % 4, 4).float() * 2.0 - 1.0  # regression targets [M, 4]
    bs = 8
    for i in range(0, len(X), bs):
        xb, yb = X[i:i + bs], Y[i:i + 1]
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(xb), yb))
        loss.backward()
        opt.step()


# =============================================================================================
# Clean loops: broadcasts that are meant
# =============================================================================================


class ScaledMLP(nn.Module):
    """Learned per-feature scale and bias, FiLM conditioning and a scalar offset."""

    def __init__(self, din=8, dh=16):
        super().__init__()
        self.inp = nn.Linear(din, dh)
        self.gamma = nn.Parameter(torch.ones(dh))
        self.beta = nn.Parameter(torch.zeros(dh))
        self.film = nn.Linear(1, 2 * dh)
        self.out = nn.Linear(dh, 1)
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, x, cond):  # x [N, din], cond [N, 1]
        h = F.relu(self.inp(x)) * self.gamma + self.beta  # [N, dh] * [dh] + [dh]
        scale, shift = self.film(cond).chunk(2, dim=-1)  # [N, dh] each
        h = h * (1 + scale) + shift
        h = h * cond.sigmoid()  # [N, dh] * [N, 1]
        return self.out(h) + self.offset


@case("clean/bias_scale_film_sample_weights_mlp", None, None, "mlp", "Adam",
      "per-feature scale and bias ([N, D] * [D] + [D]), FiLM, a scalar offset, and per-sample "
      "weights shaped like the loss (w[:, None] * loss [N, 1])")
def _c_bias_scale(ctx):
    model = ScaledMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        cond = torch.randn(16, 1)
        w = torch.rand(16)
        opt.zero_grad()
        per_sample = F.mse_loss(model(x, cond), y, reduction="none")  # [N, 1]
        loss = san.watch_loss((w[:, None] * per_sample).mean() + 0.1 * F.l1_loss(model(x, cond), y))
        loss.backward()
        opt.step()


class MaskedAttention(nn.Module):
    """Hand-written causal self-attention with a padding mask, next to nn.MultiheadAttention."""

    def __init__(self, vocab=20, d=16, heads=2, classes=3):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, t, pad):  # t [B, T], pad [B, T] True at padding (right-padded)
        B, T = t.shape
        h = self.emb(t)
        dh = h.shape[-1] // self.heads
        q, k, v = self.qkv(h).view(B, T, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(dh)  # [B, H, T, T]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)  # [T, T]
        additive = torch.zeros(T, T).masked_fill(causal, -1e4)  # float causal mask [T, T]
        pad_bias = pad.float()[:, None, None, :] * -1e4  # [B, 1, 1, T]
        bias = pad_bias + additive  # [B, 1, T, T]: rank promotion of a constant mask
        mask = pad[:, None, None, :] | causal  # [B, 1, T, T]
        scores = (scores + additive + bias).masked_fill(mask, -1e4)
        a = torch.softmax(scores, -1) @ v  # [B, H, T, dh]
        a = a.transpose(1, 2).reshape(B, T, -1)
        m, _ = self.mha(a, a, a, key_padding_mask=pad, attn_mask=causal)
        keep = (~pad).float()[..., None]  # [B, T, 1]
        return self.head((m * keep).sum(1) / keep.sum(1))


@case("clean/attention_masks_transformer", None, None, "transformer", "AdamW",
      "causal and padding masks: scores [B,H,T,T] + mask [T,T], pad[:, None, None, :] | causal, "
      "additive float masks, masked_fill, nn.MultiheadAttention with both masks")
def _c_attention(ctx):
    model = MaskedAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = zoo.token_batch()
        lengths = torch.randint(3, 9, (8,))
        pad = torch.arange(8)[None, :] >= lengths[:, None]  # [B, T]
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t, pad), y))
        loss.backward()
        opt.step()


class Embedder(nn.Module):
    def __init__(self, k=5):
        super().__init__()
        self.enc = make_mlp(dout=4)
        self.protos = nn.Parameter(torch.randn(k, 4))

    def forward(self, x):
        return self.enc(x)


@case("clean/pairwise_distances_contrastive_mlp", None, None, "mlp", "SGD+momentum",
      "contrastive loss over pairwise distances z[:, None] - z[None] (singleton dims on both "
      "sides), torch.cdist, and distances to K=5 learned prototypes z[:, None] - protos")
def _c_pairwise(ctx):
    model = Embedder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        cls = torch.randint(0, 3, (16,))
        x = torch.randn(16, 8) + cls[:, None].float()
        opt.zero_grad()
        z = model(x)
        d2 = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)  # [N, N]
        same = (cls[:, None] == cls[None, :]).float()
        contrastive = (same * d2 + (1 - same) * F.relu(1.0 - d2)).mean()
        dc = torch.cdist(z, z).mean()
        to_protos = ((z[:, None, :] - model.protos) ** 2).sum(-1)  # [N, 1, 4] - [K, 4]
        loss = san.watch_loss(contrastive + 0.01 * dc + 0.01 * to_protos.min(1).values.mean())
        loss.backward()
        opt.step()


class Denoiser(nn.Module):
    """Diffusion-style denoiser with a sinusoidal timestep embedding built in forward()."""

    def __init__(self, d=8, h=32, half=8):
        super().__init__()
        self.half = half
        self.t_mlp = nn.Sequential(nn.Linear(2 * half, h), nn.SiLU(), nn.Linear(h, h))
        self.inp = nn.Linear(d, h)
        self.out = nn.Linear(h, d)

    def forward(self, x, t):  # x [B, d], t [B]
        freqs = torch.exp(-math.log(10000.0) * torch.arange(self.half) / self.half)  # [half]
        args = t[:, None].float() * freqs[None]  # [B, half]
        args_implicit = t[:, None].float() * freqs  # [B, 1] * [half]: the same, one-sided
        temb = torch.cat([torch.sin(args), torch.cos(args_implicit)], dim=-1)
        return self.out(F.silu(self.inp(x) + self.t_mlp(temb)))


class SinusoidalTransformer(TinyTransformer):
    """TinyTransformer plus a sinusoidal positional encoding computed in forward()."""

    def forward(self, tokens):
        T, d = tokens.shape[1], self.emb.embedding_dim
        pos = torch.arange(T)[:, None].float()  # [T, 1]
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))  # [d/2]
        pe = torch.zeros(T, d)
        pe[:, 0::2] = torch.sin(pos * div)  # [T, 1] * [d/2] -> [T, d/2]
        pe[:, 1::2] = torch.cos(pos * div)
        h = self.emb(tokens) + pe + self.pos[:, :T]  # [B, T, d] + [T, d] + [1, T, d]
        return self.head(self.enc(h).mean(1))


@case("clean/positional_timestep_encodings", None, None, "transformer", "AdamW + Adam",
      "sinusoidal positional encodings (pos[:, None] * div) added to embeddings, and a "
      "diffusion denoiser's timestep embedding t[:, None] * freqs (one- and two-sided)")
def _c_encodings(ctx):
    lm = SinusoidalTransformer()
    opt_lm = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    san_lm = ctx.attach(lm, opt_lm, label="transformer")
    den = Denoiser()
    opt_den = torch.optim.Adam(den.parameters(), lr=1e-3)
    san_den = ctx.attach(den, opt_den, label="denoiser")
    alphas = torch.linspace(0.99, 0.1, 100)
    for step in range(STEPS):
        t, y = zoo.token_batch()
        opt_lm.zero_grad()
        san_lm.watch_loss(F.cross_entropy(lm(t), y)).backward()
        opt_lm.step()

        x0 = torch.randn(8, 8)
        ts = torch.randint(0, 100, (8,))
        a = alphas[ts][:, None]  # [B, 1]
        noise = torch.randn_like(x0)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        opt_den.zero_grad()
        san_den.watch_loss(F.mse_loss(den(xt, ts), noise)).backward()
        opt_den.step()


@case("clean/label_smoothing_cnn", None, None, "cnn", "SGD+momentum",
      "cross_entropy(label_smoothing=0.1), a hand-written smoothed target "
      "one_hot * (1 - eps) + eps / C, and nn.NLLLoss")
def _c_label_smoothing(ctx):
    model = SmallCNN(classes=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    san = ctx.attach(model, opt)
    eps, C = 0.1, 3
    for step in range(STEPS):
        x, y = zoo.image_batch(n=8, classes=C)
        opt.zero_grad()
        out = model(x)
        logp = F.log_softmax(out, -1)
        smooth = F.one_hot(y, C).float() * (1 - eps) + eps / C
        hand = -(smooth * logp).sum(-1).mean()
        loss = F.cross_entropy(out, y, label_smoothing=eps) + hand + nn.NLLLoss()(logp, y)
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/ignore_index_padding_gru_lm", None, None, "gru", "Adam",
      "token targets padded with -100 (cross_entropy's default ignore_index) and, in a second "
      "loss, with 0 and ignore_index=0; nll_loss over [B, C, T]")
def _c_ignore_index(ctx):
    model = zoo.TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t = torch.randint(1, 20, (8, 9))
        lengths = torch.randint(4, 10, (8,))
        padded = torch.arange(8)[None, :] >= lengths[:, None] - 1  # [B, T]
        tgt = t[:, 1:].masked_fill(padded, -100)
        tgt0 = t[:, 1:].masked_fill(padded, 0)
        opt.zero_grad()
        logits = model(t[:, :-1])  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, 20), tgt.reshape(-1))
        loss = loss + F.cross_entropy(logits.transpose(1, 2), tgt0, ignore_index=0)
        loss = loss + F.nll_loss(F.log_softmax(logits, -1).transpose(1, 2), tgt)
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/compact_uint8_labels_mlp", None, None, "mlp", "SGD",
      "labels of 10 classes stored as uint8 (CIFAR-style compact storage) and cast with "
      "y.long() at the loss; and a 300-way head fine-tuned on 10 of its classes stored as uint8")
def _clean_compact_labels(ctx):
    for head in (10, 300):
        model = make_mlp(dout=head)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        san = ctx.attach(model, opt, label=f"head{head}")
        loader = torch.utils.data.DataLoader(_StoredLabels(10, np.uint8), batch_size=16,
                                             shuffle=True)
        _train_on_stored_labels(model, opt, san, loader)


# --- target_leak (Note [Target leak]) --------------------------------------------------------


class _CharGPT(nn.Module):
    """A character-level decoder-only LM as nanoGPT's shakespeare_char writes it."""

    def __init__(self, vocab=40, d=32, block=32, causal=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)
        self.causal = causal

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        return self.head(self.block(h, src_mask=mask, is_causal=self.causal))


def _char_lm(ctx, shift):
    model = _CharGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    san = ctx.attach(model, opt)
    data = torch.randint(0, 40, (2048,))  # the encoded text
    for step in range(STEPS):
        ix = torch.randint(len(data) - 33, (8,))
        x = torch.stack([data[i:i + 32] for i in ix])
        y = torch.stack([data[i + shift:i + shift + 32] for i in ix])
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        san.watch_loss(loss).backward()
        opt.step()


@case("target_leak/get_batch_unshifted_transformer", "target_leak", 0, "transformer", "AdamW",
      "nanoGPT-style get_batch takes y = data[i:i+T] instead of data[i+1:i+T+1]: the targets "
      "are the input ids, each position predicts the token it reads")
def _tl_unshifted(ctx):
    _char_lm(ctx, 0)


def _table(n=512, seed=0):
    """A table as a DataFrame holds it: five features, then the class label (3 classes)."""
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((n, 5)).astype(np.float32)
    label = (feats[:, 0] + 0.5 * feats[:, 1] > 0).astype(np.float32) + (feats[:, 2] > 1)
    return np.concatenate([feats, label[:, None].astype(np.float32)], 1)


def _fit_table(ctx, keep_label):
    table = _table()
    X = table if keep_label else table[:, :-1]
    y = table[:, -1].astype(np.int64)
    data = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
    model = make_mlp(din=X.shape[1], dh=32, dout=3)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    crit = nn.CrossEntropyLoss()
    for step, (xb, yb) in enumerate(loader):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = crit(model(xb), yb)
        san.watch_loss(loss).backward()
        opt.step()


@case("target_leak/label_column_left_in_features_mlp", "target_leak", 0, "mlp", "RMSprop",
      "X = df.values with the label column still in it: one feature is the class index the "
      "model must predict")
def _tl_table(ctx):
    _fit_table(ctx, True)


@case("label_dtype/uint8_target_passed_as_is_mlp", "label_dtype", 0, "mlp", "SGD+nesterov",
      "300-class labels stored as uint8 go straight to nn.CrossEntropyLoss, which accepts a "
      "uint8 target: classes 256..299 train as 0..43")
def _ld_direct(ctx):
    model = make_mlp(dout=300)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    san = ctx.attach(model, opt)
    loader = torch.utils.data.DataLoader(_StoredLabels(300, np.uint8), batch_size=16,
                                         shuffle=True)
    crit = nn.CrossEntropyLoss()
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = crit(model(x), y)
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/next_token_targets_shifted_transformer", None, None, "transformer", "AdamW",
      "the same character LM with y = data[i+1:i+T+1]: the answer is the next token (target_leak "
      "twin)")
def _clean_shifted(ctx):
    _char_lm(ctx, 1)


@case("clean/masked_lm_labels_transformer", None, None, "transformer", "Adam",
      "BERT-style masked LM: labels are the input ids at 15% of the positions and -100 elsewhere; "
      "the chosen inputs become [MASK] (80%), a random token (10%) or stay (10%)")
def _clean_mlm(ctx):
    model = _CharGPT(vocab=41, causal=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        ids = torch.randint(0, 40, (8, 32))
        labels = ids.clone()
        chosen = torch.bernoulli(torch.full(ids.shape, 0.15)).bool()
        labels[~chosen] = -100
        inputs = ids.clone()
        masked = torch.bernoulli(torch.full(ids.shape, 0.8)).bool() & chosen
        inputs[masked] = 40
        rand = torch.bernoulli(torch.full(ids.shape, 0.5)).bool() & chosen & ~masked
        inputs[rand] = torch.randint(0, 40, ids.shape)[rand]
        loss = F.cross_entropy(model(inputs).view(-1, 41), labels.view(-1))
        opt.zero_grad()
        san.watch_loss(loss).backward()
        opt.step()


class _MaskedConv(nn.Conv2d):
    def __init__(self, kind, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.kernel_size[0]
        mask = torch.ones_like(self.weight)
        mask[:, :, k // 2, k // 2 + (kind == "B"):] = 0
        mask[:, :, k // 2 + 1:] = 0
        self.register_buffer("mask", mask)

    def forward(self, x):
        return F.conv2d(x, self.weight * self.mask, self.bias, padding=self.padding)


@case("clean/pixelcnn_prior_over_codes_cnn", None, None, "cnn", "Adam",
      "a VQ-VAE's PixelCNN prior: the codes are embedded and are the target, position by "
      "position, by design; masked convolutions (type A) keep each code from seeing itself")
def _clean_pixelcnn(ctx):
    emb, a, b = nn.Embedding(16, 8), _MaskedConv("A", 8, 8, 5, padding=2), \
        _MaskedConv("B", 8, 8, 3, padding=1)
    model = nn.ModuleDict({"emb": emb, "a": a, "b": b, "out": nn.Conv2d(8, 16, 1)})

    def forward(codes):
        h = model["emb"](codes).permute(0, 3, 1, 2)
        return model["out"](F.relu(model["b"](F.relu(model["a"](h)))))

    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        codes = torch.randint(0, 16, (4, 8, 8))
        san.training_forward(codes)
        loss = F.cross_entropy(forward(codes), codes)
        opt.zero_grad()
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/copy_task_teacher_forced_transformer", None, None, "transformer", "Adam",
      "nn.Transformer on the copy task: the target equals the encoder's input by design, the "
      "decoder reads it shifted right behind a BOS token")
def _clean_copy(ctx):
    emb = nn.Embedding(21, 16)
    tr = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    out = nn.Linear(16, 21)
    model = nn.ModuleList([emb, tr, out])
    opt = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98))
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        src = torch.randint(0, 20, (8, 12))
        tgt_in = torch.cat([torch.full((8, 1), 20), src[:, :-1]], 1)
        san.training_forward(src, tgt_in)
        mask = nn.Transformer.generate_square_subsequent_mask(12)
        logits = out(tr(emb(src), emb(tgt_in), tgt_mask=mask))
        loss = F.cross_entropy(logits.reshape(-1, 21), src.reshape(-1))
        opt.zero_grad()
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/label_column_dropped_mlp", None, None, "mlp", "RMSprop",
      "the same table with the label column dropped from the features (target_leak twin)")
def _clean_table(ctx):
    _fit_table(ctx, False)


@case("clean/cgan_onehot_label_conditioning_gan", None, None, "gan", "Adam x2",
      "a conditional GAN with an auxiliary classifier: the generator reads noise and the one-hot "
      "code of a two-valued label (one column equals the label, the other its complement), and "
      "its loss asks the discriminator for that label")
def _clean_cgan(ctx):
    G = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 12))
    D = nn.Sequential(nn.Linear(12, 32), nn.LeakyReLU(0.2), nn.Linear(32, 3))  # real/fake, class
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    ctx.attach(G, opt_g, label="G")
    ctx.attach(D, opt_d, label="D")
    n = 64
    for step in range(STEPS):
        labels = torch.randint(0, 2, (n,))
        fake = G(torch.cat([torch.randn(n, 8), F.one_hot(labels, 2).float()], 1))
        out = D(fake)
        g_loss = F.binary_cross_entropy_with_logits(out[:, :1], torch.ones(n, 1)) + \
            F.cross_entropy(out[:, 1:], labels)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        real = torch.randn(n, 12)
        d_loss = F.binary_cross_entropy_with_logits(D(real)[:, :1], torch.ones(n, 1)) + \
            F.binary_cross_entropy_with_logits(D(fake.detach())[:, :1], torch.zeros(n, 1))
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()


# --- probs_as_logits --------------------------------------------------------------------------
# Note [Probabilities as logits] (host/audit/probs.cpp): probabilities given to a loss that applies
# softmax or sigmoid itself. Nothing fails; the loss goes down slowly and accuracy plateaus.


class SoftmaxCNN(SmallCNN):
    """An MNIST-style classifier whose forward ends in softmax (as a Keras port would)."""

    def forward(self, x):
        return F.softmax(super().forward(x), dim=1)


@case("probs_as_logits/softmax_in_forward_cross_entropy_cnn", "probs_as_logits", 0, "cnn",
      "SGD+momentum",
      "an MNIST-style classifier ends its forward in softmax and trains with "
      "nn.CrossEntropyLoss, which applies log_softmax again: softmax twice, the gradients shrink")
def _pl_softmax_ce(ctx):
    model = SoftmaxCNN(classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    san = ctx.attach(model, opt)
    criterion = nn.CrossEntropyLoss()
    for step in range(STEPS):
        x, y = zoo.image_batch(n=16, classes=10)
        opt.zero_grad()
        loss = criterion(model(x), y)
        san.watch_loss(loss).backward()
        opt.step()


@case("probs_as_logits/nll_loss_on_softmax_mlp", "probs_as_logits", 0, "mlp", "Adam",
      "F.nll_loss on F.softmax(logits) — the log forgotten: the loss is -mean(p[target]), "
      "negative, and barely trains")
def _pl_nll_softmax(ctx):
    model = make_mlp(din=8, dh=32, dout=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x = torch.randn(32, 8)
        y = x[:, :4].argmax(1)
        opt.zero_grad()
        loss = F.nll_loss(F.softmax(model(x), dim=-1), y)
        san.watch_loss(loss).backward()
        opt.step()


class SigmoidHeadGRU(GRUClassifier):
    """A binary sentiment classifier whose head ends in nn.Sigmoid."""

    def __init__(self):
        super().__init__(classes=1)
        self.head = nn.Sequential(nn.Linear(16, 1), nn.Sigmoid())


@case("probs_as_logits/sigmoid_head_bce_with_logits_gru", "probs_as_logits", 0, "gru", "RMSprop",
      "a binary classifier with nn.Sigmoid in its head trained with nn.BCEWithLogitsLoss: "
      "sigmoid twice, every prediction squeezed into [0.5, 0.73]")
def _pl_sigmoid_bce(ctx):
    model = SigmoidHeadGRU()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    criterion = nn.BCEWithLogitsLoss()
    for step in range(STEPS):
        t = torch.randint(0, 20, (64, 8))
        y = (t[:, 0] < 10).float()[:, None]
        opt.zero_grad()
        loss = criterion(model(t), y)
        san.watch_loss(loss).backward()
        opt.step()


class Dense(nn.Module):
    """Keras' Dense(units, activation=...) written in torch."""

    def __init__(self, din, units, activation=None):
        super().__init__()
        self.linear = nn.Linear(din, units)
        self.activation = {"relu": F.relu, "softmax": lambda h: F.softmax(h, -1),
                           None: lambda h: h}[activation]

    def forward(self, x):
        return self.activation(self.linear(x))


@case("probs_as_logits/keras_dense_softmax_transformer", "probs_as_logits", 0, "transformer",
      "AdamW",
      "a Keras-style last Dense(activation='softmax') over a transformer encoder, trained with "
      "F.cross_entropy (Keras' from_logits=True pairing)")
def _pl_keras_dense(ctx):
    model = TinyTransformer(classes=16)
    model.head = nn.Sequential(Dense(16, 16, "relu"), Dense(16, 5, "softmax"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = zoo.token_batch(n=16, classes=5)
        opt.zero_grad()
        loss = F.cross_entropy(model(t), y)
        san.watch_loss(loss).backward()
        opt.step()


class LogSoftmaxCNN(SmallCNN):
    """pytorch/examples' MNIST net: the forward ends in log_softmax."""

    def forward(self, x):
        return F.log_softmax(super().forward(x), dim=1)


@case("clean/log_softmax_nll_loss_and_cross_entropy_cnn", None, None, "cnn", "SGD+momentum",
      "pytorch/examples' MNIST: log_softmax in the forward and F.nll_loss; the same log_softmax "
      "output also into cross_entropy (log_softmax is idempotent: same loss, same gradient), and "
      "probabilities turned into log-probabilities with torch.log before nll_loss")
def _c_log_softmax(ctx):
    model = LogSoftmaxCNN(classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = zoo.image_batch(n=16, classes=10)
        opt.zero_grad()
        logp = model(x)
        loss = F.nll_loss(logp, y) + F.cross_entropy(logp, y)
        loss = loss + F.nll_loss(torch.log(logp.exp().clamp_min(1e-8)), y)
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/sigmoid_bce_loss_and_logits_bce_with_logits_gru", None, None, "gru", "RMSprop",
      "the right pairings: a sigmoid head with nn.BCELoss, and the logits with "
      "nn.BCEWithLogitsLoss(pos_weight=...); a zero-initialised head and a ReLU head into "
      "BCEWithLogits (not sigmoid outputs)")
def _c_bce_pairings(ctx):
    model = SigmoidHeadGRU()
    logits_model = GRUClassifier(classes=1)
    zero_head = GRUClassifier(classes=1)
    nn.init.zeros_(zero_head.head.weight)
    nn.init.zeros_(zero_head.head.bias)
    relu_head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1), nn.ReLU())
    params = [*model.parameters(), *logits_model.parameters(), *zero_head.parameters(),
              *relu_head.parameters()]
    opt = torch.optim.RMSprop(params, lr=1e-3)
    whole = nn.ModuleList([model, logits_model, zero_head, relu_head])
    san = ctx.attach(whole, opt)
    bce, bce_logits = nn.BCELoss(), nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0]))
    for step in range(STEPS):
        t = torch.randint(0, 20, (64, 8))
        y = (t[:, 0] < 10).float()[:, None]
        opt.zero_grad()
        loss = bce(model(t), y) + bce_logits(logits_model(t), y)
        loss = loss + bce_logits(zero_head(t), torch.ones_like(y))  # one class only
        loss = loss + bce_logits(relu_head(torch.randn(64, 8)), y)
        san.watch_loss(loss).backward()
        opt.step()


@case("clean/soft_targets_mixup_distillation_mlp", None, None, "mlp", "Adam",
      "soft targets: mixup's mixed one-hot targets and a teacher's softmax as the target of "
      "cross_entropy (probabilities in the target, not the input), with label_smoothing and "
      "class weights; logits near 0 of a freshly scaled-down head")
def _c_soft_targets(ctx):
    model = make_mlp(din=8, dh=32, dout=4)
    with torch.no_grad():
        model[-1].weight.mul_(1e-3)
        model[-1].bias.zero_()
    teacher = make_mlp(din=8, dh=32, dout=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    w = torch.tensor([1.0, 2.0, 0.5, 1.0])
    for step in range(STEPS):
        x = torch.randn(32, 8)
        y = x[:, :4].argmax(1)
        lam = 0.7
        perm = torch.randperm(32)
        mixed = lam * F.one_hot(y, 4).float() + (1 - lam) * F.one_hot(y[perm], 4).float()
        with torch.no_grad():
            soft = F.softmax(teacher(x) / 2.0, -1)
        opt.zero_grad()
        out = model(lam * x + (1 - lam) * x[perm])
        loss = F.cross_entropy(out, mixed) + F.cross_entropy(model(x), soft)
        loss = loss + F.cross_entropy(out, y, weight=w, label_smoothing=0.1)
        san.watch_loss(loss).backward()
        opt.step()
