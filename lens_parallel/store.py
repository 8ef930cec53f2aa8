"""The resumable store of a sweep: a JSON-lines file whose first line is the run's fingerprint and each further line
one finished job's value (named arrays, checked against the metric's :class:`ValueSpec` s when read back).

A store is crash-safe: each row is written with one ``write`` and flushed to disk, a last line cut by a kill is
dropped (its job reruns), a row whose value does not match the checksum written with it (edited or damaged) or is
of the wrong shapes or types is dropped with a warning naming it (its job reruns), and a store whose fingerprint
differs from this run's (other weights, documents, metric, edit, batch size, ...) is refused with what differs.

One writer at a time: a run holds the store's writer lock (:func:`~lens_parallel.paths.writer_lock`, an OS lock
kept in the cache folder and released when its process ends, however it ends: a killed holder never blocks the next
run) from reading the finished jobs to its last row, so a second process on the same store waits, then reads the
first one's rows instead of computing them again.

A store that a run makes for its own use (the report shares one between its analyses) says nothing: only a store the
user named says what it resumed (:func:`quiet_stores`).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from filelock import Timeout

from lens_parallel.errors import LensParallelError, kept_in
from lens_parallel.logs import say
from lens_parallel.paths import add_suffix, check_writable, writer_lock

STORE_FORMAT = "lens_parallel.sweep/3"
"""3: every row carries the sha256 of its value (:func:`value_checksum`); 2 had none and 1 held next-token NLL sums
only (both refused)."""
STORE_ADVICE = "delete it to recompute, or give another store (store= in Python, --store on the command line)"


@runtime_checkable
class Keyed(Protocol):
    """A job as the store sees it: its name (``key``) and its content (``repr``, hashed by :func:`job_digest`)."""

    @property
    def key(self) -> str: ...


def job_digest(job: Keyed) -> str:
    """A short hash of everything a job is (its edits with every field), so that a store never hands back a result
    computed for a job that shares the key but not the content."""
    return hashlib.sha256(repr(job).encode()).hexdigest()[:16]


Values = dict[str, np.ndarray]
"""What a metric returns for one job: named arrays."""


def value_checksum(encoded: dict[str, Any]) -> str:
    """The sha256 of a row's encoded value (nested lists, NaN as null) in canonical JSON (sorted keys, no NaN): a
    number changed after the row was written no longer matches."""
    return hashlib.sha256(json.dumps(encoded, sort_keys=True, allow_nan=False).encode()).hexdigest()


@dataclass(frozen=True)
class ValueSpec:
    """One array of a job's value: its ``shape`` (``"docs"`` marks the documents axis, whose batches are
    concatenated; no ``"docs"``: summed over batches) and whether NaN may appear in it (``allow_nan``)."""

    shape: tuple[int | str, ...]
    allow_nan: bool = False

    def concrete(self, n_docs: int) -> tuple[int, ...]:
        return tuple(n_docs if d == "docs" else int(d) for d in self.shape)

    def problem(self, value: np.ndarray, n_docs: int) -> str:
        """Why ``value`` is not an array of this spec ("" when it is)."""
        if value.shape != self.concrete(n_docs):
            return f"shape {value.shape}, expected {self.concrete(n_docs)}"
        finite = np.isfinite(value) | (np.isnan(value) if self.allow_nan else False)
        return "" if finite.all() else "a value that is not finite" + ("" if self.allow_nan else " (NaN included)")


_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("quiet_stores", default=False)


@contextlib.contextmanager
def quiet_stores() -> Iterator[None]:
    """Inside: stores say nothing of what they resume (a store a run made for its own use: its "resumed" jobs are
    the same run's)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


class SweepStore:
    """The JSON-lines store of a sweep: line 1 ``{"format", "fingerprint"}``, then one ``{"job", "digest", "value",
    "sha256"}`` per finished job (each array as nested lists, NaN as null; ``sha256``: :func:`value_checksum`),
    each written with one ``write`` and flushed to disk. :meth:`session` holds the writer lock
    (:func:`~lens_parallel.paths.writer_lock`) while a run reads its finished jobs and appends the others, so two
    processes never compute the same job."""

    def __init__(
        self, path: str | Path, fingerprint: dict[str, Any], n_docs: int, spec: Callable[[Any], dict[str, ValueSpec]]
    ) -> None:
        self.path, self.fingerprint, self.n_docs, self.spec = Path(path), fingerprint, n_docs, spec
        self.lock = writer_lock(self.path)

    @contextlib.contextmanager
    def session(self, jobs: Sequence[Keyed]) -> Iterator[dict[str, Values]]:
        """Hold the writer lock (waiting, with a warning, while another process holds it) and yield the finished
        jobs (:meth:`open`); rows are appended (:meth:`append`) inside the session. The lock is the operating
        system's: it is released when the session ends or its process dies. A store this session created and left
        without a finished job (a run that failed or was interrupted first) is removed."""
        check_writable(self.path, "store")
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            warnings.warn(
                f"{self.path}: another process is writing this store; waiting for it to finish (its finished jobs "
                "are then read, not computed again)",
                stacklevel=3,
            )
            self.lock.acquire()
        except OSError as exc:
            raise LensParallelError(f"store {self.path}: cannot take its lock ({exc.strerror})") from exc
        new = not self.path.is_file()
        try:
            done = self.open(jobs)
            if (resumed := sum(job.key in done for job in jobs)) and not _QUIET.get():
                say(f"resumed {resumed} of {len(jobs)} jobs from {self.path}")
            yield done
        finally:
            if new and self._holds_no_row():  # it held no work: a failed or interrupted run leaves no store
                self.path.unlink(missing_ok=True)
            self.lock.release()

    def _holds_no_row(self) -> bool:
        """Whether the store holds its header at most (no finished job)."""
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            return sum(1 for _ in f) <= 1
        return True

    @staticmethod
    def stored_fingerprint(path: str | Path) -> dict[str, Any] | None:
        """The fingerprint in the header of the store at ``path``, or None (no store, or no readable header: opening
        it says what is wrong)."""
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        found = header.get("fingerprint") if isinstance(header, dict) else None
        return found if isinstance(found, dict) else None

    def open(self, jobs: Sequence[Keyed]) -> dict[str, Values]:
        """Finished jobs, after writing the header of a new (or empty) store or checking an existing one's (call it
        inside :meth:`session`): refuses a store of another run, or one holding a job under the key of one of
        ``jobs`` with other content. A row that is not a verified finished job of this sweep (cut by a kill, not
        matching its checksum, not of the metric's shapes and types) is dropped with a warning naming it, so that
        job is recomputed."""
        by_key = {job.key: job for job in jobs}
        raw = self.path.read_bytes() if self.path.is_file() else b""
        lines = raw.split(b"\n")
        complete, tail = lines[:-1], lines[-1]  # tail: text after the last newline (a cut line, or empty)
        if not complete:  # new, or the header itself was cut: nothing was finished
            self._rewrite([])
            return {}
        self._check_header(complete[0])
        done: dict[str, Values] = {}
        digests: dict[str, str] = {}
        kept, dropped = [], []
        for i, line in enumerate(complete[1:], start=2):
            row, problem = self._row(line, by_key)
            if problem:
                named = f" (job {row['job']})" if "job" in row else ""
                dropped.append(f"line {i}{named}: {problem}")
                continue
            if row["job"] in by_key:
                done[row["job"]] = row["value"]
            digests[row["job"]] = row["digest"]
            kept.append(line)
        for job in jobs:
            if job.key in digests and digests[job.key] != job_digest(job):
                raise LensParallelError(
                    f"{self.path} holds a job {job.key!r} computed with other settings than {job!r}; {STORE_ADVICE}"
                )
        if dropped:
            warnings.warn(
                f"{self.path}: dropped {len(dropped)} row(s) that are not verified finished jobs of this sweep "
                f"({'; '.join(dropped[:3])}); those jobs are recomputed",
                stacklevel=4,
            )
        if dropped or tail.strip():  # a line cut by a kill mid-write is dropped silently: its job reruns
            self._rewrite(kept)
        return done

    def _row(self, line: bytes, jobs: dict[str, Keyed]) -> tuple[dict[str, Any], str]:
        """The row of one line with its value decoded, or why it is not a finished job of this sweep (a job of
        another sweep sharing the store is kept, its value unchecked)."""
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return {}, f"not JSON ({exc})"
        if not isinstance(row, dict) or not isinstance(row.get("job"), str) or not isinstance(row.get("digest"), str):
            return {}, "no job key and digest"
        value = row.get("value")
        if not isinstance(value, dict):
            return {}, "no value"
        try:
            intact = row.get("sha256") == value_checksum(value)
        except ValueError:  # NaN or infinity written as a JSON number: not written by this store
            intact = False
        if not intact:
            return {"job": row["job"]}, "its value does not match its checksum (edited or damaged)"
        if row["job"] not in jobs:
            return row, ""
        specs = self.spec(jobs[row["job"]])
        if set(value) != set(specs):
            return {}, f"value holds {sorted(value)}, expected {sorted(specs)}"
        decoded: Values = {}
        for name, spec in specs.items():
            try:
                array = _decode(value[name], spec)
            except (TypeError, ValueError) as exc:
                return {}, f"{name} is not an array of numbers ({exc})"
            if problem := spec.problem(array, self.n_docs):
                return {}, f"{name} has {problem}"
            decoded[name] = array
        return row | {"value": decoded}, ""

    def _check_header(self, line: bytes) -> None:
        try:
            header = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise LensParallelError(f"{self.path}: first line is not a sweep header ({exc}); {STORE_ADVICE}") from exc
        if not isinstance(header, dict) or header.get("format") != STORE_FORMAT:
            kind = header.get("format") if isinstance(header, dict) else None
            raise LensParallelError(
                f"{self.path} is not a sweep store of format {STORE_FORMAT} (found {kind!r}); {STORE_ADVICE}"
            )
        stored = header.get("fingerprint")
        if "sha256" in header and header["sha256"] != value_checksum({"fingerprint": stored}):
            raise LensParallelError(
                f"{self.path} is damaged: its header does not match the checksum written with it; {STORE_ADVICE}"
            )
        found: dict[str, Any] = stored if isinstance(stored, dict) else {}
        keys = dict.fromkeys([*self.fingerprint, *found])  # both ways: a key only one side has differs too
        differ = {k: (found.get(k), self.fingerprint.get(k)) for k in keys if found.get(k) != self.fingerprint.get(k)}
        if differ:
            what = "; ".join(f"{k}: store has {a!r}, this run {b!r}" for k, (a, b) in differ.items())
            raise LensParallelError(
                f"{self.path} was written by a run whose numbers differ ({what}); {STORE_ADVICE}, or rerun with the "
                "store's settings"
            )

    def _rewrite(self, rows: list[bytes]) -> None:
        """Replace the store by its header and ``rows`` in one rename (the lock is held)."""
        checksum = value_checksum({"fingerprint": self.fingerprint})  # a header without one: an earlier version's
        header = json.dumps({"format": STORE_FORMAT, "fingerprint": self.fingerprint, "sha256": checksum}).encode()
        tmp = add_suffix(self.path, f".tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(b"\n".join([header, *rows]) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, job: Keyed, value: Values) -> None:
        """Append one finished job's row with its checksum (inside :meth:`session`)."""
        encoded = {name: _encode(array) for name, array in value.items()}
        row = {"job": job.key, "digest": job_digest(job), "value": encoded, "sha256": value_checksum(encoded)}
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        kept_in(self.path)


def _encode(array: np.ndarray) -> Any:
    """An array as nested lists of floats, NaN as null (JSON has no NaN)."""
    a = np.asarray(array, dtype=np.float64)
    return (
        np.where(np.isnan(a), np.array(None, dtype=object), a).tolist()
        if a.ndim
        else (None if math.isnan(a) else float(a))
    )


def _decode(value: Any, spec: ValueSpec) -> np.ndarray:
    """Nested lists back to a float64 array; null is NaN (checked against ``spec`` by the caller). Strings, bools
    and other objects are refused."""

    def check(x: Any) -> None:
        if isinstance(x, list):
            for y in x:
                check(y)
        elif x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise TypeError(f"found {type(x).__name__} {x!r}")

    check(value)
    return np.array(value, dtype=np.float64) if value is not None else np.array(np.nan)
