"""fastai (issue 37): a Learner's default optimizer is fastai's own Optimizer, not a
torch.optim.Optimizer (Note [Optimizer-like objects]); it is paired and checked as a torch one,
through `python -m trainsan run` and through attach() in a Callback, as fastai's docs write their
loops (Learner(dls, model, loss_func=...), learn.fit, callbacks with before_fit/before_batch).
Clean runs (the default optimizer, GradientAccumulation) are silent; a callback that leaves the
model in eval mode is found.

Needs fastai (scripts/install_deps.sh installs the tested version, best effort); skipped without
it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import trainsan

SKIP_REASON = ("fastai is not installed or does not import: the test-only dependency of "
               "scripts/install_deps.sh (pip install fastai==2.8.12)")

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastai.callback.core import Callback
        from fastai.callback.progress import ProgressCallback
        from fastai.callback.training import GradientAccumulation
        from fastai.data.core import DataLoaders
        from fastai.learner import Learner
    HAVE_FASTAI = True
except Exception:  # noqa: BLE001 - any import failure is a skip
    HAVE_FASTAI = False
    Callback = object

pytestmark = pytest.mark.skipif(not HAVE_FASTAI, reason=SKIP_REASON)

BATCHES = 24  # training batches per epoch (batch size 8)

PROGRAM = textwrap.dedent('''
    import sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from fastai.callback.core import Callback
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner

    torch.manual_seed(0)
    X = torch.randn(192, 10)
    y = (X[:, 0] > 0).long()
    dls = DataLoaders(DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True),
                      DataLoader(TensorDataset(X[:32], y[:32]), batch_size=16))
    model = nn.Sequential(nn.Linear(10, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 2))


    class EvalEveryBatch(Callback):
        def before_batch(self):
            if self.training:
                self.model.eval()  # BUG: the model trains in eval mode


    cbs = [EvalEveryBatch()] if "eval" in sys.argv else []
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), cbs=cbs)
    learn.remove_cb(ProgressCallback)
    learn.fit(1, 1e-3)
    print("done", type(learn.opt).__name__)
''')


def _data():
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    X = torch.randn(192, 10)
    y = (X[:, 0] > 0).long()
    return DataLoaders(DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True),
                       DataLoader(TensorDataset(X[:32], y[:32]), batch_size=16))


class Sanitize(Callback):
    """attach() in a fastai Callback: the optimizer exists from before_fit (create_opt)."""

    order = -100

    def before_fit(self):
        self.learn.san = trainsan.attach(self.model, self.opt, policy="record")

    def after_fit(self):
        self.learn.san.close()


def _fit(*cbs):
    model = nn.Sequential(nn.Linear(10, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 2))
    learn = Learner(_data(), model, loss_func=nn.CrossEntropyLoss(), cbs=[Sanitize(), *cbs])
    learn.remove_cb(ProgressCallback)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn.fit(1, 1e-3)
    return learn


def test_attach_in_a_callback_checks_fastais_optimizer():
    learn = _fit()
    san = learn.san
    assert type(learn.opt).__name__ == "Optimizer"  # fastai's, not torch's
    assert san.findings == [], san.summary()
    cov = san.coverage()
    assert cov["steps_checked"] == BATCHES and cov["update_steps"] > 0, cov
    assert "step" not in vars(learn.opt)  # put back at close


def test_gradient_accumulation_is_silent():
    learn = _fit(GradientAccumulation(32))  # 4 batches of 8 per step
    san = learn.san
    assert san.findings == [], san.summary()
    assert san.coverage()["steps_checked"] == BATCHES // 4, san.summary()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    path = tmp_path_factory.mktemp("fastai") / "train.py"
    path.write_text(PROGRAM)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return {case: subprocess.run(
        [sys.executable, "-m", "trainsan", "run", "--policy", "record", str(path), case],
        capture_output=True, text=True, timeout=300, env=env) for case in ("clean", "eval")}


def test_launcher_pairs_the_learners_optimizer(launched):
    r = launched["clean"]
    assert r.returncode == 0 and "done Optimizer" in r.stdout, r.stderr
    assert "Sequential with Optimizer" in r.stderr, r.stderr  # not "no optimizer (manual mode)"
    assert f"{BATCHES} steps, no findings" in r.stderr, r.stderr


def test_launcher_finds_the_callback_that_leaves_eval_mode(launched):
    # The model is never called in train mode: without the optimizer nothing was attached.
    r = launched["eval"]
    assert r.returncode == 0 and "done Optimizer" in r.stdout, r.stderr
    assert "eval_mode" in r.stderr and "nothing was checked" not in r.stderr, r.stderr
