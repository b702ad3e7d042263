"""Training loops where the answer is among the inputs (target_leak), and their honest twins,
written the way public training code writes them; a launcher test script (test_target_leak.py).

    python target_leak_loops.py NAME [--steps N]

Each loop also runs under an explicit trainsan.attach: test_target_leak.py imports this file and
calls LOOPS[name](attach), where attach(model, optimizer) returns a sanitizer.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 3
V = 64  # vocabulary
T = 32  # sequence length
B = 8


def no_attach(model, optimizer):
    return None


# ---------------------------------------------------------------------------------------------
# Token sequences


class TinyGPT(nn.Module):
    """A decoder-only LM as nanoGPT / minGPT write it: token and position embeddings, causal
    self-attention, a head over the vocabulary."""

    def __init__(self, vocab=V, d=32, block=T, causal=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.block = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)
        self.causal = causal

    def forward(self, idx, labels=None):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        logits = self.head(self.block(h, src_mask=mask, is_causal=self.causal))
        if labels is None:
            return logits
        # Hugging Face's ForCausalLMLoss: pad the labels with -100, shift them left by one.
        labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                               ignore_index=-100)


def corpus(n=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g)


def get_batch(data, shift):
    """nanoGPT's get_batch; shift=0 is the bug: y is x."""
    ix = torch.randint(len(data) - T - 1, (B,))
    x = torch.stack([data[i:i + T] for i in ix])
    y = torch.stack([data[i + shift:i + shift + T] for i in ix])
    return x, y


def _lm(attach, shift, steps):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    san = attach(model, opt)
    data = corpus()
    for _ in range(steps):
        x, y = get_batch(data, shift)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return san


def lm_unshifted(attach=no_attach, steps=STEPS):
    """BUG: the targets are the input ids (get_batch takes y = data[i:i+T])."""
    return _lm(attach, 0, steps)


def lm_shifted(attach=no_attach, steps=STEPS):
    """Honest: y = data[i+1:i+T+1]."""
    return _lm(attach, 1, steps)


def lm_hf_labels(attach=no_attach, steps=STEPS):
    """Honest: labels=input_ids, the model shifts them (Hugging Face's causal LMs)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    san = attach(model, opt)
    data = corpus()
    for _ in range(steps):
        x, _ = get_batch(data, 1)
        loss = model(x, labels=x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return san


MASK = V  # [MASK] id: the encoder's vocabulary has one more token


def mlm_batch(data, mask_inputs):
    """DataCollatorForLanguageModeling: 15% of the positions are predicted, the others -100; of
    those, 80% become [MASK], 10% a random token, 10% stay."""
    x, _ = get_batch(data, 1)
    labels = x.clone()
    chosen = torch.bernoulli(torch.full(x.shape, 0.15)).bool()
    labels[~chosen] = -100
    inputs = x.clone()
    if mask_inputs:
        to_mask = torch.bernoulli(torch.full(x.shape, 0.8)).bool() & chosen
        inputs[to_mask] = MASK
        to_random = torch.bernoulli(torch.full(x.shape, 0.5)).bool() & chosen & ~to_mask
        inputs[to_random] = torch.randint(V, x.shape)[to_random]
    return inputs, labels


def _mlm(attach, mask_inputs, steps):
    torch.manual_seed(0)
    model = TinyGPT(vocab=V + 1, causal=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    san = attach(model, opt)
    data = corpus()
    for _ in range(steps):
        inputs, labels = mlm_batch(data, mask_inputs)
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, V + 1), labels.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return san


def mlm_unmasked(attach=no_attach, steps=STEPS):
    """BUG: the collator picks the positions to predict but leaves the inputs unmasked."""
    return _mlm(attach, False, steps)


def mlm(attach=no_attach, steps=STEPS):
    """Honest masked LM."""
    return _mlm(attach, True, steps)


class Seq2Seq(nn.Module):
    """nn.Transformer with one embedding for source and target, as the PyTorch tutorials write
    it."""

    def __init__(self, vocab=V + 1, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, T, d) * 0.02)
        self.tr = nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt_in):
        n = tgt_in.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.tr(self.emb(src) + self.pos, self.emb(tgt_in) + self.pos[:, :n], tgt_mask=mask,
                    tgt_is_causal=True)
        return self.out(h)


BOS = V


def _seq2seq(attach, task, teacher_forced, steps):
    torch.manual_seed(0)
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4, betas=(0.9, 0.98))
    san = attach(model, opt)
    for _ in range(steps):
        src = torch.randint(0, V, (B, T))
        tgt = src if task == "copy" else src.flip(1)
        if teacher_forced:
            tgt_in = torch.cat([torch.full((B, 1), BOS), tgt[:, :-1]], 1)
        else:
            tgt_in = tgt  # BUG: the decoder reads the targets unshifted
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, V + 1), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return san


def copy_task(attach=no_attach, steps=STEPS):
    """Honest: the target equals the encoder's input by design; the decoder is teacher-forced."""
    return _seq2seq(attach, "copy", True, steps)


def reverse_task(attach=no_attach, steps=STEPS):
    """Honest: reverse the source, teacher-forced."""
    return _seq2seq(attach, "reverse", True, steps)


def reverse_unshifted(attach=no_attach, steps=STEPS):
    """BUG: the decoder is fed the reversed sequence it must output, not shifted right."""
    return _seq2seq(attach, "reverse", False, steps)


class MaskedConv2d(nn.Conv2d):
    """PixelCNN's masked convolution: 'A' hides the centre pixel, 'B' shows it."""

    def __init__(self, kind, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.kernel_size[0]
        mask = torch.ones_like(self.weight)
        mask[:, :, k // 2, k // 2 + (kind == "B"):] = 0
        mask[:, :, k // 2 + 1:] = 0
        self.register_buffer("mask", mask)

    def forward(self, x):
        return F.conv2d(x, self.weight * self.mask, self.bias, padding=self.padding)


class PixelCNNPrior(nn.Module):
    """The autoregressive prior over a VQ-VAE's codes: embedded codes, masked convolutions,
    logits over the codebook; it predicts each code from the ones before it."""

    def __init__(self, codes=32, d=16):
        super().__init__()
        self.emb = nn.Embedding(codes, d)
        self.a = MaskedConv2d("A", d, d, 5, padding=2)
        self.b = MaskedConv2d("B", d, d, 3, padding=1)
        self.out = nn.Conv2d(d, codes, 1)

    def forward(self, codes):
        h = self.emb(codes).permute(0, 3, 1, 2)
        return self.out(F.relu(self.b(F.relu(self.a(h)))))


def pixelcnn_prior(attach=no_attach, steps=STEPS):
    """Honest: the target is the input codes, position by position, by design (masked type A)."""
    torch.manual_seed(0)
    model = PixelCNNPrior()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    san = attach(model, opt)
    for _ in range(steps):
        codes = torch.randint(0, 32, (B, 8, 8))
        logits = model(codes)
        loss = F.cross_entropy(logits, codes)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return san


# ---------------------------------------------------------------------------------------------
# Feature tables


def survival_table(n=512, seed=0):
    """A Titanic-like table as a DataFrame holds it: the label column last."""
    rng = np.random.default_rng(seed)
    age = rng.uniform(1, 80, n)
    fare = rng.lognormal(3, 1, n)
    sex = rng.integers(0, 2, n)
    pclass = rng.integers(1, 4, n)
    sibsp = rng.poisson(0.5, n)
    logit = 1.5 * sex - 0.8 * (pclass - 2) - 0.02 * (age - 30)
    survived = (rng.uniform(size=n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    table = np.stack([age, fare, sex, pclass, sibsp, survived], 1).astype(np.float32)
    return table


def _survival(attach, drop_label, steps, predictive=False):
    torch.manual_seed(0)
    table = survival_table()
    y = table[:, -1:]
    X = table[:, :-1] if drop_label else table  # BUG when kept: features = the whole table
    if predictive:  # a feature that agrees with the label on 90% of the rows
        flip = np.random.default_rng(1).uniform(size=len(y)) < 0.1
        X = np.concatenate([X, np.where(flip, 1 - y, y)], 1)
    loader = DataLoader(TensorDataset(torch.from_numpy(X), torch.from_numpy(y)), batch_size=64,
                        shuffle=True)
    model = nn.Sequential(nn.Linear(X.shape[1], 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.BCEWithLogitsLoss()
    san = attach(model, opt)
    for step, (xb, yb) in enumerate(loader):
        if step == steps:
            break
        opt.zero_grad()
        loss = crit(model(xb), yb)
        loss.backward()
        opt.step()
    return san


def survival_label_left(attach=no_attach, steps=STEPS):
    """BUG: the label column is left among the features."""
    return _survival(attach, False, steps)


def survival(attach=no_attach, steps=STEPS):
    """Honest: X = table without the label column."""
    return _survival(attach, True, steps)


def survival_predictive_feature(attach=no_attach, steps=STEPS):
    """Honest: a feature that agrees with the label on 90% of the rows (not on every row)."""
    return _survival(attach, True, steps, predictive=True)


def _prices(attach, drop_label, steps):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    n = 256
    rooms = rng.integers(1, 8, n)
    area = rng.uniform(30, 250, n)
    age = rng.uniform(0, 100, n)
    price = 1000 * area * (1 + 0.1 * rooms) * np.exp(-age / 200) / 1e5
    df = {"rooms": rooms, "area": area, "age": age, "price": price}
    cols = ["rooms", "area", "age"] + ([] if drop_label else ["price"])
    X = torch.tensor(np.stack([df[c] for c in cols], 1), dtype=torch.float32)
    y = torch.tensor(df["price"], dtype=torch.float32)
    model = nn.Sequential(nn.Linear(X.shape[1], 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    san = attach(model, opt)
    for step in range(steps):
        idx = torch.randperm(n)[:32]
        pred = model(X[idx]).squeeze(-1)
        loss = F.mse_loss(pred, y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return san


def prices_label_left(attach=no_attach, steps=STEPS):
    """BUG: the price column is among the regression features."""
    return _prices(attach, False, steps)


def prices(attach=no_attach, steps=STEPS):
    """Honest regression."""
    return _prices(attach, True, steps)


def autoencoder(attach=no_attach, steps=STEPS):
    """Honest: a reconstruction loss, the target is the input [B, F]."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 4), nn.ReLU(), nn.Linear(4, 12))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = attach(model, opt)
    for _ in range(steps):
        x = torch.randn(64, 12)
        loss = F.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return san


class Generator(nn.Module):
    def __init__(self, z=16, classes=2, onehot=True):
        super().__init__()
        self.classes, self.onehot = classes, onehot
        self.label_emb = None if onehot else nn.Embedding(classes, classes)
        self.net = nn.Sequential(nn.Linear(z + classes, 32), nn.ReLU(), nn.Linear(32, 20))

    def forward(self, noise, labels=None):
        if labels is None:  # the one-hot code was concatenated to the noise by the caller
            return self.net(noise)
        c = F.one_hot(labels, self.classes).float() if self.onehot else self.label_emb(labels)
        return self.net(torch.cat([noise, c], 1))


class Discriminator(nn.Module):
    """AC-GAN's discriminator: real/fake and an auxiliary class head."""

    def __init__(self, classes=2):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 32), nn.LeakyReLU(0.2))
        self.adv = nn.Linear(32, 1)
        self.aux = nn.Linear(32, classes)

    def forward(self, x):
        h = self.body(x)
        return self.adv(h), self.aux(h)


def _acgan(attach, classes, onehot, steps, outside=False, watch_d=True):
    """PyTorch-GAN's AC-GAN loop: the generator is conditioned on the class (one-hot code
    concatenated to the noise, or an embedding), the discriminator predicts real/fake and the
    class."""
    torch.manual_seed(0)
    G, D = Generator(classes=classes, onehot=onehot), Discriminator(classes)
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
    sans = [attach(G, opt_g), attach(D, opt_d) if watch_d else None]
    adv, aux = nn.BCEWithLogitsLoss(), nn.CrossEntropyLoss()
    n = 64
    for _ in range(steps):
        real = torch.randn(n, 20)
        real_labels = torch.randint(0, classes, (n,))
        valid, fake = torch.ones(n, 1), torch.zeros(n, 1)
        # generator
        opt_g.zero_grad()
        z = torch.randn(n, 16)
        gen_labels = torch.randint(0, classes, (n,))
        if outside:
            gen = G(torch.cat([z, F.one_hot(gen_labels, classes).float()], 1))
        else:
            gen = G(z, gen_labels)
        v, c = D(gen)
        g_loss = 0.5 * (adv(v, valid) + aux(c, gen_labels))
        g_loss.backward()
        opt_g.step()
        # discriminator
        opt_d.zero_grad()
        rv, rc = D(real)
        fv, fc = D(gen.detach())
        d_loss = 0.25 * (adv(rv, valid) + aux(rc, real_labels) + adv(fv, fake) +
                         aux(fc, gen_labels))
        d_loss.backward()
        opt_d.step()
    return sans


def acgan_onehot(attach=no_attach, steps=STEPS):
    """Honest: two classes, one-hot conditioning (a column equals the label, its twin is the
    complement), an auxiliary class loss on the same labels."""
    return _acgan(attach, 2, True, steps)


def acgan_onehot_outside(attach=no_attach, steps=STEPS):
    """Honest: the one-hot code concatenated to the noise before the call, and only the
    generator watched: its input [64, 18] has a column equal to the label and one equal to its
    complement."""
    return _acgan(attach, 2, True, steps, outside=True, watch_d=False)


def acgan_embedded(attach=no_attach, steps=STEPS):
    """Honest: ten classes, an embedding of the label as conditioning."""
    return _acgan(attach, 10, False, steps)


LOOPS = {f.__name__: f for f in [
    lm_unshifted, lm_shifted, lm_hf_labels, mlm_unmasked, mlm, copy_task, reverse_task,
    reverse_unshifted, pixelcnn_prior, survival_label_left, survival,
    survival_predictive_feature, prices_label_left, prices, autoencoder, acgan_onehot,
    acgan_onehot_outside, acgan_embedded]}
BUGGY = ["lm_unshifted", "mlm_unmasked", "reverse_unshifted", "survival_label_left",
         "prices_label_left"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("name", choices=sorted(LOOPS))
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    LOOPS[args.name](steps=args.steps)
    print("done")
