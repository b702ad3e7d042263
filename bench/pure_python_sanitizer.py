"""A pure-Python training-loop sanitizer: the baseline for bench/bench_overhead.py.

This is the code a competent PyTorch user would write to get the checks TrainSan runs at its
default options, with ordinary public hooks and ordinary torch ops:

- ``Tensor.register_hook`` on every trainable parameter (bookkeeping only: which parameters got a
  gradient, whether the previous step's gradient was still there, gradients cleared unused);
- a forward pre-hook on the root module (grad mode, train/eval, duplicate batch);
- optimizer step pre/post hooks, where the numeric checks run once per step: per parameter
  ``isfinite`` of gradient and parameter, gradient and parameter norms, and the update against a
  cloned snapshot (norm of the delta, number of changed elements); the per-parameter scalars are
  stacked and brought to the host in one transfer per quantity, not with one ``.item()`` each.

Checks and default thresholds follow TrainSan's (``trainsan.OPTIONS``): nonfinite_grad,
nonfinite_param, nonfinite_loss (``watch_loss``), grad_explosion, grad_vanishing, missing_grad,
stale_grad, skipped_step, param_not_in_optimizer, update_ratio, no_grad_leak, eval_mode,
duplicate_batch and fp16_overflow; their severities are read from ``trainsan.KINDS`` (the C++
kind table), so this module imports trainsan and needs its op library. It does not compute
TrainSan's full per-tensor statistics (min/max/sum/subnormal counts/fingerprints), write a trace,
or audit broadcasting.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import weakref
from typing import Any, Optional, Sequence, Union

import torch

import trainsan

__all__ = ["PyFinding", "PurePythonSanitizer"]

_MODE_SENSITIVE = (
    torch.nn.modules.dropout._DropoutNd,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
)


@dataclasses.dataclass
class PyFinding:
    kind: str
    step: int
    severity: str
    tensor: Optional[str]
    message: str
    value: Optional[float] = None
    count: int = 1
    last_step: int = 0


class PurePythonSanitizer:
    """Attach to a model and its optimizer; the training loop stays unchanged."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]],
        *,
        policy: str = "record",
        grad_explosion_factor: float = 50.0,
        grad_explosion_warmup: int = 5,
        grad_vanishing_ratio: float = 1e-12,
        grad_vanishing_steps: int = 3,
        missing_grad_patience: int = 3,
        update_ratio_low: float = 1e-8,
        update_ratio_high: float = 1.0,
        update_ratio_steps: int = 3,
        max_accumulation: int = 64,
    ):
        if policy not in ("raise", "warn", "record"):
            raise ValueError(f"policy must be 'raise', 'warn' or 'record', got {policy!r}")
        self.policy = policy
        self.grad_explosion_factor = grad_explosion_factor
        self.grad_explosion_warmup = grad_explosion_warmup
        self.grad_vanishing_ratio = grad_vanishing_ratio
        self.grad_vanishing_steps = grad_vanishing_steps
        self.missing_grad_patience = missing_grad_patience
        self.update_ratio_low = update_ratio_low
        self.update_ratio_high = update_ratio_high
        self.update_ratio_steps = update_ratio_steps
        self.max_accumulation = max_accumulation

        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer = [optimizer]
        self.optimizers = list(optimizer)
        self.model = model
        named = list(model.named_parameters())
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        n = len(self.params)
        owner = {}
        for k, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    owner.setdefault(id(p), k)
        self.opt_of = [owner.get(id(p), -1) for p in self.params]
        self.sensitive = [(name, m) for name, m in model.named_modules()
                          if isinstance(m, _MODE_SENSITIVE)]

        # Per-parameter bookkeeping, written by the gradient hooks.
        self.got_grad = [False] * n
        self.produced_since_step = [False] * n
        self.stale = [False] * n
        self.skipped = [False] * n
        self.unused_clears = [0] * n  # gradients cleared unused since the last step
        self.consumed: list = [None] * n  # (weakref to .grad, its _version) at the last step
        self.steps_without_grad = [0] * n
        self.vanishing_steps = [0] * n
        with torch.no_grad():
            self.snapshots = [p.detach().clone() if p.requires_grad else None
                              for p in self.params]
            # ‖θ‖ before the next step: the denominator of the update ratio.
            self.prev_pnorm = torch.stack(
                [torch.linalg.vector_norm(p, dtype=torch.float32) for p in self.params]).tolist()

        self.step = 0
        self.findings: list[PyFinding] = []
        self._index: dict = {}
        self.grad_norm_ema = 0.0
        self.grad_norm_steps = 0
        self.update_ratio_out = 0
        self.backwards_since_step = 0
        self.grad_since_forward = False
        self.input_step = -1
        self.prev_inputs: Optional[list] = None
        self.eval_modules: list = []
        self.fp16_in_use = False
        self.overhead_seconds = 0.0

        self._handles = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._handles.append(p.register_hook(self._make_grad_hook(i)))
        for k, opt in enumerate(self.optimizers):
            self._handles.append(opt.register_step_post_hook(self._make_post_step(k)))

    # -- findings ------------------------------------------------------------------------------

    def _add(self, kind: str, tensor: Optional[str], message: str,
             value: Optional[float] = None) -> None:
        key = (kind, tensor)
        if key in self._index:
            f = self.findings[self._index[key]]
            f.count += 1
            f.last_step = self.step
            return
        severity = trainsan.KINDS[kind]  # the C++ kind table (kinds.def), not a copy
        f = PyFinding(kind, self.step, severity, tensor,
                      f"{kind} at step {self.step}: {message}", value, 1, self.step)
        self._index[key] = len(self.findings)
        self.findings.append(f)
        if self.policy == "raise" and severity == "error":
            raise RuntimeError(f.message)
        if self.policy == "warn":
            warnings.warn(f.message, stacklevel=3)

    # -- hooks ---------------------------------------------------------------------------------

    def _make_grad_hook(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            # Runs before the new gradient is accumulated into .grad, so p.grad is the old one.
            t0 = time.perf_counter()
            old = self.params[i].grad
            consumed = self.consumed[i]
            if old is not None and consumed is not None and consumed[0]() is old \
                    and old._version == consumed[1]:
                self.stale[i] = True  # the step's gradient was neither zeroed nor set to None
            elif old is None and self.produced_since_step[i] and self.opt_of[i] >= 0:
                # Cleared although no step used it. Once is fine (a GAN's other backward leaves
                # gradients here that zero_grad discards); twice means the steps are missing.
                self.unused_clears[i] += 1
                if self.unused_clears[i] >= 2:
                    self.skipped[i] = True
            self.got_grad[i] = True
            self.produced_since_step[i] = True
            self.grad_since_forward = True
            self.overhead_seconds += time.perf_counter() - t0

        return hook

    def _on_forward(self, module, args, kwargs):
        t0 = time.perf_counter()
        grad_enabled = torch.is_grad_enabled()
        if module.training and not grad_enabled:
            self._add("no_grad_leak", None,
                      "the forward ran with gradients disabled while the model is in train mode")
        if grad_enabled:
            self.eval_modules = [n or "<model>" for n, m in self.sensitive if not m.training]
            self.fp16_in_use = self.fp16_in_use or (
                torch.is_autocast_enabled("cuda")
                and torch.get_autocast_dtype("cuda") == torch.float16)
        if grad_enabled and module.training:
            if self.grad_since_forward:
                self.backwards_since_step += 1
            self.grad_since_forward = False
            skipped = [self.names[i] for i, s in enumerate(self.skipped) if s]
            if skipped:
                self._add("skipped_step", skipped[0],
                          f"gradients of {len(skipped)} parameter(s) were cleared without any "
                          "optimizer.step() using them", float(len(skipped)))
                self.skipped = [False] * len(self.params)
            if self.backwards_since_step > self.max_accumulation:
                self._add("skipped_step", None,
                          f"{self.backwards_since_step} backward passes without an optimizer "
                          "step", float(self.backwards_since_step))
            if self.input_step != self.step:
                self.input_step = self.step
                inputs = [t for t in list(args) + list(kwargs.values())
                          if isinstance(t, torch.Tensor)]
                prev = self.prev_inputs
                if prev is not None and len(prev) == len(inputs) and all(
                        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                        for a, b in zip(prev, inputs)):
                    self._add("duplicate_batch", None,
                              "the training forward received the same inputs as the step before")
                self.prev_inputs = [t.detach().clone() for t in inputs]
        self.overhead_seconds += time.perf_counter() - t0

    def _make_post_step(self, k: int):
        def hook(opt, args, kwargs):
            t0 = time.perf_counter()
            self._check_step(k, opt)
            self.overhead_seconds += time.perf_counter() - t0

        return hook

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(loss).all()):
            self._add("nonfinite_loss", None, "the loss holds NaN or Inf")
        return loss

    # -- the per-step checks -------------------------------------------------------------------

    def _check_step(self, k: int, opt: torch.optim.Optimizer) -> None:
        idx = [i for i in range(len(self.params)) if self.opt_of[i] == k]
        names = self.names
        lr_zero = all(float(g.get("lr", 1.0)) == 0.0 for g in opt.param_groups)

        # Hook observations.
        with_grad = sum(self.got_grad[i] for i in idx)
        for i, p in enumerate(self.params):
            if self.opt_of[i] < 0 and self.got_grad[i]:
                self._add("param_not_in_optimizer", names[i],
                          f"{names[i]} receives gradients but is in no optimizer")
        for i in idx:
            if self.stale[i]:
                self._add("stale_grad", names[i],
                          f"{names[i]} still holds the previous step's gradient "
                          "(zero_grad() missing)")
            if self.params[i].requires_grad and not self.got_grad[i] and with_grad > 0:
                self.steps_without_grad[i] += 1
                if self.steps_without_grad[i] >= self.missing_grad_patience:
                    self._add("missing_grad", names[i],
                              f"{names[i]} got no gradient for {self.steps_without_grad[i]} "
                              "steps while other parameters did",
                              float(self.steps_without_grad[i]))
            elif self.got_grad[i]:
                self.steps_without_grad[i] = 0

        # Numeric checks: per-parameter scalars on the device, one host transfer per quantity.
        g_ok, g_norm, g_at = [], [], []
        p_ok, p_norm, d_norm, changed = [], [], [], []
        with torch.no_grad():
            for i in idx:
                p = self.params[i]
                g = p.grad
                if g is not None:
                    g_ok.append(torch.isfinite(g).all())
                    g_norm.append(torch.linalg.vector_norm(g, dtype=torch.float32))
                    g_at.append(i)
                p_ok.append(torch.isfinite(p).all())
                p_norm.append(torch.linalg.vector_norm(p, dtype=torch.float32))
                snap = self.snapshots[i]
                if snap is not None and snap.shape == p.shape:
                    delta = p - snap
                    d_norm.append(torch.linalg.vector_norm(delta, dtype=torch.float32))
                    changed.append(torch.count_nonzero(p != snap))
                    snap.copy_(p)
                else:
                    self.snapshots[i] = p.detach().clone()
                    d_norm.append(torch.zeros((), device=p.device))
                    changed.append(torch.zeros((), dtype=torch.int64, device=p.device))
                if self.fp16_in_use:
                    if bool((p.abs() > 65504).any()):
                        self._add("fp16_overflow", names[i],
                                  f"{names[i]} holds values beyond fp16 range")
            g_ok = torch.stack(g_ok).tolist() if g_ok else []
            g_norm = torch.stack(g_norm).tolist() if g_norm else []
            p_ok = torch.stack(p_ok).tolist()
            p_norm = torch.stack(p_norm).tolist()
            d_norm = torch.stack(d_norm).tolist()
            changed = torch.stack(changed).tolist()

        grad_sq = 0.0
        any_bad_grad = False
        top, top_norm = None, -1.0
        pnorm_of = dict(zip(idx, p_norm))
        for i, ok, gn in zip(g_at, g_ok, g_norm):
            if not ok:
                any_bad_grad = True
                self._add("nonfinite_grad", names[i], f"{names[i]}.grad holds NaN or Inf")
                continue
            grad_sq += gn * gn
            if gn > top_norm:
                top, top_norm = i, gn
            vanished = gn == 0.0 or gn <= self.grad_vanishing_ratio * pnorm_of[i]
            self.vanishing_steps[i] = self.vanishing_steps[i] + 1 if vanished else 0
            if vanished and self.vanishing_steps[i] >= self.grad_vanishing_steps and not lr_zero:
                self._add("grad_vanishing", names[i],
                          f"{names[i]}.grad has been negligible for {self.vanishing_steps[i]} "
                          "steps", gn)
        param_sq = 0.0
        pre_sq = 0.0  # ‖θ‖² before the step, from the previous step's norms
        for i, ok, pn in zip(idx, p_ok, p_norm):
            if not ok:
                self._add("nonfinite_param", names[i], f"{names[i]} holds NaN or Inf")
            else:
                param_sq += pn * pn
            pre_sq += self.prev_pnorm[i] ** 2
            self.prev_pnorm[i] = pn if ok else math.nan
        grad_norm = math.sqrt(grad_sq)
        if not any_bad_grad and grad_sq > 0.0:
            warm = self.grad_norm_steps >= self.grad_explosion_warmup and self.grad_norm_ema > 0
            if warm and grad_norm > self.grad_explosion_factor * self.grad_norm_ema:
                self._add("grad_explosion", names[top],
                          f"global gradient norm {grad_norm:.4g} is "
                          f"{grad_norm / self.grad_norm_ema:.4g}x its running average",
                          grad_norm)
            else:
                self.grad_norm_ema = (grad_norm if self.grad_norm_steps == 0
                                      else 0.9 * self.grad_norm_ema + 0.1 * grad_norm)
                self.grad_norm_steps += 1
        param_norm = math.sqrt(param_sq)
        denom = math.sqrt(pre_sq) if math.isfinite(pre_sq) and pre_sq > 0 else param_norm
        upd_norm = math.sqrt(sum(d * d for d in d_norm))
        n_changed = sum(changed)
        if not lr_zero and grad_sq > 0.0 and n_changed == 0:
            self._add("skipped_step", None,
                      "optimizer.step() ran but changed no parameter although gradients are "
                      "nonzero", 0.0)
        if not lr_zero and denom > 0.0 and grad_sq > 0.0:
            ratio = upd_norm / denom
            outside = ratio < self.update_ratio_low or ratio > self.update_ratio_high
            self.update_ratio_out = self.update_ratio_out + 1 if outside else 0
            extreme = ratio > 10.0 * self.update_ratio_high  # one step is enough
            if outside and (self.update_ratio_out >= self.update_ratio_steps or extreme):
                self._add("update_ratio", None,
                          f"update ratio {ratio:.4g} outside [{self.update_ratio_low}, "
                          f"{self.update_ratio_high}] for {self.update_ratio_out} steps", ratio)
        if self.eval_modules:
            self._add("eval_mode", self.eval_modules[0],
                      f"{self.eval_modules[0]} ran in eval mode during a training step")

        # This step consumed the gradients as they are now.
        for i in idx:
            g = self.params[i].grad
            self.consumed[i] = (weakref.ref(g), g._version) if g is not None else None
            self.got_grad[i] = False
            self.produced_since_step[i] = False
            self.unused_clears[i] = 0
            self.stale[i] = False
        self.backwards_since_step = 0
        self.grad_since_forward = False
        self.eval_modules = []
        self.step += 1

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "PurePythonSanitizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _selftest() -> None:
    """Each check fires on a small broken loop and stays quiet on a clean one."""
    torch.manual_seed(0)

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    def run(bug: str, steps: int = 6) -> set:
        m, opt = make()
        san = PurePythonSanitizer(m, opt)
        for s in range(steps):
            x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
            if bug == "duplicate_batch":
                torch.manual_seed(1)
                x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
            if bug != "stale_grad":
                opt.zero_grad()
            out = m(x)
            if bug == "missing_grad":
                out = m[2](m[1](m[0](x).detach()))
            loss = torch.nn.functional.cross_entropy(out, y)
            if bug == "nonfinite_grad" and s == 2:
                loss = loss * float("nan")
            loss.backward()
            if bug == "skipped_step" and s % 3 != 0:
                continue
            opt.step()
        san.close()
        return {f.kind for f in san.findings}

    assert run("clean") == set(), run("clean")
    for bug in ("stale_grad", "missing_grad", "nonfinite_grad", "duplicate_batch",
                "skipped_step"):
        kinds = run(bug)
        assert bug in kinds, (bug, kinds)
    print("pure_python_sanitizer: self-test passed")


if __name__ == "__main__":
    _selftest()
