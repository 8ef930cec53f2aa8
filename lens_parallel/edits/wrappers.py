"""Wrappers of any edit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.edits.base import (
    Edit,
    EditBase,
    Footprint,
    as_edits,
    edit_footprint,
    edit_layers,
    edit_noop,
)
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import Hook, block_of
from lens_parallel.models import ModelInfo


@dataclass(frozen=True)
class SkipFirstLayers(EditBase):
    """Any edit (built-in or user-defined) with layers 0 .. ``n`` - 1 left alone: its hooks on those blocks are
    dropped, so they never fire and those layers compute exactly what the unedited model does. The
    directional-decomposition paper edits every layer but the first (its code's ``xsa_skip_first_n = 1``). Not to
    be confused with ``positions="after-first"``, which leaves token position 0 alone in every edited layer.

    ``layers`` (what the engine resumes from) is the wrapped edit's, less the skipped ones; the matched no-op wraps
    the wrapped edit's own (``noop`` is None when it has none: it is then compared with the unedited model).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SkipFirstLayers(lp.ZeroDiagonal(), n=1).n
        1
    """

    kind: ClassVar[str] = "skip-first-layers"

    edit: Edit
    n: int = 1

    def __post_init__(self) -> None:
        as_edits(self.edit)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise LensParallelError(f"SkipFirstLayers n must be a positive integer (layers to skip), got {self.n!r}")

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The wrapped edit's layers at or after ``n`` (None: every layer it edits, or it does not say)."""
        inner = edit_layers(self.edit)
        if inner is None or isinstance(inner, str):  # every layer, or undeclared
            return None
        return tuple(layer for layer in inner if layer >= self.n)

    def declared_layers(self) -> tuple[int, ...] | Literal["undeclared"] | None:
        """The wrapped edit's layers at or after ``n``; ``"undeclared"`` when the wrapped edit does not say."""
        inner = edit_layers(self.edit)
        return inner if isinstance(inner, str) else self.layers

    def noop(self) -> SkipFirstLayers | None:
        inner = edit_noop(self.edit)
        return None if inner is None else SkipFirstLayers(inner, self.n)

    def resolved(self, info: ModelInfo) -> SkipFirstLayers:
        """The wrapped edit resolved on ``info``'s model (:func:`~lens_parallel.edits.as_edits`)."""
        (inner,) = as_edits(self.edit, info)
        return self if inner is self.edit else SkipFirstLayers(inner, self.n)

    def footprint(self, info: ModelInfo) -> Footprint | None:
        """The wrapped edit's (None when it declares none)."""
        return edit_footprint(self.edit, info)

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        if self.n >= info.n_layers:
            raise LensParallelError(f"SkipFirstLayers(n={self.n}) leaves no layer of this {info.n_layers}-layer model")
        out = []
        for name, fn in self.edit.hooks(model, info):
            block = block_of(name)
            if block is None or block >= self.n:
                out.append((name, fn))
        if not out:
            raise LensParallelError(f"{type(self.edit).__name__} edits only layers before {self.n}: nothing is left")
        return out
