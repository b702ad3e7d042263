"""Facts the Python hooks gather for the C++ sanitizer: the model's mode-dependent modules and the
parameters they own, a forward's tensor inputs, a loss's targets, per-group learning rates, steps
in flight, the trace header's provenance, the source frames to skip, and what FSDP2 and DTensor
make of the parameters. No rule lives here."""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import subprocess
import sys
import time
import types
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from ._findings import TrainingBugError


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001 - torch without distributed
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's data of a tensor: a DTensor's local shard (for a replicated loss, the whole
    value), a plain tensor itself."""
    return t._local_tensor if _is_dtensor(t) else t


def script_names(kind: type) -> dict:
    """id -> name of the `kind` objects the script's own variables hold (``__main__``'s): how the
    launcher names the root modules it pairs and a sanitizer the tensors an optimizer trains
    outside the model."""
    main = vars(sys.modules.get("__main__", types.ModuleType("__main__")))
    return {id(v): k for k, v in list(main.items())
            if isinstance(v, kind) and k.isidentifier() and not k.startswith("_")}


def _param_table(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> tuple:
    """The model's parameters as the C++ sanitizer registers them: (names, parameters, the index
    of each one's optimizer (-1: none), of its param group, the names of those watched from
    outside the model).

    Note [Tensors outside the model]: an optimizer may train tensors the attached module does
    not hold (a functional model whose forward reads an external weight, a learnable temperature
    kept beside the model, a bare tensor given to the optimizer). They are watched like the
    model's own parameters, after them, each named as the script names it (its variable in
    ``__main__``, as the launcher names root modules) or by where the optimizer holds it
    (``optimizer0.group1.param2``); the sanitizer notes which. An optimizer holding none of the
    model's parameters while the model has some is different: it was built before they were
    replaced (or belongs to another model), a bug that _optimizers_holding_none reports; its
    tensors are not watched. So is a tensor of the shape and dtype of a trainable parameter of the
    model that no optimizer holds: the parameter it was before a submodule was replaced after the
    optimizer was built (param_not_in_optimizer reports that; watched, it would never get a
    gradient).

    Note [Placeholder parameters]: a parameter on the meta device holds no values — nothing can
    compute with it, so no forward that runs uses it, no gradient reaches it and no update changes
    it. Beside materialised parameters it is a placeholder (a Keras 3 model on the torch backend
    built by a symbolic call: its layers' own ParameterDicts keep the meta stand-ins of the
    variables whose real tensors the model's ParameterDict holds), not a tensor to watch: it is
    left out here and noted by the sanitizer (placeholders). A model whose parameters are all on
    the meta device is not materialised yet: attach() refuses it (_attach.py)."""
    names, params, opt_index, group_index = [], [], [], []
    where = {}  # id(param) -> (optimizer, group)
    for k, opt in enumerate(optimizers):
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                where.setdefault(id(p), (k, gi))
    for name, p in model.named_parameters():
        if p.is_meta:
            continue  # a placeholder (above)
        names.append(name)
        params.append(p)
        k, gi = where.get(id(p), (-1, 0))
        opt_index.append(k)
        group_index.append(gi)
    own = {id(p) for p in params}
    stale = {k for k, opt in enumerate(optimizers) if own and not any(
        id(p) in own for g in opt.param_groups for p in g["params"])}
    replaced = collections.Counter(
        (tuple(p.shape), p.dtype) for p, k in zip(params, opt_index) if k < 0 and p.requires_grad)
    script = None
    outside = []
    for k, opt in enumerate(optimizers):
        if k in stale:
            continue
        for gi, g in enumerate(opt.param_groups):
            for i, p in enumerate(g["params"]):
                if id(p) in own or not isinstance(p, torch.Tensor):
                    continue
                own.add(id(p))
                if replaced[(tuple(p.shape), p.dtype)] > 0:
                    replaced[(tuple(p.shape), p.dtype)] -= 1
                    continue
                if script is None:
                    script = script_names(torch.Tensor)
                name = script.get(id(p), f"optimizer{k}.group{gi}.param{i}")
                while name in names:
                    name += "_"
                names.append(name)
                params.append(p)
                opt_index.append(k)
                group_index.append(gi)
                outside.append(name)
    return names, params, opt_index, group_index, outside


def placeholders(model: torch.nn.Module) -> list:
    """The names of the model's parameters on the meta device (Note [Placeholder parameters] in
    _param_table)."""
    return [n for n, p in model.named_parameters() if p.is_meta]


def _mode_dependent(m: torch.nn.Module) -> bool:
    """Whether m's forward behaves differently in train and eval mode (as far as its class says)."""
    if isinstance(m, torch.nn.modules.dropout._DropoutNd):
        return m.p > 0
    if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm,
                      torch.nn.modules.instancenorm._InstanceNorm)):
        return bool(m.track_running_stats)
    if isinstance(m, torch.nn.RNNBase):
        return m.dropout > 0 and m.num_layers > 1
    if isinstance(m, torch.nn.MultiheadAttention):
        return m.dropout > 0
    return False


def _mode_modules(model: torch.nn.Module, index: dict) -> list:
    """The modules whose mode the C++ rules judge, registered once: (name, module, owned parameter
    indices, mode-dependent). A module with parameters owns its own; a parameterless
    mode-dependent one (Dropout) those of its nearest ancestor with parameters. The root is not
    listed: its train flag comes with every forward."""
    mods = dict(model.named_modules())
    out = []
    for name, m in mods.items():
        if not name:
            continue
        own = [index[id(p)] for p in m.parameters(recurse=False) if id(p) in index]
        dep = _mode_dependent(m)
        if not own and dep:
            anc = name  # itself (recursively), then its ancestors up to the root
            while True:
                own = [index[id(p)] for p in mods[anc].parameters() if id(p) in index]
                if own or not anc:
                    break
                anc = anc.rpartition(".")[0]
        if own or dep:
            out.append((name, m, own, dep))
    return out


def _flat_tensors(obj: Any, out: list, depth: int = 0, items: Optional[int] = None) -> list:
    """The tensors of `obj` (tuples, lists and dicts of them, two levels deep) in order, appended
    to `out`; `items`: at most that many items of each container are looked at."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif depth < 2 and isinstance(obj, (list, tuple, dict)):
        for o in (list(obj.values()) if isinstance(obj, dict) else obj)[:items]:
            _flat_tensors(o, out, depth + 1, items)
    return out


def _git_commit() -> Optional[str]:
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=2, check=False
        )
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _header_extra(model: torch.nn.Module) -> str:
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = str(dev)
    if dev.type == "cuda":
        device += " (" + torch.cuda.get_device_name(dev) + ")"
    fields = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "device": device,
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "seed": torch.initial_seed(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "git_commit": _git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    fields.update(_reproduction())
    return json.dumps(fields)[1:-1]


# Environment variables that change numerics or the order of reductions (issue 13: what a rerun
# of the same script needs to reproduce bits).
_NUMERIC_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "PYTHONHASHSEED",
                "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NVIDIA_TF32_OVERRIDE")
_NUMERIC_ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDNN_", "CUBLAS")


@functools.lru_cache(maxsize=1)
def _packages() -> tuple:
    """The installed distributions, "name==version", sorted (once per process)."""
    try:
        from importlib import metadata

        return tuple(sorted({f"{d.metadata['Name']}=={d.version}"
                             for d in metadata.distributions()
                             if d.metadata and d.metadata["Name"]}))
    except Exception:  # noqa: BLE001 - a broken distribution's metadata
        return ()


def _reproduction() -> dict:
    """What reconstructs a run besides the git commit: the script's source hash, the installed
    packages (their list and one hash of it), torch.backends settings and the environment
    variables that change numerics. Never fails the attach: a field it cannot read is left out."""
    import hashlib

    out: dict = {}
    try:
        script = sys.argv[0] if sys.argv and os.path.isfile(sys.argv[0]) else ""
        if script:
            with open(script, "rb") as fh:
                out["script_sha256"] = hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        pass
    pkgs = _packages()
    if pkgs:
        out["packages_sha256"] = hashlib.sha256("\n".join(pkgs).encode()).hexdigest()
        out["packages"] = list(pkgs)
    try:
        b = torch.backends
        out["backends"] = {
            "cudnn_enabled": bool(b.cudnn.enabled),
            "cudnn_benchmark": bool(b.cudnn.benchmark),
            "cudnn_allow_tf32": bool(b.cudnn.allow_tf32),
            "matmul_allow_tf32": bool(b.cuda.matmul.allow_tf32),
            "matmul_fp16_reduced_precision": bool(
                b.cuda.matmul.allow_fp16_reduced_precision_reduction),
            "matmul_bf16_reduced_precision": bool(
                b.cuda.matmul.allow_bf16_reduced_precision_reduction),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "deterministic_warn_only": bool(torch.is_deterministic_algorithms_warn_only_enabled()),
            "num_threads": torch.get_num_threads(),
        }
    except Exception:  # noqa: BLE001 - a torch build without some backend
        pass
    out["numeric_env"] = {k: v for k, v in sorted(os.environ.items())
                          if k in _NUMERIC_ENV or k.startswith(_NUMERIC_ENV_PREFIXES)}
    return out


def _group_lrs(opt: torch.optim.Optimizer) -> list:
    """The learning rate of each param group; NaN where unknown (none, or a tensor on a device:
    reading it would synchronise). An unknown rate counts as nonzero."""
    out = []
    for g in opt.param_groups:
        lr = g.get("lr", None)
        if isinstance(lr, torch.Tensor):
            lr = float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else math.nan
        try:
            out.append(math.nan if lr is None else float(lr))
        except (TypeError, ValueError):
            out.append(math.nan)
    return out


def _steps_in_flight(optimizers: Sequence[torch.optim.Optimizer]) -> list:
    """The optimizers whose step() is running on this thread's stack (attach() called from inside
    a step, e.g. from a closure or a callback a trainer runs there): their indices."""
    found = []
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name in ("step", "wrapper"):
            me = f.f_locals.get("self")
            for k, opt in enumerate(optimizers):
                if me is opt and k not in found:
                    found.append(k)
        f = f.f_back
    return found


def _loss_targets(loss: torch.Tensor) -> list:
    """The targets the loss was computed against: the `_saved_target` of the loss nodes nearest
    the root (this process's part of each)."""
    found, seen, frontier = [], set(), [getattr(loss, "grad_fn", None)]
    while frontier and len(seen) < 16:
        node = frontier.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        t = getattr(node, "_saved_target", None)
        if isinstance(t, torch.Tensor):
            found.append(_local(t))
        frontier += [n for n, _ in getattr(node, "next_functions", ())]
    return found


def _skip_frames() -> list:
    """Source lookup of op-audit findings skips TrainSan's hook files and torch's own files (the
    demo, also in this package, is user code)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return [
        os.path.join(here, "sanitizer.py"),
        os.path.join(here, "_hooks.py"),
        os.path.join(here, "_faults.py"),
        os.path.join(here, "_gatherers.py"),
        os.path.join(here, "_attach.py"),
        os.path.join(here, "audit.py"),
        os.path.join(here, "autograd_checks.py"),
        os.path.join(here, "_compile.py"),
        os.path.join(here, "_patches.py"),
        os.path.join(here, "launcher.py"),
        os.path.join(here, "_pairing.py"),
        os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    ]


def run_guarded(fn: Callable, args: tuple, what: str, on_failure: Callable[[], None]) -> None:
    """Run fn(*args) for a check's own machinery: a finding (TrainingBugError) goes through; any
    other failure calls on_failure() (the check stops) and becomes a warning naming `what`,
    never an exception in the training loop TrainSan watches."""
    try:
        fn(*args)
    except TrainingBugError:
        raise
    except Exception as exc:  # noqa: BLE001 - never crash the job TrainSan watches
        on_failure()
        warnings.warn(f"trainsan: {what} stops: {type(exc).__name__}: {exc}; the other checks "
                      "go on", stacklevel=4)


# -- FSDP2 and DTensor -------------------------------------------------------------------------


def _fsdp_params(model: torch.nn.Module) -> list:
    """FSDP2's per-parameter records (FSDPParam) of the model's fully_shard()ed modules; empty
    without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001 - torch without distributed
        return []
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def _fsdp_sharded_ids(model: torch.nn.Module) -> set:
    """ids of the FSDP2 sharded parameters of the model (fully_shard)."""
    return {id(fp.sharded_param) for fp in _fsdp_params(model)}


def _fsdp_unsharded(model: torch.nn.Module) -> list:
    """The unsharded parameters FSDP2 swaps in during forward and backward (those that exist
    yet)."""
    return [u for fp in _fsdp_params(model) if (u := getattr(fp, "_unsharded_param", None))
            is not None]


def _optimizers_holding_none(optimizers, params) -> list:
    """What is wrong with each optimizer that holds none of the model's parameters (it updates
    tensors the model does not use: it was built before the parameters were replaced by
    fully_shard, distribute_module, ...), one message each; attach() raises the first under
    policy "raise" (Note [Attach order] in _attach_order.py)."""
    ids = {id(p) for p in params}
    out = []
    for k, opt in enumerate(optimizers):
        held = [p for g in opt.param_groups for p in g["params"]]
        if held and not any(id(p) in ids for p in held):
            sharded = any(_is_dtensor(p) for p in params) and not any(_is_dtensor(p) for p in held)
            out.append(
                f"trainsan.attach: optimizer[{k}] holds none of the model's parameters "
                f"({len(held)} tensor(s), none of them in model.parameters()) — "
                + ("the model's parameters are sharded DTensors and the optimizer's are not: "
                   "it was built before fully_shard (or distribute_module) replaced them, so it "
                   "updates tensors the model no longer uses; build the optimizer after "
                   "fully_shard(model)"
                   if sharded else
                   "it was built before the model's parameters were replaced (fully_shard, "
                   "distribute_module, to_empty, load_state_dict(assign=True)) or belongs to "
                   "another model; build it from model.parameters() of the model you train")
            )
    return out


def outside_model(optimizers, param_ids: set) -> list:
    """The attached optimizers' parameters that are not the model's (`param_ids`): a sanitizer
    does not check them (another module's, a bare tensor, or parameters replaced after the
    optimizer was built)."""
    out = []
    for k, opt in enumerate(optimizers):
        held = [p for g in opt.param_groups for p in g["params"]]
        gone = [p for p in held if id(p) not in param_ids]
        if gone:
            out.append({
                "optimizer": k, "type": type(opt).__name__, "count": len(gone),
                "of": len(held), "shapes": [list(p.shape) for p in gone[:3]],
                "why": "not parameters of the attached model (another module's, a tensor "
                       "given to the optimizer directly, or parameters replaced after the "
                       "optimizer was built): attach to the module that holds them all"})
    return out
