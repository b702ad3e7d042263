"""The loss family on loops written as real runs show their faults (Note [Loss stream],
host/checks/loss.cpp): a data shard 1000x off once an epoch (loss_spike, with its period),
heavy-tailed minibatch noise (silent over 10 seeds), losses of steps the GradScaler skipped
(silent), a fall to 1e-2 x ln C within 50 steps (unshifted next-token targets, a label column
among the features) against honest fast learners and fixed-batch fits (silent), and class-index
losses whose targets
are all ignore_index (empty_loss, with the fraction; a fully masked batch's NaN loss with zero
gradients is that warning, not nonfinite_loss)."""

import math

import pytest
import torch
import torch.nn.functional as F

import trainsan


def _of(san, kind):
    return [f for f in san.findings if f.kind == kind]


def _kinds(san):
    return sorted({f.kind for f in san.findings})


# --- loss_spike -------------------------------------------------------------------------------


def _poly(x):
    return torch.stack([x ** (k + 1) for k in range(4)], 1)


def test_bad_shard_once_an_epoch_is_found_with_its_period():
    # A Dataset of 8 batches a epoch; the shard behind batch 5 holds targets in the wrong unit
    # (1000x). The first jump falls in the warm-up (step 5), then once an epoch.
    torch.manual_seed(0)
    xs = [torch.randn(16, 4) for _ in range(8)]
    w = torch.randn(4, 1)
    ys = [x @ w for x in xs]
    ys[5] = ys[5] * 1000.0
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    for epoch in range(4):
        for x, y in zip(xs, ys):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    san.close()
    spikes = _of(san, "loss_spike")
    assert spikes, _kinds(san)
    assert spikes[0].step == 5
    (periodic,) = [f for f in spikes if f.tensor == "loss, every 8 steps"]
    assert periodic.step == 21 and periodic.count == 2  # 5, 13, 21; then 29
    assert "it recurs every 8 steps (steps 5, 13, 21)" in periodic.message
    assert "index 5 of the period" in periodic.message
    assert sum(f.count for f in spikes) == 4  # every occurrence, none hidden by the one before


def test_healthy_warmup_bounces_are_silent():
    # A linear learning-rate warm-up on small batches: the loss bounces up in the first steps.
    torch.manual_seed(0)
    X, y = torch.randn(512, 20), torch.randint(0, 5, (512,))
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    san = trainsan.attach(model, opt, policy="record")
    for step in range(200):
        idx = torch.randint(0, 512, (8,))
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
        sched.step()
    san.close()
    assert not _of(san, "loss_spike"), [f.message for f in san.findings]


@pytest.mark.parametrize("seed", range(10))
def test_heavy_tailed_polynomial_regression_is_silent(seed):
    # examples/cpp/regression in Python: features x..x^4 of x ~ N(0, 1), batches of 32, SGD 0.1,
    # smooth_l1 until 1e-3: batch losses spread over three decades.
    torch.manual_seed(seed)
    w_target, b_target = torch.randn(4, 1) * 5, torch.randn(1) * 5
    fc = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(fc.parameters(), lr=0.1)
    san = trainsan.attach(fc, opt, policy="record")
    for _ in range(2000):
        x = _poly(torch.randn(32))
        y = x @ w_target + b_target
        opt.zero_grad()
        loss = F.smooth_l1_loss(fc(x), y)
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    san.close()
    assert not _of(san, "loss_spike"), [f.message for f in san.findings]


def _fp16_regression(plant, policy="record", steps=30):
    # The usual GradScaler loop (CPU autocast stands in for CUDA fp16): a batch whose loss
    # `plant` scales. A 1e30 loss overflows the scaled gradients and the scaler skips the step.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    san = trainsan.attach(model, opt, policy=policy)
    skipped = []
    for it in range(steps):
        x = torch.randn(32, 8)
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(plant(it, loss)).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(it)
    san.close()
    return san, skipped


def test_a_loss_whose_step_the_scaler_skipped_is_not_a_spike():
    # Iterations 12 and 20: the loss x 1e30, the scaler skips both steps (no update was made from
    # them; amp_scale_collapse judges a scaler that keeps skipping).
    san, skipped = _fp16_regression(lambda it, loss: loss * 1e30 if it in (12, 20) else loss)
    assert {12, 20} <= set(skipped), skipped
    assert not _of(san, "loss_spike"), [f.message for f in san.findings]


def test_a_spike_that_the_scaler_let_through_is_found_at_its_step():
    # x 100 at iteration 15: the scaled gradients stay finite, the step runs on that loss: found
    # when its step ends (a warning). A skipped 1e30 at iteration 8 before it neither reports nor
    # hides it (out of the window).
    def plant(it, loss):
        return loss * (1e30 if it == 8 else 100.0 if it == 15 else 1.0)

    san, skipped = _fp16_regression(plant)
    assert 8 in skipped and 15 not in skipped, skipped
    (f,) = _of(san, "loss_spike")
    assert f.step == 15 - len([s for s in skipped if s < 15]), (f.step, skipped)
    assert f.value > 30 and f.severity == "warning"


# --- trivial_loss: collapse -------------------------------------------------------------------

TEXT = "the quick brown fox jumps over the lazy dog and then some more words to learn " * 50


class CharLM(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 32)
        self.rnn = torch.nn.GRU(32, 64, batch_first=True)
        self.head = torch.nn.Linear(64, vocab)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


def _char_lm(shift, steps=250, lr=3e-3):
    torch.manual_seed(0)
    vocab = sorted(set(TEXT))
    ids = torch.tensor([vocab.index(c) for c in TEXT])
    model = CharLM(len(vocab))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(steps):
        st = torch.randint(0, len(ids) - 33, (16,)).tolist()
        x = torch.stack([ids[s:s + 32] for s in st])
        y = torch.stack([ids[s + 1:s + 33] for s in st]) if shift else x  # the bug: no shift
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        opt.step()
    san.close()
    return san


def test_unshifted_next_token_targets_collapse():
    # lr 1e-2: the mean of the last 10 losses reaches 1e-2 x ln 27 at step ~28 (seeds 0-3: 27-28)
    san = _char_lm(shift=False, lr=1e-2)
    (f,) = _of(san, "trivial_loss")
    assert 20 <= f.step < 50, f.step
    assert "the loss of an untrained model, ln 27 classes" in f.message, f.message
    assert "next-token targets not shifted" in f.message


@pytest.mark.parametrize("lr", [3e-3, 1e-2])
def test_shifted_char_lm_on_repetitive_text_is_silent(lr):
    san = _char_lm(shift=True, lr=lr)
    assert not _of(san, "trivial_loss"), [f.message for f in san.findings]


def test_unshifted_targets_learned_slowly_are_not_told_from_an_honest_task():
    # lr 3e-3: the same bug reaches 1e-2 x ln 27 only at step ~80, as slowly as honest easy tasks
    # (two blobs 7 sigma apart: 83+): the rate rule keeps quiet (Note [Loss stream]).
    san = _char_lm(shift=False, steps=120)
    assert not _of(san, "trivial_loss"), [f.message for f in san.findings]


def test_label_column_left_among_the_features_collapses():
    # A churn-style binary target left among 20 weak features, Adam 1e-2 as tabular code uses:
    # the model reads it off; the mean of the last 10 at 1e-2 x ln 2 by step ~70 (4 seeds: 69-78).
    # Faster with a larger learning rate: at 3e-2 within the 50 steps.
    torch.manual_seed(0)
    y = torch.randint(0, 2, (5000,))
    X = torch.randn(5000, 20) + 0.3 * y[:, None].float()
    X = torch.cat([X[:, :5], y[:, None].float(), X[:, 5:]], 1)
    model = torch.nn.Sequential(torch.nn.Linear(21, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(60):
        idx = torch.randint(0, 5000, (64,))
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    san.close()
    (f,) = _of(san, "trivial_loss")
    assert f.step < 50 and "x the first loss" in f.message, f.message  # 0.68 < ln 2


def test_overfitting_one_batch_and_lbfgs_are_silent():
    # The same batch every step (by its fingerprint): memorizing it is honest. Overfitting one
    # batch as a sanity check (Adam 3e-2, 128 points, 3 classes), and LBFGS on separable blobs
    # (1e-7 in 10 steps).
    torch.manual_seed(0)
    X = torch.randn(128, 10)
    y = torch.randint(0, 3, (128,))
    model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(60):
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()
    san.close()
    assert not _of(san, "trivial_loss"), [f.message for f in san.findings]
    yb = torch.randint(0, 2, (512,))
    Xb = torch.randn(512, 2) + 8 * yb[:, None].float()
    lin = torch.nn.Linear(2, 2)
    lbfgs = torch.optim.LBFGS(lin.parameters(), max_iter=20, line_search_fn="strong_wolfe")
    san = trainsan.attach(lin, lbfgs, policy="record")
    losses = []

    def closure():
        lbfgs.zero_grad()
        loss = F.cross_entropy(lin(Xb), yb)
        loss.backward()
        return loss

    for _ in range(30):
        losses.append(float(lbfgs.step(closure).detach()))
    san.close()
    assert min(losses) < 1e-3, losses
    assert not _of(san, "trivial_loss"), [f.message for f in san.findings]


@pytest.mark.parametrize("seed", range(3))
def test_easy_task_learned_fast_is_silent(seed):
    # Two Gaussian blobs 5.7 sigma apart, Adam 1e-2: the loss falls to ~1e-2 in 100 steps, as it
    # honestly can (Bayes error 0.2%): the mean of the last 10 reaches 1e-2 x ln 2 at step 111+.
    torch.manual_seed(seed)
    y = torch.randint(0, 2, (2000,))
    X = torch.randn(2000, 2) + 4 * y[:, None].float()
    model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(400):
        idx = torch.randint(0, 2000, (32,))
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
    san.close()
    assert not _of(san, "trivial_loss"), [f.message for f in san.findings]


def test_full_batch_regression_fit_is_silent():
    torch.manual_seed(0)
    X = torch.randn(256, 10)
    y = X @ torch.randn(10, 1)
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(300):  # to 1e-13: exact, and honest
        opt.zero_grad()
        F.mse_loss(model(X), y).backward()
        opt.step()
    san.close()
    assert not _of(san, "trivial_loss") and not _of(san, "loss_spike"), _kinds(san)


# --- empty_loss -------------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def _completion_only(mask_tokens, steps=12):
    # Completion-only fine-tuning: labels are -100 but for the response tokens; the loss is the
    # summed token loss over the count of response tokens (at least 1) plus a small L2 term.
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(steps):
        ids = torch.randint(0, 50, (4, 24))
        labels = torch.full_like(ids, -100)
        labels[:, 24 - mask_tokens:] = ids[:, 24 - mask_tokens:]
        opt.zero_grad()
        logits = model(ids)
        n = (labels != -100).sum().clamp(min=1)
        ce = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100,
                             reduction="sum")
        loss = ce / n + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        opt.step()
    san.close()
    return san


def test_completion_only_mask_covering_no_token_is_found_with_the_fraction():
    san = _completion_only(mask_tokens=0)
    (f,) = _of(san, "empty_loss")
    assert f.severity == "warning"
    assert f.step == 1  # the second audited step with an all-ignored target
    assert "was ignore_index on 2 of the 2 audited steps (100%)" in f.message, f.message
    assert "completion-only mask that covers no token" in f.message
    assert f.count == 9  # steps 1..9 (audit_first_steps=10); steps 10, 11 are not audited
    assert not _of(san, "nonfinite_loss")


def test_sparse_completion_mask_that_covers_tokens_is_silent():
    san = _completion_only(mask_tokens=1)
    assert not _of(san, "empty_loss"), [f.message for f in san.findings]


def test_fully_masked_batch_nan_loss_with_zero_gradients_is_a_warning():
    # The HF Trainer's causal-LM loss: mean cross-entropy with ignore_index=-100. The batch of step
    # 3 is all padding: 0/0 = NaN, its backward gives zero gradients, training goes on.
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    san = trainsan.attach(model, opt, policy="raise")
    for step in range(6):
        ids = torch.randint(0, 50, (4, 24))
        labels = ids.clone()
        if step == 3:
            labels[:] = -100
        opt.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        if step == 3:
            assert math.isnan(loss.item())
        loss.backward()  # policy raise: a warning does not raise
        if step == 3:
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
    san.close()
    (f,) = _of(san, "empty_loss")
    assert f.step == 3 and f.severity == "warning"
    assert "the loss of this step is NaN: the mean over no target is 0/0" in f.message
    assert "1 of the 4 audited steps" in f.message, f.message
    assert not _of(san, "nonfinite_loss")


def test_hand_written_empty_mask_mean_stays_nonfinite_loss():
    # (ce * mask).sum() / mask.sum(): the empty batch is 0/0 with NaN gradients (the zoo's
    # nonfinite_loss/empty_mask_gru): an error, raised at the backward.
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    san = trainsan.attach(model, opt, policy="raise")
    ids = torch.randint(0, 50, (4, 24))
    mask = torch.zeros(4 * 24)
    ce = F.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1), reduction="none")
    with pytest.raises(trainsan.TrainingBugError) as e:
        ((ce * mask).sum() / mask.sum()).backward()
    assert e.value.finding.kind == "nonfinite_loss"
    san.close()
