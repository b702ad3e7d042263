"""Whether what a resume restored fits what it resumes (Note [Resume checks] in
host/checks/resume.cpp; the journal is _journal.py's, the other resume facts resume.py's): the
facts that tell a fine-tune from a forgotten optimizer state — the parameters the model's load
wrote, the checkpoint's optimizer states against this optimizer — and, at the first step after
optimizer.load_state_dict, each parameter's restored moments against its gradient (MomentScale)
and its slot against the checkpoint's saved key order (Note [Optimizer slots by name]).
Gathered once per load and once per first step after it; nothing runs at other steps."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch

# The hyper-parameter names that tell one optimizer type from another (Adam's betas, SGD's
# momentum and dampening, RMSprop's alpha, ...). Flags that come and go with torch versions
# (foreach, fused, capturable, decoupled_weight_decay) and the keys schedulers add (initial_lr,
# max_lr, base_momentum) are left out: they do not make another optimizer.
_TYPE_KEYS = frozenset({
    "betas", "momentum", "dampening", "nesterov", "alpha", "centered", "lr_decay",
    "initial_accumulator_value", "rho", "momentum_decay", "lambd", "t0", "etas", "step_sizes",
    "eps"})


def _never_fails(default):
    """A gatherer that never fails the user's load or step: on an error, `default()` (nothing
    compared)."""
    def deco(fn):
        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            try:
                return fn(*args)
            except Exception:  # noqa: BLE001 - an unusual optimizer or tensor: not compared
                return default()
        return run
    return deco


@_never_fails(lambda: None)
def signature(state: Mapping) -> tuple:
    """An optimizer state dict found in a checkpoint: (the sizes of its parameter groups, its
    type's hyper-parameter names, how many parameters hold state); None: unreadable."""
    groups = [g for g in (state.get("param_groups") or []) if isinstance(g, Mapping)]
    sizes = tuple(len(g.get("params") or ()) for g in groups)
    keys = frozenset(k for g in groups[:1] for k in g if k in _TYPE_KEYS)
    inner = state.get("state")
    return sizes, keys, len(inner) if isinstance(inner, Mapping) else 0


@_never_fails(lambda: None)
def written(module: torch.nn.Module, missing: tuple) -> dict:
    """The parameters a model load wrote: id -> weak reference (an id alone could be a new
    parameter's at the address of a replaced one), those under a missing key left out."""
    miss = set(missing)
    out = {}
    for name, p in module.named_parameters():
        if name not in miss:
            try:
                out[id(p)] = weakref.ref(p)
            except TypeError:
                pass
    return out


@_never_fails(dict)
def fine_tune_facts(opt: torch.optim.Optimizer, wrote: Optional[dict], optimizers: list) -> dict:
    """ResumeFacts of a first step after the model's load that tell a fine-tune from a forgotten
    optimizer state (Note [Resume checks]). `wrote`: written() of the load (None: unknown);
    `optimizers`: signature() of each optimizer state in its checkpoint."""
    params = [p for g in opt.param_groups for p in g["params"]]
    trainable = [p for p in params if p.requires_grad]
    facts: dict = {"trainable_params": len(trainable)}
    if wrote is not None:
        facts["params_not_loaded"] = sum(1 for p in trainable if not _wrote(wrote, p))
    if optimizers:
        own = (tuple(len(g["params"]) for g in opt.param_groups),
               frozenset(k for g in opt.param_groups[:1] for k in g if k in _TYPE_KEYS))
        fitting = [s for s in optimizers if s[0] == own[0] and s[1] == own[1]]
        facts["checkpoint_optimizer_fits"] = bool(fitting)
        if fitting:
            facts["checkpoint_state_params"] = max(s[2] for s in fitting)
    return facts


@_never_fails(dict)
def slot_facts(opt: torch.optim.Optimizer, module: torch.nn.Module, keys: tuple,
               groups: tuple) -> dict:
    """ResumeFacts of Note [Optimizer slots by name] (host/checks/resume_slots.cpp): `opt`'s
    parameters by position, named as in `module` (the module the checkpoint's state dict was
    loaded into, so its names are the state dict's: `module.` and `_orig_mod.` alike), against
    `keys`, that state dict's keys in the saved order, and `groups`, the saved groups' sizes."""
    named = list(module.named_parameters())
    canon = {id(p): n for n, p in named}
    alias = {n: canon.get(id(p)) for n, p in module.named_parameters(remove_duplicate=False)}
    saved, seen = [], set()
    for k in keys:
        n = alias.get(k)
        if n is not None and n not in seen:  # a parameter now; a tied one at its first key
            seen.add(n)
            saved.append(n)
    slots = [p for g in opt.param_groups for p in g["params"]]
    return dict(slot_params=[canon.get(id(p), "") for p in slots],
                slot_shapes=["[" + ", ".join(str(d) for d in p.shape) + "]" for p in slots],
                group_sizes=[len(g["params"]) for g in opt.param_groups],
                saved_group_sizes=list(groups), saved_param_order=saved,
                param_order=[n for n, _ in named])


def _wrote(wrote: dict, p: torch.Tensor) -> bool:
    ref = wrote.get(id(p))
    return ref is not None and ref() is p


def _coupled_decay(opt: torch.optim.Optimizer, group: Mapping) -> float:
    """The weight decay the optimizer adds to the gradient before its moments (0: none, or
    decoupled as AdamW's)."""
    wd = group.get("weight_decay", 0) or 0
    if not isinstance(wd, (int, float)) or group.get("decoupled_weight_decay", False):
        return 0.0
    if isinstance(opt, torch.optim.AdamW):
        return 0.0
    return float(wd)


def _implied(state: Mapping, group: Mapping) -> Optional[tuple]:
    """(a 0-d float tensor: the mean square of the gradient the state implies, before its bias
    correction; a function of the step count that completes it), or None: no moment this
    function knows (factored, a third-party optimizer's)."""
    def plain(t: Any) -> bool:
        return type(t) is torch.Tensor and t.numel() > 0 and not t.is_meta and not t.is_sparse

    def ema(beta: float):
        return lambda n: 1.0 - beta ** n if n > 0 else math.nan

    v = state.get("exp_avg_sq")
    betas = group.get("betas")
    if plain(v) and isinstance(betas, (tuple, list)) and len(betas) == 2:
        return v.float().mean(), ema(float(betas[1]))
    v = state.get("square_avg")
    beta = group.get("alpha", group.get("rho"))
    if plain(v) and isinstance(beta, (int, float)):
        return v.float().mean(), ema(float(beta))
    v = state.get("sum")
    init = group.get("initial_accumulator_value", 0.0)
    if plain(v) and "lr_decay" in group and isinstance(init, (int, float)):
        return v.float().mean() - float(init), lambda n: float(n) if n > 0 else math.nan
    v = state.get("momentum_buffer")
    m, d = group.get("momentum", 0), group.get("dampening", 0)
    if (plain(v) and isinstance(m, (int, float)) and isinstance(d, (int, float)) and 0 < m < 1
            and d < 1 and "betas" not in group and "alpha" not in group):
        k = (1.0 - m) / (1.0 - d)
        return v.float().pow(2).mean() * (k * k), lambda n: 1.0
    return None


def _step_count(state: Mapping) -> Any:
    s = state.get("step")
    if isinstance(s, torch.Tensor) and s.numel() == 1:
        return s
    return float(s) if isinstance(s, (int, float)) else None


@_never_fails(list)
def moment_scales(opt: torch.optim.Optimizer, names: dict) -> list:
    """MomentScale records (resume_facts.h) of every parameter of `opt` with a dense gradient and
    a restored moment: before the first step after optimizer.load_state_dict, in one pass, read
    back with one copy per device. `names`: id(parameter) -> its name in the model."""
    scale = getattr(opt, "grad_scale", None)  # a fused optimizer under GradScaler: still scaled
    rows: dict = {}  # device -> [(name, shape, finish, figures)]
    index = 0
    for group in opt.param_groups:
        wd = _coupled_decay(opt, group)
        for p in group["params"]:
            index += 1
            g = p.grad
            state = opt.state.get(p)
            if (g is None or type(g) is not torch.Tensor or g.is_sparse or g.is_meta
                    or not p.requires_grad or not state or g.numel() == 0):
                continue
            got = _implied(state, group)
            if got is None:
                continue
            ms, finish = got
            step = _step_count(state)
            g32 = g.float()
            if wd:
                g32 = g32.add(p.detach().float(), alpha=wd)
            gms = g32.pow(2).mean()
            if isinstance(scale, torch.Tensor):
                gms = gms / scale.to(gms.device, torch.float32).pow(2)
            n = (step.to(gms.device, torch.float32) if isinstance(step, torch.Tensor)
                 else gms.new_tensor(step if step is not None else 0.0))
            name = names.get(id(p)) or f"parameter {index - 1}"
            shape = "[" + ", ".join(str(s) for s in p.shape) + "]"
            rows.setdefault(gms.device, []).append(
                (name, shape, finish, torch.stack([ms.to(gms.device), gms, n])))
    out = []
    for dev_rows in rows.values():
        values = torch.stack([r[3] for r in dev_rows]).cpu().tolist()  # the one read-back
        for (name, shape, finish, _), (ms, gms, n) in zip(dev_rows, values):
            corr = finish(n)
            implied = ms / corr if corr and not math.isnan(corr) else math.nan
            if implied > 0 and gms > 0 and math.isfinite(implied) and math.isfinite(gms):
                out.append({"name": name, "shape": shape, "moment": math.sqrt(implied),
                            "grad": math.sqrt(gms)})
    return out
