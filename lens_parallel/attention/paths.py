"""The exact paths of softmax attention, and the choice among them at each forward.

TransformerLens 4.3 forces eager attention and builds the whole ``[batch, head_index, query_pos, key_pos]`` scores
and pattern in every layer, whether a hook reads them or not. Each layer lens_parallel's attention serves (its site,
:mod:`lens_parallel.attention.site`) takes, at each forward, the cheapest of four exact paths that serves the hooks
attached to it:

- ``fused``: the fused kernels (:func:`lens_parallel.attention.fused.fused`) when nothing hooks ``hook_pattern`` or
  ``hook_attn_scores``; ``hook_q``, ``hook_k``, ``hook_v``, the rotary hooks, ``hook_z`` and ``hook_attn_out`` fire
  with the same values.
- ``diagonal``: the fused kernel again, when every hook on ``hook_pattern`` needs only each query's own weight (a
  :class:`~lens_parallel.attention.rows.RowsHook` with a ``diagonal`` form: the captures of A_tt, ``ZeroDiagonal``,
  ``DiagonalEdit``, the exclude-self space): each query's own key masked out, each row's log-sum-exp lse'_t over the
  other keys, so A_tt = sigmoid(s_tt - lse'_t) (:func:`lens_parallel.attention.fused.diagonal_rows`); the hooks read
  or edit those rows, and z_t = rest_t + A_tt v_t. Memory and time of the fused path; no pattern row is formed.
- ``blocked``: the pattern ``block_size`` queries at a time (memory O(block x T)) when every hook on
  ``hook_pattern`` is a RowsHook: a block of queries ``[start, stop)`` sees keys ``[0, offset + stop)`` only (the
  causal mask hides the rest), so each hook receives a pattern whose queries are its last positions, exactly as at
  a cached decoding step (:data:`~lens_parallel.attention.rows.QUERY_BLOCK` says which).
- ``eager``: the whole square, when any other hook reads ``hook_pattern`` (a whole-square cache, ``run_with_cache``)
  or anything hooks ``hook_attn_scores``: TransformerLens's own forward on a joint-QKV bridge, :func:`square` on a
  route through the module.

Where no kernel returns the log-sum-exp, and for edits of the diagonal while gradients flow, the blocked path serves
the diagonal path's hooks. Block sizes are the device's (:mod:`lens_parallel.devices`), and nothing in a forward is
read on the host (a fully masked row is replaced on the device whether there is one or not). Fully masked query rows
(the pads of a left-padded batch) get the mean of every value, as the eager softmax over equal masked scores gives.
:func:`attention_path` forces a path where the hooks allow it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from lens_parallel import devices
from lens_parallel.attention import kernels
from lens_parallel.attention.fused import diagonal_rows, fused
from lens_parallel.attention.rows import QUERY_BLOCK, STEP_VALUES, QueryBlock, RowsHook
from lens_parallel.attention.spec import ScoreSpec
from lens_parallel.choices import AttentionPath
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import check_choice, choice_table

_CHOICE: contextvars.ContextVar[AttentionPath] = contextvars.ContextVar("attention_path", default="auto")
_RECORDED: contextvars.ContextVar[collections.Counter[str] | None] = contextvars.ContextVar("recorded", default=None)

Arguments = tuple[Any, Tensor, Tensor, Tensor, Tensor | None, ScoreSpec, int | None]
"""What a path serves: the component (its hook points), q, k, v, the mask, the spec and the layer."""


class Path:
    """One of the exact paths (module docstring): its ``name`` (what :func:`recorded_paths` counts), whether it forms
    the whole ``[query_pos, key_pos]`` square (``whole_square``: TransformerLens's own forward on a joint-QKV
    bridge, :func:`square` on a route through the module), and what it computes in :func:`attend` (:meth:`serve`:
    z, or None where the blocked path serves the call). By default: when gradients flow and every hook on
    hook_pattern is a detached reader (the captures of the diagonal), z from the fused kernel and the blocks formed
    for the readers without a graph, so the backward holds O(T) per layer instead of every block's pattern."""

    name: ClassVar[str]
    whole_square: ClassVar[bool] = False

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: ScoreSpec, layer: int | None
    ) -> Tensor | None:
        if not (_detached_readers(component) and kernels.needs_grad(q, k, v)):
            return None
        z = fused(q, k, v, mask, spec)
        if z is not None:
            with torch.no_grad():
                blocked(component, q, k, v, mask, spec, layer, outputs=False)
        return z


class _Fused(Path):
    """``fused``: the kernel (:func:`~lens_parallel.attention.fused.fused`)."""

    name = "fused"

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: ScoreSpec, layer: int | None
    ) -> Tensor | None:
        return fused(q, k, v, mask, spec)


class _Diagonal(Path):
    """``diagonal``: the kernel's rows reduced to each query's own weight, the hooks' diagonal forms applied to them
    (:func:`_on_diagonal`); where it cannot serve, the default of :class:`Path`."""

    name = "diagonal"

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: ScoreSpec, layer: int | None
    ) -> Tensor | None:
        z = _on_diagonal(component, q, k, v, mask, spec)
        return z if z is not None else super().serve(component, q, k, v, mask, spec, layer)


class _Blocked(Path):
    """``blocked``: the queries a block at a time (:func:`blocked`), after the default of :class:`Path`."""

    name = "blocked"


class _Eager(Path):
    """``eager``: the whole square, through hook_attn_scores and hook_pattern (:func:`square`)."""

    name = "eager"
    whole_square = True

    def serve(
        self, component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: ScoreSpec, layer: int | None
    ) -> Tensor | None:
        return square(component, q, k, v, mask, spec)


FUSED, DIAGONAL, BLOCKED, EAGER = _Fused(), _Diagonal(), _Blocked(), _Eager()


@dataclasses.dataclass(frozen=True)
class _Choice:
    """A choice of :func:`attention_path`: the path taken where no hook reads the pattern (``free``), and where hooks
    read its rows either ``kept`` or, None, the diagonal path if every reader has a diagonal form, else the blocked
    one. A hook that needs the whole square gets the eager path under every choice."""

    free: Path
    kept: Path | None = None

    def path(self, readers: list[Any]) -> Path:
        if not readers:
            return self.free
        if self.kept is not None:
            return self.kept
        return DIAGONAL if all(f.diagonal is not None for f in readers) else BLOCKED


CHOICES: Mapping[AttentionPath, _Choice] = choice_table(
    AttentionPath,
    {
        "auto": _Choice(FUSED),
        "fused": _Choice(FUSED),
        "diagonal": _Choice(DIAGONAL),  # hooked or not, every layer forms z alike (a sweep's forwards round alike)
        "blocked": _Choice(BLOCKED, BLOCKED),
        "eager": _Choice(EAGER, EAGER),
    },
)
"""What each choice of :data:`~lens_parallel.choices.AttentionPath` does (:class:`_Choice`)."""


@contextlib.contextmanager
def attention_path(path: AttentionPath, *, block_size: int | None = None) -> Iterator[None]:
    """Force every layer lens_parallel's attention serves to ``path`` while inside, where its hooks allow it (a hook
    that needs the whole pattern keeps the eager path; one that reads rows keeps a pattern), ``auto``: chosen per
    forward, queries blocked ``block_size`` at a time on the blocked path (default: as many as keep one block's
    scores within the device's ``attention_elements``, :class:`~lens_parallel.devices.WorkSizes`, at least 16).

    Examples:
        >>> import torch
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-llama")
        >>> with lp.attention.attention_path("eager"), lp.attention.recorded_paths() as seen:
        ...     _ = model(torch.tensor([[1, 2, 3]]), return_type=None)
        >>> dict(seen)
        {'eager': 3}
    """
    check_choice("attention path", path, AttentionPath)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise LensParallelError(f"block_size must be a positive integer, got {block_size!r}")
    choice, block = _CHOICE.set(path), kernels.FORCED_BLOCK.set(block_size)
    try:
        yield
    finally:
        kernels.FORCED_BLOCK.reset(block)
        _CHOICE.reset(choice)


@contextlib.contextmanager
def recorded_paths() -> Iterator[collections.Counter[str]]:
    """Inside, how many times each path was chosen by the layers lens_parallel's attention serves
    (:func:`chosen_path`; a layer TransformerLens serves itself chooses none): what a benchmark reports as the path
    that ran."""
    seen: collections.Counter[str] = collections.Counter()
    token = _RECORDED.set(seen)
    try:
        yield seen
    finally:
        _RECORDED.reset(token)


def chosen_path(component: Any) -> Path:
    """The path ``component`` takes in this forward: eager when forced or when a hook needs the whole square (any
    hook on ``hook_attn_scores``, a backward hook or a hook other than a RowsHook on ``hook_pattern``); blocked
    when forced; else, when hooks read or edit rows of the pattern, diagonal if each has its diagonal form, blocked
    otherwise; with no such hook, diagonal when forced (z formed as the hooked layers form it), else fused
    (:data:`CHOICES`)."""
    scores, pattern = component.hook_attn_scores, component.hook_pattern
    readers = [handle.user_hook for handle in pattern.fwd_hooks]
    whole = scores.has_hooks() or pattern.has_hooks(dir="bwd") or any(not isinstance(f, RowsHook) for f in readers)
    path = EAGER if whole else CHOICES[_CHOICE.get()].path(readers)
    if (seen := _RECORDED.get()) is not None:
        seen[path.name] += 1
    return path


def attend(
    component: Any,
    q: Float[Tensor, "batch head_index query_pos d_head"],
    k: Float[Tensor, "batch kv_head_index key_pos d_head"],
    v: Float[Tensor, "batch kv_head_index key_pos d_head"],
    mask: Tensor | None,
    *,
    spec: ScoreSpec,
    path: Path,
    layer: int | None,
    call: dict[str, Any] | None = None,
) -> Float[Tensor, "batch head_index query_pos d_head"]:
    """Softmax attention of causal queries (the last ``query_pos`` of the ``key_pos`` positions) over keys and values
    with key-value heads shared by ``spec.group`` query heads each, on ``path``, ``component``'s hook points fired
    as the path fires them:

        s_ts = scale q_t . k_s (+ each feature's term: ALiBi's bias of key s in one more column of the queries and
        keys, from the block's ``call``; soft-capped: c tanh(s / c)), masked by ``mask`` (bool: allowed; float:
        added) or, without one, causally; A_t = softmax_s(s_t) in float32 (float64 in a float64 model),
        hook_pattern (with attention sinks b_h in each row's normaliser: A_ts = exp(s_ts) / (sum_u exp(s_tu) +
        exp(b_h))); z_t = sum_s A_ts v_s.

    Returns z ``[batch, head_index, query_pos, d_head]`` in the queries' dtype."""
    n_heads, n_kv, n_query = q.shape[1], k.shape[1], q.shape[2]
    q, k, mask = spec.prepare(q, k, mask, call or {})
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    z = path.serve(component, q, k, v, mask, spec, layer)
    if z is None:
        z = blocked(component, q, k, v, mask, spec, layer)
    dead = kernels.dead_rows(mask)
    if dead is not None and spec.sinks is None:  # eager: every masked score equal, so the softmax is uniform
        mean = einops.repeat(v.mean(2), "batch kv d -> batch (kv group) d", group=n_heads // n_kv)
        z = torch.where(dead.expand(z.shape[0], n_heads, n_query)[..., None], mean[:, :, None].to(z.dtype), z)
    return z


def block_scores(
    q: Tensor, k: Tensor, mask: Tensor | None, span: tuple[int, int, int, int], spec: ScoreSpec
) -> Float[Tensor, "batch head_index block_query block_key"]:
    """The scores of queries ``[start, stop)`` against keys ``[begin, end)`` (``span``): s = scale q . k, soft-capped
    where the layer caps them, masked by ``mask`` (bool: allowed; float, in the queries' dtype: added) or, without
    one, causally (the queries the last of the keys; ``begin`` is 0 then)."""
    start, stop, begin, end = span
    n_heads, n_kv = q.shape[1], k.shape[1]
    scores = kernels.ungrouped(
        kernels.grouped(q[:, :, start:stop], n_kv) @ k[:, :, begin:end].transpose(-1, -2), n_heads // n_kv
    )
    scores = scores * spec.scale
    if spec.softcap is not None:
        scores = spec.softcap.capped(scores)
    low = torch.finfo(q.dtype).min
    if mask is None:
        allowed = torch.ones(stop - start, end, dtype=torch.bool, device=q.device).tril(end - (stop - start))
        return scores.masked_fill(~allowed, low)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[..., start:stop, begin:end], low)
    return scores + mask[..., start:stop, begin:end]


def _probabilities(scores: Tensor, precise: torch.dtype, spec: ScoreSpec) -> Tensor:
    """softmax over the keys in ``precise``, the sinks in each row's normaliser where the layer has them."""
    if spec.sinks is None:
        return torch.softmax(scores, dim=-1, dtype=precise)
    return spec.sinks.softmax(scores, precise)


def blocked(
    component: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    spec: ScoreSpec,
    layer: int | None,
    *,
    outputs: bool = True,
) -> Tensor:
    """The blocked path (module docstring): hook_pattern fired per block with the keys up to its last query (zeros
    left of a sliding window; :data:`QUERY_BLOCK` set, :data:`STEP_VALUES` holding ``layer``'s values);
    ``outputs=False``: the hooks only (z not formed; returns an empty tensor)."""
    batch, n_heads, n_query, _ = q.shape
    n_kv, n_key = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    elements = devices.sizes(q.device).attention_elements
    block = kernels.FORCED_BLOCK.get() or max(16, elements // max(1, batch * n_heads * n_key))
    precise = torch.promote_types(q.dtype, torch.float32)  # float32 softmax, float64 for a float64 model
    values = dict(STEP_VALUES.get() or {})
    if layer is not None:
        values[layer] = einops.rearrange(v, "batch kv key d -> batch key kv d")
    values_token = STEP_VALUES.set(values)
    out = []
    window = spec.window if mask is not None else None
    try:
        for start, stop, begin, end in kernels.spans(n_query, n_key, block, window):
            scores = block_scores(q, k, mask, (start, stop, begin, end), spec)
            pattern = F.pad(_probabilities(scores, precise, spec).to(q.dtype), (begin, 0))
            token = QUERY_BLOCK.set(None if (start, stop) == (0, n_query) else QueryBlock(start, stop, n_query))
            try:
                pattern = component.hook_pattern(pattern)
            finally:
                QUERY_BLOCK.reset(token)
            if not outputs:
                continue
            if begin and bool(pattern[..., :begin].any()):  # a hook wrote outside the window: every key
                begin = 0
            out.append(kernels.ungrouped(kernels.grouped(pattern[..., begin:], n_kv) @ v[:, :, begin:end], group))
    finally:
        STEP_VALUES.reset(values_token)
    return torch.cat(out, dim=2) if out else q.new_zeros(0)


def square(component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: ScoreSpec) -> Tensor:
    """The eager path, for a layer whose bridge would only see the pattern after the attention has run (a route
    through the module): the whole ``[batch, head_index, query_pos, key_pos]`` scores through
    ``hook_attn_scores``, soft-capped and masked (as :func:`attend`), the softmax in float32 (with the sinks)
    through ``hook_pattern``, and z from the pattern the hooks leave, so that an edit of either reaches the output
    as on TransformerLens's own eager forward."""
    n_heads, n_kv, n_query, n_key = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    scores = component.hook_attn_scores(block_scores(q, k, mask, (0, n_query, 0, n_key), spec))
    precise = torch.promote_types(q.dtype, torch.float32)
    pattern = component.hook_pattern(_probabilities(scores, precise, spec).to(q.dtype))
    return kernels.ungrouped(kernels.grouped(pattern, n_kv) @ v, n_heads // n_kv)


def _on_diagonal(
    component: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: ScoreSpec
) -> Tensor | None:
    """The diagonal path: the rows from :func:`~lens_parallel.attention.fused.diagonal_rows`, each hook's diagonal
    form applied in order, z from the rows they leave (when gradients flow, and every hook only reads, from the
    fused kernel: the rows are formed without a graph). None where this path cannot serve (no kernel returns the
    log-sum-exp; an edit under gradients): the blocked path does."""
    hooks = [handle.user_hook for handle in component.hook_pattern.fwd_hooks]
    grad = kernels.needs_grad(q, k, v)
    if grad and not all(f.detached for f in hooks):
        return None
    with torch.no_grad() if grad else contextlib.nullcontext():
        rows = diagonal_rows(q, k, v, mask, spec)
        if rows is None:
            return None
        for f in hooks:
            edited = f.diagonal(rows, component.hook_pattern)
            rows = rows if edited is None else edited
    return fused(q, k, v, mask, spec) if grad else rows.z.to(q.dtype)


def _detached_readers(component: Any) -> bool:
    """Whether every hook on the component's hook_pattern is a detached :class:`RowsHook`."""
    readers = [handle.user_hook for handle in component.hook_pattern.fwd_hooks]
    return bool(readers) and all(isinstance(f, RowsHook) and f.detached for f in readers)
