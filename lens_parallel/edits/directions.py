"""The frozen-model random-direction control of value-parallel removal."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.edits.base import (
    Footprint,
    Heads,
    HeadSet,
    LayerHeadEdit,
    as_heads,
    head_mask,
    store,
)
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import (
    Hook,
    check_indices,
    check_not_gated,
    expand_kv,
    hook_name,
    softmax_layers,
)
from lens_parallel.models import ModelInfo
from lens_parallel.validate import as_indices, check_eps


@dataclass(frozen=True)
class RandomDirectionRemoval(LayerHeadEdit):
    """The frozen-model random-direction control of value-parallel removal: the same rank-one removal from each
    head's output ``hook_z``, along a fixed random unit direction u per layer and head instead of the head's own
    value, z' = z - (z . u) u (:func:`lens_parallel.geometry.direction_removal`). Layer l's directions come from
    ``seed + l`` (:func:`lens_parallel.geometry.random_unit_directions`). ``norm_matched=True``: the removed vector
    along u has, position by position, the norm the own-direction removal ``ComponentScale("value", s_par=0)`` would
    remove, |z . v_t| / |v_t| (sign that of z . u), so "own direction vs arbitrary direction" compares directions
    at equal size. ``layers`` / ``heads``: default every softmax-attention layer / head. Not defined for gated
    attention (use ``ComponentScale``).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> losses = lp.document_losses(model, docs, lp.RandomDirectionRemoval(seed=1, layers=[0]), progress=False)
    """

    kind: ClassVar[str] = "random-direction"

    seed: int = 0
    norm_matched: bool = False
    layers: int | Sequence[int] | None = None
    heads: Heads = None
    eps: float = geometry.EPS

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise LensParallelError(f"seed must be a non-negative integer, got {self.seed!r}")
        check_eps(self.eps)
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", as_heads(self.heads))

    def footprint(self, info: ModelInfo) -> Footprint:
        return Footprint(("v",) if self.norm_matched else (), ("z",), "none", decode_safe=True)

    def directions(self, info: ModelInfo) -> Float[Tensor, "layer head_index d_head"]:
        """The unit directions of every layer and head (float32)."""
        return geometry.random_unit_directions(info.n_layers, info.n_heads, info.d_head, seed=self.seed)

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers, _ = softmax_layers(info, self.layers, what="RandomDirectionRemoval")
        check_not_gated(info, "RandomDirectionRemoval", alternative="use ComponentScale('value', s_par=0)")
        heads = check_indices("heads", None if self.heads == "all" else self.heads, info.n_heads)
        u = self.directions(info)
        out: list[Hook] = []
        for layer in layers:
            state: dict[str, Tensor] = {}
            if self.norm_matched:
                out.append((hook_name(layer, "v"), partial(store, state=state, key="v")))
            out.append((hook_name(layer, "z"), partial(self._edit_z, u=u[layer], state=state, heads=heads)))
        return out

    def _edit_z(
        self,
        z: Float[Tensor, "batch pos head_index d_head"],
        hook: HookPoint,
        *,
        u: Float[Tensor, "head_index d_head"],
        state: dict[str, Tensor],
        heads: HeadSet,
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        own = expand_kv(state.pop("v"), z.shape[2]) if self.norm_matched else None
        removed = geometry.direction_removal(z, u.to(z).expand_as(z), matched_to=own, eps=self.eps)
        mask = head_mask(heads, z.shape[2], z.shape[0], z.device)
        return torch.where(mask[:, None, :, None], z - removed, z)
