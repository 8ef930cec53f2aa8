"""The kernels lens_parallel's attention paths are built from, before any feature of the scores: PyTorch's fused
scaled-dot-product attention, the fused kernels that also return each row's log-sum-exp (PyTorch's private ops,
named in :mod:`lens_parallel.compat`), and what blocks of queries need (their spans of keys, their masks).

Shapes: queries ``[batch, head_index, query_pos, d_head]``, keys and values ``[batch, kv_head_index, key_pos,
d_head]`` (query head h reads key-value head h // group); the queries are the last ``query_pos`` of the ``key_pos``
positions. Masks are boolean (True: the key is allowed) or additive, broadcast over batch and heads. Nothing here
reads a tensor on the host (a read per layer would make the host wait for the device).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor

from lens_parallel import compat, devices

FORCED_BLOCK: contextvars.ContextVar[int | None] = contextvars.ContextVar("forced_block", default=None)
"""Queries per block where :func:`lens_parallel.attention.attention_path` forces one (None: the device's sizes)."""


def grouped(x: Tensor, n_kv: int) -> Tensor:
    """Query heads gathered under the key-value head they read: ``[batch, kv, group * query, last]``."""
    return einops.rearrange(x, "batch (kv group) query last -> batch kv (group query) last", kv=n_kv)


def ungrouped(x: Tensor, group: int) -> Tensor:
    """The inverse of :func:`grouped`, ``group`` query heads per key-value head."""
    return einops.rearrange(x, "batch kv (group query) last -> batch (kv group) query last", group=group)


def per_query_head(t: Tensor, n_heads: int) -> Tensor:
    """Keys or values ``[batch, kv_head_index, key_pos, d]`` repeated to one per query head (kv-major)."""
    return einops.repeat(t, "batch kv key d -> batch (kv group) key d", group=n_heads // t.shape[1])


def needs_grad(*tensors: Tensor) -> bool:
    """Whether a gradient flows through any of ``tensors``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def dead_rows(mask: Tensor | None) -> Bool[Tensor, "batch heads query"] | None:
    """Query rows that the mask hides from every key (reduced without a mask-sized temporary); None without a
    mask."""
    if mask is None:
        return None
    return ~mask.any(-1) if mask.dtype == torch.bool else mask.amax(-1) <= torch.finfo(mask.dtype).min


def spans(n_query: int, n_key: int, block: int, window: int | None) -> Iterator[tuple[int, int, int, int]]:
    """Per block of ``block`` queries: its queries ``[start, stop)`` and the keys ``[begin, end)`` they may see
    (the queries are the last ``n_query`` of ``n_key`` positions; a sliding ``window`` hides keys more than
    ``window`` positions back, one spare key kept for either convention of the window's edge)."""
    offset = n_key - n_query
    for start in range(0, n_query, block):
        stop = min(n_query, start + block)
        yield start, stop, 0 if window is None else max(0, offset + start - window), offset + stop


def fused_block(device: torch.device, window: int | None) -> int:
    """Queries per kernel call when a mask is given: a forced block size, else the device's ``fused_block`` (the
    sliding ``window`` if smaller)."""
    block = devices.sizes(device).fused_block
    return FORCED_BLOCK.get() or min(block, window or block)


def additive(
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


def widened(v: Tensor, width: int) -> Tensor:
    """``v`` with zero columns up to ``width`` (the keys' width where a feature adds columns to the queries and
    keys): the fused kernels take values as wide as the keys; their output's first ``v.shape[-1]`` columns are the
    attention's."""
    return v if v.shape[-1] == width else F.pad(v, (0, width - v.shape[-1]))


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor] | None:
    """Softmax attention from a fused kernel that also returns each row's log-sum-exp, log sum_s exp(s_ts):
    ``(out [batch, head, query, d], lse [batch, head, query])``; ``q``, ``k``, ``v`` with the same heads, ``mask``
    additive in the queries' dtype (``causal``: queries and keys aligned at the top-left). On a CPU, PyTorch's fused
    CPU kernel; on CUDA (and on the ``meta`` device, which checks its shapes without a GPU), the memory-efficient
    kernel with ``compute_log_sumexp`` (its log-sum-exp is padded to a multiple of 32 queries, and its bias must
    have rows aligned to 16 elements: the mask is copied into such rows where they are not, as PyTorch's own
    ``scaled_dot_product_attention`` does). None where no such kernel serves (another device, a torch whose ops
    were not checked, values of another head size than the keys', a configuration the CUDA kernel refuses): the
    caller computes the rows itself."""
    if v.shape[-1] != k.shape[-1]:
        return None
    kernel = compat.lse_attention_kernel(q.device.type)
    if kernel is None:
        return None
    if q.device.type == "cpu":
        out, lse = kernel(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
        return out, lse
    bias = None
    if mask is not None:  # broadcast over batch and heads as given (stride 0), rows aligned to 16 elements
        bias = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if bias.stride(-2) % 16 or bias.stride(-1) != 1:
            width = -(-k.shape[2] // 16) * 16
            bias = bias.new_empty(*bias.shape[:-1], width)[..., : k.shape[2]].copy_(bias)
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        out, lse, _, _ = kernel(q, k, v, bias, True, 0.0, causal, scale=scale)
    except RuntimeError:  # a head size, dtype or alignment the kernel does not take: the caller's own rows
        return None
    return out, lse[..., : q.shape[2]]


def with_lse(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor] | None:
    """:func:`attention_with_lse` on values as wide as the keys (:func:`widened`)."""
    found = attention_with_lse(q, k, widened(v, k.shape[-1]), mask, causal=causal, scale=scale)
    return None if found is None else (found[0][..., : v.shape[-1]], found[1])


def lse_blocks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, window: int | None, hide_own: bool
) -> tuple[Tensor, Tensor] | None:
    """The kernel that returns the log-sum-exp (:func:`attention_with_lse`) a block of queries at a time, each
    against the keys it may see (``k``, ``v`` with the queries' heads), each query's own key hidden when
    ``hide_own``: ``(out, lse)`` for every query, or None where no kernel serves."""
    n_query, n_key = q.shape[2], k.shape[2]
    outs, lses = [], []
    for span in spans(n_query, n_key, fused_block(q.device, window), window if mask is not None else None):
        start, stop, begin, end = span
        mask_block = additive(q, mask, span, offset=n_key - n_query, hide_own=hide_own)
        found = with_lse(
            q[:, :, start:stop], k[:, :, begin:end], v[:, :, begin:end], mask_block, causal=False, scale=scale
        )
        if found is None:
            return None
        outs.append(found[0])
        lses.append(found[1])
    return torch.cat(outs, 2), torch.cat(lses, 2)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float, window: int | None) -> Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention` of causal queries (grouped heads as the kernel
    takes them): in one call, or, with a mask and more queries than a block (:func:`fused_block`), a block of
    queries per call against the keys it may see."""
    n_heads, n_kv, n_query, n_key = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    block, d_head, v = fused_block(q.device, window), v.shape[-1], widened(v, k.shape[-1])
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
            for start, stop, begin, end in spans(n_query, n_key, block, window)
        ],
        dim=2,
    )
