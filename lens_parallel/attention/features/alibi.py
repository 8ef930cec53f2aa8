"""ALiBi: a bias on the attention scores, a slope per head times the key's position, and no position embeddings.

The bias is read as the model's block hands it to its attention, so its numbers are the model's own; it rides in one
more column of the queries and keys (:meth:`Alibi.prepare`), so every path serves it, the fused kernels included,
with nothing of ``[query_pos, key_pos]`` formed. Which bridge hands it how is each subclass's (TransformerLens's
``BloomAttentionBridge``, ``MPTALiBiAttentionBridge``); ALiBi anywhere else is recognised from the config and keeps
TransformerLens's forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from lens_parallel import compat
from lens_parallel.attention.features.base import Feature, Source
from lens_parallel.errors import LensParallelError, LibraryError


@dataclasses.dataclass(frozen=True)
class Alibi(Feature):
    """ALiBi on a layer whose bridge lens_parallel does not read it from (Falcon's ``alibi=True``: its bridge adds
    the bias before scaling): recognised from the config (``alibi``, MPT's ``attn_config.alibi``, Bloom's model
    type, whose positions are always ALiBi), it keeps TransformerLens's forward. ``grouped``: the layer's keys are
    shared by several query heads, which cannot carry a slope per query head."""

    grouped: bool

    name: ClassVar[str] = "alibi"
    title: ClassVar[str] = "ALiBi: a linear bias on the attention scores by distance, no position embeddings"
    handling: ClassVar[str] = (
        "lens_parallel's attention with the bias b_hs in one more column of the queries and keys (scale q'.k' = "
        "scale q.k + b_s), so every path serves it, the fused kernels included, with no square formed; Bloom's "
        "and MPT's Hugging Face models build eager's square mask themselves, which is read as given"
    )
    keyword: ClassVar[str | None] = "position_bias"

    @classmethod
    def recognise(cls, source: Source) -> Alibi | None:
        grouped = source.n_kv_heads != source.n_heads
        classes = compat.bridge_classes()
        reader = {classes.bloom: _BloomAlibi, classes.mpt: _MptAlibi}.get(type(source.component))
        if reader is not None:
            return reader(grouped)
        config = source.config
        flags = (getattr(config, "alibi", False), getattr(getattr(config, "attn_config", None), "alibi", False))
        return cls(grouped) if any(bool(f) for f in flags) or config.model_type == "bloom" else None

    def agrees(self, handed: Any) -> bool:
        return handed is None  # handed to a module's attention interface: no bridge's bias lens_parallel reads

    @property
    def reason(self) -> str:
        return "ALiBi with grouped-query heads" if self.grouped else "ALiBi that lens_parallel does not read here"

    def bias(
        self, call: dict[str, Any], batch: int, n_key: int
    ) -> tuple[Float[Tensor, "#batch head_index key_pos"], Tensor | None]:
        """The bias b_hs as the block handed it (broadcast over the batch where its first axis is 1) and the mask
        as the paths read it (boolean: True where a key is allowed; additive; or None: causal)."""
        raise NotImplementedError

    def prepare(
        self, q: Tensor, k: Tensor, mask: Tensor | None, call: dict[str, Any], *, scale: float
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The bias carried by one more column of the queries and keys:

            q'_t = [q_t, 1, 0, ...], k'_s = [k_s, b_s / scale, 0, ...], so scale q'_t . k'_s = scale q_t . k_s + b_s,

        the width rounded up to a multiple of 8 (what CUDA's fused kernels take; the values keep theirs and the
        kernels get them padded with zeros). The keys need the query heads' own (a slope per query head)."""
        if k.shape[1] != q.shape[1]:
            raise LibraryError(
                f"a score bias per query head needs a key per query head, got {k.shape[1]} of {q.shape[1]}"
            )
        bias, mask = self.bias(call, q.shape[0], k.shape[2])
        d_head = q.shape[-1]
        pad = -(-(d_head + 1) // 8) * 8 - d_head - 1
        column = (bias.to(torch.promote_types(bias.dtype, torch.float32)) / scale).to(k.dtype)
        column = column.expand(k.shape[0], k.shape[1], k.shape[2])[..., None]
        q = torch.cat([q, q.new_ones(*q.shape[:-1], 1), q.new_zeros(*q.shape[:-1], pad)], dim=-1)
        k = torch.cat([k, column, k.new_zeros(*k.shape[:-1], pad)], dim=-1)
        return q, k, mask


@dataclasses.dataclass(frozen=True)
class _BloomAlibi(Alibi):
    """Bloom's: its block hands the attention ``alibi`` ``[batch * head, 1, key_pos]`` (slope times the key's
    position among the row's tokens) and SDPA's mask (none where causal alone suffices, else boolean, True where a
    key is allowed), once its model builds SDPA's masks (by the name in its config)."""

    masks_by_name: ClassVar[bool] = True

    @property
    def reason(self) -> str:
        return super().reason if self.grouped else ""

    def bias(self, call: dict[str, Any], batch: int, n_key: int) -> tuple[Tensor, Tensor | None]:
        alibi = call.get("alibi")
        if alibi is None or alibi.shape[-1] < n_key:
            raise LibraryError(
                f"Bloom's block handed its attention an ALiBi bias of {None if alibi is None else alibi.shape[-1]} "
                f"keys for {n_key}: a transformers release changed it"
            )
        return einops.rearrange(alibi[..., :n_key], "(batch head) 1 key -> batch head key", batch=batch), call.get(
            "attention_mask"
        )

    def for_transformer_lens(self, call: dict[str, Any], n_query: int, dtype: torch.dtype) -> dict[str, Any]:
        """TransformerLens's own Bloom forward adds its mask to the scores: eager's additive ``[batch | 1, 1,
        query_pos, key_pos]`` (0 where allowed, the dtype's minimum where hidden; causal, the queries the last of
        the keys, where SDPA's is none)."""
        mask, alibi = call.get("attention_mask"), call["alibi"]
        if mask is not None and mask.dtype != torch.bool:
            return call
        n_key = alibi.shape[-1]
        allowed = torch.ones(n_query, n_key, dtype=torch.bool, device=alibi.device).tril(n_key - n_query)
        allowed = allowed[None, None] if mask is None else mask
        zero = torch.zeros((), dtype=dtype, device=alibi.device)
        return call | {"attention_mask": torch.where(allowed, zero, torch.finfo(dtype).min)}


@dataclasses.dataclass(frozen=True)
class _MptAlibi(Alibi):
    """MPT's: its block hands ``position_bias`` ``[head, 1, max_seq_len]`` (slope times the distance from the last
    position; its last ``key_pos`` read) and a boolean mask with True where a key is hidden (read as the keys
    allowed). Its blocks read eager's masks only, so its model keeps eager's attention implementation."""

    keeps_eager_masks: ClassVar[bool] = True

    @property
    def reason(self) -> str:
        return super().reason if self.grouped else ""

    def bias(self, call: dict[str, Any], batch: int, n_key: int) -> tuple[Tensor, Tensor | None]:
        position_bias, mask = call.get("position_bias"), call.get("attention_mask")
        if position_bias is None:
            raise LibraryError("MPT's block handed its attention no ALiBi bias: a transformers release changed it")
        if position_bias.shape[-1] < n_key:
            raise LensParallelError(
                f"MPT's ALiBi covers {position_bias.shape[-1]} positions (its config's max_seq_len), fewer than the "
                f"{n_key} keys of this forward: give it at most {position_bias.shape[-1]} tokens"
            )
        return position_bias[None, :, 0, -n_key:], None if mask is None else ~mask
