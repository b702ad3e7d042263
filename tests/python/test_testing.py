"""trainsan.testing.assert_resume_equivalent on a correct resume (bitwise equal) and on broken
ones: the optimizer's state, the RNG (dropout) and the data position not restored, and a
load_state_dict that does not restore the model — each named by step and tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from trainsan.testing import assert_resume_equivalent

DATA = [torch.randn(8, 6, generator=torch.Generator().manual_seed(i)) for i in range(10)]


class Run:
    def __init__(self, save=("model", "optimizer", "rng", "data"), restore_model=True):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2), nn.Linear(12, 1))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.save = save
        self.restore_model = restore_model
        self.offset = 0  # the data position: where the loader continues

    def step(self, i):
        x = DATA[(self.offset + i) % len(DATA)] if "data" in self.save else DATA[i % 3]
        self.opt.zero_grad()
        self.model(x).pow(2).mean().backward()
        self.opt.step()

    def state_dict(self):
        out = {}
        if "model" in self.save:
            out["model"] = self.model.state_dict()
        if "optimizer" in self.save:
            out["optimizer"] = self.opt.state_dict()
        if "rng" in self.save:
            out["rng"] = torch.get_rng_state()
        return out

    def load_state_dict(self, sd):
        if "model" in sd and self.restore_model:
            self.model.load_state_dict(sd["model"])
        if "optimizer" in sd:
            self.opt.load_state_dict(sd["optimizer"])
        if "rng" in sd:
            torch.set_rng_state(sd["rng"])


def test_correct_resume_is_bitwise_equal():
    out = assert_resume_equivalent(Run, steps=6, at=3)
    assert "bitwise equal" in out and "resume at step 3 of 6" in out


@pytest.mark.parametrize("missing", ["optimizer", "rng"])
def test_state_not_saved_is_named_at_the_first_step_after(missing):
    save = tuple(s for s in ("model", "optimizer", "rng", "data") if s != missing)
    with pytest.raises(AssertionError, match="first differs from the straight one at step 3"):
        assert_resume_equivalent(lambda: Run(save=save), steps=6, at=3)


def test_model_not_restored_is_named():
    with pytest.raises(AssertionError, match="before any step: 0.weight"):
        assert_resume_equivalent(lambda: Run(restore_model=False), steps=5, at=2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="0 < at < steps"):
        assert_resume_equivalent(Run, steps=3, at=3)
    with pytest.raises(TypeError, match="has no step"):
        assert_resume_equivalent(lambda: type("R", (), {"model": nn.Linear(1, 1)})(), 3, 1)
