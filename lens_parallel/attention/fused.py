"""A layer's attention from fused kernels, by its score spec: its output z, or each row reduced to its diagonal.

Both take queries and keys ``[batch, head_index | kv_head_index, pos, d_key]`` (``d_key`` beyond ``d_head`` where a
feature rides in more columns of them: ALiBi) and values ``[batch, kv_head_index, key_pos, d_head]`` (the queries
the last ``query_pos`` of the keys), a mask (boolean: allowed; additive) or None (causal),
and the layer's :class:`~lens_parallel.attention.spec.ScoreSpec`; neither forms a ``[query_pos, key_pos]`` tensor.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from lens_parallel.attention import kernels
from lens_parallel.attention.rows import Diagonal
from lens_parallel.attention.spec import ScoreSpec

Queries = Float[Tensor, "batch head_index query_pos d_key"]
Keys = Float[Tensor, "batch kv_head_index key_pos d_key"]
Values = Float[Tensor, "batch kv_head_index key_pos d_head"]


def fused(
    q: Queries, k: Keys, v: Values, mask: Tensor | None, spec: ScoreSpec
) -> Float[Tensor, "batch head_index query_pos d_head"] | None:
    """z from a fused kernel: scaled_dot_product_attention (:func:`~lens_parallel.attention.kernels.sdpa`); with
    soft-capped scores the cap's own kernel (:meth:`~lens_parallel.attention.features.SoftCap.blocks`); with sinks
    the kernel that returns the log-sum-exp, its output scaled by each row's sum
    (:meth:`~lens_parallel.attention.features.Sinks.scaled`). None where no kernel serves (the caller takes the
    blocked path)."""
    scale, window, cap, sinks = spec.scale, spec.window, spec.softcap, spec.sinks
    if cap is not None:
        out, lse = cap.blocks(q, k, v, mask, scale=scale, window=window, hide_own=False)
        return out if sinks is None else sinks.scaled(out, lse)
    if sinks is None:
        return kernels.sdpa(q, k, v, mask, scale=scale, window=window)
    k, v = (kernels.per_query_head(t, q.shape[1]) for t in (k, v))
    if mask is None and k.shape[2] == q.shape[2]:
        found = kernels.with_lse(q, k, v, None, causal=True, scale=scale)
    else:
        found = kernels.lse_blocks(q, k, v, mask, scale=scale, window=window, hide_own=False)
    return None if found is None else sinks.scaled(*found)


def diagonal_rows(q: Queries, k: Keys, v: Values, mask: Tensor | None, spec: ScoreSpec) -> Diagonal | None:
    """Each row's :class:`~lens_parallel.attention.rows.Diagonal` from the fused kernel run with each query's own
    key masked out (:func:`~lens_parallel.attention.kernels.attention_with_lse`), O(T) memory beyond the kernel's:

        lse'_t = log sum_{s != t} exp(s_ts): [A_tt, sum_{s != t} A_ts] = softmax([s_tt, lse'_t]) (= sigmoid(+-(s_tt
        - lse'_t))), rest_t = sum_{s != t} A_ts * (the kernel's output, sum_{s != t} A_ts v_s / sum_{s != t} A_ts),

    with s_tt the query's own score (soft-capped where the layer caps its scores; plus its mask entry); a row with
    no other key has A_tt = 1. Soft-capped scores come from the cap's own kernel, which no fused kernel computes.
    With sinks b_h the normaliser holds the sink too: [A_tt, sum_{s != t} A_ts, sink share] = softmax([s_tt,
    lse'_t, b_h]). Without a mask and with as many queries as keys, one causal call of queries 1.. against keys
    ..T-2 is the strictly causal attention (no mask to read); otherwise the queries go a block at a time (as on
    the fused path), each against the keys it may see, its own masked. Fully masked rows (pads) get A_tt = 1 /
    key_pos, as eager's uniform row has (with sinks, 0: the sink takes the row). None where no kernel returns the
    log-sum-exp."""
    scale, window, cap, sinks = spec.scale, spec.window, spec.softcap, spec.sinks
    n_heads, n_query, n_key = q.shape[1], q.shape[2], k.shape[2]
    offset, precise = n_key - n_query, torch.promote_types(q.dtype, torch.float32)
    k, v = (kernels.per_query_head(t, n_heads) for t in (k, v))
    own_value = v[:, :, offset:].to(precise)
    own_score = scale * (q.to(precise) * k[:, :, offset:].to(precise)).sum(-1)
    if cap is not None:
        own_score = cap.capped(own_score)
    low = torch.finfo(q.dtype).min
    if mask is None and offset == 0 and cap is None:
        out, lse = v.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_full(q.shape[:-1], float("-inf"), dtype=precise)
        if n_query > 1:
            found = kernels.with_lse(q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], None, causal=True, scale=scale)
            if found is None:
                return None
            out[:, :, 1:], lse[:, :, 1:] = found
    else:
        blocks = (
            kernels.lse_blocks(q, k, v, mask, scale=scale, window=window, hide_own=True)
            if cap is None
            else cap.blocks(q, k, v, mask, scale=scale, window=window, hide_own=True)
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
        logits.append(sinks.logit(own_score))
    shares = torch.softmax(torch.stack(logits, -1), -1)  # own key, the other keys, the sink
    weight, keys, others = shares[..., 0], shares[..., 1], shares[..., 1:].sum(-1)
    rows = Diagonal(weight, others, keys[..., None] * out.to(precise), own_value, offset, q.dtype)
    dead = kernels.dead_rows(mask)
    if dead is None or sinks is not None:  # with sinks a fully masked row is all sink, as computed
        return rows
    uniform = torch.full_like(rows.weight, 1 / n_key)
    return rows.where(~dead, rows.replace(weight=uniform, others=1 - uniform))
