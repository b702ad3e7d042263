"""rank_desync: the replicas of a distributed run compared at every step (the facts; the rules and
their wording are host/checks/replicas.cpp).

Note [Replica comparison]
~~~~~~~~~~~~~~~~~~~~~~~~~
Which tensors must be identical, and across which ranks (a *replica set*), is read once at
attach, per parameter:

* a DTensor (FSDP2, HSDP, tensor parallel): across the mesh dimensions where its placement is
  ``Replicate()``, the other coordinates fixed (HSDP: the replicate dimension; a TP-replicated
  parameter: the TP dimension too); a parameter sharded on every dimension has no replicas;
* a plain parameter of a model wrapped in DistributedDataParallel (attached to the wrapper or to
  its ``.module``): across DDP's process group, and its gradient too (after the reduction it is
  the same on every rank, which tells a fault in the gradients from one in the update);
* any other plain parameter: across all ranks (a data-parallel loop that averages gradients
  itself), its gradient not compared; Megatron-style tensor-parallel parameters
  (``tensor_model_parallel=True``) have no replicas.

Each replica set gets its own gloo process group (``new_group``, on the host: it never
interleaves with the training's own collectives, never touches a CUDA stream and is not under the
NCCL watchdog). What is compared are the 64-bit fingerprints the step pass computes on the device
anyway (TensorStats.hash: exact bits, order-aware), which reach the host with the pass's other
results (Note [Lagged checks]). Per step event of an optimizer (a step, or a step the GradScaler
skipped) every member puts one row into the set's payload — a header (layout digest, optimizer,
event count, step, skipped, training forwards) and per parameter (present, fingerprint) for the
weight, its gradient and, on sampled steps, its optimizer state — and one all-reduce(MAX) over
``[row, ~row]`` gives every member the maximum and the minimum of every field: a few bytes per
tensor, whatever the group's size. It runs asynchronously and is read at the next event (so the
training never waits for it); only where some field differs does a second collective (an
all-gather of the rows) tell which ranks hold which value. What the payload says is judged in C++
(trainsan::judge_replica_payload and replica_labels, Note [Replica payload] in
host/checks/replicas.cpp). The schedule of launches, reads and
gathers depends only on the sequence of events, never on timing, so every member issues the same
collectives in the same order.

A rank that does not arrive (it skipped optimizer.step(), left the loop, hangs) never hangs the
job: a wait gives up after ``desync_timeout`` seconds — at once where the rank has closed its
sanitizer with fewer comparisons, which every rank records in the store at close — and reports
which ranks were missing; the set is not compared any more after that, nor after the ranks were
found at different steps (their sequences no longer pair up).

The comparison before the first step (the weights the replicas start from) is the one blocking
collective: at the first optimizer step, after the backward, before the update.

The row (trainsan::replica_row) and the verdict (judge_replica_payload, replica_labels) are the
C++ ones that trainsan::compare_replicas (host/replicas_pg.cpp, Note [Replica comparison over
c10d]) uses. The schedule of collectives around them — launch, wait, read at the next event,
report missing ranks — is still written twice, here and in PgReplicaDriver, because the C++
driver does less than this one and a Python call into it would lose findings: it compares one set
(every parameter over the caller's group; no DTensor placements, no replica sets), no optimizer
state, starts at compare_replicas() rather than at the first step, learns nothing of ranks that
closed early (every other rank is reported missing: this side reads the store's closed/late keys)
and gathers rows with an all-gather on the group (this side through the store, which a rank whose
sequence shifted cannot mismatch). The plan: a public per-set engine in C++ (members, digest,
group, timeout; launch/drain/judge; the missing-rank and row-exchange steps as callables, the
c10d ones by default), which PgReplicaDriver and this module both drive — from here through
_trainsan_hot, which can take the side group as a c10d::ProcessGroup (torch's pybind11 caster)
and the store steps as Python callables (Note [One orchestration], bindings/csrc/hot.cpp).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import time
import warnings
import zlib
from typing import Any, Callable, Optional

import torch

from . import _native
from ._facts import _is_dtensor, _local, run_guarded
from ._tables import OPTIONS
from .stats import INT_FIELDS

_HASH_COL = INT_FIELDS.index("hash")
_MASK = (1 << 64) - 1
# The row of a comparison is trainsan::ReplicaRow (replica_facts.h; Note [Replica payload]), built
# by trainsan::replica_row (_row below); these are the header fields the reports quote per rank.
_STEP, _SKIPPED, _FORWARDS = 3, 4, 5
# ReplicaVerdict::Outcome
_AGREE, _NOT_REPLICAS, _OUT_OF_STEP, _SKIPS_DIFFER, _TENSORS_DIFFER = range(5)
_MISSING_GRACE_S = 5.0
_instances = [0]  # ReplicaComparison objects made in this process (store key prefixes)


def _dist():
    import torch.distributed as dist

    return dist


def active() -> bool:
    """A torch.distributed run with more than one rank."""
    try:
        dist = _dist()
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except Exception:  # noqa: BLE001 - a half-initialised or torn-down process group
        return False


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 64) if v >> 63 else v


def _digest(parts: list) -> int:
    return _signed(int.from_bytes(hashlib.sha1(repr(parts).encode()).digest()[:8], "little"))


def _fold(h: int, key: str, v: int) -> int:
    """Fold one (key, fingerprint) into a running 64-bit fingerprint (FNV-1a style)."""
    for x in (zlib.crc32(key.encode()), v & _MASK):
        h = ((h ^ x) * 0x100000001B3) & _MASK
    return h


def _find_ddp(model: torch.nn.Module) -> Optional[Any]:
    """The DistributedDataParallel wrapper of `model` (the model itself, or the wrapper whose
    .module it is), or None. Looked up once at attach through the garbage collector's referrers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        return model
    for holder in gc.get_referrers(model):
        if isinstance(holder, dict):
            for owner in gc.get_referrers(holder):
                if isinstance(owner, DDP) and owner.module is model:
                    return owner
    return None


def _dtensor_replicas(p: Any) -> tuple[Optional[tuple], str]:
    """The ranks holding the same local tensor as this rank for DTensor `p`, and how to name them."""
    mesh, placements = p.device_mesh, p.placements
    rep = [d for d, pl in enumerate(placements) if pl.is_replicate()]
    coord = mesh.get_coordinate()
    if not rep or coord is None:
        return None, ""
    idx = tuple(slice(None) if d in rep else coord[d] for d in range(mesh.ndim))
    ranks = tuple(sorted(int(r) for r in mesh.mesh[idx].flatten().tolist()))
    if len(ranks) < 2:
        return None, ""
    names = mesh.mesh_dim_names
    dims = ", ".join(repr(names[d]) if names else str(d) for d in rep)
    kind = "dimension" if len(rep) == 1 else "dimensions"
    return ranks, f"the Replicate() mesh {kind} {dims} (DTensor placements)"


class _Set:
    """One replica set: its ranks, side group, members and comparisons in flight."""

    def __init__(self, ranks: tuple, context: str, grads: bool):
        self.ranks = ranks
        self.context = context
        self.grads = grads  # gradients are reduced alike across the set (DDP)
        self.members: list[int] = []  # parameter indices
        self.buffers: list = []  # (name, tensor)
        self.group = None
        self.prefix = ""
        self.launched = 0
        self.in_flight: list = []  # (work, payload, row, event, sequence number), oldest first
        self.known: set = set()  # (what, tensor) already reported
        self.dead = False


class _Event:
    __slots__ = ("opt", "count", "step", "skipped", "forwards", "fp", "waiting", "grad_ok", "state",
                 "buffers", "first")

    def __init__(self, opt, count, step, skipped, forwards, waiting, grad_ok, state, buffers,
                 first=False):
        self.opt, self.count, self.step, self.skipped = opt, count, step, skipped
        self.forwards, self.waiting, self.grad_ok = forwards, waiting, grad_ok
        self.state, self.buffers, self.first = state, buffers, first
        self.fp: dict[int, tuple] = {}  # parameter index -> (hash, has_grad, grad hash)


def fingerprints(tensors: list) -> list[int]:
    """The 64-bit fingerprints (TensorStats.hash, as int64) of `tensors`, in one fused pass and
    one host read (the sampled steps of the replica comparison, the re-runs)."""
    if not tensors:
        return []
    ints, _ = torch.ops.trainsan.tensor_stats(tensors)
    return ints[:, _HASH_COL].cpu().tolist()


class ReplicaComparison:
    """The rank_desync comparison of one sanitizer (Note [Replica comparison])."""

    def __init__(self, handle, model: torch.nn.Module, names: list, params: list,
                 optimizers: list, options: dict, apply: Callable, forwards: Callable[[], int]):
        dist = _dist()
        self._handle = handle
        self._apply = apply
        start = forwards()
        self._forwards = lambda: forwards() - start  # training forwards since attach
        self._names = names
        self._params = params
        self._optimizers = optimizers
        opt = lambda k: options.get(k, OPTIONS[k])  # noqa: E731
        self._every = int(opt("desync_every"))
        self._state_every = int(opt("desync_state_every"))
        self._timeout = float(opt("desync_timeout"))
        self._rank = dist.get_rank()
        self._events: dict[int, int] = {}  # optimizer -> step events so far (steps and skips)
        self._steps: dict[int, int] = {}  # optimizer -> steps so far
        self._fifo: list[_Event] = []
        self._first_done = not optimizers  # manual mode: no comparison before the first step
        self._max_opts = dist.AllreduceOptions()
        self._max_opts.reduceOp = dist.ReduceOp.MAX
        self._closed = False
        self._collect: Optional[list] = None  # reports held back during close()
        _instances[0] += 1
        ddp = _find_ddp(model)
        ddp_ranks = None
        if ddp is not None:
            pg = getattr(ddp, "process_group", None)
            ddp_ranks = tuple(sorted(dist.get_process_group_ranks(pg) if pg is not None
                                     else range(dist.get_world_size())))
        world = tuple(range(dist.get_world_size()))
        sets: dict[tuple, _Set] = {}
        for i, p in enumerate(params):
            if _is_dtensor(p):
                ranks, context = _dtensor_replicas(p)
                grads = False  # judged per step: the gradient's placements must be the weight's
            elif getattr(p, "tensor_model_parallel", False):
                ranks = None
            elif ddp_ranks is not None:
                ranks, context, grads = ddp_ranks, "the data-parallel group (DDP)", True
            else:
                ranks, context, grads = world, "all ranks (plain parameters without a data-parallel wrapper, taken as replicas)", False
            if ranks is None or self._rank not in ranks:
                continue
            s = sets.setdefault((ranks, context), _Set(ranks, context, grads))
            s.members.append(i)
        if bool(opt("desync_buffers")):
            bset = None
            key = (ddp_ranks or world)
            for s in sets.values():
                if s.ranks == key and not _is_dtensor(params[s.members[0]]):
                    bset = s
            if bset is None and len(key) > 1:
                bset = sets.setdefault((key, "buffers"), _Set(key, "the data-parallel group", False))
            if bset is not None:
                bset.buffers = [(n, b) for n, b in model.named_buffers() if not _is_dtensor(b)]
        self._sets = [sets[k] for k in sorted(sets, key=lambda k: (k[0], k[1]))]
        self._sets = [s for s in self._sets if s.members or s.buffers]
        for s in self._sets:
            layout = [(names[i], tuple(params[i].shape), str(params[i].dtype),
                       str(getattr(params[i], "placements", ""))) for i in s.members]
            layout += [(n, tuple(b.shape), str(b.dtype)) for n, b in s.buffers]
            s.digest = _digest([s.context, s.ranks, layout])
            s.group = _side_group(s.ranks, self._timeout)
            s.prefix = f"trainsan/desync/{_instances[0]}/{'-'.join(map(str, s.ranks))}/"
        if self._sets:
            handle.compare_replicas()

    @property
    def sets(self) -> list:
        return self._sets

    def _guarded(self, fn: Callable, *args: Any) -> None:
        """Run fn; a failure of the comparison's own machinery (not a finding) stops it with a
        warning instead of reaching the training loop."""

        def stop() -> None:
            for s in self._sets:
                s.dead = True

        run_guarded(fn, args, "rank_desync (its comparison failed)", stop)

    # -- events -----------------------------------------------------------------------------

    def first_step(self) -> None:
        """Before the first optimizer step's update: the weights the replicas start from."""
        if self._first_done or self._closed:
            return
        self._first_done = True
        self._guarded(self._first_step)

    def _first_step(self) -> None:
        tensors = [_local(p).detach() for p in self._params]
        hashes = fingerprints(tensors)
        ev = _Event(-1, 0, 0, False, self._forwards(), False, None, None, None, first=True)
        for i, h in enumerate(hashes):
            ev.fp[i] = (h, False, 0)
        for s in self._sets:
            if s.dead:
                continue
            self._launch(s, ev)
            self._drain(s, keep=0)

    def on_step(self, opt: int, skipped: bool) -> None:
        """Optimizer `opt` stepped (or its GradScaler skipped the step)."""
        if not self._closed:
            self._guarded(self._on_step, opt, skipped)

    def _on_step(self, opt: int, skipped: bool) -> None:
        count = self._events.get(opt, 0)
        step = self._steps.get(opt, 0)
        self._events[opt] = count + 1
        if not skipped:
            self._steps[opt] = step + 1
        due = not skipped and step % self._every == 0
        sampled = not skipped and self._state_every > 0 and step % self._state_every == 0
        grad_ok = None  # the gradients compared: on the sampled steps (the pass hashes them then)
        if due and sampled:
            grad_ok = set()
            for s in self._sets:
                if s.grads:
                    grad_ok.update(s.members)
                    continue
                for i in s.members:
                    p = self._params[i]
                    if (_is_dtensor(p) and p.grad is not None
                            and tuple(p.grad.placements) == tuple(p.placements)):
                        grad_ok.add(i)
        state = self._state_hashes(opt) if sampled else None
        buffers = None
        if sampled and any(s.buffers for s in self._sets):
            buffers = {}
            for s in self._sets:
                if s.buffers:
                    buffers[id(s)] = fingerprints([b.detach() for _, b in s.buffers])
        self._fifo.append(_Event(opt, count, step, skipped, self._forwards(), due, grad_ok, state,
                                 buffers))
        self._pump()

    def _pump(self, final: bool = False) -> None:
        """Attach landed fingerprints to their events, launch the comparisons that are ready and
        read those launched before the newest (all of them when `final`)."""
        for step, opt, rows in self._handle.take_fingerprints(final):
            if opt < 0:  # manual mode: events come with the passes
                count = self._events.get(-1, 0)
                self._events[-1] = count + 1
                self._fifo.append(_Event(-1, count, step, False, self._forwards(), True, set(),
                                         None, None))
            for ev in self._fifo:
                if ev.opt != opt or ev.skipped or not ev.waiting:
                    continue
                if ev.step == step:
                    for idx, h, has_g, g in rows.tolist():
                        ev.fp[idx] = (h, bool(has_g), g)
                    ev.waiting = False
                    break
                if ev.step < step:  # its pass was never checked: compared without fingerprints
                    ev.waiting = False
        while self._fifo and (not self._fifo[0].waiting or final):
            ev = self._fifo.pop(0)
            for s in self._sets:
                if not s.dead:
                    self._launch(s, ev)
        for s in self._sets:
            if not s.dead:
                self._drain(s, keep=0 if final else 1)

    def close(self) -> list:
        """Compare what is still pending and tell the others this rank is done; returns the
        findings' reports for the caller to apply (after the sanitizer's own close)."""
        if self._closed:
            return []
        self._collect = []
        try:
            self._guarded(self._pump, True)
        finally:
            self._closed = True
            try:
                store = _dist().distributed_c10d._get_default_store()
                for s in self._sets:
                    store.set(s.prefix + f"closed/{self._rank}", str(s.launched))
            except Exception:  # noqa: BLE001 - a torn-down process group: nothing to tell
                pass
        found, self._collect = self._collect, None
        return found

    # -- the collectives --------------------------------------------------------------------

    def _state_hashes(self, opt: int) -> dict:
        """parameter index -> one fingerprint of its optimizer state (every tensor in it)."""
        if opt < 0 or opt >= len(self._optimizers):
            return {}
        state = self._optimizers[opt].state
        keys, tensors = [], []
        for s in self._sets:
            for i in s.members:
                st = state.get(self._params[i])
                if not st:
                    continue
                for k in sorted(st):
                    v = st[k]
                    if isinstance(v, torch.Tensor):
                        keys.append((i, k))
                        tensors.append(_local(v).detach())
        out: dict = {}
        for (i, k), h in zip(keys, fingerprints(tensors)):
            out[i] = _fold(out.get(i, 0xCBF29CE484222325), k, h)
        return out

    def _row(self, s: _Set, ev: _Event) -> torch.Tensor:
        """This rank's row of set `s` at event `ev`: trainsan::replica_row (Note [Replica
        payload]), the row the C++ comparison over c10d builds too."""
        fp = ev.fp
        state = ev.state or {}
        buffers = ev.buffers.get(id(s), []) if ev.buffers else []
        return torch.ops.trainsan.replica_row(
            [s.digest, ev.opt, ev.count, ev.step, int(ev.skipped), ev.forwards],
            list(fp), [v[0] for v in fp.values()], [v[2] for v in fp.values()],
            [int(v[1]) for v in fp.values()], sorted(ev.grad_ok or ()),
            list(state), [_signed(h) for h in state.values()], buffers, s.members,
            len(s.buffers))

    def _launch(self, s: _Set, ev: _Event) -> None:
        row = self._row(s, ev)
        payload = torch.cat([row, torch.bitwise_not(row)])
        try:
            # The process group's own allreduce: dist.all_reduce's Python wrapper costs more
            # than the collective's launch.
            work = s.group.allreduce([payload], self._max_opts)
        except Exception as exc:  # noqa: BLE001 - the side group is gone (process group torn down)
            self._give_up(s, f"its collective failed: {exc}")
            return
        s.launched += 1
        s.in_flight.append((work, payload, row, ev, s.launched - 1))

    def _wait(self, s: _Set, work, seq: int, ev: Optional[_Event]) -> bool:
        """Wait for `work` up to desync_timeout; True when it completed. Otherwise the missing
        ranks are reported and the set is not compared any more."""
        t0 = time.monotonic()
        deadline = t0 + self._timeout
        next_look = t0 + 0.05
        store = None
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                self._missing(s, seq, ev, now - t0, timed_out=True)
                return False
            if now >= next_look:  # a member that closed with fewer comparisons never comes
                next_look = now + 0.5
                try:
                    store = store or _dist().distributed_c10d._get_default_store()
                    gone = self._closed_before(s, seq, store)
                except Exception:  # noqa: BLE001
                    gone = []
                if gone:
                    self._missing(s, seq, ev, now - t0, timed_out=False)
                    return False
            time.sleep(0.0002 if now - t0 < 0.01 else 0.005)
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - a peer left: connection closed
            self._missing(s, seq, ev, time.monotonic() - t0, timed_out=False, error=str(exc))
            return False
        return True

    def _closed_before(self, s: _Set, seq: int, store) -> list:
        """Members that closed their sanitizer after fewer than seq+1 comparisons: (rank, n)."""
        out = []
        for r in s.ranks:
            if r == self._rank:
                continue
            key = s.prefix + f"closed/{r}"
            if store.check([key]):
                n = int(store.get(key))
                if n <= seq:
                    out.append((r, n))
        return out

    def _missing(self, s: _Set, seq: int, ev: Optional[_Event], waited: float, timed_out: bool,
                 error: str = "") -> None:
        """Report the members that did not take part in comparison `seq`: those that closed
        their sanitizer before it, and after a timeout those that did not time out too."""
        missing, detail = [], []
        try:
            store = _dist().distributed_c10d._get_default_store()
            closed = dict(self._closed_before(s, seq, store))
            if timed_out and not closed:
                store.set(s.prefix + f"late/{seq}/{self._rank}", "1")
                time.sleep(min(_MISSING_GRACE_S, self._timeout / 4))
                closed = dict(self._closed_before(s, seq, store))
                late = {r for r in s.ranks if store.check([s.prefix + f"late/{seq}/{r}"])}
                missing = [r for r in s.ranks if r != self._rank and (r not in late or r in closed)]
            else:
                missing = sorted(closed) or [r for r in s.ranks if r != self._rank]
            for r in missing:
                detail.append(
                    f"rank {r} closed its sanitizer after {closed[r]} comparison(s), this rank "
                    f"made {seq + 1}" if r in closed else "")
        except Exception as exc:  # noqa: BLE001
            missing = [r for r in s.ranks if r != self._rank]
            detail = [f"(the store could not say which: {exc})"]
        if error and not any(detail):
            detail.append(f"the comparison failed: {error[:200]}")
        step = ev.step if ev is not None else 0
        opt = ev.opt if ev is not None else -1
        waited = self._timeout if timed_out else 0.0
        self._report(2, step, opt, s, [], [], [], [], [], [], False, missing, waited, detail)
        s.dead = True

    def _give_up(self, s: _Set, why: str) -> None:
        s.dead = True
        warnings.warn(f"trainsan: rank_desync stops comparing {s.context}: {why}", stacklevel=4)

    def _drain(self, s: _Set, keep: int) -> None:
        while len(s.in_flight) > keep and not s.dead:
            work, payload, row, ev, seq = s.in_flight.pop(0)
            if self._wait(s, work, seq, ev):
                self._judge(s, payload, row, ev, seq)

    def _judge(self, s: _Set, payload: torch.Tensor, row: torch.Tensor, ev: _Event,
               seq: int) -> None:
        # The verdict is C++ (trainsan::judge_replica_payload, Note [Replica payload] in
        # host/checks/replicas.cpp); gathering the rows it asks for and reporting stay here.
        known = sorted(s.known)
        (outcome, fields, tensors, whats, shown, fetch, grads_compared, grads_differ,
         forwards_differ) = torch.ops.trainsan.judge_replica_payload(
            payload, [self._names[i] for i in s.members], [n for n, _ in s.buffers],
            [w for w, _ in known], [t for _, t in known])
        if outcome == _AGREE:
            return
        if outcome == _NOT_REPLICAS:
            self._give_up(s, "the ranks hold different parameters (names, shapes or placements) "
                          "in it, so they are not replicas of one model (pipeline stages?); "
                          "switch the check off with checks={'rank_desync': False} if intended")
            return
        got = self._rows(s, seq, row.tolist(), fetch)
        forwards = got[_FORWARDS] if got and forwards_differ else []
        if outcome == _OUT_OF_STEP:
            self._report(1, ev.step, ev.opt, s, [], [], [], [], got[_STEP] if got else [],
                         forwards, False, [], 0.0, [])
            s.dead = True  # the sequences no longer pair up
            return
        if outcome == _SKIPS_DIFFER:
            self._report(1, ev.step, ev.opt, s, [], [], [], got[_SKIPPED] if got else [], [], [],
                         False, [], 0.0, [])
            s.dead = True  # every comparison after this one differs: said once
            return
        s.known.update(zip(whats, tensors))
        labels = []  # per tensor, the class of each rank's value (-1: not shown)
        for field, show in zip(fields, shown):
            labels += (torch.ops.trainsan.replica_labels(got[field]) if got and show
                       else [-1] * len(s.ranks))
        if forwards_differ:
            s.dead = True  # out of step: every later comparison pairs different steps
        self._report(0 if ev.first else 1, ev.step, ev.opt, s, tensors, whats, labels, [], [],
                     forwards, grads_compared and not grads_differ, [], 0.0, [])

    def _rows(self, s: _Set, seq: int, mine: list, fields: list) -> Optional[dict]:
        """`fields` of every member's row of comparison `seq`, in the order of s.ranks, through
        the store (a mismatch is rare; the store pairs nothing by order, so a rank whose
        sequence has shifted cannot be mismatched against another collective). None when a
        member does not answer within desync_timeout."""
        try:
            store = _dist().distributed_c10d._get_default_store()
            key = s.prefix + f"rows/{seq}/"
            store.set(key + str(self._rank), ",".join(str(mine[f]) for f in fields))
            keys = [key + str(r) for r in s.ranks]
            store.wait(keys, datetime.timedelta(seconds=self._timeout))
            rows = [[int(v) for v in store.get(k).decode().split(",")] for k in keys]
        except Exception:  # noqa: BLE001 - a member that is gone: report without the split
            return None
        return {f: [r[c] for r in rows] for c, f in enumerate(fields)}

    def _report(self, moment, step, opt, s, tensors, whats, labels, skipped, steps_at, forwards,
                grads_agree, missing, waited, detail) -> None:
        # labels: len(ranks) classes per tensor, flattened (-1: not known for that tensor).
        n = len(s.ranks)
        mismatches = [{"tensor": t, "what": w, "labels": labels[k * n:(k + 1) * n]
                       if labels and labels[k * n] >= 0 else []}
                      for k, (t, w) in enumerate(zip(tensors, whats))]
        reports = self._handle.replica_report(_native.facts(
            "ReplicaReport", moment=moment, step=step, opt=opt, group=s.context,
            ranks=list(s.ranks), mismatches=mismatches, skipped=[bool(v) for v in skipped],
            steps_at=steps_at, forwards=forwards, grads_agree=grads_agree, missing=missing,
            waited_s=waited, missing_detail=detail))
        if self._collect is not None:
            self._collect.extend(reports)
        else:
            self._apply(reports)


def _side_group(ranks: tuple, timeout_s: float):
    """A gloo process group over `ranks` for the comparison (made by the members only)."""
    dist = _dist()
    return dist.new_group(
        list(ranks),
        backend="gloo",
        timeout=datetime.timedelta(seconds=max(timeout_s * 2, 60.0)),
        use_local_synchronization=True,
    )
