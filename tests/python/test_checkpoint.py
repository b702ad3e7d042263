"""bad_checkpoint (issue 13, checkpoints): checked where made (torch.save while attached, before
the file is written) and where found (`trainsan.check_checkpoint`, `python -m trainsan check`).

Bugs, each found: NaN in the saved weights (not written under policy "raise"), a fresh
optimizer's empty state saved for a trained one, a checkpoint lacking trainable parameters, a
different model version (shapes), DDP's "module." prefix for a bare model, optimizer state bound
to parameters in another order, a file that needs code to load (reported, its code never run), a
truncated file (exit status 2). Legitimate look-alikes, silent: a full model + optimizer +
scheduler + RNG checkpoint, a weights-only export, EMA weights saved next to the model, the
trainable adapters alone, a submodule's state, a DDP-wrapped model's own state dict, Adafactor's
factored state.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import trainsan


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def trained(steps=2, opt_cls=torch.optim.Adam, params=None):
    model = make_model()
    opt = opt_cls(params(model) if params else model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def kinds(rep):
    return [f.kind for f in rep.findings]


def test_full_resume_checkpoint_is_clean(tmp_path):
    model, opt = trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    ema = copy.deepcopy(model)
    obj = {"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": opt.state_dict(),
           "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "epoch": 3,
           "step": 2}
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    rep = trainsan.check_checkpoint(path, model=make_model())
    assert rep.ok and rep.findings == [], str(rep)
    text = str(rep)
    assert "model state: under 'model'" in text and "6 of 6 parameters with state" in text
    assert "epoch=3" in text


def test_nan_weights_found_and_not_written_while_attached(tmp_path):
    model, opt = trained()
    san = trainsan.attach(model, opt, policy="raise")
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    path = tmp_path / "bad.pt"
    with pytest.raises(trainsan.TrainingBugError) as exc:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    assert not path.exists()
    f = exc.value.finding
    assert f.kind == "bad_checkpoint" and f.tensor == "model.0.weight"
    assert "holds NaN/±Inf values in 1 tensor(s): model.0.weight (1 of 128)" in f.message
    san.close()
    torch.save({"x": 1}, tmp_path / "after_close.pt")  # torch.save is the original again
    assert torch.save.__module__ == "torch.serialization"


def test_a_save_through_a_file_object_is_named_by_its_path(tmp_path):
    """ignite's Checkpoint (and others) save through an open file: the finding names its path,
    not its type (BufferedRandom); a buffer without a path keeps its type's name."""
    model, opt = trained()
    san = trainsan.attach(model, opt, policy="record")
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    path = tmp_path / "through_a_file.pt"
    with open(path, "w+b") as fh:
        torch.save({"model": model.state_dict()}, fh)
    import io
    torch.save({"model": model.state_dict()}, io.BytesIO())
    san.close()
    messages = [f.message for f in san.findings if f.kind == "bad_checkpoint"]
    assert any(f"torch.save to {path}" in m for m in messages), messages
    assert not any("BufferedRandom" in m for m in messages), messages


def test_fresh_optimizer_state_for_a_trained_one_is_found(tmp_path):
    model, opt = trained()
    san = trainsan.attach(model, opt, policy="record")
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.save({"model": model.state_dict(), "optimizer": fresh.state_dict()}, tmp_path / "c.pt")
    san.close()
    (f,) = [f for f in san.findings if f.kind == "bad_checkpoint"]
    assert "the optimizer state covers 0 parameter(s) of 6 while the optimizer holds state for 6" \
        in f.message
    assert (tmp_path / "c.pt").exists()  # policy "record": written, reported


def test_legitimate_saves_while_attached_are_silent(tmp_path):
    model, opt = trained()
    san = trainsan.attach(model, opt, policy="raise")
    ema = copy.deepcopy(model)
    torch.save(model.state_dict(), tmp_path / "weights.pt")  # an export
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                "optimizer": opt.state_dict()}, tmp_path / "full.pt")
    torch.save(model[3].state_dict(), tmp_path / "head.pt")  # a submodule
    torch.save({k: v for k, v in model.state_dict().items() if k.startswith("3.")},
               tmp_path / "adapter.pt")  # only part of the weights
    torch.save(model, tmp_path / "module.pt")  # the module itself
    san.close()
    assert [f for f in san.findings if f.kind == "bad_checkpoint"] == []


def test_frozen_entries_missing_is_an_adapter_save():
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    sd = {k: v for k, v in model.state_dict().items() if k.startswith("3.")}
    sd.update({k: v for k, v in model.state_dict().items() if k.startswith("1.")})
    rep = trainsan.check_checkpoint(sd, model=model)
    assert rep.ok, str(rep)


def test_missing_trainable_parameters_are_found():
    model = make_model()
    sd = dict(model.state_dict())
    del sd["3.weight"]
    sd["extra.bias"] = torch.zeros(2)
    rep = trainsan.check_checkpoint(sd, model=make_model())
    (f,) = rep.findings
    assert "lacks 1 trainable parameter(s) (3.weight)" in f.message
    assert "holds 1 key(s) the model does not have (extra.bias)" in f.message
    assert not rep.ok


def test_other_model_version_shapes_are_found():
    other = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
    rep = trainsan.check_checkpoint({"model": other.state_dict()}, model=make_model())
    (f,) = [f for f in rep.findings if "shapes or dtypes" in f.message]
    assert "0.weight: [32, 8] float32 in the checkpoint, [16, 8] float32 in the model" \
        in f.message


def test_ddp_prefix_for_a_bare_model_is_found():
    sd = {"module." + k: v for k, v in make_model().state_dict().items()}
    rep = trainsan.check_checkpoint(sd, model=make_model())
    (f,) = rep.findings
    assert "DistributedDataParallel's 'module.' prefix" in f.message


def test_optimizer_state_in_another_parameter_order_is_found():
    model, opt = trained(params=lambda m: list(m.parameters())[::-1])
    rep = trainsan.check_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()},
                                     model=make_model())
    (f,) = rep.findings
    assert "the optimizer state does not fit its parameters" in f.message
    assert "exp_avg of parameter 0 (0.weight): [2], the parameter [16, 8]" in f.message
    # ...and against the optimizer that made it, the same state fits.
    assert trainsan.check_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()},
                                     model=model, optimizer=opt).ok


def test_factored_optimizer_state_is_not_a_mismatch():
    model, opt = trained(opt_cls=torch.optim.Adafactor)
    rep = trainsan.check_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()},
                                    model=make_model())
    assert rep.ok, str(rep)


class _Marker:
    """Unpickling it would create a file: it must never happen."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_checkpoint_needing_code_is_reported_not_run(tmp_path):
    marker = tmp_path / "ran"
    m = _Marker()
    m.path = str(marker)
    path = tmp_path / "code.pt"
    torch.save({"model": make_model().state_dict(), "cfg": m}, path)
    assert not marker.exists()
    rep = trainsan.check_checkpoint(path)
    assert not marker.exists(), "the checkpoint's code ran"
    (f,) = rep.findings
    assert "cannot be loaded with torch.load(weights_only=True)" in f.message
    assert "not loaded" in str(rep)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "trainsan", "check", *args],
                          capture_output=True, text=True, env=dict(os.environ))


def test_cli_exit_status_and_model_factory(tmp_path):
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    model, opt = trained()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, good)
    sd = dict(model.state_dict())
    sd["0.weight"] = sd["0.weight"].clone()
    sd["0.weight"][0, 0] = float("inf")
    torch.save(sd, bad)
    factory = tmp_path / "mk.py"
    factory.write_text("import torch.nn as nn\n"
                       "def make():\n"
                       "    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),"
                       " nn.Linear(16, 2))\n")
    r = _cli(str(good), "--model", f"{factory}:make")
    assert r.returncode == 0 and "no findings" in r.stdout, r.stdout + r.stderr
    r = _cli(str(bad), "--model", f"{factory}:make")
    assert r.returncode == 1 and "NaN/±Inf" in r.stdout
    truncated = tmp_path / "trunc.pt"
    truncated.write_bytes(good.read_bytes()[:100])
    r = _cli(str(truncated))
    assert r.returncode == 2 and "cannot be read as a torch checkpoint" in r.stderr
    r = _cli(str(tmp_path / "missing.pt"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = _cli(str(good), "--model", "nocolon")
    assert r.returncode == 2 and "module:factory" in r.stderr


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        trainsan.check_checkpoint({}, model="resnet")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        trainsan.check_checkpoint({}, optimizer=3)


def test_stale_optimizer_snapshot_is_found(tmp_path):
    import copy as _copy

    model, opt = trained(steps=2)
    old = _copy.deepcopy(opt.state_dict())  # kept from step 2
    san = trainsan.attach(model, opt, policy="record")
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": old}, tmp_path / "stale.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ok.pt")
    san.close()
    (f,) = [f for f in san.findings if f.kind == "bad_checkpoint"]
    assert "the optimizer state is from its step 2 while the optimizer is at step 5" in f.message
