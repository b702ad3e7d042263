"""TrainSan under DistributedDataParallel: two CPU processes in one gloo group (tests/_dist.py).

Every rank attaches its own sanitizer (``policy="record"``) and the tests read what each rank
found. The matrix is MODES: the sanitizer attached to the DDP wrapper or to its ``.module``,
times six DDP configurations (CONFIGS): the defaults, ``gradient_as_bucket_view=True`` (with
``zero_grad()`` setting the gradients to None, and zeroing them in place), ``static_graph=True``,
``find_unused_parameters=True`` (with branches a step does not use) and gradient accumulation
under ``no_sync()`` (two micro-batches, then one step). Each mode runs
SCENARIOS: a clean loop that must give no error-severity finding, and four planted bugs that
must be found at error severity on the ranks they reach:

* ``no_zero_grad``: ``optimizer.zero_grad()`` never called -> ``stale_grad`` at step 1;
* ``nan_input``: a NaN in one input at step NAN_STEP on rank NAN_RANK only -> ``nonfinite_loss``
  there (the loss is per rank), ``nonfinite_grad`` on both ranks (the allreduce averages the NaN
  into every rank's gradients), nothing at error severity before that step;
* ``detach``: a stray ``.detach()`` on fc1's output -> ``missing_grad`` for fc1's parameters;
* ``broadcast``: a ``[N, 1]`` prediction against an ``[N]`` target in ``mse_loss`` -> ``broadcast``.

Spawning is the expensive part (each process imports torch), so the whole matrix runs in ONE
spawned group (the module-scoped ``results`` fixture): each rank runs every (mode, scenario)
in turn, a fresh model, optimizer, DDP wrapper and sanitizer each, and returns its findings as
plain data; the parametrized tests below only read them.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

import _dist

pytestmark = _dist.requires_gloo

WORLD_SIZE = 2
STEPS = 6  # optimizer steps per scenario
NAN_STEP = 3  # the step whose input holds the NaN ...
NAN_RANK = 1  # ... on this rank only
BATCH = 8
TRUNK = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")  # the parameters every step trains

#: DDP configurations: the DDP constructor's keyword arguments, whether the loop accumulates two
#: micro-batches under no_sync() per step, whether the model has the conditional branches, and
#: zero_grad's set_to_none. With gradient_as_bucket_view=True and set_to_none=False the gradients
#: stay views of DDP's buckets for the whole run, zeroed in place, and every allreduce writes
#: them (DDP's memory-saving setup; with set_to_none=True they are None after each zero_grad and
#: become bucket views again at the next backward).
BUCKET_VIEW = {"gradient_as_bucket_view": True}
CONFIGS = {
    "plain": dict(ddp={}, no_sync=False, branches=False, set_to_none=True),
    "bucket_view": dict(ddp=BUCKET_VIEW, no_sync=False, branches=False, set_to_none=True),
    "bucket_view_inplace_zero": dict(
        ddp=BUCKET_VIEW, no_sync=False, branches=False, set_to_none=False
    ),
    "static_graph": dict(
        ddp={"static_graph": True}, no_sync=False, branches=False, set_to_none=True
    ),
    "find_unused": dict(
        ddp={"find_unused_parameters": True}, no_sync=False, branches=True, set_to_none=True
    ),
    "no_sync": dict(ddp={}, no_sync=True, branches=False, set_to_none=True),
}
ATTACH = ("ddp", "module")  # attach(ddp_model, ...) or attach(ddp_model.module, ...)
MODES = [f"{a}-{c}" for a in ATTACH for c in CONFIGS]
SCENARIOS = (
    "clean",
    "clean_eval_frozen",
    "clean_three_backwards",
    "no_zero_grad",
    "no_zero_grad_two_backwards",
    "nan_input",
    "detach",
    "broadcast",
)
# "clean_three_backwards": three synced backwards (no no_sync) accumulate before each step — DDP
# copies the all-reduced bucket back into .grad in place after each, which is the backward's
# result, not a clear (Note [Grad identity]); "no_zero_grad_two_backwards": the same with two
# and zero_grad never called.
# "clean_eval_frozen": a clean loop with fc1.bias frozen (requires_grad=False before DDP wraps the
# model) and an evaluation pass (eval mode, no_grad, through the DDP wrapper) after every step.

# With find_unused_parameters=True the model has two extra heads on fc1's output:
#  * ``aux`` is used on even steps only — the conditional branch find_unused_parameters exists
#    for. DDP leaves its gradient None on the odd steps, TrainSan sees one step without a
#    gradient at a time, within missing_grad_patience (3): it must stay silent.
#  * ``unused`` is never called, yet it is trainable and in the optimizer: it never trains, which
#    is exactly missing_grad's rule (README: "an unused branch in forward()"), so TrainSan rightly
#    reports it, once per tensor, at error severity; DDP itself says nothing (find_unused makes
#    that legal for DDP, not for the optimizer). The clean loop of that mode therefore expects
#    these two findings and no others, and the planted-bug tests leave them out of account.
UNUSED_BRANCH_FINDINGS = {("missing_grad", "unused.weight"), ("missing_grad", "unused.bias")}

# DDP without find_unused_parameters or static_graph needs every parameter to get a gradient: with
# fc1 detached its bucket never completes, and the next forward raises "Expected to have finished
# reduction in the prior iteration ..." itself. The detach scenario stops there, so in those
# modes it runs with missing_grad_patience=1 (the minimum), which lets TrainSan name the parameter
# at step 0, before DDP's generic error; the modes that tolerate unused parameters keep the
# default patience and run all STEPS steps.
DDP_STOPS_ON_UNUSED = "Expected to have finished reduction in the prior iteration"


def _tolerates_unused(config: str) -> bool:
    kw = CONFIGS[config]["ddp"]
    return bool(kw.get("find_unused_parameters") or kw.get("static_graph"))


class Net(torch.nn.Module):
    """fc1 -> ReLU -> fc2, a [N, 1] output; with ``branches``, the aux and unused heads above."""

    def __init__(self, branches: bool):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 1)
        self.branches = branches
        if branches:
            self.aux = torch.nn.Linear(8, 1)
            self.unused = torch.nn.Linear(8, 1)
        self.use_aux = False  # set by the loop before each forward
        self.detach_hidden = False  # the planted bug of the "detach" scenario

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.detach_hidden:
            h = h.detach()  # BUG (planted): fc1 gets no gradient from anything after this
        out = self.fc2(h)
        if self.branches and self.use_aux:
            out = out + self.aux(h)
        return out


def _batch(rank: int, step: int, micro: int):
    """Different data on each rank, step and micro-batch; the target is [N, 1] like the output."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(BATCH, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=g)
    return x, y


def _run_scenario(rank: int, attach_to: str, config: str, scenario: str) -> dict:
    """One training run of STEPS steps; returns this rank's findings and how the run ended."""
    import trainsan
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = CONFIGS[config]
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    net = Net(cfg["branches"])
    net.detach_hidden = scenario == "detach"
    if scenario == "clean_eval_frozen":
        net.fc1.bias.requires_grad_(False)
    ddp = DDP(net, **cfg["ddp"])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    options = {}
    if scenario == "detach" and not _tolerates_unused(config):
        options["missing_grad_patience"] = 1
    san = trainsan.attach(ddp if attach_to == "ddp" else net, opt, policy="record", **options)
    micro_batches = 2 if cfg["no_sync"] else 1
    synced = {"clean_three_backwards": 3, "no_zero_grad_two_backwards": 2}.get(scenario, 1)
    ddp_error = None
    try:
        for step in range(STEPS):
            if not scenario.startswith("no_zero_grad"):  # BUG (planted): never zeroed
                opt.zero_grad(set_to_none=cfg["set_to_none"])
            net.use_aux = step % 2 == 0
            for m in range(max(micro_batches, synced)):
                x, y = _batch(rank, step, m)
                if scenario == "nan_input" and rank == NAN_RANK and step == NAN_STEP and m == 0:
                    x[0, 0] = float("nan")  # BUG (planted): one bad sample on one rank
                if scenario == "broadcast":
                    y = y.squeeze(-1)  # BUG (planted): [N, 1] output against an [N] target
                # All but the last micro-batch accumulate locally; the last one's backward
                # averages the accumulated gradients across the ranks.
                last = m >= micro_batches - 1  # (the synced scenarios: every backward)
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = F.mse_loss(ddp(x), y) / max(micro_batches, synced)
                    loss.backward()
            opt.step()
            if scenario == "clean_eval_frozen":
                ddp.eval()
                with torch.no_grad():
                    ddp(_batch(rank, step, 9)[0])
                ddp.train()
    except RuntimeError as e:
        if scenario != "detach" or DDP_STOPS_ON_UNUSED not in str(e):
            raise
        ddp_error = f"step {step}: {str(e).splitlines()[0]}"
    finally:
        san.close()
    # Findings as plain data; the wrapper's parameter names lose their "module." prefix so that
    # both attach targets read alike.
    findings = [
        dict(
            kind=f.kind,
            severity=f.severity,
            step=f.step,
            tensor=f.tensor[len("module.") :]
            if f.tensor and attach_to == "ddp" and f.tensor.startswith("module.")
            else f.tensor,
            message=f.message,
        )
        for f in san.findings
    ]
    return dict(findings=findings, steps=san.step, ddp_error=ddp_error)


def _worker(rank: int, world_size: int) -> dict:
    """Every (mode, scenario) in turn on this rank; {(mode, scenario): result}."""
    import torch.distributed as dist

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mse_loss warns about the planted broadcast
        for mode in MODES:
            attach_to, config = mode.split("-", 1)
            for scenario in SCENARIOS:
                try:
                    out[mode, scenario] = _run_scenario(rank, attach_to, config, scenario)
                except Exception as e:
                    # Stop here: the other rank may be blocked in a collective this one left,
                    # so the group cannot go on; the harness reports this with the traceback.
                    raise RuntimeError(f"rank {rank}, {mode}, {scenario}: {e}") from e
                dist.barrier()  # keep the ranks in lockstep between runs
    return out


@pytest.fixture(scope="module")
def results():
    """[rank 0's results, rank 1's results] of the whole matrix, from one spawned group."""
    return _dist.run(_worker, WORLD_SIZE, timeout=180)


def _errors(result: dict, ignore=()) -> list:
    """The error-severity findings of one rank's run, less those named in ``ignore``."""
    return [
        f
        for f in result["findings"]
        if f["severity"] == "error" and (f["kind"], f["tensor"]) not in ignore
    ]


def _baseline(mode: str) -> set:
    """The error findings the clean loop of this mode is meant to give (see UNUSED_BRANCH_...)."""
    return UNUSED_BRANCH_FINDINGS if mode.endswith("-find_unused") else set()


def _show(findings) -> str:
    """Findings, one a line, for an assertion message."""
    lines = [f"  [{f['severity']}] {f['kind']} step {f['step']}: {f['message']}" for f in findings]
    return "\n".join(lines) or "  (none)"


@pytest.mark.parametrize("scenario", ["clean", "clean_eval_frozen", "clean_three_backwards"])
@pytest.mark.parametrize("mode", MODES)
def test_clean_loop_has_no_errors(results, mode, scenario):
    # clean_eval_frozen: a frozen parameter and evaluation passes are legitimate, silent too.
    for rank, res in enumerate(results):
        r = res[mode, scenario]
        assert r["steps"] == STEPS, f"rank {rank}: the sanitizer counted {r['steps']} steps"
        found = {(f["kind"], f["tensor"]) for f in _errors(r)}
        assert found == _baseline(mode), f"rank {rank}:\n" + _show(_errors(r))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", ["no_zero_grad", "no_zero_grad_two_backwards"])
def test_missing_zero_grad_is_stale_grad(results, mode, scenario):
    for rank, res in enumerate(results):
        errs = _errors(res[mode, scenario], _baseline(mode))
        stale = {f["tensor"]: f["step"] for f in errs if f["kind"] == "stale_grad"}
        # Step 1's backward accumulates onto the gradient step 0 consumed, in every parameter of
        # the trunk (the find_unused model's aux head, used every other step, may come later).
        # With gradient_as_bucket_view, DDP rebuilds its buckets in step 1's forward (the order
        # gradients arrived in step 0) and points every .grad at a view of the new bucket: a new
        # tensor that no step consumed, holding step 0's values. The first backward onto a
        # consumed gradient is then step 2's, where every parameter is found.
        # (With several backwards per step, bucket-view runs are found at step 1 already.)
        first = {n: stale.get(n) for n in TRUNK}
        steps = {1, 2} if "bucket_view" in mode else {1}
        assert len(set(first.values())) == 1 and first[TRUNK[0]] in steps, (
            f"rank {rank}:\n" + _show(errs)
        )


@pytest.mark.parametrize("mode", MODES)
def test_nan_input_on_one_rank(results, mode):
    for rank, res in enumerate(results):
        errs = _errors(res[mode, "nan_input"], _baseline(mode))
        where = f"rank {rank}:\n" + _show(errs)
        # Nothing before the bad batch; the first finding is at its step.
        assert errs and min(f["step"] for f in errs) == NAN_STEP, where
        # Every rank's gradients are NaN after the allreduce, so every rank reports them.
        assert any(f["kind"] == "nonfinite_grad" and f["step"] == NAN_STEP for f in errs), where
        # The loss is NaN at NAN_STEP only where the NaN was planted; the other rank's loss goes
        # NaN one step later, through the NaN weights the averaged gradient left.
        losses = [f["step"] for f in errs if f["kind"] == "nonfinite_loss"]
        if rank == NAN_RANK:
            assert NAN_STEP in losses, where
        else:
            assert all(s > NAN_STEP for s in losses), where


@pytest.mark.parametrize("mode", MODES)
def test_stray_detach_is_missing_grad(results, mode):
    config = mode.split("-", 1)[1]
    for rank, res in enumerate(results):
        r = res[mode, "detach"]
        errs = _errors(r, _baseline(mode))
        missing = {f["tensor"] for f in errs if f["kind"] == "missing_grad"}
        # fc1 is blamed, fc2 (which still gets its gradient) is not.
        assert missing == {"fc1.weight", "fc1.bias"}, f"rank {rank}:\n" + _show(errs)
        if _tolerates_unused(config):
            assert r["ddp_error"] is None and r["steps"] == STEPS, r["ddp_error"]
        else:
            # Found at step 0, before DDP stopped the run at the next forward.
            assert min(f["step"] for f in errs if f["kind"] == "missing_grad") == 0
            assert r["ddp_error"] is not None, "DDP ran on with a parameter that got no gradient"


@pytest.mark.parametrize("mode", MODES)
def test_loss_broadcast(results, mode):
    for rank, res in enumerate(results):
        errs = _errors(res[mode, "broadcast"], _baseline(mode))
        bc = [f for f in errs if f["kind"] == "broadcast"]
        assert bc and bc[0]["step"] == 0, f"rank {rank}:\n" + _show(errs)
        assert "mse_loss" in bc[0]["message"], bc[0]["message"]


def test_kind_names_exist():
    """The kinds these tests expect are real kinds, with error severity."""
    import trainsan

    for kind in ("stale_grad", "nonfinite_grad", "nonfinite_loss", "missing_grad", "broadcast"):
        assert trainsan.KINDS[kind] == "error", kind
