"""Filters for two known, harmless notices that importing torchao logs on every process where it is installed
(``transformers`` imports it when it is present, so every model load triggers them):

- torchao's ``Failed to load .../_C_*.so``: its CUDA-only kernel libraries, absent from a CPU build of torch;
- torch's ``<enum ...> is an Enum subclass and is now natively supported by torch.compile``: torchao registering its
  enums the old way.

Only records with exactly these messages are dropped; every other record of these loggers passes. Installed when
this module is imported, which ``lens_parallel/__init__`` does first, before anything imports ``transformers``.
"""

from __future__ import annotations

import logging


class _Drop(logging.Filter):
    """Drops the records of one logger whose message contains all of ``parts``."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(part in message for part in self.parts)


def quiet_known_notices() -> None:
    """Attach the filters (idempotent)."""
    for name, parts in (
        ("torchao", ("Failed to load", ".so")),
        ("torch.utils._pytree", ("is an Enum subclass and is now natively supported",)),
    ):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(*parts))


quiet_known_notices()
