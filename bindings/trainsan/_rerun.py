"""The re-run recorder: what a re-run of one training forward needs, and the one way a re-run puts
the model's state back.

Note [One re-run recorder]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Two checks re-run a training forward: nondeterminism (determinism.py, on the rerun_every steps:
twice, before the optimizer step) and re-run attribution (attribution.py, rerun_on_error: once,
when a new finding asks). Both record the forward alike (ForwardRecord): references to its inputs,
the RNG states it started from (CPU, and every initialised CUDA device), copies of the model's
buffers, the autocast regions it ran in, and, through hooks on its floating outputs, the gradients
that reach them in the backward (keyed by the output's index among the floating outputs). A
re-run starts from that state through started_from(): the model's buffers are *swapped* for
copies of the recorded values — every module slot holding one buffer object gets the same copy —
and the model's own put back untouched afterwards, with the RNG state as the re-run found it. An
in-place restore (copy_) would move the version counters of the buffers, which a backward still
to come checks (attribution re-runs before the step's backward when a loss is non-finite). Both
re-run forwards enter the recorded autocast regions (autocast_as()): the re-runs run outside the
loop's autocast block, and a float32 re-run of a bfloat16 forward would differ from it. The
recompute check (recompute.py) re-runs nothing (torch.utils.checkpoint does) and fingerprints the
same RNG states, rng() below.

The nondeterminism re-runs are orchestrated by one C++ driver, Sanitizer::rerun (Note [One re-run
driver], host/feeds/rerun_feed.cpp), which determinism.py calls through _trainsan_hot (Note [One
orchestration], bindings/csrc/hot.cpp) with what differs from a LibTorch loop as callables: the
start state is started_from() below entered and left around each run (a LibTorch loop's is
begin_step()'s, copied into Setup::buffers), and a run calls the model on the recorded inputs,
fingerprints each module's output in its forward hook and takes the gradients with
torch.autograd.grad from the recorded output gradients (no .grad and no hook on it touched),
named by model.named_parameters() (a LibTorch loop's step function fills .grad, named by the
sanitizer's parameters). The two runs, the look-away of the gradient hooks and the op audit, the
fingerprints of the gradients, the comparison (compare_reruns) and the report are the driver's;
determinism.py keeps the recording and the two callables. Without _trainsan_hot the re-runs are
off, with a note (no second implementation).

Re-run attribution is single-sourced where it decides: which finding is re-run, the
rerun_on_error budget, the verdict (judge_rerun), the finding's rewrite and the trace records are
C++ (Sanitizer::rerun_needed / attribute). What a re-run measured (RerunOutcome) is gathered twice,
by attribution.py and by RerunFeed::rerun_for for a LibTorch loop's Setup::rerun_step, because
the two measure different things: Python re-runs the model's forward (the backward only for
nonfinite_grad, from the recorded output gradients) and compares the module outputs it kept,
within a relative 1e-4, and it can re-run before the step's backward (the buffers are swapped,
not written); a LibTorch step function runs forward and backward, and its values are compared
by fingerprint with the losses the step watched.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .precision import _float_tensors


def rng() -> tuple:
    """The RNG states a re-run starts from: the CPU's, and every CUDA device's once CUDA is
    initialised (None before)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def autocast_regions() -> list:
    """[(device type, dtype)] of the autocast regions enabled now."""
    out = []
    for dev in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(dev):
                out.append((dev, torch.get_autocast_dtype(dev)))
        except Exception:  # noqa: BLE001 - a device type this torch does not know
            pass
    return out


class ForwardRecord:
    """What a re-run of one training forward needs (Note [One re-run recorder]); made just before
    the forward runs."""

    __slots__ = ("args", "kwargs", "rng", "buffers", "amp", "outputs", "cotangents", "forwards",
                 "stepped", "modules")

    def __init__(self, model: torch.nn.Module, args: Any, kwargs: Any, forwards: int = 1):
        self.args, self.kwargs = args, kwargs
        self.rng = rng()
        self.buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self.amp = autocast_regions()
        self.outputs: Optional[list] = None  # the forward's floating outputs (detached), if kept
        self.cotangents: dict = {}  # index among the floating outputs -> the gradient reaching it
        self.forwards = forwards  # training forwards of this step so far
        self.stepped = False  # an optimizer step updated the parameters since
        self.modules: list = []  # (name, type, fingerprints) per module output, if recorded

    def watch_outputs(self, out: Any, keep: bool) -> None:
        """The forward returned `out`: keep its floating outputs (detached) where `keep`, and
        record the gradients that reach those that need one."""
        outs = _float_tensors(out, [])
        if keep:
            self.outputs = [t.detach() for t in outs]
        for i, t in enumerate(outs):
            if t.requires_grad:
                t.register_hook(lambda g, _i=i: self.cotangents.__setitem__(_i, g.detach()))


def autocast_as(rec: ForwardRecord) -> contextlib.ExitStack:
    """The autocast regions `rec`'s forward ran in, entered: a re-run's forward runs where the
    step's did (the re-runs run outside the loop's own autocast block)."""
    stack = contextlib.ExitStack()
    for dev, dtype in rec.amp:
        stack.enter_context(torch.autocast(dev, dtype=dtype))
    return stack


@contextlib.contextmanager
def started_from(model: torch.nn.Module, rec: ForwardRecord) -> Iterator[None]:
    """For the length of the block, the model's buffers are copies of those `rec` recorded and the
    RNG state is the recorded one; afterwards the model's own buffers are back, untouched, and the
    RNG state is as the block found it (Note [One re-run recorder])."""
    now = rng()
    copies = {id(b): rec.buffers[n].clone() for n, b in model.named_buffers()
              if n in rec.buffers}
    swapped = []
    try:
        for m in model.modules():
            for n, b in list(m._buffers.items()):
                if b is not None and id(b) in copies:
                    swapped.append((m, n, b))
                    m._buffers[n] = copies[id(b)]
        set_rng(rec.rng)
        yield
    finally:
        for m, n, b in reversed(swapped):
            m._buffers[n] = b
        set_rng(now)
