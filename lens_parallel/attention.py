"""lens_parallel's own attention path: softmax attention without the square pattern nobody reads.

TransformerLens 4.3 forces eager attention and its attention bridges build the whole ``[batch, head_index,
query_pos, key_pos]`` scores and pattern in every layer, whether a hook reads them or not. Once :func:`install`\\ ed
(every model :func:`lens_parallel.load_model` boots), each softmax-attention component of the bridge chooses, at
each forward, the cheapest of four exact paths that serves the hooks attached to it:

- ``fused``: :func:`torch.nn.functional.scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA,
  the fused CPU kernel here) when nothing hooks ``hook_pattern`` or ``hook_attn_scores``. ``hook_q``, ``hook_k``,
  ``hook_v``, ``hook_rot_q``/``hook_rot_k``, ``hook_z`` and ``hook_attn_out`` fire with the same values.
- ``diagonal``: the fused kernel again, when every hook on ``hook_pattern`` needs only each query's own weight
  (a :class:`RowsHook` with a ``diagonal`` form: the captures of A_tt, ``ZeroDiagonal``, ``DiagonalEdit``, the
  exclude-self space). The kernel runs with each query's own key masked out and returns each row's log-sum-exp
  lse'_t over the other keys, so with the own score s_tt: A_tt = sigmoid(s_tt - lse'_t), the rest of the row
  sums to sigmoid(lse'_t - s_tt) and its output is the kernel's times that (:class:`Diagonal`); the hooks read
  or edit those, and z_t = rest_t + A_tt v_t. Memory and time of the fused path; no pattern row is formed.
- ``blocked``: the pattern computed ``block_size`` queries at a time (memory O(block x T) instead of O(T^2)) when
  every hook on ``hook_pattern`` is a :class:`RowsHook` (a hook that reads or edits rows independently: every
  lens_parallel capture of the diagonal and every pattern edit). A block of queries ``[start, stop)`` sees keys
  ``[0, offset + stop)`` only (the causal mask hides the rest), so each hook receives a pattern whose queries are
  its last positions, exactly as at a cached decoding step; :data:`QUERY_BLOCK` says which queries they are.
- ``eager``: TransformerLens's own forward, when any other hook reads ``hook_pattern`` (a whole-square cache,
  ``run_with_cache``) or anything hooks ``hook_attn_scores``.

The diagonal path needs a kernel that returns the log-sum-exp (:func:`lens_parallel.compat.attention_with_lse`:
PyTorch's fused CPU kernel on a CPU, its memory-efficient kernel on CUDA); where none serves, and for edits of the
diagonal while gradients flow, the blocked path serves the same hooks. Block sizes are the device's
(:mod:`lens_parallel.devices`: cache-sized on a CPU, few and large on a GPU), and nothing in a forward is read on
the host (a fully masked row is replaced on the device whether there is one or not).

:func:`attention_path` forces one of them where the hooks allow it (``auto`` restores the choice). Scores, masks,
soft-capping, grouped-query heads, sliding windows (the mask Hugging Face builds; a block of queries reads only the
keys its window reaches), query/key norms and Qwen3.5's gate follow the bridge's own forward step for step; where
the queries and keys come from steps that forward does not take (norms before the head split, rotary of adjacent
pairs, a key multiplier, ...), the Hugging Face module makes them and hands them to this attention
(:func:`attend_routed`, attention sinks included); ALiBi's bias rides in one more column of the queries and keys
(:func:`_with_bias`), so every path serves it. A component TransformerLens serves itself says why
(:func:`lens_parallel.compat.own_attention_reason`). Fully masked query rows (the pads of a left-padded batch) get
the mean of every value, as the eager softmax over equal masked scores gives.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from lens_parallel import compat, devices
from lens_parallel.choices import AttentionPath
from lens_parallel.errors import LensParallelError, LibraryError
from lens_parallel.validate import check_choice


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
decoding loop (:mod:`lens_parallel.generation`, through :func:`lens_parallel.compat.cache_reaches_attention`) and by
the blocked path for its blocks; None elsewhere. Read through :func:`lens_parallel.edits.all_values`."""

_PATH: contextvars.ContextVar[tuple[AttentionPath, int | None]] = contextvars.ContextVar(
    "attention_path", default=("auto", None)
)
_RECORDED: contextvars.ContextVar[collections.Counter[str] | None] = contextvars.ContextVar("recorded", default=None)


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


@contextlib.contextmanager
def attention_path(path: AttentionPath, *, block_size: int | None = None) -> Iterator[None]:
    """Force every installed attention component to ``path`` while inside, where its hooks allow it (a hook that
    needs the whole pattern keeps the eager path; one that reads rows keeps a pattern), ``auto``: chosen per forward,
    queries blocked ``block_size`` at a time on the blocked path (default: as many as keep one block's scores within
    the device's ``attention_elements``, :class:`~lens_parallel.devices.WorkSizes`, at least 16)."""
    check_choice("attention path", path, AttentionPath)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise LensParallelError(f"block_size must be a positive integer, got {block_size!r}")
    token = _PATH.set((path, block_size))
    try:
        yield
    finally:
        _PATH.reset(token)


def block_rows(tensor: Tensor, axis: int = 1) -> Tensor:
    """The rows of a per-query ``tensor`` (one row per query of the call along ``axis``) that the pattern being
    hooked holds (:data:`QUERY_BLOCK`): all of them outside the blocked path."""
    block = QUERY_BLOCK.get()
    if block is None or tensor.shape[axis] != block.total:
        return tensor
    return tensor.narrow(axis, block.start, block.stop - block.start)


class _Path:
    """One of the exact paths (module docstring): its ``name`` (what :func:`recorded_paths` counts), whether it forms
    the whole ``[query_pos, key_pos]`` square (``whole_square``: TransformerLens's own forward on a bridge's route,
    :func:`_square` on a module's), and what it computes in :func:`attend` (:meth:`serve`: z, or None where the
    blocked path serves the call). By default: when gradients flow and every hook on hook_pattern is a detached
    reader (:class:`RowsHook`: the captures of the diagonal), z from the fused kernel and the blocks formed for the
    readers without a graph, so the backward holds O(T) per layer instead of every block's pattern."""

    name: ClassVar[str]
    whole_square: ClassVar[bool] = False

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, layer: int | None, **parts: Any
    ) -> Tensor | None:
        if not (_detached_readers(component) and _needs_grad(q, k, v)):
            return None
        z = _kernel(q, k, v, mask, **parts)
        if z is not None:
            with torch.no_grad():
                _blocked(component, q, k, v, mask, layer=layer, outputs=False, **parts)
        return z


class _Fused(_Path):
    """``fused``: the kernel, in one call or a block of queries per call (:func:`_kernel`)."""

    name = "fused"

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, layer: int | None, **parts: Any
    ) -> Tensor | None:
        return _kernel(q, k, v, mask, **parts)


class _Diagonal(_Path):
    """``diagonal``: the kernel's rows reduced to each query's own weight, the hooks' diagonal forms applied to
    them (:func:`_on_diagonal`); where it cannot serve, the default of :class:`_Path`."""

    name = "diagonal"

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, layer: int | None, **parts: Any
    ) -> Tensor | None:
        z = _on_diagonal(component, q, k, v, mask, **parts)
        return z if z is not None else super().serve(component, q, k, v, mask, layer=layer, **parts)


class _Blocked(_Path):
    """``blocked``: the queries a block at a time (:func:`_blocked`), after the default of :class:`_Path`."""

    name = "blocked"


class _Eager(_Path):
    """``eager``: the whole square, through hook_attn_scores and hook_pattern (:func:`_square`)."""

    name = "eager"
    whole_square = True

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, layer: int | None, **parts: Any
    ) -> Tensor | None:
        return _square(component, q, k, v, mask, parts["scale"], parts["softcap"], parts["sinks"])


FUSED, DIAGONAL, BLOCKED, EAGER = _Fused(), _Diagonal(), _Blocked(), _Eager()


@dataclasses.dataclass(frozen=True)
class _Choice:
    """A choice of :func:`attention_path`: the path taken where no hook reads the pattern (``free``), and where hooks
    read its rows either ``kept`` or, None, the diagonal path if every reader has a diagonal form, else the blocked
    one. A hook that needs the whole square gets the eager path under every choice."""

    free: _Path
    kept: _Path | None = None

    def path(self, readers: list[Any]) -> _Path:
        if not readers:
            return self.free
        if self.kept is not None:
            return self.kept
        return DIAGONAL if all(f.diagonal is not None for f in readers) else BLOCKED


CHOICES: Mapping[AttentionPath, _Choice] = {
    "auto": _Choice(FUSED),
    "fused": _Choice(FUSED),
    "diagonal": _Choice(DIAGONAL),  # hooked or not, every layer forms z alike (a sweep's forwards round alike)
    "blocked": _Choice(BLOCKED, BLOCKED),
    "eager": _Choice(EAGER, EAGER),
}
"""What each choice of :func:`attention_path` does (:class:`_Choice`)."""


def chosen_path(component: Any) -> _Path:
    """The path ``component`` takes in this forward: eager when forced or when a hook needs the whole square (any
    hook on ``hook_attn_scores``, a backward hook or a hook other than a :class:`RowsHook` on ``hook_pattern``);
    blocked when forced; else, when hooks read or edit rows of the pattern, diagonal if each has its diagonal form,
    blocked otherwise; with no such hook, diagonal when forced (z formed as the hooked layers form it), else fused
    (soft-capped scores included: :func:`_capped_blocks`) (:data:`CHOICES`).
    (:func:`attend` serves a diagonal choice on the blocked path where no kernel returns the log-sum-exp, and
    where an edit of the diagonal needs its gradient.)"""
    choice, _ = _PATH.get()
    scores, pattern = component.hook_attn_scores, component.hook_pattern
    readers = [handle.user_hook for handle in pattern.fwd_hooks]
    whole = scores.has_hooks() or pattern.has_hooks(dir="bwd") or any(not isinstance(f, RowsHook) for f in readers)
    path = EAGER if whole else CHOICES[choice].path(readers)
    if (seen := _RECORDED.get()) is not None:
        seen[path.name] += 1
    return path


@contextlib.contextmanager
def recorded_paths() -> Iterator[collections.Counter[str]]:
    """Inside, how many times each path was chosen by the attention components that take lens_parallel's path
    (:func:`chosen_path`; a layer TransformerLens serves itself, :attr:`~lens_parallel.ModelInfo.attention_paths`,
    chooses none): what a benchmark reports as the path that ran."""
    seen: collections.Counter[str] = collections.Counter()
    token = _RECORDED.set(seen)
    try:
        yield seen
    finally:
        _RECORDED.reset(token)


def _grouped(x: Tensor, n_kv: int) -> Tensor:
    """Query heads gathered under the key-value head they read: ``[batch, kv, group * query, last]``."""
    return einops.rearrange(x, "batch (kv group) query last -> batch kv (group query) last", kv=n_kv)


def _ungrouped(x: Tensor, group: int) -> Tensor:
    """The inverse of :func:`_grouped`, ``group`` query heads per key-value head."""
    return einops.rearrange(x, "batch kv (group query) last -> batch (kv group) query last", group=group)


def _dead_rows(mask: Tensor | None) -> Bool[Tensor, "batch heads query"] | None:
    """Query rows that the mask hides from every key (reduced without a mask-sized temporary); None without a
    mask. Never read on the host (a read per layer would make the host wait for the device)."""
    if mask is None:
        return None
    return ~mask.any(-1) if mask.dtype == torch.bool else mask.amax(-1) <= torch.finfo(mask.dtype).min


def _spans(n_query: int, n_key: int, block: int, window: int | None) -> Iterator[tuple[int, int, int, int]]:
    """Per block of ``block`` queries: its queries ``[start, stop)`` and the keys ``[begin, end)`` they may see
    (the queries are the last ``n_query`` of ``n_key`` positions; a sliding ``window`` hides keys more than
    ``window`` positions back, one spare key kept for either convention of the window's edge)."""
    offset = n_key - n_query
    for start in range(0, n_query, block):
        stop = min(n_query, start + block)
        yield start, stop, 0 if window is None else max(0, offset + start - window), offset + stop


def _with_bias(
    q: Float[Tensor, "batch head_index query_pos d_head"],
    k: Float[Tensor, "batch kv_head_index key_pos d_head"],
    bias: Float[Tensor, "#batch head_index key_pos"],
    *,
    scale: float,
) -> tuple[Float[Tensor, "batch head_index query_pos d_wide"], Float[Tensor, "batch head_index key_pos d_wide"]]:
    """An additive score term per key (ALiBi's b_hs: a slope per head times the key's position; ``bias`` broadcast
    over the batch where its first axis is 1) carried by one more column of the queries and keys:

        q'_t = [q_t, 1, 0, ...], k'_s = [k_s, b_s / scale, 0, ...], so scale q'_t . k'_s = scale q_t . k_s + b_s,

    on every path (the fused kernels with a causal flag, the diagonal rows, the blocked scores) with nothing of
    ``[query_pos, key_pos]`` formed. The width is rounded up to a multiple of 8 (what CUDA's fused kernels take);
    the values keep theirs (the kernels get them padded with zeros, :func:`_widened`). The keys need the query heads'
    own (a slope per query head): grouped-query keys are refused."""
    if k.shape[1] != q.shape[1]:
        raise LibraryError(f"a score bias per query head needs a key per query head, got {k.shape[1]} of {q.shape[1]}")
    d_head = q.shape[-1]
    pad = -(-(d_head + 1) // 8) * 8 - d_head - 1
    column = (bias.to(torch.promote_types(bias.dtype, torch.float32)) / scale).to(k.dtype)
    column = column.expand(k.shape[0], k.shape[1], k.shape[2])[..., None]
    q = torch.cat([q, q.new_ones(*q.shape[:-1], 1), q.new_zeros(*q.shape[:-1], pad)], dim=-1)
    k = torch.cat([k, column, k.new_zeros(*k.shape[:-1], pad)], dim=-1)
    return q, k


def _widened(v: Tensor, width: int) -> Tensor:
    """``v`` with zero columns up to ``width`` (the keys' width under a score bias, :func:`_with_bias`): the fused
    kernels take values as wide as the keys; their output's first ``v.shape[-1]`` columns are the attention's."""
    return v if v.shape[-1] == width else F.pad(v, (0, width - v.shape[-1]))


def _with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor] | None:
    """:func:`lens_parallel.compat.attention_with_lse` on values as wide as the keys (:func:`_widened`)."""
    found = compat.attention_with_lse(q, k, _widened(v, k.shape[-1]), mask, causal=causal, scale=scale)
    return None if found is None else (found[0][..., : v.shape[-1]], found[1])


def attend(
    component: Any,
    q: Float[Tensor, "batch head_index query_pos d_head"],
    k: Float[Tensor, "batch kv_head_index key_pos d_head"],
    v: Float[Tensor, "batch kv_head_index key_pos d_head"],
    mask: Tensor | None,
    *,
    path: _Path,
    scale: float,
    softcap: float | None,
    layer: int | None,
    window: int | None = None,
    sinks: Float[Tensor, " head_index"] | None = None,
    bias: Float[Tensor, "#batch head_index key_pos"] | None = None,
) -> Float[Tensor, "batch head_index query_pos d_head"]:
    """Softmax attention of causal queries (the last ``query_pos`` of the ``key_pos`` positions) over keys and values
    with key-value heads shared by ``head_index / kv_head_index`` query heads each (query head h reads key-value head
    h // group):

        s_ts = scale q_t . k_s (+ b_s, ALiBi's ``bias`` of key s, per head and batch row: :func:`_with_bias`;
        soft-capped: c tanh(s / c)), masked by ``mask`` (bool: allowed; float: added) or,
        without one, causally; A_t = softmax_s(s_t) in float32 (float64 in a float64 model, where
        TransformerLens's eager path rounds it to float32), hook_pattern; z_t = sum_s A_ts v_s. With attention
        ``sinks`` (gpt-oss: one learned logit b_h per head, a key without a value): A_ts = exp(s_ts) / (sum_u
        exp(s_tu) + exp(b_h)), so a row sums to sigmoid(lse_t - b_h) < 1 (:func:`_probabilities`); the fused kernel's
        output is scaled by that sum (:func:`_sink_kernel`), and the diagonal rows put b_h in their normaliser.

    ``diagonal``: the fused kernel's rows reduced to each query's own weight (:func:`_diagonal_rows`), the hooks'
    diagonal forms applied to them. ``fused``: scaled_dot_product_attention (no pattern; soft-capped scores from
    :func:`_capped_blocks`), in one call,
    or, with a mask and more queries than a block (the device's ``fused_block``,
    :class:`~lens_parallel.devices.WorkSizes`; the window if smaller; a forced ``block_size``), a block of queries
    per call against the keys it may see. ``blocked``: the queries
    ``block_size`` at a time, each block against the keys it may see, hook_pattern fired per block with the keys
    up to its last query (zeros left of a sliding ``window``; :data:`QUERY_BLOCK` set, :data:`STEP_VALUES` holding
    ``layer``'s values). A block of queries ``[start, stop)`` sees the keys ``[offset + start - window, offset +
    stop)`` (``window``: the layer's sliding window, which its mask also applies; none: from key 0). When gradients
    flow and every hook on hook_pattern is a detached reader (:class:`RowsHook`: the captures of the diagonal), z
    comes from the fused kernel and the blocks are formed for the readers without a graph, so the backward holds
    O(T) per layer instead of every block's pattern. Returns z ``[batch, head_index, query_pos, d_head]`` in the
    queries' dtype."""
    n_heads, n_kv, n_query = q.shape[1], k.shape[1], q.shape[2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if bias is not None:
        q, k = _with_bias(q, k, bias, scale=scale)
    parts: dict[str, Any] = {"scale": scale, "window": window, "sinks": sinks, "softcap": softcap}
    z = path.serve(component, q, k, v, mask, layer=layer, **parts)
    if z is None:
        z = _blocked(component, q, k, v, mask, scale=scale, softcap=softcap, layer=layer, window=window, sinks=sinks)
    dead = _dead_rows(mask)
    if dead is not None and sinks is None:  # eager: every masked score equal, so the softmax is uniform over all keys
        mean = einops.repeat(v.mean(2), "batch kv d -> batch (kv group) d", group=n_heads // n_kv)
        z = torch.where(dead.expand(z.shape[0], n_heads, n_query)[..., None], mean[:, :, None].to(z.dtype), z)
    return z


def _square(
    component: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """The eager path written inline, for a component whose TransformerLens bridge would only see the pattern after
    the attention has run (the attention-interface route, :func:`lens_parallel.compat.install_attention`): the whole
    ``[batch, head_index, query_pos, key_pos]`` scores through ``hook_attn_scores``, soft-capped, masked (as
    :func:`attend`), the softmax in float32 (with the sinks, :func:`_probabilities`) through ``hook_pattern``, and z
    from the pattern the hooks leave, so that an edit of either reaches the output as on TransformerLens's own eager
    forward."""
    n_heads, n_kv, n_query, n_key = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    scores = component.hook_attn_scores(_block_scores(q, k, mask, (0, n_query, 0, n_key), scale, softcap))
    precise = torch.promote_types(q.dtype, torch.float32)
    pattern = component.hook_pattern(_probabilities(scores, precise, sinks).to(q.dtype))
    return _ungrouped(_grouped(pattern, n_kv) @ v, n_heads // n_kv)


def attend_routed(
    component: Any,
    q: Float[Tensor, "batch head_index query_pos d_head"],
    k: Float[Tensor, "batch kv_head_index key_pos d_head"],
    v: Float[Tensor, "batch kv_head_index key_pos d_head"],
    mask: Tensor | None,
    *,
    scale: float,
    softcap: float | None,
    window: int | None,
    layer: int | None,
    sinks: Float[Tensor, " head_index"] | None = None,
) -> Float[Tensor, "batch head_index query_pos d_head"]:
    """The attention a Hugging Face module hands to transformers' attention interface, computed here for its
    TransformerLens component (the route :func:`lens_parallel.compat.install_attention` takes for the generic
    ``AttentionBridge``): ``q``, ``k``, ``v`` as the module made them (after its rotary, norms and cache). The path is
    :func:`chosen_path`'s; ``eager`` is the square written inline (:func:`_square`), so that hook_pattern fires
    inside the forward and its edits reach the output. At a cached decoding step the layer's values over every key
    go to the edits that read them (:data:`STEP_VALUES`); ``sinks``: the module's attention sinks (``s_aux``)."""
    values = STEP_VALUES.get()
    if values is not None and layer is not None:  # the decoding loop's dictionary: every key's values
        values[layer] = einops.rearrange(v, "batch kv key d -> batch key kv d")
    return attend(
        component,
        q,
        k,
        v,
        mask,
        path=chosen_path(component),
        scale=scale,
        softcap=softcap,
        layer=layer,
        window=window,
        sinks=sinks,
    )


def _on_diagonal(
    component: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float,
    window: int | None,
    sinks: Tensor | None,
    softcap: float | None,
) -> Tensor | None:
    """The diagonal path: the rows from :func:`_diagonal_rows`, each hook's diagonal form applied in order, z from
    the rows they leave (when gradients flow, and every hook only reads, from the fused kernel: the rows are formed
    without a graph). None where this path cannot serve (no kernel returns the log-sum-exp; an edit under
    gradients): the blocked path does."""
    hooks = [handle.user_hook for handle in component.hook_pattern.fwd_hooks]
    grad = _needs_grad(q, k, v)
    if grad and not all(f.detached for f in hooks):
        return None
    with torch.no_grad() if grad else contextlib.nullcontext():
        rows = _diagonal_rows(q, k, v, mask, scale=scale, window=window, sinks=sinks, softcap=softcap)
        if rows is None:
            return None
        for f in hooks:
            edited = f.diagonal(rows, component.hook_pattern)
            rows = rows if edited is None else edited
    return (
        _kernel(q, k, v, mask, scale=scale, window=window, sinks=sinks, softcap=softcap) if grad else rows.z.to(q.dtype)
    )


def _diagonal_rows(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float,
    window: int | None,
    sinks: Tensor | None,
    softcap: float | None,
) -> Diagonal | None:
    """Each row's :class:`Diagonal` from the fused kernel run with each query's own key masked out
    (:func:`lens_parallel.compat.attention_with_lse`), O(T) memory beyond the kernel's:

        lse'_t = log sum_{s != t} exp(s_ts): [A_tt, sum_{s != t} A_ts] = softmax([s_tt, lse'_t]) (= sigmoid(+-(s_tt
        - lse'_t))), rest_t = sum_{s != t} A_ts * (the kernel's output, sum_{s != t} A_ts v_s / sum_{s != t} A_ts),

    with s_tt the query's own score (soft-capped, c tanh(s_tt / c), where the layer caps its scores; plus its mask
    entry); a row with no other key has A_tt = 1. Soft-capped scores come from :func:`_capped_blocks`, which no
    fused kernel computes. With ``sinks`` b_h
    the normaliser holds the sink too: [A_tt, sum_{s != t} A_ts, sink share] = softmax([s_tt, lse'_t, b_h]). Without
    a mask and with as many queries as keys, one causal call of queries 1.. against keys ..T-2 is the strictly causal
    attention (no mask to read); otherwise the queries go a block at a time (as on the fused path), each against the
    keys it may see, its own masked. Fully masked rows (pads) get A_tt = 1 / key_pos, as eager's uniform row has
    (with sinks, 0: the sink takes the row). None where no kernel returns the log-sum-exp."""
    n_heads, n_kv, n_query, n_key = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    offset, precise = n_key - n_query, torch.promote_types(q.dtype, torch.float32)
    k, v = (einops.repeat(t, "batch kv key d -> batch (kv group) key d", group=n_heads // n_kv) for t in (k, v))
    own_value = v[:, :, offset:].to(precise)
    own_score = scale * (q.to(precise) * k[:, :, offset:].to(precise)).sum(-1)
    if softcap is not None:
        own_score = softcap * torch.tanh(own_score / softcap)
    low = torch.finfo(q.dtype).min
    if mask is None and offset == 0 and softcap is None:
        out, lse = v.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_full(q.shape[:-1], float("-inf"), dtype=precise)
        if n_query > 1:
            found = _with_lse(q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], None, causal=True, scale=scale)
            if found is None:
                return None
            out[:, :, 1:], lse[:, :, 1:] = found
    else:
        blocks = (
            _lse_blocks(q, k, v, mask, scale=scale, window=window, hide_own=True)
            if softcap is None
            else _capped_blocks(q, k, v, mask, scale=scale, softcap=softcap, window=window, hide_own=True)
        )
        if blocks is None:
            return None
        out, lse = blocks
        if mask is not None:
            own_mask = torch.diagonal(mask, offset=offset, dim1=-2, dim2=-1)
            own_score = own_score + (
                torch.where(own_mask, 0.0, low) if mask.dtype == torch.bool else own_mask.to(precise)
            )
    # [A_tt, sum_{s != t} A_ts] = softmax([s_tt, lse'_t]): a row-wise kernel, so each row rounds alike whatever the
    # batch (an elementwise sigmoid rounds the elements of a vector loop's scalar tail differently)
    logits = [own_score, lse.to(precise)]
    if sinks is not None:
        logits.append(sinks.to(precise)[None, :, None].expand_as(own_score))
    shares = torch.softmax(torch.stack(logits, -1), -1)  # own key, the other keys, the sink
    weight, keys, others = shares[..., 0], shares[..., 1], shares[..., 1:].sum(-1)
    rows = Diagonal(weight, others, keys[..., None] * out.to(precise), own_value, offset, q.dtype)
    dead = _dead_rows(mask)
    if dead is None or sinks is not None:  # with sinks a fully masked row is all sink, as computed
        return rows
    uniform = torch.full_like(rows.weight, 1 / n_key)
    return rows.where(~dead, rows.replace(weight=uniform, others=1 - uniform))


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _detached_readers(component: Any) -> bool:
    """Whether every hook on the component's hook_pattern is a detached :class:`RowsHook`."""
    readers = [handle.user_hook for handle in component.hook_pattern.fwd_hooks]
    return bool(readers) and all(isinstance(f, RowsHook) and f.detached for f in readers)


def _fused_block(device: torch.device, window: int | None) -> int:
    """Queries per kernel call when a mask is given: a forced block size, else the device's ``fused_block`` (the
    sliding ``window`` if smaller)."""
    _, forced_block = _PATH.get()
    block = devices.sizes(device).fused_block
    return forced_block or min(block, window or block)


def _additive(
    q: Tensor, mask: Tensor | None, span: tuple[int, int, int, int], *, offset: int, hide_own: bool
) -> Float[Tensor, "... block_query block_key"]:
    """The additive mask of queries ``[start, stop)`` against keys ``[begin, end)`` (``span``), in the queries'
    dtype: ``mask``'s (bool: allowed; float: added) or, without one, causal (the queries the last of the keys;
    ``begin`` is 0 then), each query's own key hidden too when ``hide_own``."""
    start, stop, begin, end = span
    low = torch.finfo(q.dtype).min
    own = torch.arange(offset + start, offset + stop, device=q.device)[:, None] == torch.arange(
        begin, end, device=q.device
    )
    own = own if hide_own else torch.zeros_like(own)
    if mask is None:
        hidden = ~torch.ones(stop - start, end - begin, dtype=torch.bool, device=q.device).tril(end - (stop - start))
        return torch.zeros_like(hidden, dtype=q.dtype).masked_fill(hidden | own, low)
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask[..., start:stop, begin:end] | own, low)
    return mask[..., start:stop, begin:end].masked_fill(own, low)


def _lse_blocks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, window: int | None, hide_own: bool
) -> tuple[Tensor, Tensor] | None:
    """The kernel that returns the log-sum-exp (:func:`lens_parallel.compat.attention_with_lse`) a block of queries
    at a time, each against the keys it may see (``k``, ``v`` with the queries' heads), each query's own key hidden
    when ``hide_own``: ``(out, lse)`` for every query, or None where no kernel serves."""
    n_query, n_key = q.shape[2], k.shape[2]
    outs, lses = [], []
    for span in _spans(n_query, n_key, _fused_block(q.device, window), window if mask is not None else None):
        start, stop, begin, end = span
        additive = _additive(q, mask, span, offset=n_key - n_query, hide_own=hide_own)
        found = _with_lse(
            q[:, :, start:stop], k[:, :, begin:end], v[:, :, begin:end], additive, causal=False, scale=scale
        )
        if found is None:
            return None
        outs.append(found[0])
        lses.append(found[1])
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _probabilities(scores: Tensor, precise: torch.dtype, sinks: Tensor | None) -> Tensor:
    """softmax over the keys of ``scores`` ``[batch, head_index, query, key]`` in ``precise``; with ``sinks`` (one
    logit b_h per head) each row's normaliser holds exp(b_h) too and the sink's column is dropped (a row sums to
    less than 1), as Hugging Face's eager attention with sinks computes it."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=precise)
    column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=precise)[..., :-1]


def _kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float,
    window: int | None,
    sinks: Tensor | None,
    softcap: float | None,
) -> Tensor | None:
    """z from a fused kernel: SDPA (:func:`_fused`), with ``sinks`` the kernel that returns the log-sum-exp
    (:func:`_sink_kernel`), with soft-capped scores :func:`_capped_blocks` (sinks too, as
    :func:`_sink_kernel` applies them); None where none serves (the caller takes the blocked path)."""
    if softcap is not None:
        out, lse = _capped_blocks(q, k, v, mask, scale=scale, softcap=softcap, window=window, hide_own=False)
        return out if sinks is None else _sunk(out, lse, sinks)
    if sinks is None:
        return _fused(q, k, v, mask, scale=scale, window=window)
    return _sink_kernel(q, k, v, mask, scale=scale, window=window, sinks=sinks)


def _sink_kernel(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, window: int | None, sinks: Tensor
) -> Tensor | None:
    """Attention with sinks from the fused kernel that returns each row's log-sum-exp lse_t
    (:func:`lens_parallel.compat.attention_with_lse`), O(T) memory beyond it: a sink is a key with logit b_h and no
    value, so z_t = sigmoid(lse_t - b_h) * (the kernel's output) exactly. The queries a block at a time where a mask
    or a cache is read (as :func:`_fused`); None where no kernel returns the log-sum-exp."""
    n_heads, n_kv, n_query, n_key = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = (einops.repeat(t, "batch kv key d -> batch (kv group) key d", group=n_heads // n_kv) for t in (k, v))
    offset = n_key - n_query
    if mask is None and offset == 0:
        found = _with_lse(q, k, v, None, causal=True, scale=scale)
        if found is None:
            return None
        out, lse = found
    else:
        blocks = _lse_blocks(q, k, v, mask, scale=scale, window=window, hide_own=False)
        if blocks is None:
            return None
        out, lse = blocks
    return _sunk(out, lse, sinks)


def _sunk(
    out: Float[Tensor, "batch head_index query_pos d_head"],
    lse: Float[Tensor, "batch head_index query_pos"],
    sinks: Tensor,
) -> Float[Tensor, "batch head_index query_pos d_head"]:
    """The attention ``out`` (normalised over the keys, log-sum-exp ``lse``) with the sinks' logits b_h in its
    normaliser: out * sigmoid(lse - b_h), in the output's dtype."""
    precise = torch.promote_types(out.dtype, torch.float32)
    share = torch.sigmoid(lse.to(precise) - sinks.to(precise)[None, :, None])
    return (out.to(precise) * share[..., None]).to(out.dtype)


def _capped_blocks(
    q: Float[Tensor, "batch head_index query_pos d_head"],
    k: Float[Tensor, "batch kv_head_index key_pos d_head"],
    v: Float[Tensor, "batch kv_head_index key_pos d_head"],
    mask: Tensor | None,
    *,
    scale: float,
    softcap: float,
    window: int | None,
    hide_own: bool,
) -> tuple[Float[Tensor, "batch head_index query_pos d_head"], Float[Tensor, "batch head_index query_pos"]]:
    """Attention with soft-capped scores (Gemma 2), which no fused kernel computes, a block of queries at a time
    against the keys each may see, never a ``[query_pos, key_pos]`` tensor:

        s_ts = c tanh(scale q_t . k_s / c) = 2c sigmoid(2 scale q_t . k_s / c) - c (+ the mask: :func:`_additive`,
        each query's own key hidden when ``hide_own``); A_t = softmax_s(s_t), out_t = sum_s A_ts v_s,
        lse_t = log sum_s exp(s_ts) = max_s s_ts - log max_s A_ts,

    the sigmoid form because it costs a sixth of tanh on a CPU and -c cancels in the softmax; the matmul in the
    queries' dtype as the eager path forms it, the cap and the softmax in float32 (float64 in a float64 model: in
    bfloat16, sigmoid's rounding near 1/2 times 2c would move every score by up to c 2^-8). One batch row
    at a time, in blocks of queries chosen by the row's size alone, so that a document's numbers do not depend on
    the batch it comes in (an elementwise kernel rounds the tail of its vector loop apart); a block holds at most
    the device's ``capped_elements`` scores (:class:`~lens_parallel.devices.WorkSizes`: on a CPU, few enough that
    a block's passes stay in the caches; a forced ``block_size`` queries); where no gradient flows its scores are
    formed in place. Returns ``(out, lse)``; a row with no key it may see has the uniform row eager gives it (lse
    about ``finfo.min``)."""
    n_heads, n_query, n_key = q.shape[1], q.shape[2], k.shape[2]
    _, forced_block = _PATH.get()
    block = forced_block or max(1, devices.sizes(q.device).capped_elements // max(1, n_heads * n_key))
    q = q * (2 * scale / softcap)
    rows = [
        _capped_row(
            q[b : b + 1],
            k[b : b + 1],
            v[b : b + 1],
            None if mask is None else mask[b : b + 1] if mask.shape[0] > 1 else mask,
            softcap=softcap,
            spans=list(_spans(n_query, n_key, block, window if mask is not None else None)),
            hide_own=hide_own,
        )
        for b in range(q.shape[0])
    ]
    return torch.cat([out for out, _ in rows]), torch.cat([lse for _, lse in rows])


def _capped_row(
    q: Float[Tensor, "1 head_index query_pos d_head"],
    k: Float[Tensor, "1 kv_head_index key_pos d_head"],
    v: Float[Tensor, "1 kv_head_index key_pos d_head"],
    mask: Tensor | None,
    *,
    softcap: float,
    spans: list[tuple[int, int, int, int]],
    hide_own: bool,
) -> tuple[Float[Tensor, "1 head_index query_pos d_head"], Float[Tensor, "1 head_index query_pos"]]:
    """One batch row of :func:`_capped_blocks`, its queries already scaled by 2 scale / c."""
    n_kv, group, offset = k.shape[1], q.shape[1] // k.shape[1], k.shape[2] - q.shape[2]
    precise = torch.promote_types(q.dtype, torch.float32)
    grad, low = _needs_grad(q, k, v), torch.finfo(precise).min
    outs, lses = [], []
    for start, stop, begin, end in spans:
        scores = _ungrouped(_grouped(q[:, :, start:stop], n_kv) @ k[:, :, begin:end].transpose(-1, -2), group)
        scores = scores.to(precise)  # the cap in float32: bfloat16's rounding of sigmoid near 1/2, times 2c, is c 2^-8
        scores = torch.sigmoid(scores) * (2 * softcap) if grad else scores.sigmoid_().mul_(2 * softcap)
        if mask is None:  # causal: only the block's own positions (its last keys) hide any key
            n = stop - start
            hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(0 if hide_own else 1)
            scores[..., end - n :].masked_fill_(hidden, low)
        else:  # a mask of -inf is read as finfo.min: a row it hides whole is eager's uniform row, not NaN
            additive = _additive(q, mask, (start, stop, begin, end), offset=offset, hide_own=hide_own)
            scores = scores.add_(additive).clamp_min_(low)
        pattern = torch.softmax(scores, dim=-1, dtype=precise)
        outs.append(_ungrouped(_grouped(pattern.to(v.dtype), n_kv) @ v[:, :, begin:end], group))
        lses.append(scores.amax(-1) - pattern.amax(-1).log() - softcap)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, window: int | None) -> Tensor:
    n_heads, n_kv, n_query, n_key = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    block, d_head, v = _fused_block(q.device, window), v.shape[-1], _widened(v, k.shape[-1])
    if mask is None or n_query <= block:
        causal = mask is None and n_query == n_key and n_query > 1
        if mask is None and 1 < n_query < n_key:
            mask = torch.ones(n_query, n_key, dtype=torch.bool, device=q.device).tril(n_key - n_query)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=n_kv != n_heads
        )[..., :d_head]
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, start:stop],
                k[:, :, begin:end],
                v[:, :, begin:end],
                attn_mask=mask[..., start:stop, begin:end],
                scale=scale,
                enable_gqa=n_kv != n_heads,
            )[..., :d_head]
            for start, stop, begin, end in _spans(n_query, n_key, block, window)
        ],
        dim=2,
    )


def _block_scores(
    q: Tensor, k: Tensor, mask: Tensor | None, span: tuple[int, int, int, int], scale: float, softcap: float | None
) -> Float[Tensor, "batch head_index block_query block_key"]:
    """The scores of queries ``[start, stop)`` against keys ``[begin, end)`` (``span``): s = scale q . k, soft-capped
    (c tanh(s / c)), masked by ``mask`` (bool: allowed; float, in the queries' dtype: added) or, without one,
    causally (the queries the last of the keys; ``begin`` is 0 then)."""
    start, stop, begin, end = span
    n_heads, n_kv = q.shape[1], k.shape[1]
    scores = _ungrouped(_grouped(q[:, :, start:stop], n_kv) @ k[:, :, begin:end].transpose(-1, -2), n_heads // n_kv)
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    low = torch.finfo(q.dtype).min
    if mask is None:
        allowed = torch.ones(stop - start, end, dtype=torch.bool, device=q.device).tril(end - (stop - start))
        return scores.masked_fill(~allowed, low)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[..., start:stop, begin:end], low)
    return scores + mask[..., start:stop, begin:end]


def _blocked(
    component: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    scale: float,
    softcap: float | None,
    layer: int | None,
    window: int | None,
    sinks: Tensor | None = None,
    outputs: bool = True,
) -> Tensor:
    """The blocked path (:func:`attend`); ``outputs=False``: the hooks only (z not formed; returns an empty
    tensor)."""
    batch, n_heads, n_query, _ = q.shape
    n_kv, n_key = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    _, forced_block = _PATH.get()
    elements = devices.sizes(q.device).attention_elements
    block = forced_block or max(16, elements // max(1, batch * n_heads * n_key))
    precise = torch.promote_types(q.dtype, torch.float32)  # float32 softmax, float64 for a float64 model
    values = dict(STEP_VALUES.get() or {})
    if layer is not None:
        values[layer] = einops.rearrange(v, "batch kv key d -> batch key kv d")
    values_token = STEP_VALUES.set(values)
    out = []
    try:
        for start, stop, begin, end in _spans(n_query, n_key, block, window if mask is not None else None):
            scores = _block_scores(q, k, mask, (start, stop, begin, end), scale, softcap)
            pattern = F.pad(_probabilities(scores, precise, sinks).to(q.dtype), (begin, 0))
            token = QUERY_BLOCK.set(None if (start, stop) == (0, n_query) else QueryBlock(start, stop, n_query))
            try:
                pattern = component.hook_pattern(pattern)
            finally:
                QUERY_BLOCK.reset(token)
            if not outputs:
                continue
            if begin and bool(pattern[..., :begin].any()):  # a hook wrote outside the window: every key
                begin = 0
            out.append(_ungrouped(_grouped(pattern[..., begin:], n_kv) @ v[:, :, begin:end], group))
    finally:
        STEP_VALUES.reset(values_token)
    return torch.cat(out, dim=2) if out else q.new_zeros(0)


def install(model: Any) -> int:
    """Give every softmax-attention component of ``model`` (a TransformerBridge) lens_parallel's attention path;
    returns how many components took it (the others keep TransformerLens's forward). Idempotent."""
    return compat.install_attention(model, attend, chosen_path, attend_routed)
