"""Bug-zoo cases of gradient accumulation: ``accumulation_mismatch`` (Note [Accumulation windows]
in host/checks/accumulation.cpp).

Registered into the zoo (zoo.py imports this module before it builds ``BUGGY``/``CLEAN``). The
loops iterate a DataLoader per epoch and declare their window with ``accumulation_steps``; the
clean look-alikes keep it, with or without a last partial window per epoch (a warning, not an
error), and a GAN whose two models each accumulate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from zoo import (SmallCNN, TinyTransformer, case, image_batch, make_mlp, regression_batch,
                 token_batch)


def _loader(make, batches, n):
    xs, ys = zip(*(make(n=n) for _ in range(batches)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=n, shuffle=True)


def _accumulate(model, opt, data, *, every, epochs, loss_fn, divide):
    """Steps after every `every` micro-batches and at each epoch's last batch (as the frameworks
    do), the loss divided by `divide`."""
    for _ in range(epochs):
        for i, (x, y) in enumerate(data):
            (loss_fn(model(x), y) / divide).backward()
            if (i + 1) % every == 0 or i + 1 == len(data):
                opt.step()
                opt.zero_grad()


@case("accumulation/off_by_one_window_mlp", "accumulation_mismatch", 0, "mlp", "SGD+momentum",
      "accumulation_steps=4 declared, but the loop steps every 3 micro-batches ((i + 1) % 3)")
def _b_off_by_one(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctx.attach(model, opt, accumulation_steps=4)
    _accumulate(model, opt, _loader(regression_batch, 24, 4), every=3, epochs=1,
                loss_fn=F.mse_loss, divide=4)


@case("accumulation/epoch_shorter_than_window_cnn", "accumulation_mismatch", 0, "cnn", "Adam",
      "an epoch of 3 batches with a window of 8: stepped at each epoch's end, i.e. every 3")
def _b_short_epoch(ctx):
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt, accumulation_steps=8)
    _accumulate(model, opt, _loader(image_batch, 3, 8), every=8, epochs=5,
                loss_fn=F.cross_entropy, divide=8)


@case("clean/accumulation_declared_with_partial_windows", None, None, "transformer", "AdamW",
      "accumulation_steps=4 kept; each epoch of 10 batches ends with a window of 2 (a warning)")
def _c_declared(ctx):
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.attach(model, opt, accumulation_steps=4)
    _accumulate(model, opt, _loader(token_batch, 10, 8), every=4, epochs=3,
                loss_fn=F.cross_entropy, divide=4)
