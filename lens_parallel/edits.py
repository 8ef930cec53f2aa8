"""Interventions as frozen dataclasses, compiled to TransformerLens forward hooks.

This is the only module whose hooks change activations. An *intervention* is a sequence of edits; they are applied
in order (an edit sees the activations earlier edits produced). Use :func:`apply_edits` (a context manager on the
model's own hook context: hooks never stay attached after an exception).

- :class:`ComponentScale`: m' = m + (s_par - 1) m_par + (s_perp - 1) m_perp, i.e. s_par m_par + s_perp m_perp,
  written so that s_par = s_perp = 1 returns m bit for bit (the matched no-op is exact).
- :class:`DiagonalEdit`: the attention-diagonal form of a parallel-only scaling, A'_tt = A_tt + dA_tt on
  hook_pattern, with dA_tt from the same forward's own activations (see :mod:`lens_parallel.geometry`).

Heads are query heads. Under GQA an edit of query head h changes only h: the kv head it reads is shared, but
the edit acts on h's own aggregate (or attention row), never on v. Head-level edits act on softmax-attention
layers only: with ``layers=None`` Qwen3.5's linear-attention layers are left alone; naming one raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, cast, runtime_checkable

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.choices import (
    Ablation,
    EditPositions,
    GateBound,
    HeadsAll,
    HeadSpace,
    ReferenceGuard,
    Space,
    ValueSite,
)
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import (
    Hook,
    check_head_writes,
    check_indices,
    check_not_gated,
    expand_kv,
    hook_name,
    output_weights,
    residual_reference_role,
    softmax_layers,
)
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.validate import as_indices, check_choice, check_finite, options

SCALE_SPACES = options(Space)
DIAGONAL_SPACES = HEAD_SPACES = options(HeadSpace)
ATTENTION_SPACES = (*HEAD_SPACES, "value-merged")
"""Spaces read from the heads (hook_z, hook_v, ...): softmax-attention layers only."""
POSITIONS = options(EditPositions)
"""Which positions an edit acts on. ``all`` (the default); ``after-first`` leaves position 0, the boundary token,
untouched: there o_0 = v_0 (a causal head attends only to itself), so a value-space s_par = 0 removes its whole
output while exclude-self leaves it alone. The sanity-checks paper's frozen interventions exclude the first token;
its trained arms include every position."""

Heads = int | Sequence[int] | HeadsAll | None
"""The heads an edit acts on: a head, a list, ``"all"`` (every head, each on its own write) or None (the default:
every head in the value spaces, where a head is all there is; the whole sublayer update, b_O included, in
residual-attn)."""


def check_positions(positions: object) -> EditPositions:
    """``positions`` if it is one of :data:`POSITIONS`, else a :class:`LensParallelError`."""
    return cast(EditPositions, check_choice("positions", positions, EditPositions))


def _after_first(hooks: list[Hook]) -> list[Hook]:
    """The same hooks, each restoring position 0 of what it returns (the query axis of an attention pattern);
    hooks that only read return None and stay as they are."""

    def keep_first(fn: Callable[..., Tensor | None], axis: int, tensor: Tensor, hook: HookPoint) -> Tensor | None:
        out = fn(tensor, hook)
        if out is None:
            return None
        rest = out.narrow(axis, 1, out.shape[axis] - 1)
        return torch.cat([tensor.narrow(axis, 0, 1).to(out.dtype), rest], dim=axis)

    return [(name, partial(keep_first, fn, 2 if name.endswith("hook_pattern") else 1)) for name, fn in hooks]


def _as_heads(heads: Heads) -> tuple[int, ...] | HeadsAll | None:
    if heads == "all":
        return "all"
    if isinstance(heads, str):
        raise LensParallelError(f"heads must be head indices, 'all' or None, got {heads!r}")
    return as_indices(heads, what="heads")


@dataclass(frozen=True)
class ComponentScale:
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
    """

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
        check_choice("space", self.space, Space)
        check_choice("guard", self.guard, ReferenceGuard)
        check_choice("site", self.site, ValueSite)
        if self.site == "post-gate" and not self.space.startswith("value"):
            raise LensParallelError(f"site='post-gate' is a value-space option; space {self.space!r} has no gate site")
        check_positions(self.positions)
        check_finite("s_par", self.s_par)
        check_finite("s_perp", self.s_perp)
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", _as_heads(self.heads))
        merged_all = self.space == "value-merged" and self.heads == "all"  # value-merged edits every head together
        if self.heads is not None and self.space not in HEAD_SPACES and not merged_all:
            raise LensParallelError(
                f"space {self.space!r} has no heads (it edits a whole sublayer update, or all heads' concatenation in "
                f"value-merged); heads are accepted for {', '.join(HEAD_SPACES)}"
            )

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        return _scale_hooks(self, self, model, info)

    def noop(self) -> ComponentScale:
        """The matched no-op: the same hooks with both scales 1 (exact: it returns every activation bit for bit)."""
        return dataclasses.replace(self, s_par=1.0, s_perp=1.0)


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


def _scale_hooks(scales: _Scaling, edit: ComponentScale, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
    """The hooks of ``edit``'s space, layers, heads and positions, scaling by ``scales`` (the edit's own, or one
    per batch row)."""
    if edit.space in ATTENTION_SPACES:  # needs hook_z / hook_attn_out: softmax-attention layers only
        layers, _ = softmax_layers(info, edit.layers, what=f"ComponentScale({edit.space!r})")
    else:
        layers = check_indices("layers", edit.layers, info.n_layers)
    heads: tuple[int, ...] | None = check_indices("heads", None if edit.heads == "all" else edit.heads, info.n_heads)
    if edit.space == "residual-attn" and edit.heads is None:
        heads = None  # the whole sublayer update
    elif edit.space == "residual-attn":
        check_head_writes(info, "ComponentScale('residual-attn') on single heads")
    out: list[Hook] = []
    for layer in layers:
        out += _SCALE_BUILDERS[edit.space](scales, model, info, layer, heads, {})
    return _after_first(out) if edit.positions == "after-first" else out


def scale_signature(edit: object) -> tuple[Any, ...] | None:
    """What a :class:`ComponentScale` is but for its scales (jobs of one signature can share a forward), or None
    for any other edit."""
    if type(edit) is not ComponentScale:
        return None
    return (edit.space, edit.layers, edit.heads, edit.eps, edit.positions, edit.guard, edit.site)


def stacked_scale_hooks(model: TransformerBridge, edits: Sequence[ComponentScale], *, repeat: int) -> list[Hook]:
    """One set of hooks running several :class:`ComponentScale` s of one :func:`scale_signature` in one forward:
    rows ``[i * repeat, (i + 1) * repeat)`` get ``edits[i]``'s scales (the documents tiled once per edit)."""
    if len({scale_signature(e) for e in edits}) != 1 or scale_signature(edits[0]) is None:
        raise LensParallelError("stacked scales must be ComponentScales alike but for s_par and s_perp")
    template = edits[0]
    s_par = torch.tensor([e.s_par for e in edits], dtype=torch.float64).repeat_interleave(repeat)
    s_perp = torch.tensor([e.s_perp for e in edits], dtype=torch.float64).repeat_interleave(repeat)
    scales = _RowScales(template.space, s_par, s_perp, template.eps, template.guard, template.site)
    return _scale_hooks(scales, template, model, model_info(model))


@dataclass(frozen=True)
class DiagonalEdit:
    """Parallel-only scaling written as a change of the attention diagonal: A'_tt = A_tt + dA_tt.

    value: dA_tt = (s_par - 1) (o_t . v_t) / |v_t|^2; value-exclude-self: (s_par - 1) (c_t . v_t) / |v_t|^2, with
    o_t = sum_s A_ts v_s and c_t = o_t - A_tt v_t from this forward. In those spaces the edited forward equals
    ``ComponentScale(space, s_par)`` exactly (up to float rounding). residual-attn (per head):
    dA_tt = (s_par - 1) (m_t . x_t) / ((W_O v_t) . x_t) with m_t = o_t W_O[h]: it reproduces the head's update
    along x_t but adds a perpendicular change (a view, not an identity). Positions where the denominator is below
    ``eps`` (|v_t|^2, or |(W_O v_t) . x_t| relative to |W_O v_t| |x_t|) get dA_tt = 0. ``positions``: ``all`` or
    ``after-first`` (query position 0 untouched).
    """

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
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", _as_heads(self.heads))

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers, _ = softmax_layers(info, self.layers, what="DiagonalEdit")
        if self.space == "residual-attn":
            check_not_gated(info, "DiagonalEdit('residual-attn')", alternative="use value or value-exclude-self")
            check_head_writes(info, "DiagonalEdit('residual-attn')")
        heads = check_indices("heads", None if self.heads == "all" else self.heads, info.n_heads)
        out: list[Hook] = []
        for layer in layers:
            state: dict[str, Tensor] = {}
            out.append((hook_name(layer, "v"), partial(_store, state=state, key="v")))
            if self.space == "residual-attn":
                out.append((hook_name(layer, "resid_pre"), partial(_store, state=state, key="x")))
            W_O = output_weights(model, layer) if self.space == "residual-attn" else None
            out.append((hook_name(layer, "pattern"), partial(self._edit_pattern, state=state, heads=heads, W_O=W_O)))
        return _after_first(out) if self.positions == "after-first" else out

    def _edit_pattern(
        self,
        pattern: Float[Tensor, "batch head_index query_pos key_pos"],
        hook: HookPoint,
        *,
        state: dict[str, Tensor],
        heads: HeadSet,
        W_O: Float[Tensor, "head_index d_head d_model"] | None,
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        v = expand_kv(state.pop("v"), pattern.shape[1])
        W_O = None if W_O is None else W_O.to(v)
        d_a = geometry.diagonal_change(
            pattern, v, self.space, s_par=self.s_par, x=state.pop("x", None), W_O=W_O, eps=self.eps
        ).d_a
        d_a = torch.where(_head_mask(heads, pattern.shape[1], pattern.shape[0], pattern.device)[:, :, None], d_a, 0.0)
        return pattern + torch.diag_embed(d_a)

    def noop(self) -> DiagonalEdit:
        """The matched no-op: the same hooks at s_par = 1 (dA_tt = 0)."""
        return dataclasses.replace(self, s_par=1.0)


ABLATIONS = options(Ablation)


@dataclass(frozen=True, eq=False)
class HeadEdit:
    """Remove heads' contribution at one layer, in one of four ways (``kind``):

    - ``zero``: z_h = 0 (hook_z). On a linear-attention layer (Qwen3.5's gated delta rule) the head's gate input
      is zeroed (hook_gate_input): its gated-norm output ``norm(o_h) * silu(0)`` is exactly 0, i.e. the head's
      slice of the output projection's input, so its projected output is removed (heads = value heads there);
    - ``mean``: z_h = ``means[h]``, a fixed mean of hook_z (``[head_index, d_head]``, e.g. over a data set);
    - ``parallel-value``: ``ComponentScale("value", s_par=0)`` on those heads;
    - ``parallel-residual``: ``ComponentScale("residual-attn", s_par=0)`` on those heads' own writes.

    ``heads`` is a tuple of heads (every batch row) or a bool mask ``[batch, head_index]`` giving each row its own
    head set, which lets the ablation engine run many edits in one forward. Only ``zero`` is defined for
    linear-attention layers. ``positions``: ``all`` or ``after-first`` (position 0 untouched, as the sanity-checks
    paper's frozen single-head interventions).
    """

    kind: Ablation
    layer: int
    heads: int | Sequence[int] | Bool[Tensor, "batch head_index"]
    means: Float[Tensor, "head_index d_head"] | None = None
    positions: EditPositions = "all"

    def __post_init__(self) -> None:
        check_choice("ablation", self.kind, Ablation)
        check_positions(self.positions)
        if self.kind == "mean" and self.means is None:
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

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        linear = self.kind == "zero" and 0 <= self.layer < info.n_layers and info.layer_types[self.layer] == "linear"
        if linear:
            layer, role = self.layer, "lin_gate"
        else:
            (layer,), _ = softmax_layers(info, [self.layer], what=f"HeadEdit({self.kind!r})")
            role = "z"
        n_heads = info.output_heads(layer)
        heads = self.heads if isinstance(self.heads, Tensor) else check_indices("heads", self.heads, n_heads)
        if self.kind == "parallel-value":
            out = _value_hooks(ComponentScale("value", s_par=0.0), model, info, layer, heads, {})
        elif self.kind == "parallel-residual":
            check_head_writes(info, "HeadEdit('parallel-residual')")
            out = _residual_attn_hooks(ComponentScale("residual-attn", s_par=0.0), model, info, layer, heads, {})
        else:

            def replace(z: Tensor, hook: HookPoint) -> Tensor:
                fill = torch.zeros_like(z) if self.means is None else self.means.to(z).expand_as(z)
                mask = _head_mask(heads, n_heads, z.shape[0], z.device)
                return torch.where(mask[:, None, :, None], fill, z)

            out = [(hook_name(layer, role), replace)]
        return _after_first(out) if self.positions == "after-first" else out


@dataclass(frozen=True, eq=False)
class GatedRemoval:
    """Remove a gated rank-one component from every head's value aggregate (XSA and its controls), on hook_z:

        z'_t = y_t - g (y_t . u_t / |u_t|^2) u_t,   i.e. ``ComponentScale("value")`` with s_par = 1 - g along u_t.

    ``directions=None``: u_t = v_t, the head's own value at t (self-attention removal, XSA); a tensor
    ``[layer, head_index, d_head]``: a fixed direction per layer and head (the random-direction control).
    ``alpha=None``: g = 1 (fixed removal); a tensor ``[layer, head_index]``: g = tanh(alpha), learnable
    (``alpha = 0`` gives g = 0, and the edited forward equals the unedited one bit for bit), or with
    ``bound="sigmoid"`` g = sigmoid(alpha) in [0, 1]. Rows of the tensors are indexed by layer number; every
    softmax-attention layer is edited. Not defined for gated attention.
    """

    alpha: Float[Tensor, "layer head_index"] | None = None
    directions: Float[Tensor, "layer head_index d_head"] | None = None
    eps: float = geometry.EPS
    bound: GateBound = "tanh"
    layers: None = None  # every softmax-attention layer

    def __post_init__(self) -> None:
        check_choice("gate bound", self.bound, GateBound)

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers = _training_layers(info, "GatedRemoval")
        for name, t in (("alpha", self.alpha), ("directions", self.directions)):
            want = (info.n_layers, info.n_heads) + ((info.d_head,) if name == "directions" else ())
            if t is not None and tuple(t.shape) != want:
                raise LensParallelError(f"GatedRemoval.{name} must have shape {want}, got {tuple(t.shape)}")
        out: list[Hook] = []
        for layer in layers:
            state: dict[str, Tensor] = {}
            if self.directions is None:
                out.append((hook_name(layer, "v"), partial(_store, state=state, key="v")))
            out.append((hook_name(layer, "z"), partial(self._edit_z, state=state, layer=layer, n_heads=info.n_heads)))
        return out

    def _edit_z(
        self,
        z: Float[Tensor, "batch pos head_index d_head"],
        hook: HookPoint,
        *,
        state: dict[str, Tensor],
        layer: int,
        n_heads: int,
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        d = self.directions
        u = expand_kv(state.pop("v"), n_heads) if d is None else d[layer].to(z).expand_as(z)
        if self.alpha is None:
            g = torch.ones((), dtype=z.dtype, device=z.device)
        else:
            g = (torch.tanh if self.bound == "tanh" else torch.sigmoid)(self.alpha[layer])
        s_par = (1 - g).to(z).expand(z.shape[:-1])
        return z + geometry.scale_delta(z, u, s_par=s_par, eps=self.eps)


@dataclass(frozen=True, eq=False)
class LearnedGate:
    """Value-space parallel scaling with a learned per-token scale (the gating control):

        z'_t = y_t + (s_t - 1) y_par,   s_t = sigmoid(w_h . x_t + b_h),   y_par = projection of y_t on v_t,

    with x_t the block's residual input (hook_resid_pre) and one (w_h, b_h) per layer and query head:
    ``weight [layer, head_index, d_model]``, ``bias [layer, head_index]``. Every softmax-attention layer is edited.
    """

    weight: Float[Tensor, "layer head_index d_model"]
    bias: Float[Tensor, "layer head_index"]
    eps: float = geometry.EPS
    layers: None = None  # every softmax-attention layer

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers = _training_layers(info, "LearnedGate")
        want_weight, want_bias = (info.n_layers, info.n_heads, info.d_model), (info.n_layers, info.n_heads)
        if tuple(self.weight.shape) != want_weight or tuple(self.bias.shape) != want_bias:
            raise LensParallelError(
                f"LearnedGate needs weight {want_weight} and bias {want_bias}, "
                f"got {tuple(self.weight.shape)} and {tuple(self.bias.shape)}"
            )
        out: list[Hook] = []
        for layer in layers:
            state: dict[str, Tensor] = {}
            edit = partial(self._edit_z, state=state, layer=layer, n_heads=info.n_heads)
            out += [
                (hook_name(layer, "resid_pre"), partial(_store, state=state, key="x")),
                (hook_name(layer, "v"), partial(_store, state=state, key="v")),
                (hook_name(layer, "z"), edit),
            ]
        return out

    def scale(self, x: Float[Tensor, "batch pos d_model"], layer: int) -> Float[Tensor, "batch pos head_index"]:
        """s_t = sigmoid(w_h . x_t + b_h) for every head of ``layer``."""
        w, b = self.weight[layer].to(x), self.bias[layer].to(x)
        return torch.sigmoid(einops.einsum(x, w, "b p m, h m -> b p h") + b)

    def _edit_z(
        self,
        z: Float[Tensor, "batch pos head_index d_head"],
        hook: HookPoint,
        *,
        state: dict[str, Tensor],
        layer: int,
        n_heads: int,
    ) -> Float[Tensor, "batch pos head_index d_head"]:
        v = expand_kv(state.pop("v"), n_heads)
        return z + geometry.scale_delta(z, v, s_par=self.scale(state.pop("x"), layer), eps=self.eps)


def _training_layers(info: ModelInfo, what: str) -> tuple[int, ...]:
    check_not_gated(info, what)
    return softmax_layers(info, None, what=what)[0]


@dataclass(frozen=True)
class ZeroDiagonal:
    """Hard diagonal removal (the directional-decomposition paper's comparison edit): every head's attention to
    its own token is set to 0 and each row renormalised over the other positions,
    A'_tt = 0, A'_ts = A_ts / (1 - A_tt) (:func:`lens_parallel.geometry.zero_diagonal`), on ``hook_pattern``.
    Query position 0 is kept (its row has no other position); a row with 1 - A_tt < ``eps`` is left unchanged and
    counted in :attr:`unchanged_rows` (summed over the forwards run since the edit was made). ``layers``: default
    every softmax-attention layer (as the authors ran it); ``heads``: default every head. No matched no-op: it is
    compared with the unedited model. Not to be confused with :class:`DiagonalEdit` (a scaling of A_tt)."""

    layers: int | Sequence[int] | None = None
    heads: Heads = None
    eps: float = 1e-6
    counts: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"unchanged_rows": 0}, compare=False, repr=False, metadata={"provenance": False}
    )

    def __post_init__(self) -> None:
        check_finite("eps", self.eps)
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", _as_heads(self.heads))

    @property
    def unchanged_rows(self) -> int:
        """Rows (query positions > 0, over batch, heads and forwards) left unchanged because 1 - A_tt < eps."""
        return self.counts["unchanged_rows"]

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers, _ = softmax_layers(info, self.layers, what="ZeroDiagonal")
        heads = check_indices("heads", None if self.heads == "all" else self.heads, info.n_heads)
        return [(hook_name(layer, "pattern"), partial(self._edit_pattern, heads=heads)) for layer in layers]

    def _edit_pattern(
        self, pattern: Float[Tensor, "batch head_index query_pos key_pos"], hook: HookPoint, *, heads: HeadSet
    ) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        edited, unchanged = geometry.zero_diagonal(pattern, eps=self.eps)
        mask = _head_mask(heads, pattern.shape[1], pattern.shape[0], pattern.device)
        self.counts["unchanged_rows"] += int((unchanged & mask[:, :, None]).sum())
        return torch.where(mask[:, :, None, None], edited, pattern)


@dataclass(frozen=True)
class RandomDirectionRemoval:
    """The frozen-model random-direction control of value-parallel removal: the same rank-one removal from each
    head's output ``hook_z``, along a fixed random unit direction u per layer and head instead of the head's own
    value, z' = z - (z . u) u (:func:`lens_parallel.geometry.direction_removal`). Layer l's directions come from
    ``seed + l`` (:func:`lens_parallel.geometry.random_unit_directions`). ``norm_matched=True``: the removed vector
    along u has, position by position, the norm the own-direction removal ``ComponentScale("value", s_par=0)`` would
    remove, |z . v_t| / |v_t| (sign that of z . u), so "own direction vs arbitrary direction" compares directions
    at equal size. ``layers`` / ``heads``: default every softmax-attention layer / head. Not defined for gated
    attention (use ``ComponentScale``)."""

    seed: int = 0
    norm_matched: bool = False
    layers: int | Sequence[int] | None = None
    heads: Heads = None
    eps: float = geometry.EPS

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise LensParallelError(f"seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "layers", as_indices(self.layers))
        object.__setattr__(self, "heads", _as_heads(self.heads))

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
                out.append((hook_name(layer, "v"), partial(_store, state=state, key="v")))
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
        mask = _head_mask(heads, z.shape[2], z.shape[0], z.device)
        return torch.where(mask[:, None, :, None], z - removed, z)


@runtime_checkable
class Edit(Protocol):
    """An intervention, built-in or user-defined: frozen data (a frozen dataclass, so that it can be hashed into a
    store, sent to workers and described in provenance) with ``hooks(model, info)`` returning its forward hooks
    (checking its settings against the model first, before any forward). Optionally ``noop()``: its matched no-op
    (the same hooks with every scale at 1); an edit without one is compared with the unedited model. Optionally
    ``layers``: the layers it edits (None: every layer), which lets the engine resume a job at the first of them;
    an edit that does not say runs from layer 0."""

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]: ...


_BLOCK_HOOK = re.compile(r"^blocks\.(\d+)\.")


@dataclass(frozen=True)
class SkipFirstLayers:
    """Any edit (built-in or user-defined) with layers 0 .. ``n`` - 1 left alone: its hooks on those blocks are
    dropped, so they never fire and those layers compute exactly what the unedited model does. The
    directional-decomposition paper edits every layer but the first (its code's ``xsa_skip_first_n = 1``). Not to
    be confused with ``positions="after-first"``, which leaves token position 0 alone in every edited layer.

    ``layers`` (what the engine resumes from) is the wrapped edit's, less the skipped ones; the matched no-op wraps
    the wrapped edit's own (``noop`` is None when it has none: it is then compared with the unedited model)."""

    edit: Edit
    n: int = 1

    def __post_init__(self) -> None:
        as_edits(self.edit)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise LensParallelError(f"SkipFirstLayers n must be a positive integer (layers to skip), got {self.n!r}")

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The wrapped edit's layers at or after ``n`` (None: every layer from ``n``; no attribute if it has none)."""
        missing = object()
        inner = getattr(self.edit, "layers", missing)
        if inner is missing:  # hasattr(self, "layers") is then False, as for the wrapped edit
            raise AttributeError(f"{type(self.edit).__name__} does not say which layers it edits")
        return None if inner is None else tuple(layer for layer in cast(tuple[int, ...], inner) if layer >= self.n)

    @property
    def noop(self) -> Callable[[], SkipFirstLayers] | None:
        make = getattr(self.edit, "noop", None)
        return None if not callable(make) else partial(SkipFirstLayers, make(), self.n)

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        if self.n >= info.n_layers:
            raise LensParallelError(f"SkipFirstLayers(n={self.n}) leaves no layer of this {info.n_layers}-layer model")
        out = []
        for name, fn in self.edit.hooks(model, info):
            block = _BLOCK_HOOK.match(name)
            if block is None or int(block.group(1)) >= self.n:
                out.append((name, fn))
        if not out:
            raise LensParallelError(f"{type(self.edit).__name__} edits only layers before {self.n}: nothing is left")
        return out


BUILT_IN_EDITS = (
    ComponentScale,
    DiagonalEdit,
    ZeroDiagonal,
    RandomDirectionRemoval,
    HeadEdit,
    GatedRemoval,
    LearnedGate,
    SkipFirstLayers,
)


def as_edits(edits: object) -> tuple[Edit, ...]:
    """One edit or a sequence of edits (one combined intervention, applied in order) as a tuple, each checked to
    follow the :class:`Edit` protocol."""
    if isinstance(edits, Edit):
        found: tuple[object, ...] = (edits,)
    elif isinstance(edits, (list, tuple)):
        found = tuple(edits)
    else:
        found = (edits,)
    bad = [e for e in found if not isinstance(e, Edit)]
    if bad:
        raise LensParallelError(
            "an edit has a hooks(model, info) method (the Edit protocol: the built-in "
            f"{', '.join(t.__name__ for t in BUILT_IN_EDITS)}, or your own frozen dataclass); "
            f"got {type(bad[0]).__name__}"
        )
    return found  # type: ignore[return-value]


def describe_edit(edit: Edit) -> dict[str, Any]:
    """A plain-data description of an edit for provenance: its type and fields (a dataclass; otherwise its repr);
    a tensor field is given by its shape (``{"tensor": [...]}``), since its values live in the run that made it."""
    out: dict[str, Any] = {"type": f"{type(edit).__module__}.{type(edit).__qualname__}"}
    if not dataclasses.is_dataclass(edit):
        return out | {"repr": repr(edit)}
    for f in dataclasses.fields(edit):
        if not f.metadata.get("provenance", True):
            continue  # run state (a counter), not a setting
        value = getattr(edit, f.name)
        if isinstance(value, Tensor):
            value = {"tensor": list(value.shape)}
        elif isinstance(value, Edit):  # a wrapped edit (SkipFirstLayers)
            value = describe_edit(value)
        out[f.name] = value
    return out


def _store(tensor: Tensor, hook: HookPoint, *, state: dict[str, Tensor], key: str) -> None:
    state[key] = tensor


HeadSet = tuple[int, ...] | Bool[Tensor, "batch head_index"]
"""The heads an edit acts on: the same query heads in every batch row, or one set per row (a bool mask)."""


def _head_mask(
    heads: HeadSet | None, n_heads: int, batch: int, device: torch.device
) -> Bool[Tensor, "batch head_index"]:
    """The heads as a mask ``[batch, head_index]`` (None: every head)."""
    if heads is None:
        return torch.ones(batch, n_heads, dtype=torch.bool, device=device)
    if isinstance(heads, Tensor):
        if heads.shape != (batch, n_heads):
            raise LensParallelError(
                f"a per-row head mask must have shape ({batch}, {n_heads}), got {tuple(heads.shape)}"
            )
        return heads.to(device)
    mask = torch.zeros(batch, n_heads, dtype=torch.bool, device=device)
    mask[:, list(heads)] = True
    return mask


def _scaling(edit: _Scaling) -> dict[str, Any]:
    """The keywords of :func:`~lens_parallel.geometry.scale_delta` a scaling passes: its scales, eps and guard."""
    return {"s_par": edit.s_par, "s_perp": edit.s_perp, "eps": edit.eps, "clamp": edit.guard == "clamp"}


def _value_hooks(
    edit: _Scaling,
    model: TransformerBridge,
    info: ModelInfo,
    layer: int,
    heads: HeadSet | None,
    state: dict[str, Tensor],
) -> list[Hook]:
    """Value-space scaling on hook_z. Gated attention (z = sigmoid(gate) * A v): the scaling acts on the pre-gate
    aggregate o = A v, rebuilt from the pattern, and its change passes through the gate: z' = z + gate * delta.
    ``value-merged``: one projection of the heads' concatenation on the values' (every head edited). ``site=
    "post-gate"``: the message is z itself (exclude-self: z minus the gated self term)."""
    post = edit.site == "post-gate"
    if post and not info.gated_attention:
        raise LensParallelError(
            f"site='post-gate': {info.name}'s attention has no output gate (pre- and post-gate are one there)"
        )

    def edit_z(z: Tensor, hook: HookPoint) -> Tensor:
        v = expand_kv(state.pop("v"), info.n_heads)
        gate = None
        if info.gated_attention:
            gate = torch.sigmoid(einops.rearrange(state.pop("gate"), "b p (h d) -> b p h d", h=info.n_heads))
        o = z if post or not info.gated_attention else geometry.value_aggregate(state.pop("pattern"), v)
        if edit.space == "value-merged":
            merged = geometry.scale_delta(geometry.merge_heads(o), geometry.merge_heads(v), **_scaling(edit))
            delta = geometry.split_heads(merged, info.n_heads)
        else:
            m = o
            if edit.space == "value-exclude-self":
                self_term, m = geometry.split_self(o, v, state.pop("diag"))  # A_tt v_t, o - A_tt v_t
                if post:
                    assert gate is not None  # post-gate is refused above without a gate
                    m = o - gate * self_term  # z minus the gated self term
            delta = geometry.scale_delta(m, v, **_scaling(edit))
        if gate is not None and not post:
            delta = gate * delta
        mask = _head_mask(heads, info.n_heads, z.shape[0], z.device)
        return torch.where(mask[:, None, :, None], z + delta, z)

    out = [(hook_name(layer, "v"), partial(_store, state=state, key="v"))]
    if info.gated_attention:
        out.append((hook_name(layer, "q_gate"), partial(_store, state=state, key="gate")))
        if not post:
            out.append((hook_name(layer, "pattern"), partial(_store, state=state, key="pattern")))
    if edit.space == "value-exclude-self":
        out.append((hook_name(layer, "pattern"), partial(_store_diag, state=state)))
    return [*out, (hook_name(layer, "z"), edit_z)]


def _store_diag(pattern: Tensor, hook: HookPoint, *, state: dict[str, Tensor]) -> None:
    state["diag"] = torch.diagonal(pattern, dim1=-2, dim2=-1)


def _residual_attn_hooks(
    edit: _Scaling,
    model: TransformerBridge,
    info: ModelInfo,
    layer: int,
    heads: HeadSet | None,
    state: dict[str, Tensor],
) -> list[Hook]:
    W_O = output_weights(model, layer)

    def edit_out(out: Tensor, hook: HookPoint) -> Tensor:
        x = state.pop("x")
        if heads is None:
            return geometry.scale_components(out, x, **_scaling(edit))
        mask = _head_mask(heads, info.n_heads, out.shape[0], out.device)
        used = mask.any(0).nonzero().flatten().tolist()  # heads some row edits: per-head writes only for these
        m = einops.einsum(state.pop("z")[:, :, used], W_O[used].to(out), "b p h d, h d m -> b p h m")
        x_h = einops.repeat(x, "b p m -> b p h m", h=len(used))
        delta = geometry.scale_delta(m, x_h, **_scaling(edit))
        return out + (delta * mask[:, None, used, None]).sum(2)

    out = [(hook_name(layer, "resid_pre"), partial(_store, state=state, key="x"))]
    if heads is not None:
        out.append((hook_name(layer, "z"), partial(_store, state=state, key="z")))
    return [*out, (hook_name(layer, "attn_out"), edit_out)]


def _residual_mlp_hooks(
    edit: _Scaling,
    model: TransformerBridge,
    info: ModelInfo,
    layer: int,
    heads: HeadSet | None,
    state: dict[str, Tensor],
) -> list[Hook]:
    def edit_out(out: Tensor, hook: HookPoint) -> Tensor:
        return geometry.scale_components(out, state.pop("x"), **_scaling(edit))

    ref = hook_name(layer, residual_reference_role(info, "mlp"))
    return [(ref, partial(_store, state=state, key="x")), (hook_name(layer, "mlp_out"), edit_out)]


def _residual_block_hooks(
    edit: _Scaling,
    model: TransformerBridge,
    info: ModelInfo,
    layer: int,
    heads: HeadSet | None,
    state: dict[str, Tensor],
) -> list[Hook]:
    def edit_post(post: Tensor, hook: HookPoint) -> Tensor:
        x = state.pop("x")
        return post + geometry.scale_delta(post - x, x, **_scaling(edit))

    return [
        (hook_name(layer, "resid_pre"), partial(_store, state=state, key="x")),
        (hook_name(layer, "resid_post"), edit_post),
    ]


_SCALE_BUILDERS = {
    "value": _value_hooks,
    "value-exclude-self": _value_hooks,
    "value-merged": _value_hooks,
    "residual-attn": _residual_attn_hooks,
    "residual-mlp": _residual_mlp_hooks,
    "residual-block": _residual_block_hooks,
}


def compile_hooks(model: TransformerBridge, edits: Edit | Sequence[Edit]) -> list[Hook]:
    """Validate every edit against the model (before any forward) and return their hooks, in order."""
    info = model_info(model)
    return [hook for edit in as_edits(edits) for hook in edit.hooks(model, info)]


def noop(edits: Edit | Sequence[Edit]) -> tuple[Edit, ...]:
    """The matched no-op: each edit's own ``noop()`` (the same hooks with every scale at 1: ``ComponentScale``,
    ``DiagonalEdit``, or a user-defined edit that defines one); edits without one (``HeadEdit``, ``GatedRemoval``,
    ``LearnedGate``) have no single scale: their no-op is the unedited model, so they are dropped."""
    found = (getattr(e, "noop", None) for e in as_edits(edits))
    return tuple(make() for make in found if callable(make))


@contextlib.contextmanager
def apply_edits(model: TransformerBridge, edits: Edit | Sequence[Edit]) -> Iterator[TransformerBridge]:
    """``with apply_edits(model, edits): model(tokens)`` runs the edited model; hooks are removed on exit."""
    hooks = compile_hooks(model, edits)
    with model.hooks(fwd_hooks=hooks):
        yield model
