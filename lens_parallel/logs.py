"""Filters for four known, harmless notices. Two are logged by importing torchao on every process where it is
installed (``transformers`` imports it when it is present, so every model load triggers them):

- torchao's ``Failed to load .../_C_*.so``: its CUDA-only kernel libraries, absent from a CPU build of torch;
- torch's ``<enum ...> is an Enum subclass and is now natively supported by torch.compile``: torchao registering its
  enums the old way.

The third comes from writing a figure's PNG: choreographer (kaleido's Chromium driver) logs
``JSONError decoding message. Ignoring``, with a full traceback, when a message from Chromium does not decode, and
carries on (the PNG is written all the same; a failure that matters is raised and reported by
:func:`lens_parallel.plots.save_figure`). It happens now and then.

The fourth is lm-evaluation-harness's ``Task '...' from ... overrides existing task from ...``, once per task each
time a task manager is built: the package's offline task folders (:mod:`lens_parallel.downstream.data`) define the
tasks lm-eval ships under the same names, on purpose, so that they read the local data.

Only records with exactly these messages are dropped; every other record of these loggers passes. Installed when
this module is imported, which ``lens_parallel/__init__`` does first, before anything imports ``transformers``.
"""

from __future__ import annotations

import importlib
import logging


class _Drop(logging.Filter):
    """Drops the records of one logger whose message contains all of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(part in message for part in self.parts)


def _drop(name: str, *parts: str) -> None:
    """Attach a :class:`_Drop` of ``parts`` to the logger ``name`` (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _Drop) for f in logger.filters):
        logger.addFilter(_Drop(*parts))


def quiet_known_notices() -> None:
    """Attach the filters (idempotent)."""
    _drop("torchao", "Failed to load", ".so")
    _drop("torch.utils._pytree", "is an Enum subclass and is now natively supported")
    _drop("lm_eval.tasks._index", "overrides existing task from")
    try:  # imported first: its module makes its logger, of logistro's class (it calls .debug2; a plain one has none)
        importlib.import_module("choreographer.channels.pipe")
    except ImportError:  # kaleido, which brings choreographer, is not installed: no PNGs, no notice
        return
    _drop("choreographer.channels.pipe", "JSONError decoding message", "Ignoring")


quiet_known_notices()
