"""Attention sinks (gpt-oss): one learned logit b_h per head joins every row's softmax as a key without a value."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_parallel.attention.features.base import Feature, Source


@dataclasses.dataclass(frozen=True, eq=False)
class Sinks(Feature):
    """The module's ``sinks`` (one logit b_h per head, the parameter itself: training updates it in place), handed
    to the attention interface as ``s_aux``. A row's pattern A_ts = exp(s_ts) / (sum_u exp(s_tu) + exp(b_h)) sums
    to sigmoid(lse_t - b_h) < 1."""

    logits: Float[Tensor, " head_index"]

    name: ClassVar[str] = "attention-sinks"
    title: ClassVar[str] = "attention sinks: a learned extra logit per head, so a pattern row sums to less than 1"
    handling: ClassVar[str] = (
        "lens_parallel's attention with the sink in every row's normaliser: the fused kernel's output scaled by "
        "sigmoid(lse_t - b_h), the diagonal rows from softmax([s_tt, lse'_t, b_h]), the blocked pattern with the "
        "sink's column dropped; ZeroDiagonal divides by 1 - A_tt (the self key masked out of the softmax, the sink "
        "kept: its share grows in proportion); DiagonalEdit adds dA_tt v_t, whatever a row sums to"
    )
    keyword: ClassVar[str | None] = "s_aux"

    @classmethod
    def recognise(cls, source: Source) -> Sinks | None:
        sinks = getattr(source.module, "sinks", None)
        return cls(sinks) if isinstance(sinks, (nn.Parameter, Tensor)) and source.hands("s_aux") else None

    def agrees(self, handed: Any) -> bool:
        return handed is self.logits

    def softmax(self, scores: Tensor, precise: torch.dtype) -> Tensor:
        """softmax over the keys of ``scores`` ``[batch, head_index, query, key]`` in ``precise`` with each row's
        normaliser holding exp(b_h) too, the sink's column dropped (a row sums to less than 1), as Hugging Face's
        eager attention with sinks computes it."""
        column = self.logits.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=precise)[..., :-1]

    def scaled(
        self, out: Float[Tensor, "batch head_index query_pos d_head"], lse: Float[Tensor, "batch head_index query_pos"]
    ) -> Float[Tensor, "batch head_index query_pos d_head"]:
        """The attention ``out`` (normalised over the keys, log-sum-exp ``lse``) with the sinks' logits b_h in its
        normaliser: out * sigmoid(lse - b_h), in the output's dtype (a sink is a key with logit b_h and no value)."""
        precise = torch.promote_types(out.dtype, torch.float32)
        share = torch.sigmoid(lse.to(precise) - self.logits.to(precise)[None, :, None])
        return (out.to(precise) * share[..., None]).to(out.dtype)

    def logit(self, like: Float[Tensor, "batch head_index query_pos"]) -> Float[Tensor, "batch head_index query_pos"]:
        """b_h for every row of ``like`` (the diagonal rows' third share, in their dtype)."""
        return self.logits.to(like.dtype)[None, :, None].expand_as(like)
