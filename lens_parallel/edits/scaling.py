"""Component scaling: m' = m + (s_par - 1) m_par + (s_perp - 1) m_perp in one space
(:mod:`lens_parallel.spaces`), written so that s_par = s_perp = 1 returns m bit for bit (the matched no-op is
exact); several scalings alike but for their scales stack as batch rows of one forward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, cast

import einops
import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.choices import EditPositions, ReferenceGuard, Space, ValueSite
from lens_parallel.edits.base import (
    EDIT_POSITIONS,
    EditBase,
    Footprint,
    Heads,
    HeadSet,
    LayerHeadEdit,
    PatternUse,
    as_heads,
    check_positions,
    head_mask,
    store,
    store_diagonal,
)
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import (
    Hook,
    check_head_writes,
    check_heads,
    check_indices,
    head_write_inputs,
    hook_name,
    layers_where,
    output_weights,
    residual_reference_role,
    softmax_layers,
)
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.spaces import (
    HEAD_SPACES,
    SPACES,
    ValueParts,
    ValueSpace,
    check_spaces,
    value_parts,
    value_space,
)
from lens_parallel.validate import as_indices, check_choice, check_eps, check_finite


@dataclass(frozen=True)
class ComponentScale(LayerHeadEdit):
    """Scale the parallel and perpendicular parts of a message in one space.

    Args:
        space: ``value`` (m = hook_z, r = v_t), ``value-exclude-self`` (o' = d_t + s_par c_par + s_perp c_perp),
            ``value-merged`` (m = concat_h o_h, r = concat_h v_t^h: one projection over every head's dimensions),
            ``residual-attn`` (m = hook_attn_out, or with ``heads`` each head's z_h W_O[h], r = resid_pre),
            ``residual-mlp`` (m = hook_mlp_out, r = resid_mid, or resid_pre for parallel attn/MLP blocks),
            ``residual-block`` (m = resid_post - resid_pre, r = resid_pre).
        s_par, s_perp: scales of the parallel and perpendicular parts (finite).
        layers: layers to edit (default all).
        heads: query heads to edit; only for the value spaces and residual-attn. In the value spaces ``None`` (the
            default) and ``"all"`` both mean every head. In residual-attn, ``heads=None`` edits the whole sublayer
            update (b_O included) against x_t, while a head list, or ``"all"``, edits each head's own write
            z_h W_O[h] against x_t (b_O untouched).
        eps: guard on |r|; with ``guard="exclude"`` positions below it scale as purely perpendicular.
        guard: ``exclude`` or ``clamp`` (|r|^2 floored at eps^2, every position projected: the
            directional-decomposition paper's reference clamp is ``guard="clamp", eps=1e-3``;
            :data:`~lens_parallel.choices.ReferenceGuard`).
        positions: ``all`` or ``after-first`` (position 0 untouched; :data:`POSITIONS`).
        site: under gated attention (Qwen3.5), where the value spaces read the message
            (:data:`~lens_parallel.choices.ValueSite`): ``pre-gate`` o = A v (its change passed through the gate) or
            ``post-gate`` z = sigmoid(gate) * o, the output projection's input (exclude-self there removes the gated
            self term sigmoid(gate) * A_tt v_t); refused on a model without a gate, where the two are one.

    Linear-attention layers (Qwen3.5's gated delta rule) are edited too, per value head (``heads`` index value heads
    there): the value spaces scale o_t (hook_recurrence_out, before the gated RMSNorm) against v_t, exclude-self
    c_t = o_t - a_tt v_t with a_tt = beta_t (k_t . q_t) (:mod:`lens_parallel.spaces`); the recurrent state does not
    read o, so the edited forward is exact. residual-attn scales the block's linear-attention output, or each value
    head's write u_h W_out[h] (u_h the gated RMSNorm of o_h and its gate z_h); ``site="post-gate"`` is a softmax-layer
    option. Such
    edits are not decode-safe (a cached step runs Hugging Face's own module, where these hooks never fire):
    generation recomputes the sequence at every step (:func:`lens_parallel.generate`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> edit = lp.ComponentScale("value", s_par=0.0, layers=[1])  # remove the value-parallel part
        >>> effect = lp.evaluate(model, docs, edit, n_resamples=50, progress=False)
    """

    kind: ClassVar[str] = "scale"

    space: Space
    s_par: float = 1.0
    s_perp: float = 1.0
    layers: int | Sequence[int] | None = None
    heads: Heads = None
    eps: float = geometry.EPS
    positions: EditPositions = "all"
    guard: ReferenceGuard = "exclude"
    site: ValueSite = "pre-gate"

    def __post_init__(self) -> None:
        check_spaces(self.space)
        check_choice("guard", self.guard, ReferenceGuard)
        check_choice("site", self.site, ValueSite)
        spec = SPACES[self.space]
        GATE_SITES[self.site].check_space(self.space, spec.value)
        check_positions(self.positions)
        check_finite("s_par", self.s_par)
        check_finite("s_perp", self.s_perp)
        check_eps(self.eps)
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", as_heads(self.heads))
        merged_all = spec.value and self.heads == "all"  # value-merged edits every head together
        if self.heads is not None and not spec.per_head and not merged_all:
            raise LensParallelError(
                f"space {self.space!r} has no heads (it edits a whole sublayer update, or all heads' concatenation in "
                f"value-merged); heads are accepted for {', '.join(HEAD_SPACES)}"
            )

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        return _scale_hooks(self, self, model, info)

    def noop(self) -> ComponentScale:
        """The matched no-op: the same hooks with both scales 1 (exact: it returns every activation bit for bit)."""
        return dataclasses.replace(self, s_par=1.0, s_perp=1.0)

    def stack_signature(self) -> tuple[Any, ...]:
        """Everything but the scales: scalings of one signature stack as batch rows of one forward."""
        return (type(self), self.space, self.layers, self.heads, self.eps, self.positions, self.guard, self.site)

    def footprint(self, info: ModelInfo) -> Footprint:
        spec = SPACES[self.space]
        softmax = self._softmax_footprint(info)
        layers = self.edited_layers(info)
        if spec.sublayer != "attn" or not edited_linear_layers(info, layers):
            return softmax
        roles = ("lin_v", *(("lin_q", "lin_k", "lin_beta") if spec.reads_self_weight else ()))
        heads = ("lin_o", "lin_gate") if self.heads is not None else ()
        reads, writes = (roles, ("lin_o",)) if spec.value else (("resid_pre", *heads), ("lin_out",))
        return combined_footprint(softmax, Footprint(reads, writes, "none", False), info, layers)

    def softmax_only(self) -> str:
        """What of this scaling is built on softmax-attention layers only (the post-gate site: a linear layer has no
        output gate), or "" when it is defined on every layer."""
        return GATE_SITES[self.site].softmax_only

    def edited_layers(self, info: ModelInfo) -> tuple[int, ...]:
        """The layers it edits on a model like ``info``: ``layers`` (None: every layer), where it is built on
        softmax layers only (:meth:`softmax_only`) without the linear-attention ones when ``layers=None``; a linear
        layer named then raises."""
        if what := self.softmax_only():
            return softmax_layers(info, self.layers, what=what)[0]
        spec = SPACES[self.space]
        edits = partial(spec.editable_at, info)
        return layers_where(info, self.layers, edits, needs=spec.edit_needs, what=f"ComponentScale({self.space!r})")[0]

    def _softmax_footprint(self, info: ModelInfo) -> Footprint:
        spec = SPACES[self.space]
        reads = spec.scale_reads(info, heads=self.heads is not None)
        pattern: PatternUse = "diagonal" if spec.reads_self_weight else "none"
        return Footprint(reads, (spec.scaled_role(),), pattern, decode_safe=True)


@dataclass(frozen=True, eq=False)
class _RowScales:
    """The scales of stacked :class:`ComponentScale` jobs, one per batch row (``s_par`` / ``s_perp`` ``[row]``)."""

    space: str
    s_par: Tensor
    s_perp: Tensor
    eps: float
    guard: ReferenceGuard
    site: ValueSite


_Scaling = ComponentScale | _RowScales


@dataclass(frozen=True)
class _Site:
    """Where a scaling's hooks go: the model, its info, one layer and the heads (None: the whole sublayer)."""

    model: TransformerBridge
    info: ModelInfo
    layer: int
    heads: HeadSet | None


def _layers(info: ModelInfo, layers: int | Sequence[int] | None) -> tuple[int, ...]:
    return check_indices("layers", layers, info.n_layers)


def edited_linear_layers(info: ModelInfo, layers: int | Sequence[int] | None) -> tuple[int, ...]:
    """The layers among ``layers`` (None: every layer) whose hooks do not fire at a cached decoding step
    (:attr:`~lens_parallel.layers.LayerKind.decodes_with_hooks`: linear attention), where an edit's footprint is not
    decode-safe."""
    return tuple(layer for layer in _layers(info, layers) if not info.kind(layer).decodes_with_hooks)


def combined_footprint(
    softmax: Footprint, linear: Footprint, info: ModelInfo, layers: int | Sequence[int] | None
) -> Footprint:
    """The footprint of an edit of ``layers`` that is ``softmax`` on softmax-attention layers and ``linear`` on
    linear-attention ones (only ``linear`` when every edited layer is one)."""
    if len(edited_linear_layers(info, layers)) == len(_layers(info, layers)):
        return linear
    return Footprint(
        tuple(dict.fromkeys(softmax.reads + linear.reads)),
        softmax.writes + linear.writes,
        softmax.pattern,
        softmax.decode_safe and linear.decode_safe,
    )


def _scale_hooks(scales: _Scaling, edit: ComponentScale, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
    """The hooks of ``edit``'s space, layers, heads and positions, scaling by ``scales`` (the edit's own, or one
    per batch row)."""
    layers = edit.edited_layers(info)
    if SPACES[edit.space].head_writes and edit.heads is not None:
        check_head_writes(info, "ComponentScale('residual-attn') on single heads")
    out: list[Hook] = []
    for layer in layers:
        heads: tuple[int, ...] | None = None
        if SPACES[edit.space].value or edit.heads is not None:  # a residual space with heads=None: the whole update
            heads = check_heads(info, layer, None if edit.heads == "all" else edit.heads)
        out += _builder(edit.space, info, layer)(scales, _Site(model, info, layer, heads))
    return EDIT_POSITIONS[edit.positions].hooks(out)


def stacked_hooks(model: TransformerBridge, edits: Sequence[EditBase], *, repeat: int) -> list[Hook]:
    """One set of hooks running several edits of one :meth:`~EditBase.stack_signature` in one forward: rows
    ``[i * repeat, (i + 1) * repeat)`` get ``edits[i]``'s scales (the documents tiled once per edit)."""
    signatures = {e.stack_signature() for e in edits}
    if len(signatures) != 1 or None in signatures or not isinstance(edits[0], ComponentScale):
        raise LensParallelError("stacked edits must be ComponentScales alike but for s_par and s_perp")
    scalings = [e for e in edits if isinstance(e, ComponentScale)]
    template = scalings[0]
    s_par = torch.tensor([e.s_par for e in scalings], dtype=torch.float64, device="cpu").repeat_interleave(repeat)
    s_perp = torch.tensor([e.s_perp for e in scalings], dtype=torch.float64, device="cpu").repeat_interleave(repeat)
    scales = _RowScales(template.space, s_par, s_perp, template.eps, template.guard, template.site)
    return _scale_hooks(scales, template, model, model_info(model))


def _scaling(edit: _Scaling) -> dict[str, Any]:
    """The keywords of :func:`~lens_parallel.geometry.scale_delta` a scaling passes: its scales, eps and guard."""
    return {"s_par": edit.s_par, "s_perp": edit.s_perp, "eps": edit.eps, "clamp": GUARD_CLAMPS[edit.guard]}


GUARD_CLAMPS: Mapping[ReferenceGuard, bool] = {"exclude": False, "clamp": True}
"""Each reference guard as :func:`~lens_parallel.geometry.scale_delta`'s ``clamp``."""


class _PreGate:
    """``site="pre-gate"``: the message is the pre-gate aggregate o = A v; its change passes through the gate."""

    softmax_only = ""

    def check_space(self, space: str, value: bool) -> None:
        pass

    def check_model(self, info: ModelInfo) -> None:
        pass

    def units(self, space: ValueSpace, z: Tensor, parts: ValueParts) -> tuple[Tensor, Tensor]:
        return space.units(parts.o, parts)

    def change_of_z(self, delta: Tensor, parts: ValueParts) -> Tensor:
        return delta if parts.gate is None else parts.gate * delta


class _PostGate:
    """``site="post-gate"``: the message is z = sigmoid(gate) * A v itself (exclude-self: z minus the gated self
    term), on softmax layers with an output gate only."""

    softmax_only = "ComponentScale's site='post-gate'"

    def check_space(self, space: str, value: bool) -> None:
        if not value:
            raise LensParallelError(f"site='post-gate' is a value-space option; space {space!r} has no gate site")

    def check_model(self, info: ModelInfo) -> None:
        if not info.gated_attention:
            raise LensParallelError(
                f"site='post-gate': {info.name}'s attention has no output gate (pre- and post-gate are one there)"
            )

    def units(self, space: ValueSpace, z: Tensor, parts: ValueParts) -> tuple[Tensor, Tensor]:
        return space.units(z, parts, gated=True)

    def change_of_z(self, delta: Tensor, parts: ValueParts) -> Tensor:
        return delta


GATE_SITES: Mapping[ValueSite, _PreGate | _PostGate] = {"pre-gate": _PreGate(), "post-gate": _PostGate()}
"""What each value site (:data:`~lens_parallel.choices.ValueSite`) does: the (m, r) a value-space scaling reads
(``units``), how its change reaches z (``change_of_z``), where it is defined (``check_space``, ``check_model``,
``softmax_only``)."""


def _value_hooks(edit: _Scaling, at: _Site) -> list[Hook]:
    """Value-space scaling on hook_z. Gated attention (z = sigmoid(gate) * A v): the scaling acts on the pre-gate
    aggregate o = A v = z / sigmoid(gate), and its change passes through the gate: z' = z + gate * delta.
    ``value-merged``: one projection of the heads' concatenation on the values' (every head edited). ``site=
    "post-gate"``: the message is z itself (exclude-self: z minus the gated self term)."""
    info, layer, heads = at.info, at.layer, at.heads
    state: dict[str, Tensor] = {}
    site = GATE_SITES[edit.site]
    site.check_model(info)
    space = value_space(edit.space)

    def edit_z(z: Tensor, hook: HookPoint) -> Tensor:
        parts = value_parts({**state, "z": z}, info)  # gated: o = z / sigmoid(gate), the pre-gate A v
        state.clear()
        m, r = site.units(space, z, parts)
        delta = site.change_of_z(space.to_heads(geometry.scale_delta(m, r, **_scaling(edit)), info.n_heads), parts)
        mask = head_mask(heads, info.n_heads, z.shape[0], z.device)
        return torch.where(mask[:, None, :, None], z + delta, z)

    out: list[Hook] = [(hook_name(layer, "v"), partial(store, state=state, key="v"))]
    if info.gate_role:
        out.append((hook_name(layer, info.gate_role), partial(store, state=state, key=info.gate_role)))
    if space.reads_self_weight:
        out.append((hook_name(layer, "pattern_diag"), store_diagonal(state)))
    return [*out, (hook_name(layer, "z"), edit_z)]


def _linear_value_hooks(edit: _Scaling, at: _Site) -> list[Hook]:
    """Value-space scaling at a linear-attention layer: o_t (hook_recurrence_out) against v_t per value head;
    value-exclude-self scales c_t = o_t - a_tt v_t (a_tt from the layer's q, k, beta); value-merged one projection of
    every value head's concatenation. The state S_t does not read o, so later positions see the same S."""
    space = value_space(edit.space)

    def delta(o: Tensor, parts: ValueParts) -> Tensor:
        return space.to_heads(geometry.scale_delta(*space.units(o, parts), **_scaling(edit)), o.shape[2])

    return linear_output_hooks(at.info, at.layer, at.heads, delta, diagonal=space.reads_self_weight)


def linear_output_hooks(
    info: ModelInfo,
    layer: int,
    heads: HeadSet | None,
    delta: Callable[[Tensor, ValueParts], Tensor],
    *,
    diagonal: bool,
) -> list[Hook]:
    """Hooks changing a linear-attention layer's output o_t (hook_recurrence_out) to o_t + ``delta(o, parts)`` on
    ``heads`` (value heads; None: all), ``parts`` its :class:`~lens_parallel.spaces.ValueParts` (with a_tt when
    ``diagonal``), read from the layer's own hooks earlier in the same forward."""
    state: dict[str, Tensor] = {}

    def edit_o(o: Tensor, hook: HookPoint) -> Tensor:
        parts = value_parts({**state, "lin_o": o}, info)
        state.clear()
        mask = head_mask(heads, o.shape[2], o.shape[0], o.device)
        return torch.where(mask[:, None, :, None], o + delta(o, parts).to(o.dtype), o)

    roles = [role for role in info.kind(layer).value_roles(info, diagonal=diagonal) if role != "lin_o"]
    return [
        *((hook_name(layer, role), partial(store, state=state, key=role)) for role in roles),
        (hook_name(layer, "lin_o"), edit_o),
    ]


def _residual_attn_hooks(edit: _Scaling, at: _Site) -> list[Hook]:
    """residual-attn scaling of the attention sublayer's update (``heads=None``) or of each head's write z_h W_O[h]
    against x = resid_pre; on a linear-attention layer the update is its hook_out and a head's write u_h W_out[h], u_h
    the gated RMSNorm of its o_h and gate z_h (:func:`~lens_parallel.hooks.linear_head_inputs`)."""
    model, info, layer, heads = at.model, at.info, at.layer, at.heads
    state: dict[str, Tensor] = {}
    kind = info.kind(layer)
    W_O = output_weights(model, info, layer) if heads is not None else None
    head_input = head_write_inputs(model, info, layer) if heads is not None else None

    def edit_out(out: Tensor, hook: HookPoint) -> Tensor:
        x = state.pop("x")
        if heads is None or W_O is None or head_input is None:
            return geometry.scale_components(out, x, **_scaling(edit))
        z = head_input({role: state.pop(role) for role in kind.head_roles})
        mask = head_mask(heads, z.shape[2], out.shape[0], out.device)
        # heads some row edits (per-head writes only for these), from the heads as given: a tuple, or a per-row mask
        # built on the host (read there, never on the device inside the forward)
        used = sorted(heads) if not isinstance(heads, Tensor) else heads.any(0).nonzero().flatten().tolist()
        m = einops.einsum(z[:, :, used].to(out), W_O[used].to(out), "b p h d, h d m -> b p h m")
        x_h = einops.repeat(x, "b p m -> b p h m", h=len(used))
        delta = geometry.scale_delta(m, x_h, **_scaling(edit))
        return out + (delta * mask[:, None, used, None]).sum(2)

    reads = ["resid_pre", *(kind.head_roles if heads is not None else ())]
    stored = [
        (hook_name(layer, role), partial(store, state=state, key="x" if role == "resid_pre" else role))
        for role in reads
    ]
    return [*stored, (hook_name(layer, kind.update_role), edit_out)]


def _residual_mlp_hooks(edit: _Scaling, at: _Site) -> list[Hook]:
    info, layer = at.info, at.layer
    state: dict[str, Tensor] = {}

    def edit_out(out: Tensor, hook: HookPoint) -> Tensor:
        return geometry.scale_components(out, state.pop("x"), **_scaling(edit))

    ref = hook_name(layer, residual_reference_role(info, "mlp"))
    return [(ref, partial(store, state=state, key="x")), (hook_name(layer, "mlp_out"), edit_out)]


def _residual_block_hooks(edit: _Scaling, at: _Site) -> list[Hook]:
    layer = at.layer
    state: dict[str, Tensor] = {}

    def edit_post(post: Tensor, hook: HookPoint) -> Tensor:
        x = state.pop("x")
        return post + geometry.scale_delta(post - x, x, **_scaling(edit))

    return [
        (hook_name(layer, "resid_pre"), partial(store, state=state, key="x")),
        (hook_name(layer, "resid_post"), edit_post),
    ]


_SCALE_BUILDERS = {
    "value": _value_hooks,
    "attn": _residual_attn_hooks,
    "mlp": _residual_mlp_hooks,
    "block": _residual_block_hooks,
}
"""Hook builders by where a space's message lives: the heads' value aggregate, or a residual update of the
attention sublayer, the MLP or the whole block (:attr:`~lens_parallel.spaces.SpaceSpec.family` / ``sublayer``)."""


_VALUE_BUILDERS = {"softmax": _value_hooks, "linear": _linear_value_hooks}
"""Value-space hook builders by layer kind (a mixer has no value spaces)."""


def _builder(space: str, info: ModelInfo, layer: int) -> Any:
    spec = SPACES[space]
    if spec.value:
        return _VALUE_BUILDERS[info.kind(layer).name]
    return _SCALE_BUILDERS[spec.sublayer]


def layer_hooks(
    edit: ComponentScale, model: TransformerBridge, info: ModelInfo, layer: int, heads: HeadSet | None
) -> list[Hook]:
    """``edit``'s hooks at one layer (softmax or linear attention) on ``heads`` (a per-row mask allowed): what
    :class:`~lens_parallel.edits.HeadEdit`'s parallel ablations and :class:`~lens_parallel.edits.DiagonalEdit` on
    a linear-attention layer run."""
    return cast(list[Hook], _builder(edit.space, info, layer)(edit, _Site(model, info, layer, heads)))
