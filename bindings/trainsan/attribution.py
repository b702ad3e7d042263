"""Re-run attribution (rerun_on_error; Note [Re-run attribution], host/checks/attribution.cpp).

With rerun_on_error=N, every training forward of the attached model keeps what a re-run of it
needs: references to its inputs and outputs, the RNG states it started from, a copy of the
model's buffers, and the gradients that reach its outputs in the backward (the last two steps'
are kept). When an event reports a new nonfinite_loss, nonfinite_grad (errors) or loss_spike (a
warning), before the policy acts (Sanitizer._apply), its step's last forward is re-run once —
the backward too for nonfinite_grad, with torch.autograd.grad so .grad is never touched — the
RNG and buffers are put back, and the outcome goes to the C++ side, which judges it
(trainsan::judge_rerun), rewrites the finding (``reproduces``, the message) and writes the
rerun_attribution and poison_batch trace records. The sanitizer's own hooks and the op audit look
away during the re-run. A re-run that raises is reported in the finding, never retried.

:func:`skip_poison` is the other half: a resumed run told to skip the batches a trace recorded
as poison (``for x, y in trainsan.skip_poison(loader, "run1.jsonl"):``). The sanitizer never
skips a batch by itself.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from . import _native
from ._facts import _flat_tensors, _local
from ._findings import TrainingBugWarning
from ._gatherers import Gatherer
from ._rerun import ForwardRecord, autocast_as, started_from
from .determinism import _distributed
from .precision import _float_tensors
from .replicas import fingerprints
from .report import earlier_part

_MASK = (1 << 64) - 1


def _hex(h: int) -> str:
    return f"{h & _MASK:016x}"


def _batch_tensors(batch: Any) -> list:
    return [_local(t).detach() for t in _flat_tensors(batch, [])
            if t.layout == torch.strided and t.numel() > 0]


def batch_fingerprint(batch: Any) -> tuple[str, list[str]]:
    """(the batch's fingerprint, each tensor's): 16 hex digits each, from the TensorStats hash of
    the batch's tensors (tuples, lists and dicts of them, two levels deep) in order, mixed as
    host/feeds/rerun_feed.cpp's combine() does (FNV-1a over the 64-bit words). The poison_batch
    records and :func:`skip_poison` both use it."""
    hashes = fingerprints(_batch_tensors(batch))
    if not hashes:
        return "", []
    h = 0xCBF29CE484222325
    for x in hashes:
        h = ((h ^ (x & _MASK)) * 0x100000001B3) & _MASK
    return _hex(h), [_hex(x) for x in hashes]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within a relative 1e-4 (a GPU's non-deterministic reductions), NaN/Inf alike."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return bool(torch.allclose(a, b, rtol=1e-4, atol=0.0, equal_nan=True))


def _nonfinite(ts: list) -> bool:
    return bool(ts) and not bool(torch.stack([torch.isfinite(t).all() for t in ts]).all())


class Attribution(Gatherer):
    """Re-run attribution of one sanitizer (rerun_on_error > 0)."""

    def __init__(self, san, model: torch.nn.Module) -> None:
        self._ref = weakref.ref(san)
        self._model = model
        self._steps: dict = {}  # step -> ForwardRecord: the step's last training forward
        self._current: Optional[ForwardRecord] = None  # awaiting its outputs
        self._running = False
        self._hook = model.register_forward_hook(self._outputs)

    # -- recording (every training forward) ------------------------------------------------------

    def on_forward(self, args: Any, kwargs: Any, train: bool) -> None:
        san = self._ref()
        if not train or self._running or san is None:
            return
        step = int(san.handle.step())
        prev = self._steps.get(step)
        # Note [One re-run recorder] (_rerun.py)
        rec = ForwardRecord(self._model, args, kwargs, prev.forwards + 1 if prev else 1)
        self._steps[step] = rec
        for s in [s for s in self._steps if s < step - 1]:
            del self._steps[s]
        self._current = rec

    def _outputs(self, module, args, out) -> None:
        rec, self._current = self._current, None
        if rec is None or self._running:
            return
        rec.watch_outputs(out, keep=True)

    def after_step(self, k: int, skipped: bool) -> None:
        if not skipped:
            for rec in self._steps.values():
                rec.stepped = True

    def close(self) -> list:
        self._hook.remove()
        self._steps.clear()
        self._current = None
        return []

    # -- the re-run (a new finding) ----------------------------------------------------------------

    def attribute(self, reports: list) -> list:
        san = self._ref()
        if san is None or san.closed or self._running:
            return reports
        handle = san.handle
        out = []
        for t, action in reports:
            try:
                # The finding by field name (finding.def), as the event reported it.
                need = int(handle.rerun_needed(t))
                if need == 1:
                    t = handle.attribute(t, self._rerun(int(t["step"]), t["kind"]))
                elif need == 2:
                    t = handle.attribute(t, None)
            except Exception:  # noqa: BLE001 - the finding goes out as it was
                pass
            out.append((t, action))
        return out

    def _rerun(self, step: int, kind: str) -> dict:
        rec = self._steps.get(step)
        if rec is None:
            return _native.facts("RerunOutcome", error=(
                f"the state step {step} started from was not kept (the attached model's training "
                "forwards keep it for two steps)"))
        if _distributed():
            return _native.facts("RerunOutcome", error=(
                "a distributed run: re-running one rank's step would issue its collectives "
                "alone"))
        o: dict = {"forwards": rec.forwards, "params_changed": rec.stepped, "rank": _rank()}
        try:
            o["fingerprint"], o["tensors"] = batch_fingerprint((rec.args, rec.kwargs))
        except Exception:  # noqa: BLE001 - a dtype the fingerprint does not take: no poison record
            pass
        try:
            o.update(self._run(rec, kind == "nonfinite_grad"))
            o["ran"] = True
        except Exception as exc:  # noqa: BLE001 - reported in the finding, never retried
            o["ran"] = False
            first = str(exc).splitlines()[0] if str(exc) else ""
            o["error"] = f"{type(exc).__name__}: {first}"[:300]
        return _native.facts("RerunOutcome", **o)

    def _run(self, rec: ForwardRecord, grads: bool) -> dict:
        san, model = self._ref(), self._model
        o: dict = {}
        if rec.stepped:
            o["params_nonfinite"] = _nonfinite([_local(p).detach() for p in model.parameters()
                                                if p.is_floating_point()])
        closed, san.closed = san.closed, True  # the sanitizer's hooks look away
        san.handle.pause_audit(True)
        self._running = True
        try:
            # The step's starting buffers and RNG state (Note [One re-run recorder], _rerun.py).
            with started_from(model, rec):
                with autocast_as(rec), torch.enable_grad() if grads else torch.no_grad():
                    out = model(*rec.args, **rec.kwargs)
                outs = _float_tensors(out, [])
                o["outputs_nonfinite"] = _nonfinite([t.detach() for t in outs])
                if rec.outputs is not None:
                    o["outputs_compared"] = True
                    o["step_outputs_nonfinite"] = _nonfinite(rec.outputs)
                    o["outputs_match"] = len(outs) == len(rec.outputs) and all(
                        _same(a.detach(), b) for a, b in zip(outs, rec.outputs))
                if grads and rec.cotangents and rec.forwards == 1:
                    live = [t for t in outs if t.requires_grad]
                    pairs = [(live[i], g) for i, g in sorted(rec.cotangents.items())
                             if i < len(live)]
                    params = [p for p in model.parameters() if p.requires_grad]
                    if pairs and params:
                        gs = torch.autograd.grad([a for a, _ in pairs], params,
                                                 [g for _, g in pairs], allow_unused=True)
                        o["grads_rerun"] = True
                        o["grads_nonfinite"] = _nonfinite([g for g in gs if g is not None])
        finally:
            self._running = False
            san.handle.pause_audit(False)
            san.closed = closed
        return o


def attribution(san, model: torch.nn.Module, options: dict) -> Gatherer:
    """The sanitizer's re-run attribution: a Gatherer that does nothing (no event of it is
    called) unless rerun_on_error > 0."""
    return Attribution(san, model) if int(options.get("rerun_on_error", 0)) > 0 else Gatherer()


def attributed(san, reports: list) -> list:
    """`reports` (an event's findings with the policy's answers), with the new nonfinite_loss,
    nonfinite_grad and loss_spike findings answered by a re-run of their step (rerun_on_error),
    before the policy acts."""
    if not reports:
        return reports
    for part in san.parts:
        if isinstance(part, Attribution):
            return part.attribute(reports)
    return reports


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001
        return 0


# -- skipping poison batches in a resumed run ------------------------------------------------------


def poison_batches(trace: Union[str, os.PathLike, Iterable]) -> list[dict]:
    """The ``poison_batch`` records of a TrainSan trace (a path, or several): the batches whose
    non-finite loss or gradient, or loss spike, reproduced when their step was re-run
    (rerun_on_error), each ``{"rank", "step", "fingerprint", "tensors", "kind"}``. A rotated
    trace (trace_max_mb) is read with the earlier part it continues, ``<path>.1``."""
    paths = [trace] if isinstance(trace, (str, os.PathLike)) else list(trace)
    out = []
    for path in paths:
        # A rotated trace (trace_max_mb) begins with a header that has "rotated": the records
        # before it, poison batches among them, are in <path>.1; read first, in order.
        parts = [path]
        earlier = earlier_part(path, _first_record(path))
        if earlier and os.path.isfile(earlier):
            parts.insert(0, earlier)
        for part in parts:
            with open(part, encoding="utf-8") as fh:
                for line in fh:
                    if '"poison_batch"' not in line:
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and rec.get("type") == "poison_batch":
                        out.append(rec)
    return out


def _first_record(path) -> Optional[dict]:
    """The first record of the trace at `path` (its header), or None where it is not JSON."""
    with open(path, encoding="utf-8") as fh:
        first = fh.readline()
    try:
        return json.loads(first)
    except ValueError:
        return None


def skip_poison(batches: Iterable, trace: Union[str, os.PathLike, Iterable],
                inputs: Optional[Callable[[Any], Any]] = None) -> Iterator:
    """Iterate over `batches` (a DataLoader, any iterable) without the batches that trace `trace`
    (the run being resumed) recorded as poison: one line in a loop,
    ``for x, y in trainsan.skip_poison(loader, "run1.jsonl"):``.

    A batch is skipped when its tensors (or those of ``inputs(batch)``: what the model is called
    with, where the loop transforms the batch first) include every input tensor of a
    ``poison_batch`` record, by fingerprint (:func:`batch_fingerprint`); each skip is warned
    (TrainingBugWarning). The records are read now, before an attach that writes the same path
    truncates it. Costs one fingerprint pass over each batch (a host read). Skipping changes what
    the run trains on: it is the loop's choice, never the sanitizer's.
    """
    records = [r for r in poison_batches(trace) if r.get("tensors")]
    return _skipping(batches, records, inputs)


def _skipping(batches: Iterable, records: list, inputs: Optional[Callable]) -> Iterator:
    for i, batch in enumerate(batches):
        if records:
            _, hexes = batch_fingerprint(batch if inputs is None else inputs(batch))
            have = set(hexes)
            hit = next((r for r in records if set(r["tensors"]) <= have), None)
            if hit is not None:
                warnings.warn(
                    f"trainsan.skip_poison: skipped batch {i}: it holds the batch of the "
                    f"poison_batch record of step {hit.get('step')} (rank {hit.get('rank')}, "
                    f"{hit.get('kind')}, fingerprint {hit.get('fingerprint')})",
                    TrainingBugWarning, stacklevel=2)
                continue
        yield batch
