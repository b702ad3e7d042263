"""Loss and data checks that must hold on real runs (issue 21, items 5, 6 and 8), from Python:

* label_dtype: class labels stored as uint8 with 300 classes (wrapped) are found at the loss;
  uint8 labels of 10 classes, and a 300-way head trained on 10 uint8 classes, are silent;
* duplicate_batch within a DataLoader pass: a Dataset that samples from a NumPy Generator made in
  __init__, in 2 workers without per-worker seeding, hands the model A A B B — found, the workers
  named; the same Dataset with a worker_init_fn that reseeds it, a full-batch fit, an unshuffled
  small loader over epochs and repeated evaluation passes are silent;
* nonfinite_grad behind a guard: a loop that skips its step when a gradient is not finite
  (`optimizer.zero_grad(); continue`) has the NaN born in the backward named with its origin, and
  skipped_step's advice names the NaN; the same guard on a healthy run is silent;
* under a GradScaler, a NaN born in the backward at every step is named at the second skip with
  its origin; ordinary occasional skips stay silent.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import trainsan


def of(san, kind):
    return [f for f in san.findings if f.kind == kind]


def errors(san):
    return [(f.kind, f.tensor, f.message) for f in san.findings if f.severity == "error"]


# ---------------------------------------------------------------------------------------------
# label_dtype


class Tabular(Dataset):
    """Features and class labels as a data set file holds them: NumPy arrays, the labels in the
    smallest integer type the writer chose."""

    def __init__(self, classes: int, n: int = 256, label_dtype=np.uint8, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((n, 16)).astype(np.float32)
        self.y = rng.integers(0, classes, n).astype(label_dtype)  # 300 classes wrap in uint8

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), self.y[i]


def fit_labels(classes: int, head: int, steps: int = 4, **attach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, head))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(Tabular(classes), batch_size=32, shuffle=True)
    attach.setdefault("policy", "record")
    with trainsan.attach(model, opt, **attach) as san:
        for i, (x, y) in enumerate(loader):
            if i == steps:
                break
            assert y.dtype == torch.uint8
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y.long())  # cross_entropy needs int64 targets
            loss.backward()
            opt.step()
    return san


def test_uint8_labels_of_300_classes_are_found():
    san = fit_labels(300, 300)
    (f,) = of(san, "label_dtype")
    assert f.severity == "error" and f.step == 0
    assert "comes from a uint8 tensor of the batch [32]" in f.message
    assert "the loss has 300 classes and uint8 holds only 256" in f.message
    assert "class 300 became 44" in f.message
    assert "test_data_guards.py" in f.message  # the user's line
    assert not of(san, "label_range")  # the wrapped values are all in range


def test_uint8_labels_of_300_classes_raise_before_the_loss():
    with pytest.raises(trainsan.TrainingBugError) as e:
        fit_labels(300, 300, policy="raise")
    assert e.value.finding.kind == "label_dtype"


@pytest.mark.parametrize("classes,head", [(10, 10), (10, 300)], ids=["fits", "wide_head"])
def test_compact_labels_that_fit_are_silent(classes, head):
    san = fit_labels(classes, head)
    assert errors(san) == [] and not san.findings


# ---------------------------------------------------------------------------------------------
# duplicate_batch within a DataLoader pass


class RandomWindows(Dataset):
    """Windows of a long series at random offsets, drawn from a generator the dataset holds (the
    pattern of many forecasting and audio pipelines)."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.series = torch.randn(20000, generator=g).cumsum(0) * 0.01
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return 512

    def __getitem__(self, i):
        start = int(self.rng.integers(0, len(self.series) - 33))
        w = self.series[start:start + 33]
        return w[:32], w[32:]


def seed_worker(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)  # each worker its own stream


def fit_loader(loader, epochs=1, steps=None, eval_loader=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = trainsan.attach(model, opt, policy="record")
    n = 0
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            n += 1
            if steps is not None and n >= steps:
                break
        if eval_loader is not None:
            model.eval()
            with torch.no_grad():
                for x, y in eval_loader:
                    F.mse_loss(model(x), y)
    san.close()
    return san


def test_workers_sharing_a_generator_repeat_batches():
    loader = DataLoader(RandomWindows(), batch_size=16, num_workers=2)
    san = fit_loader(loader, steps=8)
    (f,) = of(san, "duplicate_batch")
    assert f.severity == "warning" and f.step == 3
    assert "within the same pass over the data loader (num_workers=2, no worker_init_fn)" in \
        f.message
    assert "worker processes draw the same random numbers" in f.message
    assert "worker_init_fn" in f.message


def test_workers_seeded_per_worker_are_silent():
    loader = DataLoader(RandomWindows(), batch_size=16, num_workers=2, worker_init_fn=seed_worker)
    san = fit_loader(loader, steps=8)
    assert not san.findings


def test_full_batch_fit_is_silent():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=64)
    san = fit_loader(loader, epochs=12)
    assert not of(san, "duplicate_batch")


def test_unshuffled_small_loader_and_repeated_evaluation_are_silent():
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    train = DataLoader(TensorDataset(x, x[:, :1]), batch_size=16)  # 4 batches, same every epoch
    val = DataLoader(TensorDataset(x[:32], x[:32, :1]), batch_size=16)
    san = fit_loader(train, epochs=5, eval_loader=val)
    assert not of(san, "duplicate_batch")


# ---------------------------------------------------------------------------------------------
# nonfinite_grad behind a guard


class NormFeatures(nn.Module):
    """Scales each feature vector to unit length by a hand-written norm: finite for an all-zero
    vector (the clamp), but its backward is not (d sqrt at 0: 0/0)."""

    def forward(self, h):
        return h / torch.sqrt((h * h).sum(-1, keepdim=True)).clamp_min(1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.norm = NormFeatures()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def guarded_fit(padded: bool, steps: int = 6):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    skipped = 0
    for _ in range(steps):
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        if padded:
            x[::4] = 0.0  # padding samples: all-zero feature vectors
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if not all(torch.isfinite(p.grad).all() for p in model.parameters()
                   if p.grad is not None):
            opt.zero_grad()
            skipped += 1
            continue
        opt.step()
    san.close()
    return san, skipped


def test_nan_behind_a_guard_is_named_with_its_origin():
    san, skipped = guarded_fit(padded=True)
    assert skipped == 6
    fs = of(san, "nonfinite_grad")
    assert fs, san.findings
    first = fs[0]
    assert first.step == 0 and "is being cleared without an optimizer step" in first.message
    assert "It first appeared in the backward at the gradient of the output of fc1" in \
        first.message
    assert not of(san, "nonfinite_loss")
    for f in of(san, "skipped_step"):
        assert "held NaN/Inf (see nonfinite_grad)" in f.message, f.message
        assert "call optimizer.step() after backward()" not in f.message
    unchecked = san.coverage()["unchecked"]
    assert "nonfinite_grad" not in unchecked, unchecked  # read before each clear


def test_guard_on_a_healthy_run_is_silent():
    san, skipped = guarded_fit(padded=False)
    assert skipped == 0
    assert not san.findings


# ---------------------------------------------------------------------------------------------
# A NaN born in the backward under a GradScaler


class SqrtAct(nn.Module):
    def forward(self, x):
        return torch.sqrt(x * 0.0) + x  # finite; its backward: Inf (d sqrt at 0) times 0 -> NaN


class AmpNet(nn.Module):
    def __init__(self, act=None):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = act if act is not None else nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def amp_fit(model, steps, plant=None):
    torch.manual_seed(1)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gs = torch.amp.GradScaler("cpu")
    san = trainsan.attach(model, opt, policy="record")
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        if plant is not None:
            loss = plant(i, loss)
        gs.scale(loss).backward()
        gs.step(opt)
        gs.update()
    san.close()
    return san


def test_nan_born_in_the_backward_under_a_scaler_is_named_at_the_second_skip():
    san = amp_fit(AmpNet(act=SqrtAct()), steps=4)
    (f,) = of(san, "nonfinite_grad")
    assert f.step == 0 and f.value == 2.0  # the second skip (a skipped step keeps its number)
    assert "skipped 2 steps in a row" in f.message
    assert "the gradient of the output of fc1" in f.message
    assert not of(san, "amp_scale_collapse")  # the scale is still 16384: no collapse yet


def test_occasional_overflow_skips_are_silent():
    san = amp_fit(AmpNet(), steps=30,
                  plant=lambda i, loss: loss * 1e30 if i in (0, 1, 12) else loss)
    assert errors(san) == []


def test_zero_grad_between_forward_and_backward_keeps_the_backward_origin():
    # The order many scripts use: the gradients are cleared after the forward, before backward().
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    x[::4] = 0.0
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    san.close()
    first = of(san, "nonfinite_grad")[0]
    assert "being cleared" not in first.message  # read by the step, as before
    assert "It first appeared in the backward at the gradient of the output of fc1" in \
        first.message
