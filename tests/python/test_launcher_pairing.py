"""``python -m trainsan run`` pairs what an explicit attach would: the smallest module holding an
optimizer's parameters even when its own forward is never called (an agent without forward()),
one model over several roots that one optimizer trains, a training forward under no_grad
(no_grad_leak naming it, before torch's own error), and a closing summary that says what was not
checked. Scripts in tests/python/launcher/, each with its clean twin; every run a subprocess."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import trainsan

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "trainsan", "run", *args], capture_output=True,
                          text=True, timeout=180, cwd=HERE, env=ENV)


def _findings(path):
    with open(path, encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    return [r for r in recs if r.get("type") == "finding"], recs[-1]


def test_agent_without_forward_is_paired_whole_and_its_detached_value_head_found(tmp_path):
    trace = str(tmp_path / "agent.jsonl")
    r = _launch("--policy", "record", "--trace", trace, "agent_script.py", "--bug",
                "detached_value")
    assert r.returncode == 0, r.stderr
    assert "trainsan run: Agent with Adam" in r.stderr, r.stderr
    found, summary = _findings(trace)
    missing = {f["tensor"] for f in found if f["kind"] == "missing_grad"}
    # full dotted names, the critic's parameters all reported, the actor's none
    assert missing == {"critic.0.weight", "critic.0.bias", "critic.2.weight", "critic.2.bias"}
    assert summary["type"] == "summary"
    cov = summary["coverage"]
    assert cov["training_forwards"] > 0 and cov["losses_checked"] > 0, cov


def test_agent_without_forward_clean_is_silent_and_fully_covered():
    r = _launch("agent_script.py")
    assert r.returncode == 0, r.stderr
    assert "trainsan run: Agent with Adam" in r.stderr
    assert "no findings" in r.stderr, r.stderr
    assert "not checked: duplicate_batch" not in r.stderr, r.stderr  # forwards were seen
    assert "parameter(s) of optimizer" not in r.stderr, r.stderr  # both heads covered


def test_explicit_attach_to_an_agent_without_forward_sees_its_forwards():
    class Agent(nn.Module):
        def __init__(self):
            super().__init__()
            self.actor = nn.Linear(4, 2)
            self.critic = nn.Linear(4, 1)

    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.SGD(agent.parameters(), lr=0.01)
    with trainsan.attach(agent, opt, policy="record") as san:
        for _ in range(5):
            x = torch.randn(8, 4)
            loss = agent.actor(x).logsumexp(-1).mean() + agent.critic(x).detach().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        cov = san.coverage()
    assert cov["training_forwards"] == 10 and cov["losses_checked"] == 5
    assert {f.tensor for f in san.findings if f.kind == "missing_grad"} == {
        "critic.weight", "critic.bias"}


def test_one_optimizer_over_two_roots_is_one_model_and_a_bare_tensor_is_listed(tmp_path):
    r = _launch("--policy", "record", "two_roots_script.py", "--bug", "detached_code")
    assert r.returncode == 0, r.stderr
    assert "missing_grad at step 2: encoder.0.weight" in r.stderr, r.stderr
    assert "decoder.weight" not in r.stderr.split("checked:")[0]
    # the bare tensor: watched beside the roots' parameters, named by the script's variable
    # (Note [Tensors outside the model]), so no closing line says it is unchecked
    assert ("the optimizer trains 1 tensor(s) the attached _Roots does not hold (offset): "
            "watched") in r.stderr, r.stderr
    assert "in no attached model" not in r.stderr and "not checked: 1 of" not in r.stderr
    clean = _launch("--policy", "record", "two_roots_script.py")
    assert clean.returncode == 0 and "no findings" in clean.stderr, clean.stderr


def test_no_grad_training_forward_raises_no_grad_leak_naming_the_forward():
    r = _launch("nograd_script.py", "--bug", "no_grad_forward")
    assert r.returncode == 1
    assert "TrainingBugError: no_grad_leak at step 0" in r.stderr, r.stderr
    assert "nograd_script.py:30 in forward" in r.stderr, r.stderr  # where the forward was called
    assert "does not require grad" not in r.stderr  # stopped before torch's own error
    assert "built no optimizer" not in r.stderr


def test_no_grad_training_forward_under_record_is_reported_then_torch_fails():
    r = _launch("--policy", "record", "nograd_script.py", "--bug", "no_grad_forward")
    assert r.returncode == 1
    assert "does not require grad" in r.stderr  # the script's own error, as without TrainSan
    assert "trainsan run: Sequential with SGD" in r.stderr, r.stderr
    assert "[error] no_grad_leak at step 0: backward() was called on a loss without an " \
           "autograd graph" in r.stderr, r.stderr
    clean = _launch("nograd_script.py")
    assert clean.returncode == 0 and "no findings" in clean.stderr, clean.stderr


def test_explicit_attach_no_grad_forward_then_backward():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trainsan.attach(model, opt, policy="record") as san:
        with torch.no_grad():
            out = model(torch.randn(3, 4))
        with pytest.raises(RuntimeError, match="does not require grad"):
            out.sum().backward()
        # an evaluation pass in eval mode under no_grad followed by a real step: silent
        model.eval()
        with torch.no_grad():
            model(torch.randn(3, 4))
        model.train()
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    kinds = [f.kind for f in san.findings]
    assert kinds == ["no_grad_leak"], san.findings


def test_closing_lines_never_say_no_optimizer_when_one_was_built(tmp_path):
    script = tmp_path / "built_not_used.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 2)\n"
                      "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nprint('done')\n")
    r = _launch(str(script))
    assert r.returncode == 0, r.stderr
    assert "built no optimizer" not in r.stderr
    assert "the script built 1 optimizer(s) (SGD) but none stepped" in r.stderr, r.stderr


def test_a_model_whose_parameters_were_replaced_after_its_first_call_is_paired_again(tmp_path):
    # A probe forward before any optimizer (manual mode), then load_state_dict(assign=True)
    # replaces the parameters and the optimizer is built over the new ones: the launcher pairs
    # them with its own sanitizer of that model at the first step (not "left to it").
    script = tmp_path / "replaced.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))\n"
        "m(torch.randn(2, 4))\n"
        "m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    loss = m(torch.randn(16, 4)).pow(2).mean()\n"
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
        "print('done')\n")
    r = _launch("--policy", "record", str(script))
    assert r.returncode == 0, r.stderr
    assert "trainsan run: Sequential with SGD" in r.stderr, r.stderr
    assert "trainsan: 4 steps, no findings" in r.stderr, r.stderr
    assert "left to it" not in r.stderr and "Traceback" not in r.stderr, r.stderr
