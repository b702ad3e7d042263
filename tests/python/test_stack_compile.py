"""TrainSan under torch.compile.

With a sanitizer attached, torch.compile must keep working as it does without one — no graph
break, no recompile, no error with ``fullgraph=True`` caused by TrainSan — and TrainSan must
still see every training forward (its forward event runs eagerly, outside the compiled graph),
every optimizer step and every backward's loss. The matrix is USES, the ways a loop compiles:

* ``compile_model``: ``attach(model)``, then ``compiled = torch.compile(model)``; the loop calls
  ``compiled(x)`` (and ``compile_model_first``: compiled before attach);
* ``attach_compiled``: ``attach(torch.compile(model))``, an OptimizedModule;
* ``module_compile``: ``model.compile()`` in place, after attach (``module_compile_first``:
  before);
* ``compiled_loss``: the loss function compiled, ``torch.compile(F.cross_entropy)``;
* ``compiled_step``: ``@torch.compile def step(): opt.step()``. torch.optim graph-breaks around
  the update itself (``_use_grad_for_differentiable``), so there is no ``fullgraph=True`` variant,
  and TrainSan's step hooks may leave the graph there on purpose (``torch.compiler.disable``),
  next to torch's own breaks: the update's graph must stay what it is without TrainSan;

the model uses with ``fullgraph=True`` too (suffix ``_fullgraph``). Each use runs SCENARIOS:

* ``clean``: no finding at error severity (policy ``"raise"`` would raise), the same graphs as
  the same loop without TrainSan (so: no graph break, nothing of TrainSan's in a graph), no new
  frame or graph compiled after WARMUP steps (no recompile: the label guard's audited window
  closes at step AUDIT_STEPS, inside the loop), and every forward, loss and step counted;
* ``nan_input``: a NaN in one input at step NAN_STEP -> ``nonfinite_loss`` raised at that step;
* ``no_zero_grad``: ``optimizer.zero_grad()`` never called -> ``stale_grad`` raised at step 1.

The backend is ``aot_eager`` (dynamo and AOTAutograd, no code generation: fast on a CPU) wrapped
in a recorder of the graphs it receives; one case runs inductor (C++ code generation, about half
a minute on two cores the first time in a process).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import trainsan

try:
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    _COMPILE = dynamo.is_dynamo_supported()
except Exception:  # noqa: BLE001 - any import failure means: no torch.compile here
    _COMPILE = False

pytestmark = pytest.mark.skipif(
    not _COMPILE, reason="torch.compile (TorchDynamo) is not supported on this platform/Python"
)

STEPS = 6  # optimizer steps per run
WARMUP = 2  # steps after which nothing may compile any more
AUDIT_STEPS = 3  # audit_first_steps: the audited window (the label guard) closes inside the loop
NAN_STEP = 3

MODEL_USES = ("compile_model", "attach_compiled", "module_compile")
USES = (
    *MODEL_USES,
    *(u + "_fullgraph" for u in MODEL_USES),
    "compile_model_first",
    "module_compile_first",
    "compiled_loss",
    "compiled_step",
)
SCENARIOS = {  # planted bug -> the finding kind it must raise, and at which step
    "nan_input": ("nonfinite_loss", NAN_STEP),
    "no_zero_grad": ("stale_grad", 1),
}

# torch.optim's own graph breaks in a compiled step (Optimizer._use_grad_for_differentiable) and
# the one kind of break TrainSan may add there: a call to a torch.compiler.disable()d hook.
_OPTIM_BREAK = "Call to `torch._dynamo.graph_break()`"
_DISABLED_CALL = "Skip calling `torch.compiler.disable()`d function"


class Net(torch.nn.Module):
    """A user-defined module: model.compile() of a torch.nn.Sequential would trace nothing
    (dynamo skips torch.nn's own frames unless entered through torch.compile(model))."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 12)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


class _Recorder:
    """A dynamo backend: `inner` (a registered backend's name), recording each graph it gets as
    the list of the ops it calls."""

    def __init__(self, inner: str):
        self.inner = dynamo.lookup_backend(inner)
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        ops = ("call_function", "call_method", "call_module")
        self.graphs.append(
            [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op in ops]
        )
        return self.inner(gm, example_inputs)


def _compile_state() -> tuple:
    return counters["frames"]["total"], counters["stats"]["unique_graphs"]


def _breaks() -> dict:
    """Graph breaks so far: {first line of the reason: count}."""
    out: dict = {}
    for reason, n in counters["graph_break"].items():
        key = reason.strip().splitlines()[0]
        out[key] = out.get(key, 0) + n
    return out


def _run(use: str, scenario: str = "clean", backend="aot_eager", sanitize: bool = True):
    """One training run of `use`; returns (sanitizer or None, record). The sanitizer is closed;
    an exception from the loop (a planted bug's TrainingBugError) propagates."""
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fullgraph = use.endswith("_fullgraph")
    kind = use.removesuffix("_fullgraph")
    kw = dict(backend=backend, fullgraph=fullgraph)

    def attach(m):
        if not sanitize:
            return None
        return trainsan.attach(m, opt, policy="raise", audit_first_steps=AUDIT_STEPS)

    fwd, loss_fn, step = model, F.cross_entropy, opt.step
    if kind == "compile_model":
        san = attach(model)
        fwd = torch.compile(model, **kw)
    elif kind == "compile_model_first":
        fwd = torch.compile(model, **kw)
        san = attach(model)
    elif kind == "attach_compiled":
        fwd = torch.compile(model, **kw)
        san = attach(fwd)
    elif kind == "module_compile":
        san = attach(model)
        model.compile(**kw)
    elif kind == "module_compile_first":
        model.compile(**kw)
        san = attach(model)
    elif kind == "compiled_loss":
        san = attach(model)
        loss_fn = torch.compile(F.cross_entropy, **kw)
    elif kind == "compiled_step":
        san = attach(model)

        @torch.compile(**kw)
        def compiled_step():
            opt.step()

        step = compiled_step
    else:
        raise AssertionError(use)

    record = {"warm": None}
    try:
        for i in range(STEPS):
            x, y = _batch(i)
            if scenario == "nan_input" and i == NAN_STEP:
                x[0, 0] = float("nan")
            if scenario != "no_zero_grad":
                opt.zero_grad()
            loss = loss_fn(fwd(x), y)
            loss.backward()
            step()
            if i + 1 == WARMUP:
                record["warm"] = _compile_state()
    finally:
        record["end"] = _compile_state()
        record["breaks"] = _breaks()
        if san is not None:
            with contextlib.suppress(trainsan.TrainingBugError):
                san.close()
    return san, record


_BARE: dict = {}


def _bare_graphs(use: str) -> list:
    """The graphs the same loop compiles without TrainSan (cached per use)."""
    base = use.replace("_first", "").replace("attach_compiled", "compile_model")
    if base not in _BARE:
        rec = _Recorder("aot_eager")
        _run(base, backend=rec, sanitize=False)
        _BARE[base] = rec.graphs
    return _BARE[base]


def _check_clean(use: str, san, record: dict, graphs=None, bare=None) -> None:
    assert san.errors() == [], [str(f) for f in san.errors()]
    breaks = record["breaks"]
    if use == "compiled_step":
        # torch.optim's own breaks, and at most one deliberate break per step hook.
        assert set(breaks) <= {_OPTIM_BREAK, _DISABLED_CALL}, breaks
        assert breaks.get(_DISABLED_CALL, 0) <= 2, breaks
    else:
        assert breaks == {}, f"graph breaks with TrainSan attached: {breaks}"
    if graphs is not None:
        assert graphs, "nothing was compiled"
        assert graphs == bare, (
            "the compiled graphs differ from the same loop's without TrainSan:\n"
            f"  with:    {graphs}\n  without: {bare}"
        )
    assert record["warm"] == record["end"], (
        f"compiled again after step {WARMUP} (frames, graphs): {record['warm']} -> "
        f"{record['end']}"
    )
    cov = san.coverage()
    assert san.step == STEPS
    assert cov["training_forwards"] == STEPS, cov
    assert cov["losses_checked"] == STEPS, cov


@pytest.mark.parametrize("use", USES)
def test_clean_loop(use):
    rec = _Recorder("aot_eager")
    san, record = _run(use, backend=rec)
    _check_clean(use, san, record, rec.graphs, _bare_graphs(use))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("use", USES)
def test_planted_bug_is_found(use, scenario):
    kind, at_step = SCENARIOS[scenario]
    assert kind in trainsan.KINDS
    with pytest.raises(trainsan.TrainingBugError) as info:
        _run(use, scenario)
    f = info.value.finding
    assert (f.kind, f.step, f.severity) == (kind, at_step, "error"), str(f)


def _inductor_available() -> bool:
    """Inductor on a CPU generates C++: it needs a supported platform and a C++ compiler."""
    if not _COMPILE:
        return False
    try:
        if not dynamo.eval_frame.is_inductor_supported():
            return False
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:  # noqa: BLE001 - no compiler found, or inductor unusable here
        return False


@pytest.mark.skipif(
    not _inductor_available(),
    reason="inductor is unavailable here (unsupported platform, or no C++ compiler for its CPU "
    "code generation)",
)
def test_inductor_fullgraph_model():
    """The real compiler: torch.compile(model, fullgraph=True) with inductor (generated C++)."""
    san, record = _run("compile_model_fullgraph", backend="inductor")
    _check_clean("compile_model_fullgraph", san, record)
    with pytest.raises(trainsan.TrainingBugError) as info:
        _run("compile_model_fullgraph", "nan_input", backend="inductor")
    assert (info.value.finding.kind, info.value.finding.step) == ("nonfinite_loss", NAN_STEP)


@pytest.mark.parametrize("use", MODEL_USES)
def test_eager_loss_after_a_compiled_model_is_audited_from_step_0(use):
    # AOTAutograd's joint trace on the first compiled call runs autograd nodes inside the forward;
    # the op audit is paused for the compiled call, so they do not end the audited window before
    # the eager loss runs (Note [Compiled regions]). A [N, 1] output against an [N] target.
    dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(backend="aot_eager")
    if use == "attach_compiled":
        fwd = torch.compile(model, **kw)
        san = trainsan.attach(fwd, opt, policy="record", audit_first_steps=1)
    else:
        san = trainsan.attach(model, opt, policy="record", audit_first_steps=1)
        if use == "compile_model":
            fwd = torch.compile(model, **kw)
        else:
            model.compile(**kw)
            fwd = model
    with san, pytest.warns(UserWarning, match="target size"):
        for i in range(3):
            x, y = _batch(i)
            opt.zero_grad()
            F.mse_loss(fwd(x), y.float()).backward()
            opt.step()
    found = [(f.kind, f.step) for f in san.findings if f.severity == "error"]
    assert ("broadcast", 0) in found, san.summary()
