"""What an attention feature is: one object that recognises itself on an attention layer and applies itself.

A feature (:class:`Feature`) is recognised once per attention layer, when its site is made
(:mod:`lens_parallel.attention.site`), from what TransformerLens and Hugging Face say of that layer (:class:`Source`:
the bridge's component and config, the Hugging Face module and config), never from an architecture's name. It then
takes part in the layer's :class:`~lens_parallel.attention.spec.ScoreSpec`, which every path and kernel reads: its
term in the scores, the softmax or the output (each hook below does nothing by default), the hook points the route
through the module cannot fire for it, and why lens_parallel's attention cannot serve it where it cannot. Its
``name``, ``title`` and ``handling`` are the support matrix's and the models guide's words for it, and its
``keyword`` the one Hugging Face's attention interface hands it under (checked against it at every call, so that a
release that hands something else fails in one line instead of computing something else).

Adding a feature: a module beside these with its class, and its class in
:data:`lens_parallel.attention.features.FEATURES`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Source:
    """What an attention layer's features are recognised from.

    Attributes:
        component: TransformerLens's attention bridge component.
        module: the Hugging Face attention module it wraps.
        config: the Hugging Face model's (text) config.
        bridged: TransformerLens's config of the component (``n_heads``, ``n_key_value_heads``, ``d_head``, ...).
    """

    component: Any
    module: Any
    config: Any
    bridged: Any

    def attribute(self, name: str) -> Any:
        """``name`` on the Hugging Face module, else on the component (which holds the bridge's own submodules:
        its norms), else None."""
        found = getattr(self.module, name, None)
        return found if found is not None else getattr(self.component, name, None)

    def hands(self, keyword: str) -> bool:
        """Whether the module hands the attention ``keyword``: a module that computes its attention through
        transformers' attention interface hands what its forward names (Gemma 3's keeps ``attn_logit_softcapping``
        and never hands it: its scores are not capped); one that computes it itself, whatever it holds."""
        forward = type(self.module).forward
        return not source_names(forward, "ALL_ATTENTION_FUNCTIONS") or source_names(forward, f"{keyword}=")

    @property
    def n_heads(self) -> int:
        return int(self.bridged.n_heads)

    @property
    def n_kv_heads(self) -> int:
        return int(getattr(self.bridged, "n_key_value_heads", None) or self.bridged.n_heads)


class Feature:
    """One feature of an attention layer (module docstring). A subclass sets the class attributes, recognises
    itself (:meth:`recognise`) and overrides the hooks its term needs."""

    name: ClassVar[str]
    """The support matrix's word for it."""
    title: ClassVar[str]
    """What it is, in words."""
    handling: ClassVar[str]
    """What lens_parallel does with it (the models guide's sentence)."""
    keyword: ClassVar[str | None] = None
    """The keyword Hugging Face's attention interface hands it under; None where it hands none."""

    @classmethod
    def recognise(cls, source: Source) -> Feature | None:
        """The feature as the layer has it, or None where it has not."""
        raise NotImplementedError

    def agrees(self, handed: Any) -> bool:
        """Whether what the attention interface hands under :attr:`keyword` is this feature."""
        return True

    @property
    def reason(self) -> str:
        """Why lens_parallel's attention cannot serve the layer with this feature ("" where it can)."""
        return ""

    def unfired(self) -> frozenset[str]:
        """The hook points of the component that the route through its module does not fire as TransformerLens's
        forward does, because of this feature."""
        return frozenset()

    keeps_eager_masks: ClassVar[bool] = False
    """Whether the model's blocks read eager's masks only where the layer has it, so that the model keeps eager's
    attention implementation (its masks) under lens_parallel's attention."""

    masks_by_name: ClassVar[bool] = False
    """Whether the model builds its masks by the attention implementation its config names, which it accepts
    without an attention backend, where the layer has it (Bloom): the config then names lens_parallel's."""

    def prepare(
        self, q: Tensor, k: Tensor, mask: Tensor | None, call: dict[str, Any], *, scale: float
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Its term, where it rides in the queries, keys and mask before any path (``call``: the keywords the
        block handed its attention; ``scale``: the scores' scale)."""
        return q, k, mask

    def for_transformer_lens(self, call: dict[str, Any], n_query: int, dtype: torch.dtype) -> dict[str, Any]:
        """The keywords TransformerLens's own forward reads, where lens_parallel's masks are not what it reads."""
        return call


@functools.cache
def source_names(function: Callable[..., Any], text: str) -> bool:
    """Whether ``function``'s source holds ``text`` (read once per function: reading a source takes about 2 ms)."""
    try:
        return text in inspect.getsource(function)
    except (OSError, TypeError):
        return False
