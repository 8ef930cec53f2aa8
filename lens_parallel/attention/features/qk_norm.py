"""Queries and keys normalised before the scores (Qwen3, OLMo 2, Gemma 3, ...), before or after rotary."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from lens_parallel.attention.features.base import Feature, Source


@dataclasses.dataclass(frozen=True)
class QKNorm(Feature):
    """A query/key norm, recognised from the layer's ``q_norm`` / ``q_layernorm`` (the module's or the bridge's) or
    from TransformerLens's ``qk_norm_after_rope``, which says it comes ``after_rope``: the module's queries and keys
    are then normed after rotary, so the route through the module has no rotated, un-normed queries to fire
    ``hook_rot_q`` / ``hook_rot_k`` on (a hook on them runs TransformerLens's forward)."""

    after_rope: bool

    name: ClassVar[str] = "qk-norm"
    title: ClassVar[str] = "queries and keys normalised before the scores"
    handling: ClassVar[str] = (
        "the queries and keys the module makes, normed where it norms them (the route through the module); "
        "hook_q_normed fires on TransformerLens's forward, which a hook on it selects"
    )

    @classmethod
    def recognise(cls, source: Source) -> QKNorm | None:
        after = bool(getattr(source.bridged, "qk_norm_after_rope", False))
        present = any(source.attribute(name) is not None for name in ("q_norm", "q_layernorm"))
        return cls(after) if present or after else None

    def unfired(self) -> frozenset[str]:
        return frozenset({"hook_rot_q", "hook_rot_k"} if self.after_rope else ())
