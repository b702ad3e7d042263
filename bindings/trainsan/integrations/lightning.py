"""TrainSan for Lightning (``lightning.pytorch``, or the older ``pytorch_lightning`` package).

::

    from trainsan.integrations.lightning import TrainSan

    trainer = L.Trainer(max_epochs=3, callbacks=[TrainSan(policy="raise", trace="run.jsonl")])
    trainer.fit(module, train_loader, val_loader)

The callback attaches at ``on_train_start`` — the strategy has built the optimizers
(``trainer.optimizers``, the torch optimizers themselves; a ``LightningOptimizer`` would be
unwrapped) — to the LightningModule and all its optimizers, and closes at ``on_train_end``
(or ``on_exception``, without masking the exception), printing :meth:`Sanitizer.summary` to
stderr (``summary=False`` silences it, a callable receives the text). The options are
:func:`trainsan.attach`'s keyword options (``policy``, ``trace``, ``checks``, ``sync``, ...);
``{rank}`` in ``trace`` becomes the process's global rank (``trace="run.{rank}.jsonl"``).

Lightning calls ``training_step`` as a method, not through the module's ``__call__``, so the
LightningModule's forward hook fires only when the step calls ``self(x)``; a step that calls a
submodule (``self.net(x)``) would leave the sanitizer without training forwards (no loss, input,
mode or op-audit checks). The callback therefore reports each batch as a training forward of the
LightningModule at ``on_train_batch_start``, with the batch as its inputs (a step that also calls
``self(x)`` reports a second one; harmless, as in a loop with several forwards). That report
runs before the LightningModule's own ``on_train_batch_start``: a train/eval switch made there is
seen only by a step that calls ``self(x)``.

Seen as in a plain loop: automatic optimization (the forward and backward run inside
``optimizer.step(closure)``: Note [Closure steps] in bindings/trainsan/_hooks.py), manual
optimization (``self.optimizers()``, ``self.manual_backward(loss)``, ``opt.step()``: the
LightningOptimizer calls the torch optimizer's step), ``accumulate_grad_batches`` (silent;
declared as ``accumulation_steps`` under automatic optimization, so an epoch shorter than the
window — Lightning steps at each epoch's last batch — is ``accumulation_mismatch``),
validation loops (eval mode, ``no_grad``: silent), gradient clipping, precision plugins
(``"bf16-mixed"``; ``"16-mixed"`` with its GradScaler: skipped steps are AMP skips — with an
unfused optimizer; a fused one, ``AdamW(fused=True)``, gets a false ``nonfinite_grad`` at each
skipped step, as with the Hugging Face callback). Not
supported: ``DeepSpeedStrategy`` (the engine steps inside ``backward()`` on partitioned flat
buffers; the callback raises at ``on_train_start``). Untested: several devices (DDP),
``ModelParallelStrategy`` (FSDP2), ``FSDPStrategy`` (FSDP1's flat parameters, which TrainSan does
not claim to support).

Tested with lightning 2.6.6 (scripts/install_deps.sh).
"""

from __future__ import annotations

import trainsan

from . import _common

__all__ = ["TrainSan"]

_NAME = "trainsan.integrations.lightning.TrainSan"


class _TrainSanImpl(_common.CallbackBase):
    """Attaches TrainSan to the LightningModule and its optimizers for each ``fit()``
    (parameters and attributes: _common.CallbackBase)."""

    NAME = _NAME

    # -- Trainer events -------------------------------------------------------------------------

    def on_train_start(self, trainer, pl_module) -> None:
        _common.close_quietly(self.sanitizer)  # a previous fit() that ended oddly
        self.sanitizer = None
        strategy = getattr(trainer, "strategy", None)
        if strategy is not None and "deepspeed" in type(strategy).__name__.lower():
            raise RuntimeError(
                f"{_NAME}: DeepSpeedStrategy is not supported: the engine runs the optimizer "
                "step inside backward() on partitioned flat buffers that TrainSan's hooks do not "
                "see, so it would check nothing. Remove the callback for DeepSpeed runs"
            )
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        options = _common.rank_options(self.options, int(getattr(trainer, "global_rank", 0) or 0))
        if getattr(pl_module, "automatic_optimization", True):  # manual: the step decides
            window = getattr(trainer, "accumulate_grad_batches", None)
            options = _common.with_window(options, window)
        self.sanitizer = trainsan.attach(
            _common.unwrap_model(pl_module), optimizers or None, **options
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Lightning calls training_step(batch, batch_idx) directly: this is the training forward.
        _common.training_forward(self.sanitizer, batch)

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish(trainer, quiet=False)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._finish(trainer, quiet=True)

    def teardown(self, trainer, pl_module, stage) -> None:
        self._finish(trainer, quiet=True)

    def _finish(self, trainer, quiet: bool) -> None:
        self.finish(
            rank=int(getattr(trainer, "global_rank", 0) or 0),
            world=int(getattr(trainer, "world_size", 1) or 1),
            quiet=quiet,
        )


def _framework():
    """lightning.pytorch, else pytorch_lightning; the ImportError of the first if neither."""
    try:
        import lightning.pytorch as pl

        return pl
    except ImportError as e:
        first = e
    try:
        import pytorch_lightning as pl  # the package's older name

        return pl
    except ImportError:
        raise first from None


def _build() -> type:
    try:
        pl = _framework()
    except ImportError as e:
        return _common.missing_class("TrainSan", __name__, "Lightning", "lightning", e)
    return type(
        "TrainSan",
        (_TrainSanImpl, pl.Callback),
        {"__module__": __name__, "__doc__": _TrainSanImpl.__doc__},
    )


# PEP 562: the class is made, and Lightning imported, at the first lookup of its name.
__getattr__, __dir__ = _common.lazy_class(__name__, globals(), "TrainSan", _build, "on_train_start")
