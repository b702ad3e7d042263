"""Callbacks that attach TrainSan inside a framework's own training loop.

* :class:`trainsan.integrations.hf.TrainSanCallback` — Hugging Face ``transformers.Trainer``;
* :class:`trainsan.integrations.lightning.TrainSan` — Lightning (``lightning.pytorch``, or the
  older ``pytorch_lightning`` package) ``Trainer``.

Both take the keyword options of :func:`trainsan.attach` (``policy``, ``trace``, ``checks``,
``sync``, ...), attach when training starts (the framework has built the optimizer then) and close
when it ends, printing :meth:`trainsan.Sanitizer.summary`.

Importing this package or its modules imports no framework: each callback class is made the first
time its name is looked up (``from trainsan.integrations.hf import TrainSanCallback``), and where
the framework is not installed, constructing it raises an ``ImportError`` that names the package
to ``pip install``.
"""

from __future__ import annotations

from typing import Any

from . import hf, lightning

__all__ = ["TrainSan", "TrainSanCallback"]


def __getattr__(name: str) -> Any:
    if name == "TrainSanCallback":
        return hf.TrainSanCallback
    if name == "TrainSan":
        return lightning.TrainSan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
