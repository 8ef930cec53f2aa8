"""Filters for seven known, harmless notices. Two are logged by importing torchao on every process where it is
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
tasks lm-eval ships under the same names, on purpose, so that they read the local data. The fifth is lm-eval's
``<task>: Custom kwargs can be passed to `--metadata` ...``, once per RULER task it builds: lens_parallel passes
those (``max_seq_lengths``, the tokenizer) itself. The sixth and seventh are lm-eval's ``[Task: ...] metric acc is
defined, but aggregation (higher_is_better) is not. using default ...`` for its own task definitions that leave the
default implied (RTE, BoolQ, COPA): the defaults are what lm-eval's own command line uses.

Beside the loggers, RULER's variable-tracking task prints (with ``print``) one ``Max length ... | Current length
...`` line per haystack size it tries, ``Num noises: N`` and ``reduces chain length for not enough noises``:
:func:`drop_printed_lines` drops those lines from standard output while its tasks are built, and lets every other
line through.

Only records with exactly these messages are dropped; every other record of these loggers passes. Installed when
this module is imported, which ``lens_parallel/__init__`` does first, before anything imports ``transformers``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import re
import sys
import typing
from collections.abc import Iterator


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
    if not any(isinstance(f, _Drop) and f.parts == parts for f in logger.filters):
        logger.addFilter(_Drop(*parts))


def quiet_known_notices() -> None:
    """Attach the filters (idempotent)."""
    _drop("torchao", "Failed to load", ".so")
    _drop("torch.utils._pytree", "is an Enum subclass and is now natively supported")
    _drop("lm_eval.tasks._index", "overrides existing task from")
    _drop("lm_eval.api.task", "Custom kwargs can be passed to `--metadata`")
    for default in ("aggregation", "higher_is_better"):
        _drop("lm_eval.api.task", "is defined, but", f"{default} is not. using default")
    try:  # imported first: its module makes its logger, of logistro's class (it calls .debug2; a plain one has none)
        importlib.import_module("choreographer.channels.pipe")
    except ImportError:  # kaleido, which brings choreographer, is not installed: no PNGs, no notice
        return
    _drop("choreographer.channels.pipe", "JSONError decoding message", "Ignoring")


RULER_PRINTED_LINE = re.compile(
    r"^(Max length \d+ \| Current length \d+|Num noises: \d+$|reduces chain length for not enough noises$)"
)
"""What RULER's variable-tracking task prints while it sizes its haystacks: a line per size tried, the size found,
and a line per item it shortens."""


@typing.runtime_checkable
class _Stream(typing.Protocol):
    """What a line filter writes to: standard output, or whatever replaced it (a notebook's, a test's capture)."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class _LineFilter(io.TextIOBase):
    """A text stream passing every line to ``target`` except those matching ``pattern`` (whole lines: a partial
    one is held until its newline arrives, or until :meth:`flush`)."""

    def __init__(self, target: _Stream, pattern: re.Pattern[str]) -> None:
        self.target, self.pattern, self.pending = target, pattern, ""

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        self.target.write("".join(line + "\n" for line in lines if not self.pattern.match(line)))
        return len(text)

    def flush(self) -> None:
        if self.pending and not self.pattern.match(self.pending):
            self.target.write(self.pending)
        self.pending = ""
        self.target.flush()


@contextlib.contextmanager
def drop_printed_lines(pattern: re.Pattern[str]) -> Iterator[None]:
    """Inside, lines printed to standard output that match ``pattern`` are dropped; every other line passes."""
    stream = _LineFilter(sys.stdout, pattern)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()


quiet_known_notices()


def say(message: str) -> None:
    """One line for the user on stderr, ``[lens_parallel] message`` (a download, a resumed run), shown every time
    (a warning would be shown once per place)."""
    print(f"[lens_parallel] {message}", file=sys.stderr, flush=True)
