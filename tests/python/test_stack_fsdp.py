"""TrainSan on sharded parameters: FSDP2 (``fully_shard``) and DTensor tensor parallelism
(``distribute_module``), two CPU processes in one gloo group (tests/_dist.py).

Every rank attaches its own sanitizer (``policy="record"``) after the model is sharded, as the
README asks of any wrapper, and the tests read what each rank found. SCENARIOS:

FSDP2 — ``fully_shard`` on fc1, fc2 and the root of a small MLP whose fc2 has one output, so
rank 1's shard of fc2.weight and fc2.bias is empty (uneven dim-0 sharding, which FSDP2 allows):

* ``fsdp_clean``: a clean loop -> no finding, every step checked, the gradient of every
  parameter read; ``fsdp_clean_zero_in_place`` the same with ``zero_grad(set_to_none=False)``
  (FSDP2 then adds each new gradient shard into the zeroed one: no error either);
* ``fsdp_nan_input``: a NaN in one input at NAN_STEP on NAN_RANK only -> ``nonfinite_loss``
  there (the loss is per rank), ``nonfinite_grad`` on both ranks (the reduce-scatter averages the
  NaN into every rank's gradient shard), nothing at error severity before that step;
* ``fsdp_no_zero_grad``: ``optimizer.zero_grad()`` never called -> ``stale_grad`` at step 1 for
  every parameter (README: the .grad a step consumed is accumulated onto by the next backward;
  FSDP2 adds the new reduce-scattered shard into the existing sharded gradient);
* ``fsdp_optimizer_before_shard``: the optimizer is built on ``model.parameters()`` BEFORE
  ``fully_shard``, so it holds the original tensors, which the sharded model no longer uses, and
  training silently does nothing -> under policy "raise" a clear error, either from ``attach`` or
  as an error finding at the first step, whose message names ``fully_shard``;
* ``fsdp_attach_before_shard``: the sanitizer is attached before ``fully_shard`` too -> under
  policy "raise" an error at the first step saying to attach after ``fully_shard``. (Under "warn"
  and "record" neither raises: test_attach_order.py, Note [Attach order].)

DTensor tensor parallelism — ``distribute_module`` with a Megatron-style plan on a 1-D mesh of
both ranks (fc1 column-parallel: weight and bias Shard(0); fc2 row-parallel: weight Shard(1),
bias replicated), the input replicated and the output (hence the loss) a replicated DTensor:

* ``dtensor_clean``: a clean loop -> no error-severity finding, every gradient read;
* ``dtensor_nan_input``: a NaN in the (replicated) input at NAN_STEP -> ``nonfinite_loss`` and
  ``nonfinite_grad`` on every rank at that step, nothing before.

Spawning is the expensive part (each process imports torch), so the scenarios run in one spawned
group, one after another, each with a fresh model, optimizer and sanitizer; each rank writes each
scenario's result to a file as soon as it is done. A scenario that kills its processes (a crash
in native code) or raises loses only itself: the scenarios after it are run again in a new group
(``_collect``), and its tests fail with the ranks' story.
"""

from __future__ import annotations

import faulthandler
import json
import os
import tempfile
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

import _dist

pytestmark = _dist.requires_gloo

WORLD_SIZE = 2
STEPS = 5  # optimizer steps per scenario
NAN_STEP = 3  # the step whose input holds the NaN ...
NAN_RANK = 1  # ... on this rank only (FSDP; under tensor parallelism the input is replicated)
BATCH = 4
NONFINITE = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param")
MAX_GROUPS = 3  # spawned groups at most (each costs seconds: every process imports torch)

# In this order: a scenario that crashes costs a new group for the ones after it (MAX_GROUPS), so
# the two families alternate early and a crash in one does not hide the other.
SCENARIOS = (
    "fsdp_clean",
    "dtensor_clean",
    "dtensor_nan_input",
    "fsdp_clean_zero_in_place",
    "fsdp_nan_input",
    "fsdp_no_zero_grad",
    "fsdp_optimizer_before_shard",
    "fsdp_attach_before_shard",
)


class MLP(torch.nn.Module):
    """fc1 -> ReLU -> fc2 (8 -> 16 -> ``out``)."""

    def __init__(self, out: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _findings(san) -> list:
    """A sanitizer's findings as plain data (the parent process needs no trainsan to read them)."""
    return [
        dict(kind=f.kind, severity=f.severity, step=f.step, tensor=f.tensor, message=f.message)
        for f in san.findings
    ]


def _summary(san) -> dict:
    cov = san.coverage()
    return dict(
        findings=_findings(san),
        steps=san.step,
        steps_checked=cov["steps_checked"],
        losses_checked=cov["losses_checked"],
        # The gradients the last step pass read (their local shards): every parameter's, if the
        # sanitizer really sees the sharded gradients.
        grads_read=sorted(k[: -len(".grad")] for k in san.last_stats() if k.endswith(".grad")),
    )


# -- FSDP2 -----------------------------------------------------------------------------------------


def _fsdp_batch(rank: int, step: int):
    """Different data on each rank and step (FSDP is data parallel); the target is [N, 1]."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _run_fsdp(rank: int, scenario: str) -> dict:
    import trainsan
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same full model on every rank before each shards its part
    model = MLP(out=1)  # fc2 has one row: rank 1's dim-0 shard of fc2.weight/bias is empty
    if scenario in ("fsdp_optimizer_before_shard", "fsdp_attach_before_shard"):
        # BUG (planted): the optimizer holds the unsharded originals; fully_shard replaces the
        # module's parameters with new sharded DTensors, which this optimizer never updates.
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if scenario == "fsdp_attach_before_shard":
        # ... and the sanitizer is attached before fully_shard too: both watch the originals.
        san = trainsan.attach(model, opt, policy="raise")
        fully_shard(model.fc1)
        fully_shard(model.fc2)
        fully_shard(model)
        try:
            opt.zero_grad()
            x, y = _fsdp_batch(rank, 0)
            F.mse_loss(model(x), y).backward()
            opt.step()
        except Exception as e:  # noqa: BLE001 - the refusal at the first step is the datum
            return dict(attach_error=None, step_error=f"{type(e).__name__}: {e}")
        finally:
            san.close()
        return dict(_summary(san), attach_error=None, step_error=None)
    fully_shard(model.fc1)
    fully_shard(model.fc2)
    fully_shard(model)
    if scenario != "fsdp_optimizer_before_shard":
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # The attach-order errors are policy "raise"'s (under "record" TrainSan goes on).
    policy = "raise" if scenario == "fsdp_optimizer_before_shard" else "record"
    try:
        san = trainsan.attach(model, opt, policy=policy)
    except Exception as e:  # noqa: BLE001 - a refusal at attach is data for the test
        if scenario != "fsdp_optimizer_before_shard":
            raise
        # attach is local to each rank (no collective), so every rank gets here alike.
        return dict(attach_error=f"{type(e).__name__}: {e}")
    try:
        for step in range(STEPS):
            if scenario != "fsdp_no_zero_grad":  # BUG (planted) in fsdp_no_zero_grad
                opt.zero_grad(set_to_none=scenario != "fsdp_clean_zero_in_place")
            x, y = _fsdp_batch(rank, step)
            if scenario == "fsdp_nan_input" and rank == NAN_RANK and step == NAN_STEP:
                x[0, 0] = float("nan")  # BUG (planted): one bad sample on one rank
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    finally:
        san.close()
    return dict(_summary(san), attach_error=None)


# -- DTensor tensor parallelism ----------------------------------------------------------------


def _tp_model(world_size: int, dim_names=None):
    """An MLP (8 -> 16 -> 4) whose parameters are DTensors on a 1-D mesh of every rank (its
    dimension named by `dim_names`, e.g. ("tp",)); also test_rank_desync.py's."""
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=dim_names)
    torch.manual_seed(0)
    model = MLP(out=4)

    def partition(name, module, mesh):
        # Megatron-style: fc1 column-parallel (its output features sharded), fc2 row-parallel
        # (its input features sharded; the partial sums are reduced in the output hook).
        placements = {"fc1": ([Shard(0)], [Shard(0)]), "fc2": ([Shard(1)], [Replicate()])}
        if name in placements:
            w, b = placements[name]
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight, mesh, w))
            module.bias = torch.nn.Parameter(distribute_tensor(module.bias, mesh, b))

    def input_fn(module, inputs, mesh):
        return tuple(DTensor.from_local(t, mesh, [Replicate()]) for t in inputs)

    def output_fn(module, output, mesh):
        return output.redistribute(mesh, [Replicate()])  # stays a DTensor: so does the loss

    distribute_module(model, mesh, partition, input_fn, output_fn)
    return model, mesh


def _run_dtensor(rank: int, world_size: int, scenario: str) -> dict:
    import trainsan
    from torch.distributed.tensor import DTensor, Replicate

    model, mesh = _tp_model(world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    san = trainsan.attach(model, opt, policy="record")
    try:
        for step in range(STEPS):
            opt.zero_grad()
            # Tensor parallelism: every rank sees the same batch.
            g = torch.Generator().manual_seed(step)
            x = torch.randn(BATCH, 8, generator=g)
            y = torch.randn(BATCH, 4, generator=g)
            if scenario == "dtensor_nan_input" and step == NAN_STEP:
                x[0, 0] = float("nan")  # BUG (planted): one bad sample
            out = model(x)
            loss = F.mse_loss(out, DTensor.from_local(y, mesh, [Replicate()]))
            loss.backward()
            opt.step()
    finally:
        san.close()
    return _summary(san)


# -- the spawned group -----------------------------------------------------------------------------


def _worker(rank: int, world_size: int, scenarios: list, outdir: str) -> None:
    """Run ``scenarios`` in turn on this rank, writing ``<scenario>.<rank>.json`` after each.

    An exception ends this rank's run (the other rank may be blocked in a collective this one
    left, so the group cannot go on); its traceback is written to the scenario's file first. A
    crash in native code leaves the Python stack in ``crash.<rank>.txt`` (faulthandler).
    """
    import torch.distributed as dist

    crash_log = open(os.path.join(outdir, f"crash.{rank}.txt"), "w")  # noqa: SIM115 - until exit
    faulthandler.enable(crash_log)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for scenario in scenarios:
            path = os.path.join(outdir, f"{scenario}.{rank}.json")
            try:
                if scenario.startswith("fsdp_"):
                    result = _run_fsdp(rank, scenario)
                else:
                    result = _run_dtensor(rank, world_size, scenario)
            except Exception:
                with open(path, "w") as f:
                    json.dump(dict(exception=traceback.format_exc()), f)
                raise
            with open(path, "w") as f:
                json.dump(result, f)
            dist.barrier()  # keep the ranks in lockstep between scenarios


def _collect() -> dict:
    """{scenario: [rank 0's result, rank 1's result], or a str saying how it failed}.

    The scenarios run in one group, in order. When the group fails (a rank raised or died), the
    first scenario without a full result is the one it failed in: it is recorded as failed, and
    the scenarios after it run again in a new group — at most MAX_GROUPS groups in all, so that a
    build that crashes everywhere fails in bounded time."""
    out: dict = {}
    pending = list(SCENARIOS)
    for _ in range(MAX_GROUPS):
        if not pending:
            break
        with tempfile.TemporaryDirectory(prefix="trainsan_fsdp_") as d:
            try:
                _dist.run(_worker, WORLD_SIZE, args=(pending, d), timeout=150)
                failure = "no result"  # cannot happen: the group ran every scenario
            except _dist.DistributedTestError as e:
                failure = str(e) + _crash_stacks(d)
            rest = []
            for scenario in pending:
                ranks = []
                for r in range(WORLD_SIZE):
                    path = os.path.join(d, f"{scenario}.{r}.json")
                    if os.path.exists(path):
                        with open(path) as f:
                            ranks.append(json.load(f))
                if len(ranks) == WORLD_SIZE and not any("exception" in x for x in ranks):
                    out[scenario] = ranks
                elif failure is not None:
                    out[scenario] = f"the run failed in this scenario:\n{failure}"
                    failure = None  # the scenarios after it did not run: run them again
                else:
                    rest.append(scenario)
            pending = rest
    for scenario in pending:
        out[scenario] = f"not run: {MAX_GROUPS} groups failed before it (see the other tests)"
    return out


def _crash_stacks(outdir: str) -> str:
    """The faulthandler reports the ranks left, if any (a native crash), for the failure text."""
    text = ""
    for r in range(WORLD_SIZE):
        path = os.path.join(outdir, f"crash.{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                stack = f.read().strip()
            if stack:
                text += f"\n--- rank {r}, faulthandler ---\n{stack}"
    return text


@pytest.fixture(scope="module")
def results():
    return _collect()


def _ranks(results, scenario: str) -> list:
    r = results[scenario]
    if isinstance(r, str):
        pytest.fail(f"{scenario}: {r}", pytrace=False)
    return r


def _errors(result: dict) -> list:
    return [f for f in result["findings"] if f["severity"] == "error"]


def _show(findings) -> str:
    """Findings, one a line, for an assertion message."""
    lines = [
        f"  [{f['severity']}] {f['kind']} ({f['tensor']}) step {f['step']}: {f['message']}"
        for f in findings
    ]
    return "\n".join(lines) or "  (none)"


# -- the tests -------------------------------------------------------------------------------------


def test_kind_names_exist():
    """The kinds these tests expect are real kinds, with error severity."""
    import trainsan

    for kind in NONFINITE + ("stale_grad",):
        assert trainsan.KINDS[kind] == "error", kind


@pytest.mark.parametrize("scenario", ["fsdp_clean", "fsdp_clean_zero_in_place", "dtensor_clean"])
def test_clean_loop_has_no_errors(results, scenario):
    for rank, r in enumerate(_ranks(results, scenario)):
        where = f"rank {rank}:\n" + _show(r["findings"])
        assert _errors(r) == [], where
        # Checked, not merely silent: every step's pass ran, every loss was read, and the pass
        # read the gradient (shard) of every parameter, the empty shards on rank 1 included.
        assert r["steps"] == STEPS and r["steps_checked"] == STEPS, where
        assert r["losses_checked"] == STEPS, where
        assert r["grads_read"] == sorted(PARAMS), where


def test_fsdp_clean_loop_has_no_warnings(results):
    """Nor warnings: an empty shard (rank 1's part of fc2) is not a vanished gradient, and the
    gradient norms are not judged on one rank's shards as if they were the whole tensor."""
    for rank, r in enumerate(_ranks(results, "fsdp_clean")):
        assert r["findings"] == [], f"rank {rank}:\n" + _show(r["findings"])


@pytest.mark.parametrize("scenario", ["fsdp_nan_input", "dtensor_nan_input"])
def test_nan_input(results, scenario):
    for rank, r in enumerate(_ranks(results, scenario)):
        errs = _errors(r)
        where = f"rank {rank}:\n" + _show(errs)
        # Nothing before the bad batch; the first finding is at its step, and is about it.
        assert errs and min(f["step"] for f in errs) == NAN_STEP, where
        assert all(f["kind"] in NONFINITE for f in errs if f["step"] == NAN_STEP), where
        # Every rank's gradient shards are NaN (FSDP: the reduce-scatter averages the NaN in;
        # tensor parallelism: the same batch on every rank).
        assert any(f["kind"] == "nonfinite_grad" and f["step"] == NAN_STEP for f in errs), where
        # The loss is NaN at NAN_STEP where the NaN input was: on NAN_RANK only under FSDP (the
        # other rank's loss goes NaN a step later, through the NaN weights), everywhere under
        # tensor parallelism.
        losses = [f["step"] for f in errs if f["kind"] == "nonfinite_loss"]
        if scenario == "dtensor_nan_input" or rank == NAN_RANK:
            assert NAN_STEP in losses, where
        else:
            assert all(s > NAN_STEP for s in losses), where


def test_fsdp_missing_zero_grad_is_stale_grad(results):
    for rank, r in enumerate(_ranks(results, "fsdp_no_zero_grad")):
        errs = _errors(r)
        stale = {f["tensor"]: f["step"] for f in errs if f["kind"] == "stale_grad"}
        # Step 1's backward adds onto the gradient step 0 consumed, in every parameter — also
        # where this rank's shard is empty (FSDP still assigns and accumulates it).
        assert stale == {n: 1 for n in PARAMS}, f"rank {rank}:\n" + _show(errs)


def test_fsdp_optimizer_built_before_fully_shard(results):
    """Policy "raise": either ``attach`` refuses the optimizer (any exception whose message names
    fully_shard) or the first step reports an error-severity finding whose message names
    fully_shard."""
    for rank, r in enumerate(_ranks(results, "fsdp_optimizer_before_shard")):
        if r["attach_error"] is not None:
            assert "fully_shard" in r["attach_error"], f"rank {rank}: {r['attach_error']}"
            continue
        errs = _errors(r)
        named = [f for f in errs if f["step"] == 0 and "fully_shard" in f["message"]]
        assert named, (
            f"rank {rank}: the optimizer updates tensors the sharded model does not use, and "
            "nothing at step 0 says so:\n" + _show(r["findings"])
        )


def test_fsdp_attach_before_fully_shard_is_a_clear_error_at_the_first_step(results):
    """attach() before fully_shard: the sanitizer (and here the optimizer) hold the originals that
    fully_shard replaced. The first step says so and what to do (attach after fully_shard)."""
    for rank, r in enumerate(_ranks(results, "fsdp_attach_before_shard")):
        err = r.get("step_error")
        assert err is not None, f"rank {rank}: no error at the first step:\n" + _show(r["findings"])
        assert "replaced after attach()" in err and "fully_shard" in err, f"rank {rank}: {err}"
