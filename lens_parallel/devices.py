"""Work sizes chosen per kind of device: the one place where a loop's block size depends on where it runs.

A CPU wants blocks that stay in its cores' caches; a GPU wants few large ones, because every kernel launch costs
5-10 us of CPU time while the GPU waits (measured on an H200: a diagonal capture at 8,192 tokens in blocks launched
28,800 kernels, 1.33 s of CPU time for 0.36 s of GPU time). :func:`sizes` gives a tensor's device its
:class:`WorkSizes`; :func:`sized_as` makes every choice inside as another kind of device makes it, so that a CPU
run counts the operations a GPU run would dispatch (:func:`dispatch_counts`, ``benchmarks/dispatch_counts.py``,
``tests/test_dispatch.py``). The kernels themselves are still chosen by the real device
(:func:`lens_parallel.attention.kernels.attention_with_lse`).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch

from lens_parallel import compat
from lens_parallel.choices import DeviceKind
from lens_parallel.validate import check_choice


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkSizes:
    """How large one step of each blocked loop is on a kind of device.

    ``attention_elements``: one block of the blocked attention path holds at most this many scores (batch x heads x
    queries x keys); ``capped_elements``: the same for one block of soft-capped attention's own kernel
    (:func:`lens_parallel.attention._capped_blocks`); ``fused_block``: queries per kernel call of the fused and
    diagonal paths when a mask is given;
    ``scan_rows`` x ``scan_bytes``: positions per unembedding matmul of the vocabulary scan and the float32 logits
    of one of its blocks; ``loss_chunk_bytes``: the logits one chunk of the loss's backward holds."""

    attention_elements: int
    capped_elements: int
    fused_block: int
    scan_rows: int
    scan_bytes: int
    loss_chunk_bytes: int


SIZES: dict[DeviceKind, WorkSizes] = {
    "cpu": WorkSizes(
        attention_elements=1 << 24,  # 64 MB of float32 scores
        capped_elements=1 << 19,  # 2 MB of float32 scores: a block's passes stay in the caches (1 MB: 1.25x the time)
        fused_block=1024,
        scan_rows=1024,  # 4,096 x 49,152 logits: 2.6 s in blocks of 170 rows, 2.1 s in blocks of 1,024
        scan_bytes=8 * 2**20,  # 1,024 x 2,048 float32 logits: 378 ms for 1,024 x 49,152 (398 ms in blocks of 2 MB)
        loss_chunk_bytes=64 * 2**20,
    ),
    "cuda": WorkSizes(
        attention_elements=1 << 27,  # 512 MB of float32 scores: a few blocks at 32k tokens
        capped_elements=1 << 27,
        fused_block=16384,
        scan_rows=8192,
        scan_bytes=1 << 28,  # 8,192 x 8,192 float32 logits: a vocabulary of 49,152 in 6 blocks per 8k rows
        loss_chunk_bytes=1 << 30,
    ),
}
"""The work sizes of each kind of device (anything but CUDA is sized as a CPU)."""

_AS: contextvars.ContextVar[DeviceKind | None] = contextvars.ContextVar("sized_as", default=None)


def kind(device: torch.device | str) -> DeviceKind:
    """The kind ``device`` is sized as: its own (``cuda`` or else ``cpu``), or the one :func:`sized_as` forces."""
    forced = _AS.get()
    if forced is not None:
        return forced
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def sizes(device: torch.device | str) -> WorkSizes:
    """The :class:`WorkSizes` of ``device`` (:func:`kind`)."""
    return SIZES[kind(device)]


@contextlib.contextmanager
def sized_as(device_kind: DeviceKind) -> Iterator[None]:
    """Inside, every block size is chosen as on a ``device_kind`` device, whatever the tensors' device."""
    check_choice("device kind", device_kind, DeviceKind)
    token = _AS.set(device_kind)
    try:
        yield
    finally:
        _AS.reset(token)


class Counting:
    """The operations dispatched while a :func:`dispatch_counts` block runs: ``kernels`` excludes views (operations
    whose outputs alias an input without writing it: reshapes, slices, transposes), which launch no kernel."""

    def __init__(self) -> None:
        self.all: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def dispatch_counts() -> Iterator[Counting]:
    """Count every aten operation dispatched inside (PyTorch's dispatch mode,
    :func:`lens_parallel.compat.dispatch_mode`): a device-independent measure of how many kernels a computation
    launches, so that a loop of small blocks (cheap on a CPU, launch-bound on a GPU) shows on a CPU too."""
    counts = Counting()

    def seen(name: str, view: bool) -> None:
        counts.all[name] += 1
        if not view:
            counts.kernels[name] += 1

    with compat.dispatch_mode(seen):
        yield counts
