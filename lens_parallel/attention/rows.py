"""What a hook on ``hook_pattern`` is handed by lens_parallel's attention: rows of the pattern, a block of queries
at a time, or each query's own weight alone.

A hook that treats each query row on its own says so (:func:`rows_hook`), and may say how it acts on a row's own
weight alone (its ``diagonal`` form, :class:`Diagonal` in and out): the paths (:mod:`lens_parallel.attention.paths`)
then hand it blocks of rows (:data:`QUERY_BLOCK` says which) or the diagonal rows, never the square.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint


@dataclasses.dataclass(frozen=True)
class QueryBlock:
    """The queries a blocked pattern holds: rows ``start .. stop - 1`` of the ``total`` queries of the call."""

    start: int
    stop: int
    total: int


QUERY_BLOCK: contextvars.ContextVar[QueryBlock | None] = contextvars.ContextVar("query_block", default=None)
"""While a hook on ``hook_pattern`` runs on the blocked path, the block of queries it holds; None when it holds
every query of the call (the eager path, a decoding step)."""

STEP_VALUES: contextvars.ContextVar[dict[int, Tensor] | None] = contextvars.ContextVar("step_values", default=None)
"""Each layer's values over every key position its attention reads in the current forward (cached and new:
``[batch, key_pos, head_index, d_head]``, key-value heads), where hook_v does not hold them all: filled by the
decoding loop (:mod:`lens_parallel.generation`) and by the blocked path for its blocks; None elsewhere. Read through
:func:`lens_parallel.edits.all_values`."""


@dataclasses.dataclass(frozen=True)
class Diagonal:
    """A softmax pattern's rows reduced to what a hook that reads or edits only each query's own weight needs (the
    ``diagonal`` path), for the queries of the call, the last ``query_pos`` of the keys (key ``first_key + t`` is
    query t's own):

        weight = A_tt, others = 1 - A_tt (the other keys' weight sum_{s != t} A_ts, plus the sink's share where the
        layer has attention sinks; kept apart: exact where A_tt is near 1),
        rest = sum_{s != t} A_ts v_s, value = v_t (per query head), so z_t = rest + weight v_t.

    Held in float32 (float64 in a float64 model); ``dtype`` is the model's, the pattern's on the other paths. An
    edit of the diagonal returns the rows it leaves: adding dA to A_tt is ``replace(weight=weight + dA)``."""

    weight: Float[Tensor, "batch head_index query_pos"]
    others: Float[Tensor, "batch head_index query_pos"]
    rest: Float[Tensor, "batch head_index query_pos d_head"]
    value: Float[Tensor, "batch head_index query_pos d_head"]
    first_key: int
    dtype: torch.dtype

    @property
    def z(self) -> Float[Tensor, "batch head_index query_pos d_head"]:
        """The attention output z_t = rest + A_tt v_t."""
        return self.rest + self.weight[..., None] * self.value

    def replace(
        self, *, weight: Tensor | None = None, others: Tensor | None = None, rest: Tensor | None = None
    ) -> Diagonal:
        """The same rows with ``weight``, ``others`` or ``rest`` replaced (an edit of the rows; v_t stays)."""
        return Diagonal(
            self.weight if weight is None else weight,
            self.others if others is None else others,
            self.rest if rest is None else rest,
            self.value,
            self.first_key,
            self.dtype,
        )

    def where(self, keep: Bool[Tensor, "batch head_index query_pos"], other: Diagonal) -> Diagonal:
        """These rows where ``keep`` (broadcast to ``[batch, head_index, query_pos]``), ``other``'s elsewhere."""
        return Diagonal(
            torch.where(keep, self.weight, other.weight),
            torch.where(keep, self.others, other.others),
            torch.where(keep[..., None], self.rest, other.rest),
            torch.where(keep[..., None], self.value, other.value),
            self.first_key,
            self.dtype,
        )


@dataclasses.dataclass(frozen=True)
class RowsHook:
    """A hook on ``hook_pattern`` that treats each query row on its own (it reads or rewrites rows, with the keys
    each row has), so the blocked path may hand it the pattern a block of queries at a time (:data:`QUERY_BLOCK`).
    ``detached``: it only reads the pattern and keeps nothing that needs its gradient (a detached capture), so when
    gradients flow the output may come from the fused kernel, the pattern rows computed for it without a graph.
    ``diagonal``: the same hook written on each row's own weight alone (:class:`Diagonal` in, the rows it leaves
    out, None if it only reads), which lets the ``diagonal`` path serve it from the fused kernel."""

    fn: Callable[..., Tensor | None]
    detached: bool = False
    diagonal: Callable[[Diagonal, HookPoint], Diagonal | None] | None = None

    def __call__(self, tensor: Tensor, hook: HookPoint) -> Tensor | None:
        return self.fn(tensor, hook)


def rows_hook(
    fn: Callable[..., Tensor | None],
    *,
    detached: bool = False,
    diagonal: Callable[[Diagonal, HookPoint], Diagonal | None] | None = None,
) -> RowsHook:
    """``fn`` marked as row-wise (:class:`RowsHook`), ``detached`` if it only reads without a gradient, with its
    ``diagonal`` form if it needs only each row's own weight."""
    return RowsHook(fn.fn if isinstance(fn, RowsHook) else fn, detached, diagonal)


def block_rows(tensor: Tensor, axis: int = 1) -> Tensor:
    """The rows of a per-query ``tensor`` (one row per query of the call along ``axis``) that the pattern being
    hooked holds (:data:`QUERY_BLOCK`): all of them outside the blocked path."""
    block = QUERY_BLOCK.get()
    if block is None or tensor.shape[axis] != block.total:
        return tensor
    return tensor.narrow(axis, block.start, block.stop - block.start)
