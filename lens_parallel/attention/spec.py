"""The score spec of one attention layer: everything its scores, softmax and output are, resolved once.

A :class:`ScoreSpec` is made when the layer's site is (:mod:`lens_parallel.attention.site`): the scores' scale, the
query and key-value heads (query head h reads key-value head h // group), and the layer's features
(:data:`lens_parallel.attention.features.FEATURES`, read at each resolution, each recognised from the layer itself).
Every path and kernel reads it, and nothing else, for what the layer computes; the support matrix and
:class:`~lens_parallel.ModelInfo` read the same objects. What Hugging Face's attention interface hands a layer at
each call is checked against it (:meth:`ScoreSpec.check`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar

from torch import Tensor

from lens_parallel.attention import features as kinds
from lens_parallel.attention.features import AttentionGate, Feature, Sinks, SlidingWindow, SoftCap, Source
from lens_parallel.errors import LibraryError

F = TypeVar("F", bound=Feature)


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """One attention layer's scores: s_ts = ``scale`` q_t . k_s, with ``n_heads`` query heads reading
    ``n_kv_heads`` key-value heads (query head h reads h // group), and each of ``features``' terms.

    Examples:
        >>> import lens_parallel as lp
        >>> from lens_parallel.attention import sites
        >>> spec = sites(lp.load_model("toy-llama"))[0].spec
        >>> (spec.n_heads, spec.n_kv_heads, spec.group, spec.names)
        (6, 2, 3, ())
    """

    scale: float
    n_heads: int
    n_kv_heads: int
    features: tuple[Feature, ...] = ()

    @classmethod
    def resolve(cls, source: Source, *, scale: float) -> ScoreSpec:
        """The spec of the layer ``source`` describes, its features recognised
        (:data:`lens_parallel.attention.features.FEATURES`)."""
        found = tuple(f for kind in kinds.FEATURES if (f := kind.recognise(source)) is not None)
        return cls(scale, source.n_heads, source.n_kv_heads, found)

    @property
    def group(self) -> int:
        """Query heads per key-value head."""
        return self.n_heads // self.n_kv_heads

    def find(self, kind: type[F]) -> F | None:
        """The layer's feature of ``kind`` (a subclass included), or None."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    @functools.cached_property
    def window(self) -> int | None:
        """The sliding window's size (:class:`~lens_parallel.attention.features.SlidingWindow`), or None."""
        found = self.find(SlidingWindow)
        return None if found is None else found.size

    @functools.cached_property
    def softcap(self) -> SoftCap | None:
        """The scores' soft cap, or None."""
        return self.find(SoftCap)

    @functools.cached_property
    def sinks(self) -> Sinks | None:
        """The attention sinks, or None."""
        return self.find(Sinks)

    @functools.cached_property
    def gate(self) -> AttentionGate | None:
        """The output gate, or None."""
        return self.find(AttentionGate)

    @property
    def names(self) -> tuple[str, ...]:
        """The features' names (the support matrix's words)."""
        return tuple(f.name for f in self.features)

    @property
    def reason(self) -> str:
        """Why lens_parallel's attention cannot serve the layer ("" where it can), from its features."""
        return "; ".join(f.reason for f in self.features if f.reason)

    def unfired(self) -> frozenset[str]:
        """The component's hook points the route through the module cannot fire, because of the features."""
        return frozenset().union(*(f.unfired() for f in self.features))

    @property
    def keeps_eager_masks(self) -> bool:
        """Whether the model must keep eager's masks for this layer (a feature's blocks read no other)."""
        return any(f.keeps_eager_masks for f in self.features)

    def prepare(
        self, q: Tensor, k: Tensor, mask: Tensor | None, call: dict[str, Any]
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The queries, keys and mask with every feature's term that rides in them (ALiBi's bias)."""
        for feature in self.features:
            q, k, mask = feature.prepare(q, k, mask, call, scale=self.scale)
        return q, k, mask

    def for_transformer_lens(self, call: dict[str, Any], n_query: int, dtype: Any) -> dict[str, Any]:
        """The keywords TransformerLens's own forward reads (:meth:`Feature.for_transformer_lens`)."""
        for feature in self.features:
            call = feature.for_transformer_lens(call, n_query, dtype)
        return call

    def check(self, module: Any, scaling: float | None, handed: dict[str, Any]) -> None:
        """Raise :class:`~lens_parallel.errors.LibraryError` in one line where what ``module`` hands the attention
        interface (its ``scaling`` and each feature's keyword) is not this spec: a transformers release changed
        what its modules hand, and lens_parallel would compute something else."""
        off = [] if scaling is None or scaling == self.scale else [f"scaling={scaling} (the spec's {self.scale})"]
        for kind in kinds.FEATURES:
            if kind.keyword is None:
                continue
            value, found = handed.get(kind.keyword), self.find(kind)
            if found.agrees(value) if found is not None else value is None:
                continue
            off.append(f"{kind.keyword}={value!r} ({found or 'none recognised'})")
        if off:
            raise LibraryError(
                f"{type(module).__name__} hands the attention interface {', '.join(off)}, which is not what "
                "lens_parallel recognised on the layer: a TransformerLens or transformers release changed it"
            )
