"""How an analysis runs, as one typed object with one set of defaults: :class:`RunOptions`.

Every analysis takes ``options=RunOptions(...)`` and the same fields as keyword shortcuts (``batch_size=4``); the
command line is generated from the same fields (:mod:`lens_parallel.cli`), and provenance records them. What an
analysis computes (its edits, spaces, seeds, statistics) lives in its own settings object
(:mod:`lens_parallel.settings`); how it runs lives here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union

from lens_parallel.budget import parse_bytes
from lens_parallel.choices import Dtype
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import (
    as_tuple,
    check_bool,
    check_choice,
    check_non_negative_int,
    check_positive_int,
    check_ray_address,
    did_you_mean,
)


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run executes (never what it computes).

    ``batch_size``: documents per forward, or ``"auto"``: the largest batch whose measured cost fits
    ``memory_budget`` (:mod:`lens_parallel.budget`; the chosen size is what the run's provenance and store record,
    and a resumed run takes it from its store). ``tokens_per_forward``: the most tokens (rows x positions) one forward
    may hold when the engine stacks several jobs, or several settings of one job, into it. Both change float
    rounding (the batch composition), so both are part of a store's fingerprint. ``store``: the path of a file that
    makes the run resumable (a sweep's and generation's: JSON lines; downstream tasks': SQLite, a table per
    setting); finished work is read back from it, never recomputed. ``progress``: progress bars. ``workers`` /
    ``ray_address``: run the units of work on Ray (:mod:`lens_parallel.distributed`): ``workers > 1`` or an
    address; the numbers equal a single process's.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.RunOptions(batch_size=4, progress=False).batch_size
        4
    """

    batch_size: int | Literal["auto"] = field(
        default=8, metadata={"help": "documents per forward, or auto: the most that fit in the free memory"}
    )
    memory_budget: str | int | None = field(
        default=None,
        metadata={
            "help": "with batch_size auto: memory a run may add over the loaded model (4GB, 512MiB, bytes)",
            "none": "80% of free CUDA memory or 50% of available RAM",
        },
    )
    tokens_per_forward: int = field(
        default=4096, metadata={"help": "the most tokens (rows x positions) one forward holds when jobs are stacked"}
    )
    store: str | Path | None = field(
        default=None,
        metadata={
            "help": "a file that makes the run resumable (finished work is read back; its folder created if missing)",
            "none": "none",
        },
    )
    progress: bool = field(default=True, metadata={"help": "show progress bars"})
    workers: int = field(default=1, metadata={"help": "Ray workers (pip install 'lens_parallel[distributed]')"})
    ray_address: str | None = field(
        default=None,
        metadata={"help": "a running Ray cluster (auto, or host:6379)", "none": "a local Ray when workers > 1"},
    )

    def __post_init__(self) -> None:
        size = self.batch_size
        if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise LensParallelError(f"batch_size must be a positive integer or 'auto', got {size!r}")
        if self.memory_budget is not None:
            if self.batch_size != "auto":
                raise LensParallelError("memory_budget is read only with batch_size='auto'; give one or the other")
            parse_bytes(self.memory_budget)
        check_positive_int("tokens_per_forward", self.tokens_per_forward)
        check_positive_int("workers", self.workers)
        if self.store is not None:
            object.__setattr__(self, "store", str(self.store))
        check_ray_address(self.ray_address)
        check_bool("progress", self.progress)

    @property
    def store_path(self) -> Path | None:
        return None if self.store is None else Path(self.store)

    def numbers(self) -> dict[str, Any]:
        """The fields that change a run's numbers (float rounding): recorded in provenance and fingerprints."""
        auto = {} if self.batch_size != "auto" else {"memory_budget": self.memory_budget}
        return {"batch_size": self.batch_size, "tokens_per_forward": self.tokens_per_forward} | auto

    def record(self) -> dict[str, Any]:
        """Every field, for provenance."""
        return dataclasses.asdict(self)


RUN_FIELDS = tuple(f.name for f in dataclasses.fields(RunOptions))


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """Which model and documents a command line runs on (in Python, the caller loads them): ``model`` (a toy, a real
    model, a folder or a hub name), loaded on ``device`` in ``dtype``; ``n_docs`` blocks of ``seq_len`` tokens of
    ``texts`` (a bundled corpus, ``hf:DATASET``, or ``study``: the head-dominance study's four texts), chosen with
    ``doc_seed``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.DataOptions(model="toy-gpt2", seq_len=32).seq_len
        32
    """

    model: str = field(
        default="smollm2-135m", metadata={"help": "model spec: a toy, a real model, a folder, a hub name"}
    )
    texts: str = field(
        default="wikipedia-en",
        metadata={
            "help": "bundled corpus, hf:DATASET, study (the dominance study's texts), or wikitext (lm-eval's "
            "WikiText-2 task, online; word perplexity only)"
        },
    )
    n_docs: int = field(default=16, metadata={"help": "documents (token blocks)"})
    seq_len: int = field(default=128, metadata={"help": "tokens per block (word perplexity: per rolling window)"})
    doc_seed: int = field(default=0, metadata={"help": "seed of the order documents are chosen in"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    dtype: Dtype = field(default="float32", metadata={"help": "model precision"})

    def __post_init__(self) -> None:
        check_positive_int("n_docs", self.n_docs)
        check_positive_int("seq_len", self.seq_len)
        check_non_negative_int("doc_seed", self.doc_seed)
        check_choice("dtype", self.dtype, Dtype)


S = TypeVar("S")

RENAMED: dict[str, str] = {"edit": "ablation"}
"""Settings fields renamed (old -> new): ``edit`` held an ablation kind, a name now kept for :class:`Edit` objects.
The old keyword (:func:`split_changes`) and the old command-line flag (the saved parser's ``renamed``) are refused in
one line naming the new one."""


def split_changes(
    changes: dict[str, Any], settings_fields: tuple[str, ...], *, where: str = "settings"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword shortcuts split into (settings changes, run-option changes); an unknown name is one line listing both,
    a renamed one (:data:`RENAMED`) one line naming its new spelling."""
    refuse_renamed(changes, {old: new for old, new in RENAMED.items() if new in settings_fields}, where=where)
    if "attention_mask" in changes:
        raise LensParallelError(
            f"{where}: attention_mask= (TransformerLens's keyword) travels with the tokens here: pass "
            "{'input_ids': tokens, 'attention_mask': mask} as the documents (or the tokenizer's batch itself)"
        )
    if unknown := sorted(set(changes) - set(settings_fields) - set(RUN_FIELDS)):
        raise LensParallelError(
            f"unknown option {unknown[0]!r}{did_you_mean(unknown[0], (*settings_fields, *RUN_FIELDS))}"
            f"{f' (and {unknown[1:]})' if unknown[1:] else ''}; accepted: {', '.join(settings_fields)} (settings) and "
            f"{', '.join(RUN_FIELDS)} (RunOptions)"
        )
    settings = {k: v for k, v in changes.items() if k in settings_fields}
    return settings, {k: v for k, v in changes.items() if k in RUN_FIELDS and k not in settings_fields}


def resolve_options(
    options: RunOptions | None, changes: dict[str, Any], *, defaults: dict[str, Any] | None = None
) -> RunOptions:
    """``options`` (default: :class:`RunOptions` with a caller's ``defaults``) with ``changes`` applied; a field
    given in ``options`` and as a keyword with another value is refused (:func:`check_given_once`)."""
    if options is None:
        return RunOptions(**((defaults or {}) | changes))
    check_given_once(options, changes, "options=")
    return dataclasses.replace(options, **changes)


def refuse_renamed(changes: Mapping[str, Any], renamed: Mapping[str, str], *, where: str) -> None:
    """Refuse a keyword that has been renamed, in one line naming the new spelling (``renamed``: old -> new)."""
    for old, new in renamed.items():
        if old in changes:
            raise LensParallelError(f"{where}: {old}= is now {new}= (give {new}={changes[old]!r})")


def check_given_once(given: object, changes: dict[str, Any], where: str) -> None:
    """Refuse a field of the dataclass ``given`` that ``changes`` (keywords) sets to another value: one line naming
    the field and both values, never one of them silently."""
    for name, value in changes.items():
        if getattr(given, name) != value:
            raise LensParallelError(
                f"{name} is given twice: {getattr(given, name)!r} in {where} and {value!r} as a keyword; give it once"
            )


def resolve(
    cls: type[S],
    settings: S | None,
    options: RunOptions | None,
    protocol: str | None,
    changes: dict[str, Any],
    *,
    option_defaults: dict[str, Any] | None = None,
) -> tuple[S, RunOptions]:
    """An analysis's settings and run options: ``settings`` (default: ``protocol``'s, else ``cls()``) and
    ``options`` (default :class:`RunOptions` with ``option_defaults``), with the keyword shortcuts ``changes``
    applied to whichever owns each name (an unknown name, both a settings object and a protocol, or a field given
    in ``settings`` and as a keyword with another value, is one line)."""
    names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    setting_changes, option_changes = split_changes(changes, names, where=cls.__name__)
    if settings is not None and protocol is not None:
        raise LensParallelError("give settings= or protocol=, not both (a protocol is a saved settings object)")
    given = settings
    if protocol is not None:
        from lens_parallel.protocols import protocol_settings  # the protocols hold settings objects of the analyses

        settings = protocol_settings(protocol, cls)
    base = cls() if settings is None else settings
    if not isinstance(base, cls):
        raise LensParallelError(f"settings must be a {cls.__name__}, got {type(base).__name__}")
    coerced = coerce(cls, setting_changes)
    if given is not None:  # a protocol's fields may be overridden by keywords; a settings object's may not
        check_given_once(given, coerced, "settings=")
    settings_out = dataclasses.replace(base, **coerced)  # type: ignore[type-var]
    return settings_out, resolve_options(options, option_changes, defaults=option_defaults)


def _tuple_field(hint: Any) -> bool:
    """Whether a field's type is (or may be) a tuple of values."""
    if typing.get_origin(hint) is tuple:
        return True
    return (
        any(_tuple_field(arg) for arg in typing.get_args(hint))
        if typing.get_origin(hint) in (Union, UnionType)
        else False
    )


def coerce(cls: type, changes: dict[str, Any]) -> dict[str, Any]:
    """Keyword shortcuts as the settings fields hold them: a list, a single value or a range for a tuple field
    becomes a tuple (``layers=[0, 2]``, ``space="all"``); everything else is checked by the settings themselves."""
    hints = typing.get_type_hints(cls)
    out = {}
    for name, value in changes.items():
        if _tuple_field(hints.get(name)) and value is not None and not isinstance(value, tuple):
            value = as_tuple(value)
        out[name] = value
    return out
