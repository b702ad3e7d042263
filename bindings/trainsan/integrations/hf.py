"""TrainSan for Hugging Face ``transformers.Trainer``.

::

    from trainsan.integrations.hf import TrainSanCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[TrainSanCallback(policy="raise", trace="run.jsonl")])
    trainer.train()   # "raise": a TrainingBugError leaves train() at the first error finding

The callback attaches at ``on_train_begin`` — the Trainer has built the optimizer and run
``accelerator.prepare`` then — to the model (``kwargs["model"]``, the module itself: a
DistributedDataParallel or DataParallel wrapper is unwrapped, torch.compile's by
:func:`trainsan.attach`) and to the optimizer (accelerate's ``AcceleratedOptimizer``, unwrapped by
:func:`trainsan.attach`), and closes at ``on_train_end``, printing :meth:`Sanitizer.summary` to
stderr (``summary=False`` silences it, a callable receives the text). The options are
:func:`trainsan.attach`'s keyword options (``policy``, ``trace``, ``checks``, ``sync``, ...);
``{rank}`` in ``trace`` becomes the process's global rank (``trace="run.{rank}.jsonl"``), so that
the processes of a distributed run do not write one file.

Silent on a clean run: gradient accumulation (``gradient_accumulation_steps`` > 1; the Trainer
clears gradients with ``model.zero_grad()`` after each step; the callback declares the window as
``accumulation_steps``, so a run that does not keep it is ``accumulation_mismatch``: an epoch
shorter than the window, where the Trainer steps at each epoch's last batch, is an error, an
epoch's last partial window a warning), evaluation during training
(``eval_strategy``: the Trainer evaluates in eval mode under ``no_grad``), gradient clipping,
activation checkpointing, bf16, ``torch_compile`` (the op audits then see no loss op: the loss is
computed inside the compiled model), and steps a GradScaler skips (fp16 on a GPU: AMP skips, not
``skipped_step``) — with an unfused optimizer. Known limitation: with a *fused* optimizer (the
Trainer's default ``optim="adamw_torch_fused"``) GradScaler.step calls the optimizer's step even
when it skips (the fused kernel does not update), and TrainSan reports that step's non-finite
gradients as ``nonfinite_grad``; with fp16 use ``optim="adamw_torch"`` until it tells them apart.

Not supported: DeepSpeed (``TrainingArguments(deepspeed=...)`` or an accelerate DeepSpeed
config). The engine runs the optimizer step inside ``accelerator.backward()`` and ZeRO keeps
gradients and parameters in partitioned flat buffers that TrainSan's hooks do not see, so the
callback raises at ``on_train_begin`` rather than check nothing. Untested: ``DataParallel``
(several GPUs in one process: it replicates the module each step) and FSDP through accelerate
(``fsdp=...``; TrainSan itself supports FSDP2, attached after sharding, which is when
``on_train_begin`` runs).

If ``trainer.train()`` raises (policy ``"raise"``, or any other error), the Trainer calls no
callback on the way out: the sanitizer stays open until :meth:`TrainSanCallback.close` or the next
``train()`` closes it.

Tested with transformers 5.24.0 and accelerate 1.15.0 (scripts/install_deps.sh).
"""

from __future__ import annotations

import os
from typing import Any

import trainsan

from . import _common

__all__ = ["TrainSanCallback"]

_NAME = "trainsan.integrations.hf.TrainSanCallback"


class _TrainSanCallbackImpl(_common.CallbackBase):
    """Attaches TrainSan to the Trainer's model and optimizer for each ``train()`` (parameters
    and attributes: _common.CallbackBase)."""

    NAME = _NAME

    # -- Trainer events -------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # A previous train() that raised left its sanitizer open (no callback runs then).
        _common.close_quietly(self.sanitizer)
        self.sanitizer = None
        if model is None:
            raise RuntimeError(f"{_NAME}: the Trainer passed no model to on_train_begin")
        _refuse_deepspeed(args, model, optimizer)
        options = _common.rank_options(self.options, int(getattr(args, "process_index", 0) or 0))
        options = _common.with_window(options, getattr(args, "gradient_accumulation_steps", None))
        self.sanitizer = trainsan.attach(_common.unwrap_model(model), optimizer, **options)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.finish(
            rank=int(getattr(args, "process_index", 0) or 0),
            world=int(getattr(args, "world_size", 1) or 1),
        )
        return control


def _refuse_deepspeed(args: Any, model: Any, optimizer: Any) -> None:
    on = bool(getattr(args, "deepspeed", None))
    on = on or getattr(args, "deepspeed_plugin", None) is not None
    on = on or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")
    on = on or any(
        "deepspeed" in type(o).__module__.lower() or "DeepSpeed" in type(o).__name__
        for o in (model, optimizer)
        if o is not None
    )
    if on:
        raise RuntimeError(
            f"{_NAME}: DeepSpeed is not supported: its engine runs the optimizer step inside "
            "accelerator.backward() and ZeRO keeps gradients and parameters in partitioned flat "
            "buffers that TrainSan's hooks do not see, so it would check nothing. Remove the "
            "callback for DeepSpeed runs (DDP is supported)"
        )


def _build() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        return _common.missing_class(
            "TrainSanCallback",
            __name__,
            "Hugging Face transformers (and accelerate, which its Trainer uses)",
            "transformers accelerate",
            e,
        )
    cls = type(
        "TrainSanCallback",
        (_TrainSanCallbackImpl, TrainerCallback),
        {"__module__": __name__, "__doc__": _TrainSanCallbackImpl.__doc__},
    )
    return cls


# PEP 562: the class is made, and transformers imported, at the first lookup of its name.
__getattr__, __dir__ = _common.lazy_class(__name__, globals(), "TrainSanCallback", _build, "on_train_begin")
