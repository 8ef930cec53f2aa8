"""Memory budgets: ``batch_size="auto"`` picks the largest batch whose measured cost fits ``memory_budget``.

The cost is measured, not modelled: the sweep engine runs its own work (the reference pass and the metric's first
chunk of jobs) on 1 and then 2 of the longest documents and records the memory each run adds at its peak
(:func:`peak_added`: CUDA's allocator statistics on a GPU; on CPU the process's resident-set high-water mark,
reset through Linux's ``/proc/self/clear_refs`` after glibc's ``malloc_trim`` hands freed memory back). The cost of
one more document is the difference of the two peaks (at least half of the 2-document peak, so that memory the
allocator kept from the first probe cannot make it look free); the batch is the largest ``b`` with
``peak(1) + (b - 1) * per_document <= budget``. ``memory_budget`` is what a run may add over the loaded model (a
name apart from ``load_model``'s per-device ``max_memory``, which places weights). The chosen size is recorded in
provenance and in a sweep store's fingerprint, and a resumed run takes it from the store.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lens_parallel.errors import LensParallelError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_SHARE = {"cuda": 0.8, "cpu": 0.5}
"""Without ``memory_budget``: this share of the device's free memory (CUDA) or of available RAM (CPU)."""


def parse_bytes(value: str | int) -> int:
    """``"4GB"``, ``"512 MiB"``, ``"1.5e9"`` or a number of bytes, as bytes (a positive integer)."""
    if isinstance(value, bool):
        raise LensParallelError(f"memory_budget must be a size such as '4GB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(value).lower())
        if not match or match.group(2) not in _UNITS:
            raise LensParallelError(
                f"memory_budget {value!r} is not a size; accepted: a number of bytes or a number with one of "
                f"{', '.join(u.upper() for u in _UNITS if u)} (e.g. '4GB', '512MiB')"
            )
        size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise LensParallelError(f"memory_budget must be positive, got {value!r}")
    return size


def default_budget(device: torch.device) -> int:
    """What a run may add when no budget is given: :data:`DEFAULT_SHARE` of free CUDA memory or available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(DEFAULT_SHARE["cuda"] * free)
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration) as exc:
        raise LensParallelError(f"cannot read the available memory ({exc}); give memory_budget, e.g. '4GB'") from exc
    return int(DEFAULT_SHARE["cpu"] * available)


def _trim() -> None:
    """Hand memory glibc keeps after ``free`` back to the system (no-op without glibc)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def peak_added(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes ``run()`` adds at its peak over what was in use when it started, on ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    _trim()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
        start = _status_bytes("VmRSS")
    except OSError as exc:
        raise LensParallelError(
            f"batch_size='auto' on CPU reads the process's peak memory from Linux's /proc ({exc}); give batch_size=N"
        ) from exc
    run()
    return max(0, _status_bytes("VmHWM") - start)


def _per_document(peak_one: int, peak_two: int) -> int:
    """The cost of one more document: the difference of the two peaks, at least half the 2-document peak."""
    return max(peak_two - peak_one, peak_two // 2, 1)


@dataclass(frozen=True)
class AutoBatch:
    """What ``batch_size="auto"`` chose: ``batch_size`` documents, from the peaks of 1 and 2 documents of
    ``probe_tokens`` tokens each (``peak_one``, ``peak_two`` bytes) and ``budget`` bytes."""

    batch_size: int
    budget: int
    peak_one: int
    peak_two: int
    probe_tokens: int

    @property
    def per_document(self) -> int:
        return _per_document(self.peak_one, self.peak_two)

    @property
    def bytes_per_token(self) -> float:
        return self.per_document / self.probe_tokens

    def record(self) -> dict[str, float | int]:
        return {
            "batch_size": self.batch_size,
            "memory_budget_bytes": self.budget,
            "bytes_per_document": self.per_document,
            "bytes_per_token": round(self.bytes_per_token, 1),
            "probe_tokens": self.probe_tokens,
        }


def choose_batch_size(
    probe: Callable[[int], object], *, n_docs: int, tokens: int, budget: int, device: torch.device
) -> AutoBatch:
    """Run ``probe(1)`` and ``probe(2)`` (the work on that many documents of ``tokens`` tokens), then the largest
    batch (at most ``n_docs``) whose cost fits ``budget``; a budget the first probe already exceeds is refused."""
    one = peak_added(device, lambda: probe(1))
    if one > budget:
        raise LensParallelError(
            f"one document of {tokens} tokens needs {one / 2**20:.0f} MiB, over memory_budget ({budget / 2**20:.0f} "
            "MiB): raise memory_budget, or lower tokens_per_forward or the documents' length"
        )
    two = peak_added(device, lambda: probe(2)) if n_docs > 1 else 2 * one
    size = 1 + (budget - one) // _per_document(one, two)
    return AutoBatch(int(max(1, min(n_docs, size))), budget, one, two, tokens)
