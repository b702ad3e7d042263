"""A small harness for tests that need several processes in one torch.distributed group.

``run(fn, world_size)`` starts ``world_size`` fresh processes (``spawn``: no state inherited from
the pytest process), joins them into a gloo process group on the loopback interface (CPU only,
no GPU needed) and calls ``fn(rank, world_size, *args)`` in each. What ``fn`` returns comes back
to the parent, one entry per rank, through a queue; an exception in any rank is re-raised in the
parent as :class:`DistributedTestError` with every failing rank's traceback.

A hang must fail the test, not CI: the process group gets a timeout (so a collective that one
rank never joins errors out in the others), and the parent has a hard deadline after which every
rank still running is killed. Once one rank has failed, the others get a short grace period to
report (they may be blocked in a collective the failed rank will never join) and are then killed.

``fn`` and ``args`` are pickled for the children, so ``fn`` must be a module-level function of an
importable module (a test module is: spawn gives the children the parent's ``sys.path``), and what
it returns must be picklable — plain data is best, so the parent needs no library the children
loaded (an unpicklable result shows up as a rank that exited without one). The children are
daemonic, so a parent that exits takes them down with it, but they cannot start processes of
their own (no DataLoader workers). Children run with one intra-op thread: N processes on a small
CI machine would otherwise oversubscribe its cores.

``skip_reason()`` says why distributed tests cannot run here (None when they can);
``requires_gloo`` is the matching ``pytest.mark.skipif``.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import pytest
import torch


def skip_reason() -> Optional[str]:
    """Why a gloo process group cannot be made in this build of torch, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this build of torch"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this build of torch"
    return None


#: ``pytestmark = _dist.requires_gloo`` skips a whole module where gloo is missing.
requires_gloo = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


class DistributedTestError(AssertionError):
    """A rank raised, died, or did not finish in time; the message holds every rank's story."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now.

    The socket is closed before the children bind the port, so another process could take it in
    between; on a test machine that window (well under a second) is an accepted risk.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, pg_timeout_s, args, results) -> None:
    """The body of each child: join the group, run ``fn``, send ("ok"|"error", rank, payload)."""
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        # gloo picks its interface from the host name, which need not resolve to a reachable
        # address in a container; the loopback interface always works for one machine.
        if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put(("error", rank, traceback.format_exc()))


def run(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    grace: float = 5.0,
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results.

    The list holds what each rank's ``fn`` returned, rank 0's first.

    ``timeout`` (seconds) bounds the whole run, process start-up included; ``grace`` is how long
    the other ranks may still take to report once one has failed. Raises
    :class:`DistributedTestError` when a rank raised, exited without a result, or ran past the
    deadline (every child is gone by then), and skips the test when gloo is not available.
    """
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Collectives time out a little before the parent's deadline, so a rank stuck waiting for a
    # failed peer usually reports its own error instead of being killed silently.
    pg_timeout_s = max(5.0, timeout * 0.75)
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, pg_timeout_s, tuple(args), results),
            name=f"dist-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    outcome: dict[int, tuple[str, Any]] = {}
    exited_at: dict[int, float] = {}  # rank -> when its process was first seen gone
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                status, rank, payload = results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                # A child that died without reporting (a crash in native code, os._exit) never
                # will: notice it instead of waiting for the deadline. A result sent just before
                # a normal exit may still be in the pipe, hence the second of patience.
                for r, p in enumerate(procs):
                    if r in outcome or p.exitcode is None:
                        continue
                    if now - exited_at.setdefault(r, now) > 1.0:
                        outcome[r] = ("died", f"exited with code {p.exitcode} without a result")
                        deadline = min(deadline, now + grace)
                continue
            outcome[rank] = (status, payload)
            if status == "error":
                deadline = min(deadline, time.monotonic() + grace)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(grace, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()

    failed = {r: o for r, o in outcome.items() if o[0] != "ok"}
    missing = [r for r in range(world_size) if r not in outcome]
    if failed or missing:
        parts = []
        for r in sorted(failed):
            parts.append(f"--- rank {r} ({failed[r][0]}) ---\n{failed[r][1]}")
        for r in missing:
            why = (
                f"no result within the {timeout:.0f} s deadline"
                if not failed
                else f"no result within {grace:.0f} s of another rank's failure"
            )
            parts.append(f"--- rank {r}: killed, {why} ---")
        raise DistributedTestError(
            f"{len(failed) + len(missing)} of {world_size} ranks failed:\n" + "\n".join(parts)
        )
    return [outcome[r][1] for r in range(world_size)]
