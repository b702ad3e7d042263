"""The mode and input rules as seen from Python (Note [Mode rules], Note [Stuck data]): the
legitimate look-alikes are silent (not only free of errors), the severities and the policy's
answers, and the DataLoader bookkeeping that is in place only while a sanitizer is open."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

sys.path.insert(0, os.path.dirname(__file__))

import trainsan  # noqa: E402
import zoo  # noqa: E402
import zoo_mode  # noqa: E402

MODE_KINDS = {"no_grad_leak", "eval_mode", "duplicate_batch"}


@pytest.mark.parametrize(
    "case", [c for c in zoo.CASES if c.fn.__name__ in zoo_mode.SILENT], ids=lambda c: c.name
)
def test_legitimate_patterns_are_silent(case):
    r = zoo.run_case(case)
    assert r.exception is None, r.report()
    noisy = [f for f in r.findings if f.kind in MODE_KINDS]
    assert not noisy, r.report()


def test_silent_list_is_complete():
    assert len(zoo_mode.SILENT) >= 9


def _model(dropout=0.0):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(16, 2))


def test_no_grad_prediction_in_train_mode_warns_only_with_dropout():
    for dropout, expect in ((0.0, set()), (0.3, {"warning"})):
        model = _model(dropout)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with trainsan.attach(model, opt, policy="record") as san:
            for i in range(3):
                x = torch.randn(16, 8)
                opt.zero_grad()
                F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
                opt.step()
                with torch.no_grad():
                    model(x)  # a metric on the training batch, train mode
        got = {f.severity for f in san.findings if f.kind == "no_grad_leak"}
        assert got == expect, san.summary()
        if dropout:
            (f,) = [f for f in san.findings if f.kind == "no_grad_leak"]
            assert f.tensor == "2" and "dropout is active" in f.message


def test_training_forward_under_no_grad_raises_at_the_step():
    backbone, head = _model(0.3), nn.Linear(2, 2)
    opt_b = torch.optim.SGD(backbone.parameters(), lr=0.1)
    opt_h = torch.optim.SGD(head.parameters(), lr=0.1)
    san = trainsan.attach(backbone, opt_b, policy="raise")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with torch.no_grad():
                f = backbone(torch.randn(16, 8))  # the warning: dropout under no_grad
            assert any(issubclass(x.category, trainsan.TrainingBugWarning) for x in w)
        loss = F.cross_entropy(head(f), torch.zeros(16, dtype=torch.long))
        loss.backward()
        opt_h.step()
        with pytest.raises(trainsan.TrainingBugError) as e:
            opt_b.step()
        assert e.value.finding.kind == "no_grad_leak"
        assert e.value.finding.severity == "error"
    finally:
        san.close()


def test_dataloader_bookkeeping_only_while_open():
    import gc

    from trainsan import _patches as sanmod

    gc.collect()  # sanitizers an earlier failing test left unclosed
    users0 = sanmod._loader_patch.users
    orig_iter, orig_next = DataLoader.__iter__, _BaseDataLoaderIter.__next__
    loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.zeros(32, dtype=torch.long)),
                        batch_size=8)
    m1, m2 = _model(), _model()
    s1 = trainsan.attach(m1, torch.optim.SGD(m1.parameters(), lr=0.1), policy="record")
    s2 = trainsan.attach(m2, torch.optim.SGD(m2.parameters(), lr=0.1), policy="record")
    assert DataLoader.__iter__ is not orig_iter or users0 > 0
    # held by each sanitizer (its attach-time patch, and its load journal's loader numbering)
    assert sanmod._loader_patch.held("attach") and sanmod._loader_patch.users >= users0 + 2
    assert sum(1 for _ in loader) == 4  # iteration is unchanged
    batches = [b for b in loader]
    assert torch.equal(batches[0][0], next(iter(loader))[0])
    s1.close()
    assert DataLoader.__iter__ is not orig_iter or users0 > 0  # s2 still open
    s2.close()
    assert sanmod._loader_patch.users == users0
    if users0 == 0:
        assert DataLoader.__iter__ is orig_iter
        assert _BaseDataLoaderIter.__next__ is orig_next


def test_first_batch_restart_is_flagged_and_shuffled_restart_is_not():
    for shuffle, expect in ((False, True), (True, False)):
        torch.manual_seed(0)
        loader = DataLoader(TensorDataset(torch.randn(32, 8), torch.zeros(32, dtype=torch.long)),
                            batch_size=8, shuffle=shuffle)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with trainsan.attach(model, opt, policy="record") as san:
            for _ in range(4):
                x, y = next(iter(loader))
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
        got = [f for f in san.findings if f.kind == "duplicate_batch"]
        assert bool(got) == expect, san.summary()
        if got:
            assert got[0].step == 1 and "next(iter(loader))" in got[0].message


def test_eval_mode_judged_by_what_trains():
    # Frozen BatchNorm in eval mode: silent; the same BatchNorm trainable: a warning naming it.
    for frozen in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        model[1].eval()
        if frozen:
            model[1].requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        with trainsan.attach(model, opt, policy="record") as san:
            for _ in range(2):
                opt.zero_grad()
                F.cross_entropy(model(torch.randn(16, 8)),
                                torch.zeros(16, dtype=torch.long)).backward()
                opt.step()
        em = [f for f in san.findings if f.kind == "eval_mode"]
        if frozen:
            assert not em, san.summary()
        else:
            assert [f.tensor for f in em] == ["1"] and em[0].severity == "warning"
