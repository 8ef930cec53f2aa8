"""Head ablations: a head's contribution at one layer removed (zeroed, mean-replaced, or its parallel part)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.choices import Ablation, EditPositions, HeadSpace
from lens_parallel.edits.base import (
    EDIT_POSITIONS,
    EditBase,
    Footprint,
    HeadSet,
    check_positions,
    from_end,
    head_mask,
)
from lens_parallel.edits.scaling import ComponentScale, layer_hooks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import (
    Hook,
    check_head_writes,
    check_heads,
    hook_name,
    layers_where,
    softmax_layers,
)
from lens_parallel.layers import LAYER_KINDS, LayerKind
from lens_parallel.models import ModelInfo
from lens_parallel.spaces import SPACES
from lens_parallel.validate import as_indices, check_choice, literal_values, named_table


@dataclass(frozen=True)
class AblationKind:
    """One head ablation (:data:`~lens_parallel.choices.Ablation`), defined once: the hooks and footprint of
    :class:`HeadEdit`, and what head attribution and the sweeps ask of it. A fill (zero, mean) replaces the heads'
    output; a removal (parallel-value, parallel-residual) is ``ComponentScale(space, s_par=0)`` on those heads.

    Attributes:
        name: the ablation's name.
        removed_space: the space whose parallel part a removal takes out (None for a fill).
        needs_means: whether it fills with per-head means (``HeadEdit.means``, computed by the sweeps).
        gate_input: whether on a linear-attention layer it acts on the heads' gate input (its kind's ``zero_role``).
    """

    name: Ablation
    removed_space: HeadSpace | None = None
    needs_means: bool = False
    gate_input: bool = False

    def footprint(self, edit: HeadEdit, info: ModelInfo, kind: LayerKind | None) -> Footprint:
        """What ``edit`` (of this ablation) reads and writes at its layer (``kind``: None out of range)."""
        raise NotImplementedError

    def hooks(
        self, edit: HeadEdit, model: TransformerBridge, info: ModelInfo, heads: HeadSet, kind: LayerKind
    ) -> list[Hook]:
        """``edit``'s hooks at its layer, on ``heads`` (a tuple, or a per-row mask)."""
        raise NotImplementedError

    def layers(self, info: ModelInfo, layers: int | Sequence[int] | None, *, what: str) -> tuple[tuple[int, ...], str]:
        """:func:`~lens_parallel.hooks.layers_where` it is defined: the layers of ``layers`` (None: all) whose kind
        lists it (:attr:`~lens_parallel.layers.LayerKind.ablations`), and a note of those skipped (``what``: the
        analysis, in the refusal of a named layer it is not defined on)."""
        kinds = " or ".join(kind.title for kind in LAYER_KINDS.values() if self.name in kind.ablations)
        return layers_where(
            info, layers, lambda layer: self.name in info.kind(layer).ablations, needs=f"{kinds} layers", what=what
        )

    def linearity_note(self) -> str:
        """How good a first-order estimate of its effect is (head attribution's confirmation)."""
        return (
            f"{self.name} removes a whole component (s = 0 is not a small change from s = 1): the estimate is a "
            "linearisation, good for ranking, not for size"
        )


@dataclass(frozen=True)
class _Fill(AblationKind):
    """zero and mean: the heads' output replaced (by 0, or by ``HeadEdit.means``)."""

    def footprint(self, edit: HeadEdit, info: ModelInfo, kind: LayerKind | None) -> Footprint:
        if kind is not None and self.name in kind.ablations:
            # a linear-attention layer is not decode-safe: its cached steps (prefill included) run Hugging Face's
            # own module, where hook_gate_input never fires (cached generation would report unedited steps as edited)
            return Footprint((), (kind.zero_role,), "none", kind.decodes_with_hooks)
        return Footprint((), ("z",), "none", True)

    def hooks(
        self, edit: HeadEdit, model: TransformerBridge, info: ModelInfo, heads: HeadSet, kind: LayerKind
    ) -> list[Hook]:
        n_heads = info.output_heads(edit.layer)
        means = edit.means

        def replace(z: Tensor, hook: HookPoint) -> Tensor:
            fill = torch.zeros_like(z) if means is None else means.to(z).expand_as(z)
            mask = head_mask(heads, n_heads, z.shape[0], z.device)
            return torch.where(mask[:, None, :, None], fill, z)

        return [(hook_name(edit.layer, kind.zero_role), replace)]

    def linearity_note(self) -> str:
        if self.needs_means:
            return "first order in z_h - mean: close where a head's output varies little around its mean"
        return super().linearity_note()


@dataclass(frozen=True)
class _Removal(AblationKind):
    """parallel-value and parallel-residual: the heads' parallel part in ``removed_space`` scaled to 0."""

    def _space(self) -> HeadSpace:
        assert self.removed_space is not None  # every removal names its space
        return self.removed_space

    def footprint(self, edit: HeadEdit, info: ModelInfo, kind: LayerKind | None) -> Footprint:
        layers = None if kind is None else [edit.layer]
        return ComponentScale(self._space(), s_par=0.0, heads="all", layers=layers).footprint(info)

    def hooks(
        self, edit: HeadEdit, model: TransformerBridge, info: ModelInfo, heads: HeadSet, kind: LayerKind
    ) -> list[Hook]:
        if SPACES[self._space()].head_writes:
            check_head_writes(info, f"HeadEdit({self.name!r})")
        return layer_hooks(ComponentScale(self._space(), s_par=0.0), model, info, edit.layer, heads)


ABLATION_KINDS: Mapping[str, AblationKind] = named_table(
    Ablation,
    (
        _Fill("zero", gate_input=True),
        _Fill("mean", needs_means=True),
        _Removal("parallel-value", removed_space="value"),
        _Removal("parallel-residual", removed_space="residual-attn"),
    ),
)
"""Every head ablation, by its name in :data:`~lens_parallel.choices.Ablation`."""
ABLATIONS = literal_values(Ablation)
LINEAR_ABLATIONS: tuple[Ablation, ...] = LAYER_KINDS["linear"].ablations
"""The ablations defined on a linear-attention layer's value heads (``mean`` replaces hook_z by its mean, a
softmax-layer activation): :attr:`lens_parallel.layers.LinearAttention.ablations`."""


@dataclass(frozen=True, eq=False)
class HeadEdit(EditBase):
    """Remove heads' contribution at one layer, in one of four ways (``kind``):

    - ``zero``: z_h = 0 (hook_z). On a linear-attention layer (Qwen3.5's gated delta rule) the head's gate input
      is zeroed (hook_gate_input): its gated-norm output ``norm(o_h) * silu(0)`` is exactly 0, i.e. the head's
      slice of the output projection's input, so its projected output is removed (heads = value heads there);
    - ``mean``: z_h = ``means[h]``, a fixed mean of hook_z (``[head_index, d_head]``, e.g. over a data set);
    - ``parallel-value``: ``ComponentScale("value", s_par=0)`` on those heads;
    - ``parallel-residual``: ``ComponentScale("residual-attn", s_par=0)`` on those heads' own writes.

    ``heads`` is a tuple of heads (every batch row) or a bool mask ``[batch, head_index]`` giving each row its own head
    set, which lets the ablation engine run many edits in one forward. On linear-attention layers ``zero``,
    ``parallel-value`` (o_t's part along v_t removed) and ``parallel-residual`` (the head's write u_h W_out[h] along x_t
    removed) are defined, on value heads (:data:`LINEAR_ABLATIONS`); ``mean`` is refused there. ``positions``: ``all``
    or ``after-first`` (position 0 untouched, as the sanity-checks paper's frozen single-head interventions).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> losses = lp.document_losses(model, docs, lp.HeadEdit("zero", 1, [0, 2]), progress=False)
    """

    kind: ClassVar[str] = "head-ablation"

    ablation: Ablation
    layer: int
    heads: int | Sequence[int] | Bool[Tensor, "batch head_index"]
    means: Float[Tensor, "head_index d_head"] | None = None
    positions: EditPositions = "all"

    def __post_init__(self) -> None:
        check_choice("ablation", self.ablation, Ablation)
        check_positions(self.positions)
        as_indices(self.layer, what="layers")
        if ABLATION_KINDS[self.ablation].needs_means and self.means is None:
            raise LensParallelError(
                "a mean ablation needs means [n_heads, d_head] (e.g. from lens_parallel.sweep.head_means)"
            )
        if not isinstance(self.heads, Tensor):
            heads = as_indices(self.heads, what="heads")
            if not heads:
                raise LensParallelError("empty head set: give at least one query head")
            object.__setattr__(self, "heads", heads)

    @property
    def layers(self) -> tuple[int]:
        return (self.layer,)

    def footprint(self, info: ModelInfo) -> Footprint:
        return ABLATION_KINDS[self.ablation].footprint(self, info, self._kind(info))

    def resolved(self, info: ModelInfo) -> HeadEdit:
        """The layer counted from the end of ``info``'s layers, the heads (indices, not a mask) from the end of that
        layer's heads."""
        layer = from_end((self.layer,), info.n_layers, "layers")[0]
        heads = self.heads
        if isinstance(heads, tuple) and info.kind(layer).heads:
            heads = from_end(heads, info.output_heads(layer), "heads")
        if layer == self.layer and (heads is self.heads or heads == self.heads):
            return self
        return dataclasses.replace(self, layer=layer, heads=heads)

    def _kind(self, info: ModelInfo) -> LayerKind | None:
        """The edited layer's kind (None where the layer is out of range: the hooks say so)."""
        return info.kind(self.layer) if 0 <= self.layer < info.n_layers else None

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        kind = self._kind(info)
        if kind is None or self.ablation not in kind.ablations:  # refused, saying which layers take it
            softmax_layers(info, [self.layer], what=f"HeadEdit({self.ablation!r})")
        assert kind is not None
        heads = self.heads if isinstance(self.heads, Tensor) else check_heads(info, self.layer, self.heads)
        out = ABLATION_KINDS[self.ablation].hooks(self, model, info, heads, kind)
        return EDIT_POSITIONS[self.positions].hooks(out)
