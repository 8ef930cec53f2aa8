"""An attention site: one attention layer of a bridge as lens_parallel's attention knows it, made once.

A site (:class:`AttentionSite`) is made for every attention component of a bridge the first time lens_parallel
reads it (:func:`lens_parallel.attention.sites`) and kept on the component itself, and on the Hugging Face module it
wraps (where transformers' attention interface hands lens_parallel a call). It holds the layer's route into
lens_parallel's attention, or the one reason the layer keeps TransformerLens's forward; its state (whether the
route is installed, the hook points the route cannot fire); and its frozen
:class:`~lens_parallel.attention.spec.ScoreSpec`, which every path reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, runtime_checkable

from jaxtyping import Float
from torch import Tensor

from lens_parallel.attention.paths import Path, attend, chosen_path
from lens_parallel.attention.spec import ScoreSpec


@runtime_checkable
class Route(Protocol):
    """What a site asks of its route (:mod:`lens_parallel.attention.routes` has them): its label
    (:attr:`~lens_parallel.ModelInfo.attention_paths`), whether TransformerLens's own forward of the bridge fires
    hook_pattern after the attention, whether the layer fires the rotary hooks, how it is put in place, and what it
    hands the attention of what the module handed the interface."""

    @property
    def label(self) -> str: ...

    @property
    def pattern_after(self) -> bool: ...

    @functools.cached_property
    def fires_rotary(self) -> bool: ...

    def install(self, site: AttentionSite) -> None: ...

    def handed(self, site: AttentionSite, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]: ...


SITE = "lens_parallel_site"
"""The attribute under which a component and its Hugging Face module keep their site (in their own dictionary)."""


@dataclasses.dataclass(eq=False)
class AttentionSite:
    """One attention layer (module docstring).

    Attributes:
        component: TransformerLens's attention bridge component.
        module: the Hugging Face module it wraps.
        layer: the layer's index, as the key/value cache and the edits' values key it.
        spec: what the layer's scores, softmax and output are.
        route: how lens_parallel's attention reaches the layer, or would (:mod:`lens_parallel.attention.routes`).
        reason: why TransformerLens's forward keeps the layer ("" where the route takes it).
        installed: whether the route is in place on the bridge.
        unfired: the component's hook points the route does not fire as TransformerLens's forward does (a hook on
            one runs that forward).
    """

    component: Any
    module: Any
    layer: int | None
    spec: ScoreSpec
    route: Route
    reason: str
    installed: bool = False
    unfired: tuple[Any, ...] = ()

    def attend(
        self,
        q: Float[Tensor, "batch head_index query_pos d_head"],
        k: Float[Tensor, "batch kv_head_index key_pos d_head"],
        v: Float[Tensor, "batch kv_head_index key_pos d_head"],
        mask: Tensor | None,
        *,
        path: Path | None = None,
        call: dict[str, Any] | None = None,
    ) -> Float[Tensor, "batch head_index query_pos d_head"]:
        """The layer's attention z on ``path`` (default: the one its hooks choose now,
        :func:`~lens_parallel.attention.paths.chosen_path`), ``call``: the keywords the block handed it."""
        path = path or chosen_path(self.component)
        return attend(self.component, q, k, v, mask, spec=self.spec, path=path, layer=self.layer, call=call)

    @property
    def served(self) -> bool:
        """Whether lens_parallel's attention can serve the layer (its route, once installed)."""
        return not self.reason

    @property
    def label(self) -> str:
        """Which attention serves the layer now: lens_parallel's (the route's label), or TransformerLens's eager
        forward and why (:attr:`~lens_parallel.ModelInfo.attention_paths`)."""
        if self.installed:
            return self.route.label
        return f"eager: {self.reason or 'lens_parallel attention not installed on this bridge'}"

    @property
    def pattern_after(self) -> bool:
        """Whether hook_pattern fires only after the layer's attention has run (read-only: an edit of it changes
        nothing): TransformerLens's generic bridge, which fires it on the weights its module returns, where
        lens_parallel's attention does not serve the layer and the module does not fire it itself."""
        own = bool(getattr(self.module, "accepts_pattern_fn", False))
        return self.route.pattern_after and not self.installed and not own

    @functools.cached_property
    def fires_rotary(self) -> bool:
        """Whether the layer fires hook_rot_q / hook_rot_k (the queries and keys after rotary): where its route does
        and its component has them (a layer without position embeddings, NoPE, has none)."""
        children = dict(self.component.named_children())
        return self.route.fires_rotary and "hook_rot_q" in children and "hook_rot_k" in children


def site_of(component: Any) -> AttentionSite | None:
    """The site kept on an attention component or Hugging Face attention module, None where none was made."""
    found: AttentionSite | None = vars(component).get(SITE)
    return found
