"""rank_desync (issue 11): replicas that must agree, compared across torch.distributed ranks.

gloo on the CPU, two and four processes (tests/_dist.py). Each spawned group runs its scenarios
one after another (spawning is the expensive part), a fresh model, optimizer and sanitizer each
(``policy="record"``), and returns every rank's findings as plain data.

Clean setups, which must give no rank_desync finding (and no error-severity finding at all): DDP
with Adam (optimizer state compared every other step), DDP with ``no_sync`` accumulation, DDP
with BatchNorm and different data per rank (running statistics differ; buffers are not compared
by default), a plain loop that all-reduces its gradients itself, FSDP2 (every parameter sharded:
nothing has replicas), a tensor-parallel DTensor model with a ``Replicate()`` bias, HSDP 2x2.

Planted desyncs, each found at the step it shows, naming the tensor and the ranks: a weight
nudged on one rank between steps; different initial weights (a plain loop, and one HSDP replica);
a replicated tensor-parallel parameter initialised differently on one rank; a learning rate that
depends on the rank; one rank's GradScaler skipping a step the other takes; one rank skipping
``optimizer.step()`` under DDP; a rank that closes early and one that stalls past
``desync_timeout`` (the others report it missing instead of hanging); buffers compared on
request (``desync_buffers``).
"""

from __future__ import annotations

import time
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

import _dist

pytestmark = _dist.requires_gloo

STEPS = 5
NUDGE_AFTER = 2  # the planted write happens after this step, so the comparison of the next shows it
SKIP_STEP = 3


class MLP(torch.nn.Module):
    def __init__(self, out: int = 4, bn: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16) if bn else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(16, out)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _batch(rank: int, step: int, out: int = 4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, out, generator=g)


def _data(san) -> dict:
    return dict(
        findings=[
            dict(kind=f.kind, severity=f.severity, step=f.step, tensor=f.tensor, message=f.message)
            for f in san.findings
        ],
        unchecked=san.coverage()["unchecked"],
    )


def _ddp_loop(rank: int, ws: int, scenario: str, trace_dir: str = "") -> dict:
    import torch.distributed as dist
    import trainsan
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = MLP(bn=scenario in ("ddp_batchnorm", "ddp_buffers"))
    ddp = DDP(model)
    lr = 0.05 * (1 + rank) if scenario == "ddp_lr" else 0.05
    opt = (
        torch.optim.Adam(ddp.parameters(), lr=1e-3)
        if scenario == "ddp_adam"
        else torch.optim.SGD(ddp.parameters(), lr=lr)
    )
    options = dict(desync_timeout=20)
    if scenario == "ddp_adam":
        options["desync_state_every"] = 2
    if scenario == "ddp_nudge":
        options["desync_state_every"] = 1  # gradients compared every step: the cause localised
    if scenario == "ddp_buffers":
        options.update(desync_buffers=True, desync_state_every=1)
    target = model if scenario == "ddp_inner" else ddp  # attached to .module: DDP found anyway
    if trace_dir:
        options["trace"] = f"{trace_dir}/{scenario}.rank{rank}.jsonl"
    san = trainsan.attach(target, opt, policy="record", **options)
    for step in range(STEPS):
        opt.zero_grad()
        if scenario == "ddp_no_sync":
            with ddp.no_sync():
                x, y = _batch(rank, 100 + step)
                F.mse_loss(ddp(x), y).backward()
        x, y = _batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
        if scenario == "ddp_skip_step" and rank == 1 and step == SKIP_STEP:
            continue  # BUG (planted): this rank skips the update the others make
        opt.step()
        if scenario in ("ddp_nudge", "ddp4_nudge") and step == NUDGE_AFTER and rank == ws // 2:
            with torch.no_grad():
                model.fc2.bias[0] += 1e-3  # BUG (planted): a write on one rank only
    san.close()
    dist.barrier()
    return _data(san)


def _plain_loop(rank: int, ws: int, scenario: str) -> dict:
    """No wrapper: the loop all-reduces its gradients itself (plain parameters: all ranks)."""
    import torch.distributed as dist
    import trainsan

    torch.manual_seed(rank if scenario == "plain_init" else 0)  # BUG (planted) in plain_init
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu") if scenario == "plain_amp_skip" else None
    timeout = 1.5 if scenario == "plain_stall" else 20
    san = trainsan.attach(model, opt, policy="record", desync_timeout=timeout)
    for step in range(STEPS):
        last = rank == 1 and step == STEPS - 1
        if scenario == "plain_close_early" and last:
            san.close()  # BUG (planted): this rank stops checking one step before the others
        opt.zero_grad()
        x, y = _batch(rank, step)
        loss = F.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ws
        if scaler is not None:
            if rank == 1 and step == SKIP_STEP:
                model.fc1.weight.grad[0, 0] = float("inf")  # BUG (planted): Inf on one rank only
            scaler.step(opt)
            scaler.update()
        elif scenario == "plain_stall" and last:
            # BUG (planted): this rank skips its last step and stalls: the others' comparison of
            # that step waits for it until desync_timeout.
            time.sleep(4 * timeout)
        else:
            opt.step()
    san.close()
    return _data(san)


def _fsdp_loop(rank: int, ws: int, scenario: str) -> dict:
    import trainsan
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP()
    if scenario.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
        kw = dict(mesh=mesh)
    else:
        kw = {}
    fully_shard(model.fc1, **kw)
    fully_shard(model.fc2, **kw)
    fully_shard(model, **kw)
    if scenario == "hsdp_init" and rank == 2:
        with torch.no_grad():
            model.fc1.weight._local_tensor.add_(1e-3)  # BUG (planted): one replica's init differs
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = trainsan.attach(model, opt, policy="record")
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
    san.close()
    return _data(san)


def _tp_loop(rank: int, ws: int, scenario: str) -> dict:
    import trainsan
    from test_stack_fsdp import _tp_model
    from torch.distributed.tensor import DTensor, Replicate

    # fc1 column-parallel (Shard(0) weight and bias), fc2 row-parallel (Shard(1) weight,
    # Replicate() bias) on a mesh dimension named "tp".
    model, mesh = _tp_model(ws, ("tp",))
    if scenario == "tp_replicated_init" and rank == 1:
        with torch.no_grad():
            model.fc2.bias._local_tensor.add_(1.0)  # BUG (planted): a replicated param differs
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = trainsan.attach(model, opt, policy="record")
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(0, step)  # tensor parallel: the same batch on every rank
        F.mse_loss(model(x), DTensor.from_local(y, mesh, [Replicate()])).backward()
        opt.step()
    san.close()
    return _data(san)


LOOPS = {"ddp": _ddp_loop, "plain": _plain_loop, "fsdp": _fsdp_loop, "hsdp": _fsdp_loop,
         "tp": _tp_loop}


def _run_all(rank: int, ws: int, scenarios: list, trace_dir: str = "") -> dict:
    warnings.simplefilter("ignore")
    out = {}
    for sc in scenarios:
        try:
            kind = sc.split("_")[0].rstrip("4")
            extra = (trace_dir,) if kind == "ddp" and trace_dir else ()
            out[sc] = LOOPS[kind](rank, ws, sc, *extra)
        except Exception:  # noqa: BLE001 - one scenario's failure is its test's datum
            out[sc] = dict(error=traceback.format_exc())
    return out


TWO = [
    "ddp_clean", "ddp_inner", "ddp_adam", "ddp_no_sync", "ddp_batchnorm", "plain_clean",
    "fsdp_clean", "tp_clean", "ddp_nudge", "ddp_lr", "ddp_buffers", "plain_init",
    "tp_replicated_init", "plain_amp_skip", "ddp_skip_step", "plain_close_early", "plain_stall",
]
FOUR = ["hsdp_clean", "hsdp_init", "ddp4_nudge"]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("desync_traces"))


@pytest.fixture(scope="module")
def two(trace_dir):
    return _dist.run(_run_all, 2, args=(TWO, trace_dir), timeout=240)


@pytest.fixture(scope="module")
def four():
    return _dist.run(_run_all, 4, args=(FOUR,), timeout=180)


def _of(results, sc, rank) -> list:
    got = results[rank][sc]
    assert "error" not in got, got["error"]
    return [f for f in got["findings"] if f["kind"] == "rank_desync"]


def _errors(results, sc, rank) -> list:
    got = results[rank][sc]
    assert "error" not in got, got["error"]
    return [f for f in got["findings"] if f["severity"] == "error"]


@pytest.mark.parametrize(
    "sc",
    ["ddp_clean", "ddp_inner", "ddp_adam", "ddp_no_sync", "ddp_batchnorm", "plain_clean",
     "fsdp_clean", "tp_clean"],
)
def test_clean_two_ranks_silent(two, sc):
    for rank in range(2):
        assert _errors(two, sc, rank) == [], (rank, _errors(two, sc, rank))


def test_fsdp_fully_sharded_says_nothing_to_compare(two):
    assert "rank_desync" in two[0]["fsdp_clean"]["unchecked"]
    assert "rank_desync" not in two[0]["ddp_clean"]["unchecked"]


@pytest.mark.parametrize("sc", ["hsdp_clean"])
def test_clean_four_ranks_silent(four, sc):
    for rank in range(4):
        assert _errors(four, sc, rank) == [], (rank, _errors(four, sc, rank))


def test_nudged_weight_found_next_step(two):
    for rank in range(2):
        fs = _of(two, "ddp_nudge", rank)
        assert len(fs) == 1, fs
        f = fs[0]
        assert f["step"] == NUDGE_AFTER + 1 and f["tensor"] == "module.fc2.bias"
        assert "rank 1 differs from rank 0" in f["message"]
        assert "The gradients agree" in f["message"]


def test_nudged_weight_four_ranks_names_the_rank(four):
    for rank in range(4):
        fs = _of(four, "ddp4_nudge", rank)
        assert [f["step"] for f in fs] == [NUDGE_AFTER + 1], fs
        assert "rank 2 differs from ranks 0, 1, 3" in fs[0]["message"]


def test_rank_dependent_lr_found_at_step_0(two):
    for rank in range(2):
        fs = _of(two, "ddp_lr", rank)
        assert fs and fs[0]["step"] == 0, fs
        assert "4 parameters" in fs[0]["message"] and "learning rate" in fs[0]["message"]


def test_different_initial_weights_found_before_the_first_step(two):
    for rank in range(2):
        fs = _of(two, "plain_init", rank)
        assert fs and fs[0]["step"] == 0, fs
        assert "start from different weights" in fs[0]["message"]
        assert "broadcast" in fs[0]["message"]


def test_replicated_tp_param_init_found(two):
    for rank in range(2):
        fs = _of(two, "tp_replicated_init", rank)
        assert fs and fs[0]["step"] == 0 and fs[0]["tensor"] == "fc2.bias", fs
        assert "start from different weights" in fs[0]["message"]
        assert "'tp'" in fs[0]["message"]
        # fc1 is sharded on the only mesh dimension: never compared, never named.
        assert not any("fc1" in f["message"] for f in fs)


def test_hsdp_replica_init_found_on_its_replica_group_only(four):
    # Mesh (replicate=2, shard=2): ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1.
    for rank in (0, 2):
        fs = _of(four, "hsdp_init", rank)
        assert fs and fs[0]["step"] == 0 and fs[0]["tensor"] == "fc1.weight", fs
        assert "start from different weights" in fs[0]["message"]
        assert "rank 2 differs from rank 0" in fs[0]["message"]
    for rank in (1, 3):
        assert _of(four, "hsdp_init", rank) == []


def test_amp_skip_on_one_rank_found(two):
    for rank in range(2):
        fs = _of(two, "plain_amp_skip", rank)
        assert fs and fs[0]["step"] == SKIP_STEP, fs
        assert "rank 1" in fs[0]["message"] and "skipped step" in fs[0]["message"]
        assert "rank 0 stepped" in fs[0]["message"]


def test_skipped_optimizer_step_found(two):
    for rank in range(2):
        fs = _of(two, "ddp_skip_step", rank)
        assert fs and fs[0]["step"] == SKIP_STEP, fs
        assert "training forwards" in fs[0]["message"]
        assert "out of step" in fs[0]["message"] and "rank 0: 4, rank 1: 5" in fs[0]["message"]
        # Said once: the ranks' later comparisons would pair different steps, so there are none
        # (rank 0's extra last step does not wait for rank 1 either).
        assert len(fs) == 1, fs


def test_rank_that_closes_early_reported_missing(two):
    fs = _of(two, "plain_close_early", 0)
    assert len(fs) == 1 and "did not arrive" in fs[0]["message"], fs
    assert "rank 1 closed its sanitizer" in fs[0]["message"]
    assert _of(two, "plain_close_early", 1) == []


def test_stalled_rank_reported_after_timeout(two):
    fs = _of(two, "plain_stall", 0)
    assert len(fs) == 1 and "did not arrive" in fs[0]["message"], fs
    assert "rank 1 of" in fs[0]["message"] and "within 1.5 s" in fs[0]["message"]


def test_buffers_compared_on_request(two):
    for rank in range(2):
        fs = _of(two, "ddp_buffers", rank)
        assert fs and all("buffer" in f["message"] for f in fs), fs
        assert {f["tensor"] for f in fs} <= {"module.bn.running_mean", "module.bn.running_var"}


def test_report_reads_the_rank_traces_together(two, trace_dir):
    from trainsan.report import rank_traces, report_many

    text = report_many(rank_traces(f"{trace_dir}/ddp_nudge.jsonl"))
    assert f"first rank_desync: step {NUDGE_AFTER + 1}" in text, text
    assert f"fingerprints first differ at step {NUDGE_AFTER + 1}: module.fc2.bias" in text, text
    assert "(rank1 differ" in text
    clean = report_many(rank_traces(f"{trace_dir}/ddp_clean.jsonl"))
    assert "rank_desync" not in clean and "fingerprints first differ" not in clean, clean
