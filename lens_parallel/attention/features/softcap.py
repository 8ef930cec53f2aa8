"""Soft-capped attention scores (Gemma 2): s_ts = c tanh(scale q_t . k_s / c), which no fused kernel computes."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from lens_parallel import devices
from lens_parallel.attention import kernels
from lens_parallel.attention.features.base import Feature, Source


@dataclasses.dataclass(frozen=True)
class SoftCap(Feature):
    """Scores soft-capped at ``cap`` = c: s -> c tanh(s / c), recognised from the module's (or the config's)
    ``attn_logit_softcapping`` where the module hands it to the attention interface (as ``softcap``)."""

    cap: float

    name: ClassVar[str] = "attention-softcap"
    title: ClassVar[str] = "attention logits soft-capped, c tanh(s / c)"
    handling: ClassVar[str] = (
        "lens_parallel's own kernel for capped scores (no fused kernel caps them): blocks of queries with each row's "
        "log-sum-exp, never the square; on the fused and diagonal paths alike"
    )
    keyword: ClassVar[str | None] = "softcap"

    @classmethod
    def recognise(cls, source: Source) -> SoftCap | None:
        if not source.hands("softcap"):
            return None
        cap = getattr(source.module, "attn_logit_softcapping", None)
        cap = cap if cap is not None else getattr(source.config, "attn_logit_softcapping", None)
        return cls(float(cap)) if isinstance(cap, (int, float)) and cap else None

    def agrees(self, handed: Any) -> bool:
        return bool(handed == self.cap)

    def capped(self, scores: Tensor) -> Tensor:
        """c tanh(s / c) of scores formed explicitly (the blocked and eager paths, a row's own score)."""
        return torch.tanh(scores / self.cap) * self.cap

    def blocks(
        self,
        q: Float[Tensor, "batch head_index query_pos d_head"],
        k: Float[Tensor, "batch kv_head_index key_pos d_head"],
        v: Float[Tensor, "batch kv_head_index key_pos d_head"],
        mask: Tensor | None,
        *,
        scale: float,
        window: int | None,
        hide_own: bool,
    ) -> tuple[Float[Tensor, "batch head_index query_pos d_head"], Float[Tensor, "batch head_index query_pos"]]:
        """Attention with capped scores a block of queries at a time against the keys each may see, never a
        ``[query_pos, key_pos]`` tensor:

            s_ts = c tanh(scale q_t . k_s / c) = 2c sigmoid(2 scale q_t . k_s / c) - c (+ the mask:
            :func:`~lens_parallel.attention.kernels.additive`, each query's own key hidden when ``hide_own``);
            A_t = softmax_s(s_t), out_t = sum_s A_ts v_s, lse_t = log sum_s exp(s_ts) = max_s s_ts - log max_s A_ts,

        the sigmoid form because it costs a sixth of tanh on a CPU and -c cancels in the softmax; the matmul in the
        queries' dtype as the eager path forms it, the cap and the softmax in float32 (float64 in a float64 model:
        in bfloat16, sigmoid's rounding near 1/2 times 2c would move every score by up to c 2^-8). One batch row at
        a time, in blocks of queries chosen by the row's size alone, so that a document's numbers do not depend on
        the batch it comes in (an elementwise kernel rounds the tail of its vector loop apart); a block holds at
        most the device's ``capped_elements`` scores (:class:`~lens_parallel.devices.WorkSizes`; a forced block
        size, that many queries); where no gradient flows its scores are formed in place. Returns ``(out, lse)``;
        a row with no key it may see has the uniform row eager gives it (lse about ``finfo.min``)."""
        n_heads, n_query, n_key = q.shape[1], q.shape[2], k.shape[2]
        block = kernels.FORCED_BLOCK.get() or max(1, devices.sizes(q.device).capped_elements // max(1, n_heads * n_key))
        q = q * (2 * scale / self.cap)
        rows = [
            self._row(
                q[b : b + 1],
                k[b : b + 1],
                v[b : b + 1],
                None if mask is None else mask[b : b + 1] if mask.shape[0] > 1 else mask,
                spans=list(kernels.spans(n_query, n_key, block, window if mask is not None else None)),
                hide_own=hide_own,
            )
            for b in range(q.shape[0])
        ]
        return torch.cat([out for out, _ in rows]), torch.cat([lse for _, lse in rows])

    def _row(
        self,
        q: Float[Tensor, "1 head_index query_pos d_head"],
        k: Float[Tensor, "1 kv_head_index key_pos d_head"],
        v: Float[Tensor, "1 kv_head_index key_pos d_head"],
        mask: Tensor | None,
        *,
        spans: list[tuple[int, int, int, int]],
        hide_own: bool,
    ) -> tuple[Float[Tensor, "1 head_index query_pos d_head"], Float[Tensor, "1 head_index query_pos"]]:
        """One batch row of :meth:`blocks`, its queries already scaled by 2 scale / c."""
        n_kv, group, offset = k.shape[1], q.shape[1] // k.shape[1], k.shape[2] - q.shape[2]
        precise = torch.promote_types(q.dtype, torch.float32)
        grad, low = kernels.needs_grad(q, k, v), torch.finfo(precise).min
        outs, lses = [], []
        for start, stop, begin, end in spans:
            scores = kernels.ungrouped(
                kernels.grouped(q[:, :, start:stop], n_kv) @ k[:, :, begin:end].transpose(-1, -2), group
            )
            scores = scores.to(precise)  # the cap in float32: bfloat16's rounding of sigmoid near 1/2, times 2c
            scores = torch.sigmoid(scores) * (2 * self.cap) if grad else scores.sigmoid_().mul_(2 * self.cap)
            if mask is None:  # causal: only the block's own positions (its last keys) hide any key
                n = stop - start
                hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(0 if hide_own else 1)
                scores[..., end - n :].masked_fill_(hidden, low)
            else:  # a mask of -inf is read as finfo.min: a row it hides whole is eager's uniform row, not NaN
                mask_block = kernels.additive(q, mask, (start, stop, begin, end), offset=offset, hide_own=hide_own)
                scores = scores.add_(mask_block).clamp_min_(low)
            pattern = torch.softmax(scores, dim=-1, dtype=precise)
            outs.append(kernels.ungrouped(kernels.grouped(pattern.to(v.dtype), n_kv) @ v[:, :, begin:end], group))
            lses.append(scores.amax(-1) - pattern.amax(-1).log() - self.cap)
        return torch.cat(outs, 2), torch.cat(lses, 2)
