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
training never waits for it); only where some field differs does a second exchange (the rows,
through the store) tell which ranks hold which value. What the payload says is judged in C++
(trainsan::judge_replica_payload and replica_labels, Note [Replica payload] in
host/checks/replicas.cpp). The schedule of launches, reads and exchanges depends only on the
sequence of events, never on timing, so every member issues the same collectives in the same
order.

A rank that does not arrive (it skipped optimizer.step(), left the loop, hangs) never hangs the
job: a wait gives up after ``desync_timeout`` seconds — at once where the rank has closed its
sanitizer with fewer comparisons, which every rank records in the store at close — and reports
which ranks were missing; the set is not compared any more after that, nor after the ranks were
found at different steps (their sequences no longer pair up).

The comparison before the first step (the weights the replicas start from) is the one blocking
collective: at the first optimizer step, after the backward, before the update.

The schedule of collectives around the row — launch, wait with desync_timeout, read at the next
event, the second exchange where something differs, the missing-rank report, stopping after
missing or misaligned ranks — is one C++ implementation, trainsan::ReplicaEngine (Note [Replica
comparison over c10d], host/replicas_pg.cpp), which trainsan::compare_replicas drives for a
LibTorch program too. This module drives one engine per replica set through _trainsan_hot (Note
[One orchestration], bindings/csrc/hot.cpp), giving it the set's side group as the
c10d::ProcessGroup it is (torch's pybind11 caster) and the steps that are this side's own as
Python callables (_StoreSteps): which ranks are missing (the store's closed/late keys, so a rank
that closed early is named, and the wait for it ends at once), which rank holds which value (rows
through the store, which a rank whose sequence shifted cannot mismatch) and the warning when a set
stops. What stays here: the replica sets (DTensor placements, DDP, plain parameters, buffers),
the step events and their fingerprints (paired with the passes that landed), the optimizer
state's fingerprints on sampled steps, the blocking first comparison at the first optimizer step,
and the closed keys at close. Without _trainsan_hot (Note [One orchestration]) rank_desync is
off, with a note: there is no second implementation here.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import time
import warnings
import weakref
import zlib
from typing import Any, Callable, Optional

import torch

from ._facts import _is_dtensor, _local, run_guarded
from ._tables import OPTIONS
from .stats import INT_FIELDS

_HASH_COL = INT_FIELDS.index("hash")
_MASK = (1 << 64) - 1
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
    """One replica set: its ranks, side group, members and engine (trainsan::ReplicaEngine)."""

    def __init__(self, ranks: tuple, context: str, grads: bool):
        self.ranks = ranks
        self.context = context
        self.grads = grads  # gradients are reduced alike across the set (DDP)
        self.members: list[int] = []  # parameter indices
        self.buffers: list = []  # (name, tensor)
        self.digest = 0
        self.group = None
        self.prefix = ""
        self.engine = None  # _trainsan_hot.ReplicaEngine


class _StoreSteps:
    """The steps of a set's comparison that read the store (ReplicaSteps, replica_engine.h), as
    the engine calls them. Holds no reference to the engine or the comparison (which hold it)."""

    def __init__(self, prefix: str, ranks: tuple, rank: int, timeout: float, context: str):
        self.prefix, self.ranks, self.rank = prefix, ranks, rank
        self.timeout, self.context = timeout, context

    def closed_before(self, seq: int, store) -> list:
        """Members that closed their sanitizer after fewer than seq+1 comparisons: (rank, n)."""
        out = []
        for r in self.ranks:
            if r == self.rank:
                continue
            key = self.prefix + f"closed/{r}"
            if store.check([key]):
                n = int(store.get(key))
                if n <= seq:
                    out.append((r, n))
        return out

    def gone(self, seq: int) -> bool:
        """While waiting: a member that closed with fewer comparisons never comes."""
        try:
            return bool(self.closed_before(seq, _store()))
        except Exception:  # noqa: BLE001 - a torn-down store: the wait's timeout decides
            return False

    def missing(self, seq: int, timed_out: bool) -> tuple:
        """The members that did not take part in comparison `seq`, a detail each: those that
        closed their sanitizer before it, and after a timeout those that did not time out too."""
        try:
            store = _store()
            closed = dict(self.closed_before(seq, store))
            if timed_out and not closed:
                store.set(self.prefix + f"late/{seq}/{self.rank}", "1")
                time.sleep(min(_MISSING_GRACE_S, self.timeout / 4))
                closed = dict(self.closed_before(seq, store))
                late = {r for r in self.ranks if store.check([self.prefix + f"late/{seq}/{r}"])}
                missing = [r for r in self.ranks
                           if r != self.rank and (r not in late or r in closed)]
            else:
                missing = sorted(closed) or [r for r in self.ranks if r != self.rank]
            detail = [f"rank {r} closed its sanitizer after {closed[r]} comparison(s), this rank "
                      f"made {seq + 1}" if r in closed else "" for r in missing]
        except Exception as exc:  # noqa: BLE001
            missing = [r for r in self.ranks if r != self.rank]
            detail = [f"(the store could not say which: {exc})"]
        return missing, detail

    def rows(self, seq: int, mine: list, fields: list) -> Optional[list]:
        """`fields` of every member's row of comparison `seq`, in the order of the ranks, through
        the store (a mismatch is rare; the store pairs nothing by order, so a rank whose sequence
        has shifted cannot be mismatched against another collective). None when a member does
        not answer within desync_timeout."""
        try:
            store = _store()
            key = self.prefix + f"rows/{seq}/"
            store.set(key + str(self.rank), ",".join(str(mine[f]) for f in fields))
            keys = [key + str(r) for r in self.ranks]
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return [[int(v) for v in store.get(k).decode().split(",")] for k in keys]
        except Exception:  # noqa: BLE001 - a member that is gone: report without the split
            return None

    def warn(self, why: str) -> None:
        warnings.warn(f"trainsan: rank_desync stops comparing {self.context}: {why}",
                      stacklevel=2)


def _store():
    return _dist().distributed_c10d._get_default_store()


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


def _emitter(comparison: "ReplicaComparison") -> Callable:
    """The engine's way to the comparison's reports, without keeping it alive (the engine, which
    the comparison holds, holds this)."""
    ref = weakref.ref(comparison)

    def emit(reports: list) -> None:
        c = ref()
        if c is not None:
            c._emit(reports)

    return emit


class ReplicaComparison:
    """The rank_desync comparison of one sanitizer (Note [Replica comparison])."""

    def __init__(self, handle, model: torch.nn.Module, names: list, params: list,
                 optimizers: list, options: dict, apply: Callable, forwards: Callable[[], int],
                 engines: Any):
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
        hid = int(handle.hot_id()) if self._sets else 0
        emit = _emitter(self)
        for s in self._sets:
            layout = [(names[i], tuple(params[i].shape), str(params[i].dtype),
                       str(getattr(params[i], "placements", ""))) for i in s.members]
            layout += [(n, tuple(b.shape), str(b.dtype)) for n, b in s.buffers]
            s.digest = _digest([s.context, s.ranks, layout])
            s.group = _side_group(s.ranks, self._timeout)
            s.prefix = f"trainsan/desync/{_instances[0]}/{'-'.join(map(str, s.ranks))}/"
            steps = _StoreSteps(s.prefix, s.ranks, self._rank, self._timeout, s.context)
            s.engine = engines.ReplicaEngine(
                hid, s.group, s.context, list(s.ranks), self._rank, s.members,
                [names[i] for i in s.members], [n for n, _ in s.buffers], s.digest,
                self._timeout, "checks={'rank_desync': False}", emit, gone=steps.gone,
                missing=steps.missing, rows=steps.rows, warn=steps.warn)
        if self._sets:
            handle.compare_replicas()

    @property
    def sets(self) -> list:
        return self._sets

    def _live(self) -> list:
        return [s for s in self._sets if not s.engine.stopped]

    def _guarded(self, fn: Callable, *args: Any) -> None:
        """Run fn; a failure of the comparison's own machinery (not a finding) stops it with a
        warning instead of reaching the training loop."""

        def stop() -> None:
            for s in self._sets:
                s.engine.stop()

        run_guarded(fn, args, "rank_desync (its comparison failed)", stop)

    def _emit(self, reports: list) -> None:
        if self._collect is not None:
            self._collect.extend(reports)
        else:
            self._apply(reports)

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
        for s in self._live():
            self._launch(s, ev)
            s.engine.drain(0)

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
            for s in self._live():
                self._launch(s, ev)
        for s in self._live():
            s.engine.drain(0 if final else 1)

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
                store = _store()
                for s in self._sets:
                    store.set(s.prefix + f"closed/{self._rank}", str(s.engine.launched))
            except Exception:  # noqa: BLE001 - a torn-down process group: nothing to tell
                pass
        found, self._collect = self._collect, None
        return found

    # -- what this rank knows of an event ---------------------------------------------------

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

    def _launch(self, s: _Set, ev: _Event) -> None:
        """Set `s`'s comparison of event `ev`: this rank's facts (ReplicaRowFacts), from which
        the engine builds the row (trainsan::replica_row, Note [Replica payload])."""
        fp = ev.fp
        state = ev.state or {}
        s.engine.launch(
            ev.opt, ev.count, ev.step, ev.skipped, ev.forwards, list(fp),
            [v[0] for v in fp.values()], [v[2] for v in fp.values()],
            [v[1] for v in fp.values()], sorted(ev.grad_ok or ()),
            [(i, _signed(h)) for i, h in state.items()],
            ev.buffers.get(id(s), []) if ev.buffers else [], ev.first)


def _side_group(ranks: tuple, timeout_s: float):
    """A gloo process group over `ranks` for the comparison (made by the members only)."""
    dist = _dist()
    return dist.new_group(
        list(ranks),
        backend="gloo",
        timeout=datetime.timedelta(seconds=max(timeout_s * 2, 60.0)),
        use_local_synchronization=True,
    )
