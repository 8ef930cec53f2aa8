"""Edits of the attention pattern: the diagonal form of parallel scaling, and hard diagonal removal."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import einops
import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.attention import Diagonal, block_rows, rows_hook
from lens_parallel.choices import EditPositions, HeadSpace
from lens_parallel.edits.base import (
    EDIT_POSITIONS,
    Footprint,
    Heads,
    HeadSet,
    LayerHeadEdit,
    all_values,
    as_heads,
    check_positions,
    head_mask,
    store,
)
from lens_parallel.edits.scaling import (
    ComponentScale,
    combined_footprint,
    edited_linear_layers,
    layer_hooks,
    linear_output_hooks,
)
from lens_parallel.hooks import (
    Hook,
    check_head_writes,
    check_heads,
    check_not_gated,
    expand_kv,
    head_layers,
    hook_name,
    output_weights,
    softmax_layers,
)
from lens_parallel.layers import LinearAttention
from lens_parallel.models import ModelInfo
from lens_parallel.spaces import SPACES, ResidualFrame, ValueParts
from lens_parallel.validate import as_indices, check_choice, check_eps, check_finite


@dataclass(frozen=True)
class DiagonalEdit(LayerHeadEdit):
    """Parallel-only scaling written as a change of the attention diagonal: A'_tt = A_tt + dA_tt.

    value: dA_tt = (s_par - 1) (o_t . v_t) / |v_t|^2; value-exclude-self: (s_par - 1) (c_t . v_t) / |v_t|^2, with
    o_t = sum_s A_ts v_s and c_t = o_t - A_tt v_t from this forward. In those spaces the edited forward equals
    ``ComponentScale(space, s_par)`` exactly (up to float rounding). residual-attn (per head):
    dA_tt = (s_par - 1) (m_t . x_t) / ((W_O v_t) . x_t) with m_t = o_t W_O[h]: it reproduces the head's update
    along x_t but adds a perpendicular change (a view, not an identity). Positions where the denominator is below
    ``eps`` (|v_t|^2, or |(W_O v_t) . x_t| relative to |W_O v_t| |x_t|) get dA_tt = 0. ``positions``: ``all`` or
    ``after-first`` (query position 0 untouched).

    On a linear-attention layer (Qwen3.5's gated delta rule) the diagonal is a_tt = beta_t (k_t . q_t) and
    o_t = ... + a_tt v_t, so the same change da_tt v_t is added to o_t (hook_recurrence_out; the recurrent state
    does not read o): in value and value-exclude-self it equals ``ComponentScale(space, s_par)`` there too. Heads are
    value heads there; residual-attn is refused on linear layers (a head's write passes its gated RMSNorm, so no
    change of a_tt alone reproduces its scaling).
    Not decode-safe on a linear layer (:meth:`ComponentScale.footprint`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> edit = lp.DiagonalEdit("value", s_par=0.0, layers=[1])  # the same removal, as a change of A_tt
        >>> losses = lp.document_losses(model, docs, edit, progress=False)
    """

    kind: ClassVar[str] = "diagonal-scale"

    space: HeadSpace
    s_par: float = 0.0
    layers: int | Sequence[int] | None = None
    heads: Heads = None
    eps: float = geometry.EPS
    positions: EditPositions = "all"

    def __post_init__(self) -> None:
        check_choice("diagonal space", self.space, HeadSpace)
        check_positions(self.positions)
        check_finite("s_par", self.s_par)
        check_eps(self.eps)
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", as_heads(self.heads))

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        space = SPACES[self.space]
        if space.head_writes:
            layers, _ = softmax_layers(info, self.layers, what="DiagonalEdit('residual-attn')")
            check_not_gated(info, "DiagonalEdit('residual-attn')", alternative="use value or value-exclude-self")
            check_head_writes(info, "DiagonalEdit('residual-attn')")
        else:
            layers, _ = head_layers(info, self.layers, what=f"DiagonalEdit({self.space!r})")
        out: list[Hook] = []
        for layer in layers:
            heads = check_heads(info, layer, None if self.heads == "all" else self.heads)
            if isinstance(info.kind(layer), LinearAttention):  # o_t + da_tt v_t, the parallel scaling itself
                out += layer_hooks(
                    ComponentScale(self.space, s_par=self.s_par, eps=self.eps), model, info, layer, heads
                )
                continue
            state: dict[str, Tensor] = {}
            out.append((hook_name(layer, "v"), partial(store, state=state, key="v")))
            if space.head_writes:
                out.append((hook_name(layer, "resid_pre"), partial(store, state=state, key="x")))
            W_O = output_weights(model, info, layer) if space.head_writes else None
            edit = partial(self._edit_pattern, layer=layer, state=state, heads=heads, W_O=W_O)
            diagonal = partial(self._edit_diagonal, state=state, heads=heads, W_O=W_O)
            out.append((hook_name(layer, "pattern_full"), rows_hook(edit, diagonal=diagonal)))
        return EDIT_POSITIONS[self.positions].hooks(out)

    def _edit_pattern(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        hook: HookPoint,
        *,
        layer: int,
        state: dict[str, Tensor],
        heads: HeadSet,
        W_O: Float[Tensor, "head_index d_head d_model"] | None,
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        v = expand_kv(all_values(state["v"], layer, pattern.shape[-1]), pattern.shape[1])
        frame = None if W_O is None else ResidualFrame(block_rows(state["x"]), W_O.to(v))
        d_a = SPACES[self.space].pattern_weight_change(pattern, v, s_par=self.s_par, frame=frame, eps=self.eps).d_a
        d_a = torch.where(head_mask(heads, pattern.shape[1], pattern.shape[0], pattern.device)[:, :, None], d_a, 0.0)
        return geometry.add_self_weights(pattern, d_a)

    def _edit_diagonal(
        self,
        rows: Diagonal,
        hook: HookPoint,
        *,
        state: dict[str, Tensor],
        heads: HeadSet,
        W_O: Float[Tensor, "head_index d_head d_model"] | None,
    ) -> Diagonal:
        """The same edit on the diagonal path: A'_tt = A_tt + dA_tt, so z'_t = z_t + dA_tt v_t."""
        o, v = (einops.rearrange(t, "batch head_index pos d -> batch pos head_index d") for t in (rows.z, rows.value))
        frame = None if W_O is None else ResidualFrame(state["x"].to(v), W_O.to(v))
        parts = ValueParts(o, v, rows.weight, None)
        d_a = SPACES[self.space].weight_change(parts, s_par=self.s_par, frame=frame, eps=self.eps).d_a
        batch, n_heads = d_a.shape[:2]
        d_a = torch.where(head_mask(heads, n_heads, batch, d_a.device)[:, :, None], d_a, 0.0)
        return rows.replace(weight=rows.weight + d_a)

    def noop(self) -> DiagonalEdit:
        """The matched no-op: the same hooks at s_par = 1 (dA_tt = 0)."""
        return dataclasses.replace(self, s_par=1.0)

    def footprint(self, info: ModelInfo) -> Footprint:
        """Reads v (and x_t in residual-attn); changes only A_tt of each row, from the row's own diagonal, o_t and
        v_t (on the blocked path o_t = A_t. v reads the whole row against every value: at a decoding step the cached
        values, :func:`~lens_parallel.edits.all_values`; the diagonal path hands it o_t)."""
        head_writes = SPACES[self.space].head_writes
        reads = ("v", *(("resid_pre",) if head_writes else ()))
        softmax = Footprint(reads, ("pattern_full",), "diagonal", decode_safe=True)
        if head_writes or not edited_linear_layers(info, self.layers):
            return softmax
        return combined_footprint(
            softmax, ComponentScale(self.space, layers=self.layers).footprint(info), info, self.layers
        )


@dataclass(frozen=True)
class ZeroDiagonal(LayerHeadEdit):
    """Hard diagonal removal (the directional-decomposition paper's comparison edit): every head's attention to
    its own token is set to 0 and each row renormalised over the other positions,
    A'_tt = 0, A'_ts = A_ts / (1 - A_tt) (:func:`lens_parallel.geometry.zero_diagonal`), on ``hook_pattern``.
    On a linear-attention layer (Qwen3.5's gated delta rule) its self term is removed, o'_t = o_t - a_tt v_t
    (a_tt = beta_t (k_t . q_t)), without renormalisation: the delta rule's weights are not a distribution, there is
    no row to renormalise (not decode-safe there: :meth:`ComponentScale.footprint`).
    Query position 0 is kept (its row has no other position); a row with 1 - A_tt < ``eps`` is left unchanged and
    counted in :attr:`unchanged_rows` (summed over the forwards run since the edit was made). ``layers``: default
    every layer (the authors' models have softmax layers only); ``heads``: default every head (value heads on a
    linear layer). No matched no-op: it is
    compared with the unedited model. Not to be confused with :class:`DiagonalEdit` (a scaling of A_tt).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> losses = lp.document_losses(model, docs, lp.ZeroDiagonal(layers=[0, 1]), progress=False)
    """

    kind: ClassVar[str] = "zero-diagonal"

    layers: int | Sequence[int] | None = None
    heads: Heads = None
    eps: float = 1e-6
    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"unchanged_rows": 0}, compare=False, repr=False, metadata={"provenance": False}
    )

    def __post_init__(self) -> None:
        check_eps(self.eps)
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", as_heads(self.heads))

    def footprint(self, info: ModelInfo) -> Footprint:
        """Rewrites whole attention rows (every A_ts is renormalised), which needs only A_tt and the rest of the row's
        weight and output (the diagonal path)."""
        softmax = Footprint((), ("pattern_full",), "diagonal", decode_safe=True)
        if not edited_linear_layers(info, self.layers):
            return softmax
        linear = ComponentScale("value-exclude-self", layers=self.layers).footprint(info)
        return combined_footprint(softmax, linear, info, self.layers)

    @property
    def unchanged_rows(self) -> int:
        """Rows (query positions > 0, over batch, heads and forwards) left unchanged because 1 - A_tt < eps."""
        return self.counts["unchanged_rows"]

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        out: list[Hook] = []
        for layer in head_layers(info, self.layers, what="ZeroDiagonal")[0]:
            heads = check_heads(info, layer, None if self.heads == "all" else self.heads)
            if isinstance(info.kind(layer), LinearAttention):  # the self term a_tt v_t removed
                out += linear_output_hooks(info, layer, heads, _minus_self_term, diagonal=True)
                continue
            edit = partial(self._edit_pattern, heads=heads)
            out.append(
                (hook_name(layer, "pattern_full"), rows_hook(edit, diagonal=partial(self._edit_diagonal, heads=heads)))
            )
        return out

    def _edit_pattern(
        self, pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: HookPoint, *, heads: HeadSet
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        edited, unchanged = geometry.zero_diagonal(pattern, eps=self.eps)
        mask = head_mask(heads, pattern.shape[1], pattern.shape[0], pattern.device)
        self.counts["unchanged_rows"] += int((unchanged & mask[:, :, None]).sum())
        return torch.where(mask[:, :, None, None], edited, pattern)

    def _edit_diagonal(self, rows: Diagonal, hook: HookPoint, *, heads: HeadSet) -> Diagonal:
        """The same edit on the diagonal path (:func:`lens_parallel.geometry.zero_diagonal_rows`): z'_t = c_t /
        sum_{s != t} A_ts."""
        position = torch.arange(rows.weight.shape[-1], device=rows.weight.device) + rows.first_key
        zeroed = geometry.zero_diagonal_rows(rows.weight, rows.others, rows.rest, position, eps=self.eps)
        mask = head_mask(heads, rows.weight.shape[1], rows.weight.shape[0], rows.weight.device)[:, :, None]
        self.counts["unchanged_rows"] += int((zeroed.unchanged & mask).sum())
        edited = rows.replace(weight=zeroed.weight, others=zeroed.others, rest=zeroed.rest)
        return edited.where(mask, rows)


def _minus_self_term(o: Tensor, parts: ValueParts) -> Tensor:
    """-a_tt v_t: a linear-attention layer's self term, removed."""
    assert parts.diag is not None  # captured: linear_output_hooks(..., diagonal=True)
    return -geometry.split_self(o, parts.v, parts.diag)[0]
