"""The bug zoo: small, seeded CPU training loops, each with one known training bug or none.

Every case builds its own model, optimizer and data, trains 8-12 steps with TrainSan attached
(``policy="record"``) and declares:

* ``name``   — a unique id;
* ``kind``   — the finding kind the bug must produce, or ``None`` for a clean loop;
* ``onset``  — the 0-based optimizer step (TrainSan's step counter, i.e. the number of completed
  optimizer steps) at which the bug first takes effect. A buggy case is *detected* when a finding
  of ``kind`` has ``onset <= finding.step <= onset + 3``. For a loop that never calls the
  optimizer's step the counter stays at 0, so such bugs have onset 0.

A clean case must produce no finding of error severity (warnings are allowed and reported).

Run the zoo with :func:`run_all` / :func:`run_case`, score it with ``bench/zoo_score.py``, test it
with ``tests/python/test_zoo.py``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import trainsan

# Detection window: onset <= finding.step <= onset + WINDOW.
WINDOW = 3

# ---------------------------------------------------------------------------------------------
# Registry


@dataclasses.dataclass
class Case:
    name: str
    kind: Optional[str]  # expected finding kind; None: clean loop
    onset: Optional[int]  # step of the bug's onset; None for a clean loop
    model: str  # mlp, cnn, gru, embedding, transformer, gan
    optimizer: str
    description: str
    fn: Callable[["Ctx"], None]
    seed: int = 0

    @property
    def clean(self) -> bool:
        return self.kind is None


CASES: List[Case] = []


def case(name, kind, onset, model, optimizer, description, seed=0):
    """Register a zoo case. ``kind=None`` (and ``onset=None``) marks a clean loop."""

    def deco(fn):
        if any(c.name == name for c in CASES):
            raise ValueError(f"duplicate zoo case {name}")
        if kind is not None and kind not in trainsan.KINDS:
            raise ValueError(f"{name}: unknown kind {kind}")
        CASES.append(Case(name, kind, onset, model, optimizer, description, fn, seed))
        return fn

    return deco


class Ctx:
    """Handed to each case: attaches sanitizers (policy "record") and keeps them for the runner."""

    def __init__(self):
        self.sanitizers: list = []  # (label, Sanitizer)

    def attach(self, model, optimizer=None, label="model", **options):
        san = trainsan.attach(model, optimizer, policy="record", **options)
        self.sanitizers.append((label, san))
        return san


@dataclasses.dataclass
class LabeledFinding:
    sanitizer: str
    finding: trainsan.Finding

    def __getattr__(self, item):
        return getattr(self.finding, item)

    def __str__(self):
        f = self.finding
        rep = f" (x{f.count}, last step {f.last_step})" if f.count > 1 else ""
        return (f"<{self.sanitizer}> {f.kind} step={f.step} [{f.severity}] "
                f"tensor={f.tensor}{rep}: {f.message}")


@dataclasses.dataclass
class Result:
    case: Case
    findings: List[LabeledFinding]
    seconds: float
    exception: Optional[str] = None
    # detected / missed / wrong_kind / too_early / too_late / clean / false_error / crashed
    status: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("detected", "clean")

    def errors(self) -> List[LabeledFinding]:
        return [f for f in self.findings if f.severity == "error"]

    def report(self) -> str:
        lines = [f"{self.case.name}: {self.status} {self.detail}".rstrip()]
        if self.exception:
            lines.append("  exception: " + self.exception)
        for f in self.findings:
            lines.append("  " + str(f))
        return "\n".join(lines)


def judge(c: Case, findings: List[LabeledFinding], exception: Optional[str]) -> tuple:
    if exception is not None:
        return "crashed", exception
    if c.clean:
        errs = [f for f in findings if f.severity == "error"]
        if errs:
            return "false_error", ", ".join(sorted({f"{f.kind}@{f.step}" for f in errs}))
        return "clean", ""
    same = [f for f in findings if f.kind == c.kind]
    lo, hi = c.onset, c.onset + WINDOW
    if any(lo <= f.step <= hi for f in same):
        first = min(f.step for f in same if lo <= f.step <= hi)
        return "detected", f"at step {first} (onset {c.onset})"
    if same:
        first = min(f.step for f in same)
        status = "too_early" if first < lo else "too_late"
        return status, f"{c.kind} at step {first} (onset {c.onset})"
    if findings:
        return "wrong_kind", "found " + ", ".join(sorted({f"{f.kind}@{f.step}" for f in findings}))
    return "missed", "no finding"


def run_case(c: Case) -> Result:
    """Run one case (seeded, single intra-op thread: the models are tiny) and judge it."""
    torch.manual_seed(c.seed)
    ctx = Ctx()
    exc = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        c.fn(ctx)
    except Exception as e:  # a crashing loop is reported, not raised
        exc = f"{type(e).__name__}: {e}"
    finally:
        torch.set_num_threads(threads)
    findings: List[LabeledFinding] = []
    for label, san in ctx.sanitizers:
        try:
            san.close()
        except Exception as e:  # pragma: no cover - policy is "record"
            exc = exc or f"close: {type(e).__name__}: {e}"
        findings += [LabeledFinding(label, f) for f in san.findings]
    secs = time.perf_counter() - t0
    r = Result(c, findings, secs, exc)
    r.status, r.detail = judge(c, findings, exc)
    return r


def run_all(cases: Optional[List[Case]] = None) -> List[Result]:
    return [run_case(c) for c in (CASES if cases is None else cases)]


def get(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Models (tiny, CPU)


def make_mlp(din=8, dh=16, dout=1, dropout=0.0, act=nn.ReLU):
    layers = [nn.Linear(din, dh), act()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(dh, dout))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """1x8x8 images -> `classes` logits (or an embedding when classes is None)."""

    def __init__(self, classes=3, bn=False, width=4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.head = nn.Linear(2 * width, classes)

    def features(self, x):
        h = F.relu(self.bn(self.conv1(x)))
        h = F.relu(self.conv2(h))
        return F.adaptive_avg_pool2d(h, 1).flatten(1)

    def forward(self, x):
        return self.head(self.features(x))


class GRUClassifier(nn.Module):
    def __init__(self, vocab=20, emb=8, hidden=16, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.GRU(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):
        _, h = self.rnn(self.emb(tokens))
        return self.head(h[-1])


class TinyTransformer(nn.Module):
    """Token classifier: embedding + positions + one encoder layer + mean-pool head."""

    def __init__(self, vocab=20, d=16, classes=3, seq=8, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, seq, d) * 0.02)
        self.enc = nn.TransformerEncoderLayer(
            d, nhead=2, dim_feedforward=32, dropout=dropout, batch_first=True
        )
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        h = self.enc(self.emb(tokens) + self.pos[:, : tokens.shape[1]])
        return self.head(h.mean(1))


def regression_batch(n=16, din=8, dout=1):
    x = torch.randn(n, din)
    y = x[:, :dout] * 0.5 + 0.1 * torch.randn(n, dout)
    return x, y


def image_batch(n=8, classes=3):
    x = torch.randn(n, 1, 8, 8)
    y = torch.randint(0, classes, (n,))
    return x, y


def token_batch(n=8, seq=8, vocab=20, classes=3):
    t = torch.randint(0, vocab, (n, seq))
    y = t[:, 0] % classes
    return t, y


STEPS = 10


# =============================================================================================
# Buggy loops
# =============================================================================================

# --- nonfinite_loss ---------------------------------------------------------------------------


@case("nonfinite_loss/corrupt_batch_mlp", "nonfinite_loss", 4, "mlp", "SGD",
      "a corrupt sample (NaN feature) arrives in the batch of step 4")
def _nl_corrupt_batch(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        if step == 4:
            x[3, 2] = float("nan")
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


@case("nonfinite_loss/cold_softmax_transformer", "nonfinite_loss", 5, "transformer", "AdamW",
      "hand-written log(softmax(logits / T)); the temperature schedule drops T to 1e-4 at step 5, "
      "softmax underflows to 0 and log(0) = -inf")
def _nl_cold_softmax(ctx):
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        temp = 1.0 if step < 5 else 1e-4
        opt.zero_grad()
        p = torch.softmax(model(t) / temp, dim=-1)
        loss = san.watch_loss(-torch.log(p.gather(1, y[:, None])).mean())
        loss.backward()
        opt.step()


@case("nonfinite_loss/empty_mask_gru", "nonfinite_loss", 6, "gru", "Adam",
      "masked loss normalised by mask.sum(); the batch of step 6 is all padding, 0/0 = NaN")
def _nl_empty_mask(ctx):
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        mask = (torch.rand(t.shape[0]) > 0.3).float()
        if step == 6:
            mask.zero_()
        opt.zero_grad()
        ce = F.cross_entropy(model(t), y, reduction="none")
        loss = san.watch_loss((ce * mask).sum() / mask.sum())
        loss.backward()
        opt.step()


# --- nonfinite_grad ---------------------------------------------------------------------------


class SignedSqrtGRU(GRUClassifier):
    def forward(self, tokens):
        _, h = self.rnn(self.emb(tokens))
        h = h[-1]
        # signed square root: each branch is NaN where it is not selected
        h = torch.where(h > 0, h.sqrt(), -(-h).sqrt())
        return self.head(h)


@case("nonfinite_grad/signed_sqrt_where_gru", "nonfinite_grad", 0, "gru", "RMSprop",
      "signed square-root pooling with torch.where(h > 0, h.sqrt(), -(-h).sqrt()): the branch "
      "not selected is NaN in forward and 0 * NaN = NaN in backward; the loss stays finite")
def _ng_signed_sqrt(ctx):
    model = SignedSqrtGRU()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


@case("nonfinite_grad/zero_distance_cnn", "nonfinite_grad", 5, "cnn", "SGD+momentum",
      "siamese CNN with Euclidean distance ((a-b)**2).sum(1).sqrt(); at step 5 a positive pair is "
      "the same image, distance 0, and d sqrt/dx at 0 is inf -> NaN gradients, finite loss")
def _ng_zero_distance(ctx):
    model = SmallCNN(classes=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        xa = torch.randn(8, 1, 8, 8)
        xb = xa + 0.3 * torch.randn(8, 1, 8, 8)
        if step == 5:
            xb[2] = xa[2]
        opt.zero_grad()
        ea, eb = model(xa), model(xb)
        dist = ((ea - eb) ** 2).sum(1).sqrt()
        loss = san.watch_loss(dist.mean())
        loss.backward()
        opt.step()


# --- nonfinite_param --------------------------------------------------------------------------


class BagOfEmbeddings(nn.Module):
    def __init__(self, vocab=50, d=8, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, classes)

    def forward(self, t):
        return self.head(self.emb(t).mean(1))


@case("nonfinite_param/adam_eps0_embedding", "nonfinite_param", 0, "embedding", "Adam(eps=0)",
      "Adam with eps=0: embedding rows absent from the batch have an exactly zero gradient, "
      "m / (sqrt(v) + 0) = 0/0 = NaN in the weights; the gradients are finite")
def _np_adam_eps0(ctx):
    model = BagOfEmbeddings()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t = torch.randint(0, 50, (8, 6))
        y = t[:, 0] % 3
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


@case("nonfinite_param/rmsprop_eps0_mlp", "nonfinite_param", 0, "mlp", "RMSprop(eps=0)",
      "RMSprop with eps=0 on data with an always-zero feature column: that column's weight "
      "gradient is exactly 0, g / sqrt(avg g^2) = 0/0 = NaN in the weights")
def _np_rmsprop_eps0(ctx):
    model = make_mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=0.0)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        x[:, 7] = 0.0  # one-hot slot that never fires
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


# --- nonfinite_activation (opt-in: the case switches it on) -------------------------------------


class LogCountMLP(nn.Module):
    """Count features -> log -> MLP: the log is a module of its own, so its output is hooked."""

    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)

    def __init__(self):
        super().__init__()
        self.log = self.Log()
        self.mlp = make_mlp()

    def forward(self, x):
        return self.mlp(self.log(x))


@case("nonfinite_activation/log_of_missing_sentinel_mlp", "nonfinite_activation", 4, "mlp",
      "Adam", "log-scaled count features; from step 4 the loader marks a missing count with the "
      "sentinel -1, log(-1) = NaN in the output of the log module (checks={"
      "'nonfinite_activation': True})")
def _na_log_sentinel(ctx):
    model = LogCountMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt, checks={"nonfinite_activation": True})
    for step in range(STEPS):
        x = torch.rand(16, 8) * 10 + 1  # counts >= 1
        y = torch.log(x[:, :1]) * 0.5
        if step >= 4:
            x[2, 5] = -1.0  # bug: "missing" sentinel fed to the log
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


# --- grad_explosion ---------------------------------------------------------------------------


@case("grad_explosion/unnormalised_batch_mlp", "grad_explosion", 7, "mlp", "Adam",
      "at step 7 a batch arrives un-normalised (raw 0..1000 values instead of standardised)")
def _ge_unnormalised(ctx):
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(12):
        x, y = regression_batch()
        if step == 7:
            x = x * 1000.0
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


@case("grad_explosion/loss_weight_gru", "grad_explosion", 6, "gru", "SGD+momentum",
      "a mis-configured loss-weight schedule multiplies the loss by 1e4 from step 6")
def _ge_loss_weight(ctx):
    model = GRUClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        w = 1.0 if step < 6 else 1e4
        opt.zero_grad()
        loss = san.watch_loss(w * F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- grad_vanishing ---------------------------------------------------------------------------


@case("grad_vanishing/dead_relu_cnn", "grad_vanishing", 0, "cnn", "SGD+momentum",
      "conv1's bias initialised to -1000 (bad init): every ReLU after it is dead, conv1 gets an "
      "exactly zero gradient at every step")
def _gv_dead_relu(ctx):
    model = SmallCNN()
    with torch.no_grad():
        model.conv1.bias.fill_(-1000.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("grad_vanishing/saturated_sigmoid_mlp", "grad_vanishing", 0, "mlp", "Adam",
      "raw sensor readings (~1e6) fed unnormalised into a sigmoid MLP: every hidden unit is "
      "saturated, the first layer's gradient is exactly zero")
def _gv_saturated(ctx):
    model = make_mlp(act=nn.Sigmoid)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x * 1e6), y))
        loss.backward()
        opt.step()


class GatedResidual(nn.Module):
    """x + alpha * ffn(x) with alpha registered as a zero *buffer* (meant to be a parameter)."""

    def __init__(self, vocab=20, d=16, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, 32), nn.GELU(), nn.Linear(32, d))
        self.register_buffer("alpha", torch.zeros(()))
        self.head = nn.Linear(d, classes)

    def forward(self, t):
        h = self.emb(t)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.alpha * self.ffn(h)
        return self.head(h.mean(1))


@case("grad_vanishing/zero_gate_transformer", "grad_vanishing", 0, "transformer", "AdamW",
      "ReZero-style gate registered as a zero buffer instead of a parameter: the FFN output is "
      "multiplied by 0, its weights get an exactly zero gradient forever")
def _gv_zero_gate(ctx):
    model = GatedResidual()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- missing_grad -----------------------------------------------------------------------------


class DetachedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.dec = nn.Linear(16, 1)

    def forward(self, x):
        # bug: .detach() left over from a feature-caching experiment
        return self.dec(self.enc(x).detach())


@case("missing_grad/detach_mlp", "missing_grad", 0, "mlp", "SGD",
      "the encoder output is .detach()ed inside forward(): the encoder never gets a gradient")
def _mg_detach(ctx):
    model = DetachedEncoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


class AuxBranchCNN(SmallCNN):
    def __init__(self):
        super().__init__()
        self.aux = nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        h = self.features(x)
        with torch.no_grad():  # bug: aux branch computed under no_grad
            a = F.relu(self.aux(x)).mean((2, 3))
        return self.head(h + a.repeat(1, 2))


@case("missing_grad/no_grad_branch_cnn", "missing_grad", 0, "cnn", "Adam",
      "an auxiliary conv branch is computed under torch.no_grad() inside forward()")
def _mg_no_grad_branch(ctx):
    model = AuxBranchCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


class GRUWithProj(GRUClassifier):
    def __init__(self, use_proj=False):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.use_proj = use_proj  # bug: defaults to False, the layer is never used

    def forward(self, tokens):
        _, h = self.rnn(self.emb(tokens))
        h = h[-1]
        if self.use_proj:
            h = torch.tanh(self.proj(h))
        return self.head(h)


@case("missing_grad/unused_branch_gru", "missing_grad", 0, "gru", "RMSprop",
      "a projection layer is defined (and in the optimizer) but a flag skips it in forward()")
def _mg_unused_branch(ctx):
    model = GRUWithProj()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- stale_grad -------------------------------------------------------------------------------


@case("stale_grad/no_zero_grad_mlp", "stale_grad", 1, "mlp", "SGD",
      "optimizer.zero_grad() is never called: from step 1 every gradient is the sum of all "
      "past ones")
def _sg_no_zero_grad(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


@case("stale_grad/one_of_two_optimizers_transformer", "stale_grad", 1, "transformer",
      "AdamW + SGD", "body trained by AdamW, head by SGD; only the body's optimizer is zeroed "
      "before backward, the head's gradients accumulate across steps")
def _sg_two_opts(ctx):
    model = TinyTransformer()
    head = list(model.head.parameters())
    head_ids = {id(p) for p in head}
    body = [p for p in model.parameters() if id(p) not in head_ids]
    opt_body = torch.optim.AdamW(body, lr=1e-3)
    opt_head = torch.optim.SGD(head, lr=0.01)
    san = ctx.attach(model, [opt_body, opt_head])
    for step in range(STEPS):
        t, y = token_batch()
        opt_body.zero_grad()  # bug: opt_head.zero_grad() forgotten
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt_body.step()
        opt_head.step()


@case("stale_grad/zero_grad_every_10_cnn", "stale_grad", 1, "cnn", "Adam",
      "zero_grad() ended up inside `if step % 10 == 0:` (meant for logging) and runs only at "
      "step 0")
def _sg_zero_every_10(ctx):
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        if step % 10 == 0:
            opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


# --- skipped_step -----------------------------------------------------------------------------


@case("skipped_step/missing_step_mlp", "skipped_step", 0, "mlp", "SGD+momentum",
      "zero_grad(), forward, backward ... and no optimizer.step(): the model never trains")
def _ss_missing_step(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()


def make_gan():
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return G, D


def real_batch(n=16):
    return torch.randn(n, 2) * 0.5 + torch.tensor([2.0, -1.0])


@case("skipped_step/gan_step_typo", "skipped_step", 0, "gan", "Adam x2",
      "GAN: the generator phase calls opt_d.step() instead of opt_g.step(); G's gradients are "
      "produced and cleared every iteration without a step (one sanitizer per model)")
def _ss_gan_typo(ctx):
    G, D = make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    san_g = ctx.attach(G, opt_g, label="G")
    ctx.attach(D, opt_d, label="D")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for step in range(STEPS):
        fake = G(torch.randn(16, 4))
        opt_d.zero_grad()
        loss_d = F.binary_cross_entropy_with_logits(D(real_batch()), ones) + \
            F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = san_g.watch_loss(F.binary_cross_entropy_with_logits(D(fake), ones))
        loss_g.backward()
        opt_d.step()  # bug: should be opt_g.step()


@case("skipped_step/scheduler_instead_of_optimizer_gru", "skipped_step", 0, "gru", "Adam",
      "scheduler.step() is called where optimizer.step() was meant")
def _ss_scheduler_typo(ctx):
    import warnings

    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    san = ctx.attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about scheduler-before-optimizer
        for step in range(STEPS):
            t, y = token_batch()
            opt.zero_grad()
            loss = san.watch_loss(F.cross_entropy(model(t), y))
            loss.backward()
            sched.step()  # bug


@case("skipped_step/zero_grad_between_backward_and_step_cnn", "skipped_step", 0, "cnn",
      "SGD+momentum", "optimizer.zero_grad() moved between loss.backward() and optimizer.step(): "
      "every step sees no gradient (None) and changes nothing")
def _ss_zero_between(ctx):
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.zero_grad()  # bug: clears the gradients the step was meant to use
        opt.step()


@case("skipped_step/zero_grad_in_place_before_step_gru", "skipped_step", 0, "gru", "Adam",
      "zero_grad(set_to_none=False) between backward() and step(): the step sees all-zero "
      "gradients (Adam still drifts on its momentum, so parameters do change)")
def _ss_zero_between_inplace(ctx):
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.zero_grad(set_to_none=False)  # bug
        opt.step()


class _SkipVectorsSGD(torch.optim.SGD):
    """A hand-written SGD whose step was meant to exempt 1-d tensors (biases, norms) from weight
    decay, and exempts them from the update instead."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p.ndim == 1:  # bug: `continue` skips the update itself
                    continue
                p.add_(p.grad, alpha=-group["lr"])


@case("skipped_step/custom_optimizer_skips_biases_mlp", "skipped_step", 0, "mlp",
      "custom SGD", "a custom optimizer's step() skips every 1-d tensor (meant: no weight decay "
      "on biases); the biases never train although the other weights do")
def _ss_skips_biases(ctx):
    model = make_mlp()
    opt = _SkipVectorsSGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


class _OffByOneAdam(torch.optim.Optimizer):
    """A hand-written Adam whose loop over a group stops one tensor short."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = group["params"]
            for i in range(len(ps) - 1):  # bug: range(len(ps))
                p = ps[i]
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                st["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                st["v"].mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                mh = st["m"] / (1 - 0.9 ** st["t"])
                vh = st["v"] / (1 - 0.999 ** st["t"])
                p.addcdiv_(mh, vh.sqrt().add_(1e-8), value=-group["lr"])


@case("skipped_step/off_by_one_custom_adam_cnn", "skipped_step", 0, "cnn", "custom Adam",
      "a custom Adam's loop over each group's params stops one short: the classifier head's "
      "bias never changes, silently")
def _ss_off_by_one(ctx):
    model = SmallCNN()
    opt = _OffByOneAdam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


# --- param_not_in_optimizer -------------------------------------------------------------------


@case("param_not_in_optimizer/layer_added_late_mlp", "param_not_in_optimizer", 0, "mlp", "SGD",
      "an output layer is added to the model after the optimizer was built from model.parameters()")
def _pno_added_late(ctx):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.append(nn.Linear(16, 1))  # bug: after the optimizer
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


@case("param_not_in_optimizer/submodule_optimizer_cnn", "param_not_in_optimizer", 0, "cnn", "Adam",
      "the optimizer is built from model.conv1/conv2 only (copied from a fine-tuning script); "
      "the trainable head is in no optimizer")
def _pno_submodule(ctx):
    model = SmallCNN()
    opt = torch.optim.Adam(list(model.conv1.parameters()) + list(model.conv2.parameters()), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("param_not_in_optimizer/replaced_rnn_gru", "param_not_in_optimizer", 0, "gru", "RMSprop",
      "model.rnn is replaced (different dropout/config) after the optimizer was created; the "
      "optimizer still holds the old GRU's tensors")
def _pno_replaced(ctx):
    model = GRUClassifier()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    model.rnn = nn.GRU(8, 16, batch_first=True)  # bug: after the optimizer
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- update_ratio -----------------------------------------------------------------------------


@case("update_ratio/sgd_lr_1e3_mlp", "update_ratio", 0, "mlp", "SGD(lr=1e3)",
      "classifier MLP trained by SGD with lr=1e3 (a typo for 1e-3): every step moves the weights "
      "by hundreds of times their norm; cross-entropy keeps the loss finite for 7 steps")
def _ur_high_sgd(ctx):
    model = make_mlp(dout=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e3)
    san = ctx.attach(model, opt)
    for step in range(7):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("update_ratio/sgd_momentum_lr_1e3_bn_cnn", "update_ratio", 0, "cnn", "SGD+momentum(lr=1e3)",
      "CNN with BatchNorm trained by SGD+momentum with lr=1e3: the weights grow by orders of "
      "magnitude per step (BatchNorm keeps the loss finite), then freeze at a huge scale")
def _ur_high_sgd_bn(ctx):
    model = SmallCNN(bn=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e3, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(8):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("update_ratio/adam_lr_1e-12_cnn", "update_ratio", 0, "cnn", "Adam(lr=1e-12)",
      "Adam with lr=1e-12 (a typo for 1e-2): the weights do not move")
def _ur_low_adam(ctx):
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-12)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("update_ratio/adamw_lr_50_transformer", "update_ratio", 0, "transformer", "AdamW(lr=50)",
      "AdamW with lr=50 (the 5e-5 exponent lost): each element moves by ~50 per step")
def _ur_high_adamw(ctx):
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=50.0)
    san = ctx.attach(model, opt)
    for step in range(8):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


# --- no_grad_leak -----------------------------------------------------------------------------


@case("no_grad_leak/feature_extractor_cnn", "no_grad_leak", 0, "cnn", "SGD+momentum x2",
      "the backbone is meant to be fine-tuned (train mode, own optimizer) but its call was left "
      "inside `with torch.no_grad():` from a frozen-feature tutorial (one sanitizer per model)")
def _ngl_feature_extractor(ctx):
    class Backbone(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
            self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)

        def forward(self, x):
            return F.adaptive_avg_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 1).flatten(1)

    backbone, head = Backbone(), nn.Linear(8, 3)
    opt_b = torch.optim.SGD(backbone.parameters(), lr=1e-3, momentum=0.9)
    opt_h = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
    ctx.attach(backbone, opt_b, label="backbone")
    san_h = ctx.attach(head, opt_h, label="head")
    for step in range(STEPS):
        x, y = image_batch()
        opt_b.zero_grad()
        opt_h.zero_grad()
        with torch.no_grad():  # bug
            f = backbone(x)
        loss = san_h.watch_loss(F.cross_entropy(head(f), y))
        loss.backward()
        opt_b.step()
        opt_h.step()


@case("no_grad_leak/freeze_schedule_gru", "no_grad_leak", 3, "gru", "Adam x2",
      "an inverted freeze schedule (`freeze = step >= 3` instead of `<`) runs the encoder under "
      "torch.no_grad() from step 3 on, while it is in train mode and in its optimizer")
def _ngl_freeze_schedule(ctx):
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.rnn = nn.GRU(8, 16, batch_first=True)

        def forward(self, t):
            return self.rnn(self.emb(t))[1][-1]

    enc, dec = Encoder(), nn.Linear(16, 3)
    opt_e = torch.optim.Adam(enc.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(dec.parameters(), lr=1e-3)
    ctx.attach(enc, opt_e, label="encoder")
    san_d = ctx.attach(dec, opt_d, label="decoder")
    for step in range(STEPS):
        t, y = token_batch()
        opt_e.zero_grad()
        opt_d.zero_grad()
        freeze = step >= 3  # bug: meant `step < 3`
        with torch.set_grad_enabled(not freeze):
            h = enc(t)
        loss = san_d.watch_loss(F.cross_entropy(dec(h), y))
        loss.backward()
        opt_e.step()
        opt_d.step()


# --- eval_mode --------------------------------------------------------------------------------


@case("eval_mode/validation_no_train_mlp", "eval_mode", 3, "mlp", "SGD+momentum",
      "model.eval() for validation after step 2, model.train() forgotten: Dropout is off for "
      "every later training step")
def _em_validation(ctx):
    model = make_mlp(dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()
        if step == 2:
            model.eval()
            with torch.no_grad():
                xv, yv = regression_batch()
                F.mse_loss(model(xv), yv)
            # bug: model.train() forgotten


@case("eval_mode/bn_left_in_eval_cnn", "eval_mode", 0, "cnn", "Adam",
      "model.bn.eval() copied from a fine-tuning recipe that froze BatchNorm, while training "
      "from scratch: BatchNorm uses its (initial) running statistics in every training step")
def _em_bn_eval(ctx):
    model = SmallCNN(bn=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    model.bn.eval()  # bug
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("eval_mode/restore_after_eval_transformer", "eval_mode", 4, "transformer", "AdamW",
      "evaluate() saves `was_training = model.training` *after* model.eval(), so its "
      "model.train(was_training) leaves the model in eval mode from step 4")
def _em_restore(ctx):
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)

    def evaluate():
        model.eval()
        was_training = model.training  # bug: read after eval()
        with torch.no_grad():
            t, y = token_batch()
            acc = (model(t).argmax(1) == y).float().mean()
        model.train(was_training)
        return acc

    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()
        if step == 3:
            evaluate()


# --- duplicate_batch --------------------------------------------------------------------------


@case("duplicate_batch/next_iter_loader_mlp", "duplicate_batch", 1, "mlp", "SGD+momentum",
      "`x, y = next(iter(loader))` inside the loop restarts the (unshuffled) loader every step: "
      "the same first batch every time")
def _db_next_iter(ctx):
    from torch.utils.data import DataLoader, TensorDataset

    X, Y = regression_batch(n=64)
    loader = DataLoader(TensorDataset(X, Y), batch_size=16, shuffle=False)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = next(iter(loader))  # bug
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


# (duplicate_batch/reused_tensor_gru, one batch fed at every step from step 0, is full-batch
# training: it moved to zoo_mode.py as clean/full_batch_reused_tensor_gru.)


# --- loss_spike and trivial_loss (no watch_loss: the backward's root is the loss) ---------------
# Their clean look-alikes are here too; tests/python/test_loss.py checks that every clean loop of
# the zoo is silent on these two kinds.


@case("loss_spike/target_units_mlp", "loss_spike", 15, "mlp", "SGD",
      "one shard of the data has its targets in centimetres instead of metres: the batch of "
      "step 15 has targets 100x too large and its loss jumps ~1e4x (finite, so no NaN check sees "
      "it)")
def _ls_target_units(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt)
    for step in range(20):
        x, y = regression_batch()
        if step == 15:
            y = y * 100.0
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


@case("loss_spike/lr_multiplier_cnn", "loss_spike", 14, "cnn", "SGD+momentum",
      "a hand-written schedule multiplies the learning rate by 300 at step 14 instead of 0.3; the "
      "loss of the next batch jumps far above its running level")
def _ls_lr_multiplier(ctx):
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ctx.attach(model, opt)
    for step in range(20):
        if step == 14:
            for g in opt.param_groups:
                g["lr"] *= 300  # bug: meant 0.3
        x, y = image_batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@case("trivial_loss/pred_vs_pred_autoencoder_mlp", "trivial_loss", 0, "mlp", "Adam",
      "an autoencoder's loss compares the reconstruction with itself (mse_loss(recon, recon), a "
      "swapped variable) instead of with the input: the loss is exactly 0 from the first step")
def _tl_pred_vs_pred(ctx):
    model = make_mlp(din=8, dh=4, dout=8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, _ = regression_batch()
        opt.zero_grad()
        recon = model(x)
        F.mse_loss(recon, recon).backward()  # bug: the target should be x
        opt.step()


@case("trivial_loss/all_labels_ignored_transformer", "trivial_loss", 0, "transformer", "AdamW",
      "the padding mask is built from the wrong tensor and marks every label as ignore_index; "
      "with reduction='sum' the loss is exactly 0 and nothing trains")
def _tl_all_ignored(ctx):
    model = TinyTransformer(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        pad = torch.ones_like(y, dtype=torch.bool)  # bug: should be t[:, 0] == PAD
        y = y.masked_fill(pad, -100)
        opt.zero_grad()
        F.cross_entropy(model(t), y, ignore_index=-100, reduction="sum").backward()
        opt.step()


# --- empty_loss -------------------------------------------------------------------------------


@case("empty_loss/completion_mask_covers_nothing_transformer", "empty_loss", 1, "transformer",
      "AdamW", "completion-only fine-tuning: the response template is never found, so every label "
      "is ignore_index; the summed token loss over max(count, 1) plus weight decay trains nothing")
def _el_completion_only(ctx):
    model = TinyTransformer(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        y = torch.full_like(y, -100)  # bug: the template search masked every position
        opt.zero_grad()
        logits = model(t)
        loss = _masked_token_loss(logits, y) + 1e-4 * logits.pow(2).mean()
        loss.backward()
        opt.step()


@case("empty_loss/all_padding_batches_mean_gru", "empty_loss", 2, "gru", "Adam",
      "the collator pads every label of the batches from one bucket with -100; mean cross-entropy "
      "over no label is NaN (0/0) with zero gradients at steps 2 and 5")
def _el_all_padding(ctx):
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        if step in (2, 5):
            y = torch.full_like(y, -100)
        opt.zero_grad()
        F.cross_entropy(model(t), y, ignore_index=-100).backward()
        opt.step()


@case("clean/noisy_small_batch_sgd_gru", None, None, "gru", "SGD",
      "batches of 2 sequences: the loss jumps between near 0 and several times its median from "
      "one batch to the next (ordinary minibatch noise, not a spike)")
def _c_noisy_small_batch(ctx):
    model = GRUClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ctx.attach(model, opt)
    for step in range(60):
        t, y = token_batch(n=2)
        opt.zero_grad()
        F.cross_entropy(model(t), y).backward()
        opt.step()


@case("clean/cosine_warm_restarts_mlp", None, None, "mlp", "Adam + CosineAnnealingWarmRestarts",
      "the learning rate restarts at its maximum every 8 steps (SGDR); the loss rises after "
      "each restart, a schedule's doing, not a spike")
def _c_warm_restarts(ctx):
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=8)
    ctx.attach(model, opt)
    for step in range(48):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


@case("clean/easy_task_low_loss_late_mlp", None, None, "mlp", "Adam",
      "a noiseless linear target a small net fits exactly: the loss falls by orders of magnitude, "
      "but over tens of steps, not within the first few")
def _c_easy_late(ctx):
    model = nn.Linear(8, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    ctx.attach(model, opt)
    w = torch.randn(8, 1)
    for step in range(80):
        x = torch.randn(32, 8)
        opt.zero_grad()
        F.mse_loss(model(x), x @ w).backward()
        opt.step()


@case("clean/finetune_converged_cnn", None, None, "cnn", "SGD+momentum",
      "fine-tuning a model that already fits its task (trained before attach): the loss is small "
      "from the first watched step and stays there")
def _c_finetune_converged(ctx):
    model = SmallCNN(classes=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def batch():
        x = torch.randn(16, 1, 8, 8)
        return x, (x.mean((1, 2, 3)) > 0).long()

    for _ in range(150):  # pre-training, before the sanitizer
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


# --- inplace_before_backward and bad_custom_grad (the autograd family) ------------------------


@case("inplace_before_backward/weight_clip_before_backward_mlp", "inplace_before_backward", 0,
      "mlp", "RMSprop",
      "WGAN-style weight clipping (p.data.clamp_) placed between the loss and loss.backward(): "
      "the backward multiplies by the clipped weights, not the ones the forward used")
def _ib_clip_before_backward(ctx):
    model = make_mlp(dh=32)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)  # bug: belongs after opt.step()
        loss.backward()
        opt.step()


@case("inplace_before_backward/weight_standardise_after_forward_cnn", "inplace_before_backward",
      0, "cnn", "Adam",
      "the conv weights are standardised through .data after the forward instead of before it: "
      "the gradient is computed with weights the forward never saw")
def _ib_standardise_after_forward(ctx):
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        w = model.conv2.weight.data
        w.sub_(w.mean()).div_(w.std() + 1e-5)  # bug: must happen before model(x)
        loss.backward()
        opt.step()


class _Swish(torch.autograd.Function):
    """x * sigmoid(x) with a hand-written backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


class _SwishMissingTerm(_Swish):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x)  # bug: the x·σ'(x) term is missing


class _SwishMLP(nn.Module):
    def __init__(self, fn, din=8, dh=16):
        super().__init__()
        self.fc1, self.fc2, self.fn = nn.Linear(din, dh), nn.Linear(dh, 1), fn

    def forward(self, x):
        return self.fc2(self.fn.apply(self.fc1(x)))


class _LinearFn(torch.autograd.Function):
    """y = x Wᵀ with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class _LinearFnTransposed(_LinearFn):
    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, x.t() @ g  # bug: the weight gradient is transposed (square: no shape error)


class _CustomLinearCNN(SmallCNN):
    def __init__(self, fn):
        super().__init__(classes=3)
        self.mix = nn.Parameter(torch.eye(8) + 0.1 * torch.randn(8, 8))
        self.fn = fn

    def forward(self, x):
        return self.head(self.fn.apply(self.features(x), self.mix))


@case("bad_custom_grad/swish_missing_term_mlp", "bad_custom_grad", 0, "mlp", "Adam",
      "a custom Swish autograd.Function whose backward forgets the x·σ'(x) term "
      "(gradcheck_every=1)")
def _bcg_swish(ctx):
    model = _SwishMLP(_SwishMissingTerm)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt, gradcheck_every=1)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


@case("bad_custom_grad/transposed_weight_grad_cnn", "bad_custom_grad", 0, "cnn", "SGD",
      "a custom linear Function on a square weight returns the transposed weight gradient "
      "(shapes agree, so autograd cannot tell) (gradcheck_every=2)")
def _bcg_transposed(ctx):
    model = _CustomLinearCNN(_LinearFnTransposed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt, gradcheck_every=2)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


class _SwishDoubled(_Swish):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return 2 * g * (s + x * s * (1 - s))  # bug: a factor 2


@case("bad_custom_grad/doubled_swish_defaults_mlp", "bad_custom_grad", 0, "mlp", "AdamW",
      "a custom Swish autograd.Function whose backward is twice the derivative, at the defaults "
      "(checked at its first use)")
def _bcg_doubled_defaults(ctx):
    model = _SwishMLP(_SwishDoubled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


# =============================================================================================
# Clean loops (no error-severity finding allowed)
# =============================================================================================


@case("clean/baseline_cnn_bn_adam", None, None, "cnn", "Adam",
      "plain supervised loop, CNN with BatchNorm")
def _c_baseline_cnn(ctx):
    model = SmallCNN(bn=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("clean/baseline_transformer_adamw_clip", None, None, "transformer", "AdamW",
      "plain loop with dropout, gradient clipping and a cosine schedule")
def _c_baseline_transformer(ctx):
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


@case("clean/grad_accumulation_mlp", None, None, "mlp", "SGD+momentum",
      "gradient accumulation over 4 micro-batches per optimizer step")
def _c_accumulation(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    accum = 4
    opt.zero_grad()
    for it in range(STEPS * accum):
        x, y = regression_batch(n=4)
        loss = san.watch_loss(F.mse_loss(model(x), y) / accum)
        loss.backward()
        if (it + 1) % accum == 0:
            opt.step()
            opt.zero_grad()


@case("clean/frozen_params_cnn", None, None, "cnn", "SGD",
      "conv1 frozen (requires_grad=False) and left out of the optimizer")
def _c_frozen(ctx):
    model = SmallCNN()
    model.conv1.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        opt.step()


@case("clean/validation_eval_no_grad_transformer", None, None, "transformer", "AdamW",
      "validation every 3 steps under torch.no_grad() in eval mode, then model.train()")
def _c_validation(ctx):
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()
        if step % 3 == 2:
            model.eval()
            with torch.no_grad():
                tv, yv = token_batch()
                F.cross_entropy(model(tv), yv)
            model.train()


@case("clean/validation_with_grad_enabled_mlp", None, None, "mlp", "SGD+momentum",
      "validation in eval mode but without torch.no_grad() (wasteful, not wrong), between steps")
def _c_validation_grad(ctx):
    model = make_mlp(dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()
        if step % 2 == 1:
            model.eval()
            xv, yv = regression_batch()
            F.mse_loss(model(xv), yv).item()
            model.train()


@case("clean/two_optimizers_one_model_transformer", None, None, "transformer", "AdamW + SGD",
      "one model, two optimizers (body AdamW, head SGD), both zeroed and stepped every step")
def _c_two_opts(ctx):
    model = TinyTransformer()
    head_ids = {id(p) for p in model.head.parameters()}
    opt_body = torch.optim.AdamW([p for p in model.parameters() if id(p) not in head_ids], lr=1e-3)
    opt_head = torch.optim.SGD(list(model.head.parameters()), lr=0.01, momentum=0.9)
    san = ctx.attach(model, [opt_body, opt_head])
    for step in range(STEPS):
        t, y = token_batch()
        opt_body.zero_grad()
        opt_head.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt_body.step()
        opt_head.step()


@case("clean/lr_warmup_from_zero_gru", None, None, "gru", "Adam + LambdaLR",
      "linear learning-rate warm-up starting at lr=0 (LambdaLR(lambda s: s / 5))")
def _c_warmup(ctx):
    model = GRUClassifier()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 5))
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()
        sched.step()


class TiedLM(nn.Module):
    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, vocab)
        self.out.weight = self.emb.weight  # tied

    def forward(self, t):
        h, _ = self.rnn(self.emb(t))
        return self.out(h)


@case("clean/tied_embeddings_gru_lm", None, None, "gru", "SGD+momentum",
      "language model with tied input embedding / output projection weights")
def _c_tied(ctx):
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t = torch.randint(0, 20, (8, 9))
        opt.zero_grad()
        logits = model(t[:, :-1])
        loss = san.watch_loss(F.cross_entropy(logits.reshape(-1, 20), t[:, 1:].reshape(-1)))
        loss.backward()
        opt.step()


@case("clean/zero_grad_set_to_none_false_mlp", None, None, "mlp", "Adam",
      "optimizer.zero_grad(set_to_none=False): gradients are zeroed in place, never freed")
def _c_zero_in_place(ctx):
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad(set_to_none=False)
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        opt.step()


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head_a = nn.Linear(16, 1)
        self.head_b = nn.Linear(16, 1)

    def forward(self, x, task):
        h = self.trunk(x)
        return self.head_a(h) if task == 0 else self.head_b(h)


@case("clean/alternate_branches_mlp", None, None, "mlp", "Adam",
      "multi-task loop alternating heads: each head gets a gradient every other step")
def _c_alternate(ctx):
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(12):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x, step % 2), y))
        loss.backward()
        opt.step()


@case("clean/alternate_branches_set_to_none_false_mlp", None, None, "mlp", "SGD+momentum",
      "the same alternating-heads loop with zero_grad(set_to_none=False)")
def _c_alternate_inplace(ctx):
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(12):
        x, y = regression_batch()
        opt.zero_grad(set_to_none=False)
        loss = san.watch_loss(F.mse_loss(model(x, step % 2), y))
        loss.backward()
        opt.step()


@case("clean/grad_scaler_skip_mlp", None, None, "mlp", "SGD + GradScaler('cpu')",
      "torch.amp.GradScaler on CPU; an outlier batch at step 4 overflows the scaled gradients, "
      "the scaler skips that optimizer step and halves its scale (what fp16 training does)")
def _c_grad_scaler(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # A large initial scale stands in for fp16's narrow range: float32 overflows at ~3.4e38.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)
    san = ctx.attach(model, opt)
    skipped = 0
    for it in range(STEPS):
        x, y = regression_batch()
        if it == 4:
            x = x * 1e6  # outlier batch: the scaled loss overflows, the unscaled one does not
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
    assert skipped == 1, f"the scaler skipped {skipped} steps, expected exactly 1"


@case("clean/gan_two_models", None, None, "gan", "Adam x2",
      "GAN with one sanitizer per model: G's backward also reaches D's parameters, whose "
      "gradients D's zero_grad() then clears without using them")
def _c_gan(ctx):
    G, D = make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    san_g = ctx.attach(G, opt_g, label="G")
    san_d = ctx.attach(D, opt_d, label="D")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for step in range(STEPS):
        fake = G(torch.randn(16, 4))
        opt_d.zero_grad()
        loss_d = san_d.watch_loss(
            F.binary_cross_entropy_with_logits(D(real_batch()), ones)
            + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        )
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = san_g.watch_loss(F.binary_cross_entropy_with_logits(D(fake), ones))
        loss_g.backward()
        opt_g.step()


@case("clean/gan_generator_first", None, None, "gan", "Adam x2",
      "GAN, generator phase first: G's backward accumulates onto D's already-consumed "
      "gradients, which D's zero_grad() then discards before D's own backward")
def _c_gan_g_first(ctx):
    G, D = make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    san_g = ctx.attach(G, opt_g, label="G")
    san_d = ctx.attach(D, opt_d, label="D")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for step in range(STEPS):
        opt_g.zero_grad()
        fake = G(torch.randn(16, 4))
        loss_g = san_g.watch_loss(F.binary_cross_entropy_with_logits(D(fake), ones))
        loss_g.backward()
        opt_g.step()
        opt_d.zero_grad()
        loss_d = san_d.watch_loss(
            F.binary_cross_entropy_with_logits(D(real_batch()), ones)
            + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        )
        loss_d.backward()
        opt_d.step()


@case("clean/gan_zero_grad_after_step", None, None, "gan", "Adam x2",
      "GAN with zero_grad() right after each step (Lightning's order): G's backward leaves fresh "
      "gradients on D's parameters, which D's next zero_grad() discards unused")
def _c_gan_zero_after(ctx):
    G, D = make_gan()
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
    san_g = ctx.attach(G, opt_g, label="G")
    san_d = ctx.attach(D, opt_d, label="D")
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    for step in range(STEPS):
        fake = G(torch.randn(16, 4))
        loss_d = san_d.watch_loss(
            F.binary_cross_entropy_with_logits(D(real_batch()), ones)
            + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
        )
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        loss_g = san_g.watch_loss(F.binary_cross_entropy_with_logits(D(fake), ones))
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()


@case("clean/activation_checkpointing_transformer", None, None, "transformer", "AdamW",
      "the encoder layer runs under torch.utils.checkpoint (recomputed during backward)")
def _c_checkpoint(ctx):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(TinyTransformer):
        def forward(self, tokens):
            h = self.emb(tokens) + self.pos[:, : tokens.shape[1]]
            h = checkpoint(self.enc, h, use_reentrant=False)
            return self.head(h.mean(1))

    model = Checkpointed(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.cross_entropy(model(t), y))
        loss.backward()
        opt.step()


@case("clean/selective_freeze_grad_none_mlp", None, None, "mlp", "SGD+momentum",
      "the first layer is held fixed for 4 warm-up steps by setting its .grad to None before "
      "optimizer.step() (the other layers train)")
def _c_selective_none(ctx):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    san = ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        if step < 4:
            for p in model[0].parameters():
                p.grad = None
        opt.step()


@case("clean/lbfgs_closure_mlp", None, None, "mlp", "LBFGS",
      "closure-based optimizer: LBFGS runs forward and backward several times inside step()")
def _c_lbfgs(ctx):
    model = make_mlp(act=nn.Tanh)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
    san = ctx.attach(model, opt)
    for step in range(8):
        x, y = regression_batch(n=32)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        san.watch_loss(opt.step(closure))


def _masked_token_loss(logits, y, ignore_index=-100):
    """Cross-entropy summed over the labelled tokens / their count (at least 1), as masked-LM
    trainers compute it: exactly 0, with all-zero gradients, for a batch with no label."""
    per = F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="none")
    n = (y != ignore_index).sum().clamp(min=1)
    return per.sum() / n


@case("clean/all_labels_ignored_batch_clipped_transformer", None, None, "transformer",
      "AdamW + clip_grad_norm_",
      "one batch in ten has every label set to ignore_index (all padding): its gradients are all "
      "exactly zero, the trainer still clips them in place, and the step changes nothing")
def _c_all_ignored_clipped(ctx):
    model = TinyTransformer(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        if step == 3:
            y = torch.full_like(y, -100)
        opt.zero_grad()
        _masked_token_loss(model(t), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


@case("clean/fully_masked_batches_clipped_in_place_gru", None, None, "gru",
      "SGD + zero_grad(set_to_none=False) + clip_grad_value_",
      "two fully masked batches in a row (steps 4 and 5): all-zero gradients, zeroed in place "
      "before each backward and clipped in place after it, and SGD without momentum changes "
      "nothing")
def _c_fully_masked_gru(ctx):
    model = GRUClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ctx.attach(model, opt)
    for step in range(STEPS):
        t, y = token_batch()
        mask = torch.ones_like(y, dtype=torch.float32)
        if step in (4, 5):
            mask.zero_()
        opt.zero_grad(set_to_none=False)
        per = F.cross_entropy(model(t), y, reduction="none")
        ((per * mask).sum() / mask.sum().clamp(min=1)).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
        opt.step()


@case("clean/param_group_lr_zero_cnn", None, None, "cnn", "SGD, backbone group lr=0",
      "discriminative fine-tuning: the backbone's param group has lr 0 (frozen by its learning "
      "rate, gradients still computed), the head's group trains")
def _c_group_lr_zero(ctx):
    model = SmallCNN()
    head = list(model.head.parameters())
    backbone = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opt = torch.optim.SGD([{"params": backbone, "lr": 0.0}, {"params": head, "lr": 0.05}])
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = image_batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@case("clean/zero_grad_tensor_weight_decay_mlp", None, None, "mlp", "SGD(weight_decay)",
      "a gate multiplies one layer's output by 0 for the first steps: its gradient is exactly "
      "zero and only weight decay moves it (or nothing, in the group without decay)")
def _c_zero_grad_wd(ctx):
    model = make_mlp()
    gate = {"on": 0.0}

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model
            self.side = nn.Linear(8, 1)

        def forward(self, x):
            return self.net(x) + gate["on"] * self.side(x)

    m = Gated()
    opt = torch.optim.SGD(
        [{"params": m.net.parameters()},
         {"params": [m.side.weight], "weight_decay": 0.01},
         {"params": [m.side.bias], "weight_decay": 0.0}], lr=0.05)
    ctx.attach(m, opt)
    for step in range(STEPS):
        gate["on"] = 1.0 if step >= 6 else 0.0
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


@case("clean/attach_inside_lbfgs_closure_mlp", None, None, "mlp", "LBFGS",
      "the sanitizer is attached by a callback that runs inside the first optimizer.step(closure) "
      "(as a launcher or a trainer hook may): the rest of that step's closure evaluations are "
      "part of the step")
def _c_attach_in_closure(ctx):
    model = make_mlp(act=nn.Tanh)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=6, history_size=5)
    calls = {"n": 0}
    for step in range(6):
        x, y = regression_batch(n=32)

        def closure():
            calls["n"] += 1
            if calls["n"] == 2:
                ctx.attach(model, opt)  # a callback attaching mid-step
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)


@case("clean/attach_inside_sgd_closure_cnn", None, None, "cnn", "SGD(closure)",
      "attached from inside the closure of the first optimizer.step(closure), between its "
      "backward and the update (a trainer hook): that step's post-hook comes without a pre-hook")
def _c_attach_in_sgd_closure(ctx):
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = image_batch()

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if step == 0:
                ctx.attach(model, opt)
            return loss

        opt.step(closure)


@case("clean/manual_update_no_optimizer_mlp", None, None, "mlp", "manual SGD",
      "no optimizer: `p -= lr * p.grad` under no_grad, then model.zero_grad() (attach(model))")
def _c_manual(ctx):
    model = make_mlp()
    san = ctx.attach(model)
    for step in range(STEPS):
        x, y = regression_batch()
        loss = san.watch_loss(F.mse_loss(model(x), y))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
        model.zero_grad()


@case("clean/manual_update_grad_zero_cnn", None, None, "cnn", "manual SGD",
      "no optimizer: `p -= lr * p.grad` under no_grad, then p.grad.zero_() (attach(model))")
def _c_manual_zero(ctx):
    model = SmallCNN()
    san = ctx.attach(model)
    for step in range(STEPS):
        x, y = image_batch()
        loss = san.watch_loss(F.cross_entropy(model(x), y))
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad.zero_()


@case("clean/weight_clip_after_step_mlp", None, None, "mlp", "RMSprop",
      "WGAN-style weight clipping through p.data.clamp_ after optimizer.step(), where it belongs")
def _c_clip_after_step(ctx):
    model = make_mlp(dh=32)
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)


@case("clean/weight_standardise_before_forward_bn_cnn", None, None, "cnn", "Adam",
      "conv weights standardised through .data before each forward, and a batch-norm model run "
      "twice (two batches, one backward): its running statistics change between forward and "
      "backward, as they should")
def _c_standardise_before_forward(ctx):
    model = SmallCNN(bn=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        (x1, y1), (x2, y2) = image_batch(), image_batch()
        w = model.conv2.weight.data
        w.sub_(w.mean()).div_(w.std() + 1e-5)
        opt.zero_grad()
        loss = F.cross_entropy(model(x1), y1) + F.cross_entropy(model(x2), y2)
        loss.backward()
        opt.step()


class _CustomDropout(torch.autograd.Function):
    """Inverted dropout with a hand-written backward: random, yet exact under one draw."""

    @staticmethod
    def forward(ctx, x, p):
        mask = (torch.rand_like(x) >= p).to(x.dtype) / (1 - p)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask, None


class _CustomReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0).to(g.dtype)


class _CustomFnGRU(GRUClassifier):
    def forward(self, tokens):
        _, h = self.rnn(self.emb(tokens))
        h = _CustomReLU.apply(torch.relu(h[-1]))  # many inputs exactly at the kink 0
        return self.head(_CustomDropout.apply(h, 0.2))


@case("clean/custom_swish_mlp", None, None, "mlp", "Adam",
      "a custom Swish autograd.Function with a correct backward (gradcheck_every=1)")
def _c_custom_swish(ctx):
    model = _SwishMLP(_Swish)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt, gradcheck_every=1)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


@case("clean/custom_dropout_relu_linear_gru", None, None, "gru", "SGD+momentum",
      "correct custom Functions that a naive gradcheck gets wrong: a random one (custom dropout), "
      "one evaluated at its kink (a custom ReLU after a ReLU), a custom linear on a square weight "
      "(gradcheck_every=1)")
def _c_custom_functions(ctx):
    model = _CustomFnGRU()
    model.mix = nn.Parameter(torch.eye(3) + 0.1 * torch.randn(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.attach(model, opt, gradcheck_every=1)
    for step in range(STEPS):
        t, y = token_batch()
        opt.zero_grad()
        F.cross_entropy(_LinearFn.apply(model(t), model.mix), y).backward()
        opt.step()


class _RoundSTE(torch.autograd.Function):
    """Straight-through rounding (quantisation-aware training): the backward is the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _GradReverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): identity forward, backward −λg."""

    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class _SurrogateMLP(nn.Module):
    def __init__(self, din=8, dh=16):
        super().__init__()
        self.fc1, self.fc2, self.adv = nn.Linear(din, dh), nn.Linear(dh, 1), nn.Linear(dh, 1)

    def forward(self, x):
        h = _RoundSTE.apply(torch.tanh(self.fc1(x)))
        return self.fc2(h) + 0.1 * self.adv(_GradReverse.apply(h, 0.5))


@case("clean/straight_through_and_gradient_reversal_mlp", None, None, "mlp", "Adam",
      "custom Functions whose backward is deliberately not the derivative, at the defaults: a "
      "straight-through rounding and a gradient reversal layer")
def _c_surrogates(ctx):
    model = _SurrogateMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx.attach(model, opt)
    for step in range(STEPS):
        x, y = regression_batch()
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


# The op-audit cases (broadcast, label_range, batch_mismatch) live in their own module, which
# registers them with @case; it imports this (partly initialised) module for the helpers above.
import zoo_audit  # noqa: E402,F401
import zoo_mode  # noqa: E402,F401  (no_grad_leak, eval_mode, duplicate_batch: Note [Mode rules])
import zoo_lifecycle  # noqa: E402,F401  (mixed precision, checkpoints, resumes, determinism)
import zoo_accumulation  # noqa: E402,F401  (accumulation_mismatch: Note [Accumulation windows])

BUGGY = [c for c in CASES if not c.clean]
CLEAN = [c for c in CASES if c.clean]
