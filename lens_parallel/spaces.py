"""The decomposition spaces: one registry entry per space, read by the edits, every analysis, the explorer and the
report (each ``*_SPACES`` tuple of the package is derived here).

A space names a message m and the reference r it is split against (m_par = (m.r / |r|^2) r, m_perp = m - m_par):

=====================  =========================================  ===========================  ========  =========
space                  message m                                   reference r                  level     per head
=====================  =========================================  ===========================  ========  =========
value                  o_t = sum_s A_ts v_s (hook_z)               v_t (hook_v)                 head      yes
value-exclude-self     c_t = o_t - A_tt v_t                        v_t                          head      yes
value-merged           concat_h o_t^h                              concat_h v_t^h               sublayer  no
residual-attn          hook_attn_out (per head: z_h W_O[h])        x_t = resid_pre              sublayer  yes
residual-mlp           hook_mlp_out                                resid_mid (resid_pre when    sublayer  no
                                                                   attention and MLP are
                                                                   parallel)
residual-block         resid_post - resid_pre                      resid_pre                    sublayer  no
=====================  =========================================  ===========================  ========  =========

Under gated attention (Qwen3.5: hook_z = sigmoid(gate) * A v) the value spaces read the *pre-gate* aggregate
o = A v = hook_z / sigmoid(gate), rebuilt by :func:`value_parts` (the one place that rebuild is written): the gate
is elementwise and positive, so the division is exact to the float's rounding, and no T x T pattern is read.

Every space exists on Qwen3.5's linear-attention (gated delta rule) layers too. There a unit is a value head:
m = o_t (hook_recurrence_out, before the gated RMSNorm), r = v_t (its hook_v), the self weight is
a_tt = beta_t (k_t . q_t) (:func:`lens_parallel.geometry.linear_self_weights`, exact: o_t = ... + a_tt v_t), so
value-exclude-self is o_t - a_tt v_t; residual-attn reads the block's linear-attention output (hook_out) as the
sublayer update, and per head u_h W_out[h] with u_h its gated RMSNorm of (o_h, z_h)
(:func:`lens_parallel.hooks.linear_head_inputs`), the writes summing to that output.

Adding a space: its name in :data:`lens_parallel.choices.Space` (the ``Literal`` the type checker and the CLI read)
and its :class:`SpaceSpec` here; ``tests/test_registries.py`` checks that the two agree.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, cast

import torch
from jaxtyping import Float
from torch import Tensor

from lens_parallel import geometry
from lens_parallel.attention import GATES
from lens_parallel.choices import HeadSpace, Space
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import expand_kv, residual_reference_role
from lens_parallel.layers import BLOCK_HOOKS
from lens_parallel.models import ModelInfo
from lens_parallel.validate import as_tuple, check_choices, literal_values, named_table

Level = Literal["head", "sublayer"]
"""A space's unit: one query head, or a whole sublayer update (one per layer)."""
HeadTensor = Float[Tensor, "batch pos head_index d_head"]
Pattern = Float[Tensor, "batch head_index query_pos key_pos"]


class ResidualFrame(NamedTuple):
    """What a head's residual write m_t = o_t W_O[h] is measured against (the residual-attn space): the residual state
    x_t it is added to, and the layer's W_O."""

    x: Float[Tensor, "batch pos d_model"]
    W_O: Float[Tensor, "head_index d_head d_model"]


@dataclass(frozen=True)
class SpaceSpec:
    """One space: what it splits, where it is read and which levels it has. Each space is an object of its own class
    (value, value-exclude-self, value-merged, residual-attn, residual-mlp, residual-block), whose methods say what
    it reads and how its message, its split and its attention-diagonal form are made; nothing compares a space's
    name.

    Attributes:
        name: the space's name (:data:`~lens_parallel.choices.Space`).
        message, reference: m and r in words (help texts, the spaces' table in docs/guides/decompositions.md).
        level: the space's own unit: ``head`` (value, value-exclude-self) or ``sublayer`` (one unit per layer).
        per_head: whether it also has a head level (the value spaces; residual-attn's per-head writes z_h W_O[h], on a
            linear-attention layer u_h W_out[h]).
        sublayer: the sublayer whose output an edit of this space changes (``attn``: hook_z or hook_attn_out;
            ``mlp``: hook_mlp_out; ``block``: hook_resid_post).
        hook_points: the TransformerLens hook points a user may name for this space (``hook_z`` for ``value``): given
            as a space, such a name is refused pointing here (:func:`check_spaces`).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SPACES["value"].reference
        'v_t'
    """

    name: Space
    message: str
    reference: str
    level: Level
    per_head: bool
    sublayer: Literal["attn", "mlp", "block"]
    hook_points: tuple[str, ...] = ()

    value: ClassVar[bool] = False
    """A value space: read from the heads (m from hook_z or the pre-gate A v, r = v_t); the gate site applies."""
    reads_self_weight: ClassVar[bool] = False
    """Its message leaves out the head's own term A_tt v_t, so it reads each query's own weight A_tt."""
    head_writes: ClassVar[bool] = False
    """Its per-head level is each head's residual write z_h W_O[h], split against the residual state x_t."""

    def roles(self, info: ModelInfo, layer: int, *, heads: bool = False) -> tuple[str, ...]:
        """The activation roles (:data:`lens_parallel.hooks.ROLE_HOOKS`) this space's (m, r) are formed from at
        ``layer``, as its :class:`~lens_parallel.layers.LayerKind` has them; ``heads``: also what its per-head level
        needs (residual-attn: what one head's write is formed from)."""
        raise NotImplementedError

    @property
    def edit_needs(self) -> str:
        """What an edit of this space needs of a layer, in words (:meth:`editable_at`)."""
        return "hook_resid_pre and hook_resid_post"

    def editable_at(self, info: ModelInfo, layer: int) -> bool:
        """Whether an edit of this space can act at ``layer``: where the space is :meth:`defined_at` and its message
        is a hook an edit rewrites."""
        return self.defined_at(info, layer)

    def undefined_reason(self, info: ModelInfo, layers: Sequence[int]) -> str:
        """Why this space is not :meth:`defined_at` ``layers``: their kinds have no heads, or their blocks hook no
        such update."""
        kinds = ", ".join(sorted({info.kind(layer).title for layer in layers}))
        missing = sorted({r for layer in layers for r in self.roles(info, layer) if not info.has_block_role(layer, r)})
        return f"their blocks ({kinds}) have no {', '.join('hook_' + r for r in missing)}"

    def defined_at(self, info: ModelInfo, layer: int) -> bool:
        """Whether this space exists at ``layer``: the block hooks its message and reference are read from are
        there."""
        return all(info.has_block_role(layer, role) for role in self.roles(info, layer) if role in BLOCK_HOOKS)

    def scale_reads(self, info: ModelInfo, *, heads: bool) -> tuple[str, ...]:
        """The roles a scaling of this space at a softmax-attention layer reads before it rewrites
        :meth:`scaled_role` (``heads``: of some heads only)."""
        raise NotImplementedError

    def scaled_role(self) -> str:
        """The role a scaling of this space rewrites at a softmax-attention layer."""
        raise NotImplementedError

    def weight_change(
        self, parts: ValueParts, *, s_par: float, frame: ResidualFrame | None = None, eps: float = geometry.EPS
    ) -> geometry.DiagonalChange:
        """dA_tt that gives scaling this space's parallel part by ``s_par`` as a change of each query's own
        attention weight, from ``parts``: each query's o_t = sum_s A_ts v_s, its v_t (expanded to query heads) and
        A_tt (``frame``: x_t and W_O, for a head's residual write). A head-level space's
        (:data:`~lens_parallel.choices.HeadSpace`)."""
        raise LensParallelError(f"space {self.name!r} has no attention-diagonal form (it has no heads)")

    def pattern_weight_change(
        self,
        pattern: Pattern,
        v: HeadTensor,
        *,
        s_par: float,
        frame: ResidualFrame | None = None,
        eps: float = geometry.EPS,
    ) -> geometry.DiagonalChange:
        """:meth:`weight_change` from the attention pattern: A + diag(dA) (:func:`~lens_parallel.geometry.
        add_self_weights`) is the attention-diagonal form of scaling the parallel part by ``s_par``. ``v``: the
        values at every key position, expanded to query heads; the queries are the last ``query_pos`` keys (all of
        them in a whole-sequence forward; with cached keys, the new ones), and v_t, ``frame``'s x_t are each
        query's own.

        - ``value``: dA_tt = (s_par - 1) (o_t . v_t) / |v_t|^2
        - ``value-exclude-self``: dA_tt = (s_par - 1) (c_t . v_t) / |v_t|^2 with c_t = o_t - A_tt v_t
        - ``residual-attn``: dA_tt = (s_par - 1) (m_t . x_t) / ((W_O v_t) . x_t) with m_t = o_t W_O[h]

        Positions whose denominator is below eps get dA = 0 and ``valid = False``."""
        o = geometry.value_aggregate(pattern, v)
        own = v[:, v.shape[1] - pattern.shape[-2] :]  # each query's own value v_t
        a_self = geometry.self_weights(pattern)
        return self.weight_change(ValueParts(o, own, a_self, None), s_par=s_par, frame=frame, eps=eps)

    def coefficient(
        self, pattern: Pattern, v: HeadTensor, *, frame: ResidualFrame | None = None, eps: float = geometry.EPS
    ) -> Float[Tensor, "batch pos head_index"]:
        """Per-token parallel coefficient of each head's message (``v`` expanded to query heads): value o.v/|v|^2;
        value-exclude-self c.v/|v|^2 with c = o - A_tt v; residual-attn m.x/|x|^2 with m = o W_O[h]. 0 where the
        reference's norm is below eps."""
        raise LensParallelError(f"space {self.name!r} has no per-head coefficient")


@dataclass(frozen=True)
class ValueSpace(SpaceSpec):
    """value: m = o_t = sum_s A_ts v_s per head, r = v_t."""

    value: ClassVar[bool] = True

    def roles(self, info: ModelInfo, layer: int, *, heads: bool = False) -> tuple[str, ...]:
        return info.kind(layer).value_roles(info, diagonal=self.reads_self_weight)

    @property
    def edit_needs(self) -> str:
        return "heads (softmax or linear attention)"

    def undefined_reason(self, info: ModelInfo, layers: Sequence[int]) -> str:
        kinds = ", ".join(sorted({info.kind(layer).title for layer in layers}))
        return f"the value spaces need heads, and these layers are {kinds}"

    def defined_at(self, info: ModelInfo, layer: int) -> bool:
        return info.kind(layer).heads

    def scale_reads(self, info: ModelInfo, *, heads: bool) -> tuple[str, ...]:
        own = ("pattern_diag",) if self.reads_self_weight else ()
        return ("v", *((info.gate_role,) if info.gate_role else ()), *own)

    def scaled_role(self) -> str:
        return "z"

    def units(self, o: HeadTensor, parts: ValueParts, *, gated: bool = False) -> tuple[Tensor, Tensor]:
        """(m, r) per unit ``[batch pos unit d]`` of a layer's value aggregate ``o`` (the pre-gate A v, or
        ``gated``: hook_z itself, the post-gate site) against its values."""
        return o, parts.v

    def head_message(self, parts: ValueParts) -> HeadTensor:
        """Each head's message m from the pre-gate aggregate, the values per key-value head."""
        return parts.o

    def alignment(self, parts: ValueParts, *, eps: float = geometry.EPS) -> geometry.Alignment:
        """The alignment statistics of each unit's message with its reference (:meth:`units`), fields ``[batch pos
        unit]``, with the values read per key-value head (:func:`~lens_parallel.geometry.grouped_products`: never
        repeated per query head)."""
        return geometry.alignment_from_products(
            *geometry.grouped_products(self.head_message(parts), parts.values), eps=eps
        )

    def to_heads(self, delta: Tensor, n_heads: int) -> HeadTensor:
        """A change of :meth:`units`' messages as a change of each head's aggregate."""
        return delta

    def weight_change(
        self, parts: ValueParts, *, s_par: float, frame: ResidualFrame | None = None, eps: float = geometry.EPS
    ) -> geometry.DiagonalChange:
        m, _ = self.units(parts.o, parts)
        return geometry.value_weight_change(m, parts.values, s_par=s_par, eps=eps)

    def coefficient(
        self, pattern: Pattern, v: HeadTensor, *, frame: ResidualFrame | None = None, eps: float = geometry.EPS
    ) -> Float[Tensor, "batch pos head_index"]:
        o = geometry.value_aggregate(pattern, v)
        m, r = self.units(o, ValueParts(o, v, geometry.self_weights(pattern), None))
        return geometry.project(m, r, eps=eps).coef


@dataclass(frozen=True)
class _ExcludeSelfSpace(ValueSpace):
    """value-exclude-self: m = c_t = o_t - A_tt v_t (at the post-gate site, hook_z minus the gated self term)."""

    reads_self_weight: ClassVar[bool] = True

    def units(self, o: HeadTensor, parts: ValueParts, *, gated: bool = False) -> tuple[Tensor, Tensor]:
        return o - parts.self_term(gated=gated), parts.v

    def head_message(self, parts: ValueParts) -> HeadTensor:
        return parts.o - parts.self_term()


@dataclass(frozen=True)
class _MergedSpace(ValueSpace):
    """value-merged: one unit, the heads' concatenation of o_t against that of v_t."""

    def units(self, o: HeadTensor, parts: ValueParts, *, gated: bool = False) -> tuple[Tensor, Tensor]:
        return geometry.merge_heads(o).unsqueeze(2), geometry.merge_heads(parts.v).unsqueeze(2)

    def to_heads(self, delta: Tensor, n_heads: int) -> HeadTensor:
        return geometry.split_heads(delta.squeeze(2), n_heads)

    def alignment(self, parts: ValueParts, *, eps: float = geometry.EPS) -> geometry.Alignment:
        """One unit: the heads' products summed (concat_h o . concat_h v = sum_h o_h . v_h)."""
        products = geometry.grouped_products(parts.o, parts.values)
        return geometry.alignment_from_products(*(p.sum(-1, keepdim=True) for p in products), eps=eps)


@dataclass(frozen=True)
class _ResidualSpace(SpaceSpec):
    """A residual space: a sublayer's update m against the residual state it is added to."""

    def residual_message(
        self, captured: Mapping[str, Tensor], info: ModelInfo
    ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"]]:
        """(m, x) at one layer: the sublayer's update and the residual state it is added to."""
        raise NotImplementedError


@dataclass(frozen=True)
class _AttentionUpdateSpace(_ResidualSpace):
    """residual-attn: the attention sublayer's update against resid_pre; per head, each head's write z_h W_O[h]
    (on a linear-attention layer u_h W_out[h]). A mixer without heads: resid_mid - resid_pre, measured only."""

    head_writes: ClassVar[bool] = True

    def roles(self, info: ModelInfo, layer: int, *, heads: bool = False) -> tuple[str, ...]:
        kind = info.kind(layer)
        if not kind.update_role:
            return ("resid_pre", "resid_mid")
        return ("resid_pre", *(kind.head_roles if heads else ()), kind.update_role)

    @property
    def edit_needs(self) -> str:
        return "an attention output hook (softmax or linear attention)"

    def editable_at(self, info: ModelInfo, layer: int) -> bool:
        return bool(info.kind(layer).update_role) and self.defined_at(info, layer)

    def scale_reads(self, info: ModelInfo, *, heads: bool) -> tuple[str, ...]:
        return ("resid_pre", *(("z",) if heads else ()))

    def scaled_role(self) -> str:
        return "attn_out"

    def residual_message(
        self, captured: Mapping[str, Tensor], info: ModelInfo
    ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"]]:
        # a linear-attention layer's update: its hook_out; a mixer's: resid_mid - resid_pre
        update = next((captured[role] for role in ("attn_out", "lin_out") if role in captured), None)
        if update is None:
            update = captured["resid_mid"] - captured["resid_pre"]
        return update, captured["resid_pre"]

    def weight_change(
        self, parts: ValueParts, *, s_par: float, frame: ResidualFrame | None = None, eps: float = geometry.EPS
    ) -> geometry.DiagonalChange:
        x, W_O = self._frame(frame, "diagonal")
        return geometry.residual_weight_change(parts.o, parts.values, x, W_O, s_par=s_par, eps=eps)

    def coefficient(
        self, pattern: Pattern, v: HeadTensor, *, frame: ResidualFrame | None = None, eps: float = geometry.EPS
    ) -> Float[Tensor, "batch pos head_index"]:
        x, W_O = self._frame(frame, "coefficient")
        return geometry.residual_head_coefficient(geometry.value_aggregate(pattern, v), W_O, x, eps=eps)

    @staticmethod
    def _frame(frame: ResidualFrame | None, what: str) -> ResidualFrame:
        if frame is None:
            raise LensParallelError(f"the residual-attn {what} needs the residual state x and W_O (a ResidualFrame)")
        return frame


@dataclass(frozen=True)
class _MlpUpdateSpace(_ResidualSpace):
    """residual-mlp: hook_mlp_out against resid_mid (resid_pre when attention and MLP are parallel)."""

    def roles(self, info: ModelInfo, layer: int, *, heads: bool = False) -> tuple[str, ...]:
        return (residual_reference_role(info, "mlp"), "mlp_out")

    @property
    def edit_needs(self) -> str:
        return "an MLP output hook"

    def scale_reads(self, info: ModelInfo, *, heads: bool) -> tuple[str, ...]:
        return (residual_reference_role(info, "mlp"),)

    def scaled_role(self) -> str:
        return "mlp_out"

    def residual_message(
        self, captured: Mapping[str, Tensor], info: ModelInfo
    ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"]]:
        return captured["mlp_out"], captured[residual_reference_role(info, "mlp")]


@dataclass(frozen=True)
class _BlockUpdateSpace(_ResidualSpace):
    """residual-block: resid_post - resid_pre against resid_pre."""

    def roles(self, info: ModelInfo, layer: int, *, heads: bool = False) -> tuple[str, ...]:
        return ("resid_pre", "resid_post")

    def scale_reads(self, info: ModelInfo, *, heads: bool) -> tuple[str, ...]:
        return ("resid_pre",)

    def scaled_role(self) -> str:
        return "resid_post"

    def residual_message(
        self, captured: Mapping[str, Tensor], info: ModelInfo
    ) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"]]:
        return captured["resid_post"] - captured["resid_pre"], captured["resid_pre"]


SPACES: Mapping[str, SpaceSpec] = named_table(
    Space,
    (
        ValueSpace(
            "value",
            "o_t = sum_s A_ts v_s (hook_z)",
            "v_t",
            "head",
            True,
            "attn",
            hook_points=("hook_z", "hook_v", "hook_pattern"),
        ),
        _ExcludeSelfSpace("value-exclude-self", "c_t = o_t - A_tt v_t", "v_t", "head", True, "attn"),
        _MergedSpace("value-merged", "concat_h o_t^h", "concat_h v_t^h", "sublayer", False, "attn"),
        _AttentionUpdateSpace(
            "residual-attn",
            "hook_attn_out (per head: z_h W_O[h])",
            "resid_pre",
            "sublayer",
            True,
            "attn",
            hook_points=("hook_attn_out",),
        ),
        _MlpUpdateSpace(
            "residual-mlp",
            "hook_mlp_out",
            "resid_mid (resid_pre when attention and MLP are parallel)",
            "sublayer",
            False,
            "mlp",
            hook_points=("hook_mlp_out",),
        ),
        _BlockUpdateSpace(
            "residual-block",
            "resid_post - resid_pre",
            "resid_pre",
            "sublayer",
            False,
            "block",
            hook_points=("hook_resid_post",),
        ),
    ),
)
"""Every space, by its name in :data:`lens_parallel.choices.Space` (:func:`~lens_parallel.validate.choice_table`)."""

SPACE_NAMES: tuple[Space, ...] = tuple(s.name for s in SPACES.values())
"""Every space's name."""
HEAD_SPACES = cast(tuple[HeadSpace, ...], tuple(s.name for s in SPACES.values() if s.per_head))
"""Spaces with a per-head level (:data:`~lens_parallel.choices.HeadSpace`): scalings and diagonal views per head."""


def check_spaces(values: object, *, choice: object = Space, what: str = "space") -> tuple[Space, ...]:
    """``values`` (a space or several) checked against ``choice`` (:data:`~lens_parallel.choices.Space` or
    :data:`~lens_parallel.choices.HeadSpace`): a TransformerLens hook point given as a space (``hook_z``,
    ``blocks.3.attn.hook_z``) is refused naming its space (:attr:`SpaceSpec.hook_points`), any other unknown value as
    :func:`~lens_parallel.validate.check_choices` refuses it.

    Examples:
        >>> check_spaces(["value", "residual-attn", "value"])
        ('value', 'residual-attn')
    """
    found = as_tuple(values)
    for value in found:
        point = value.rsplit(".", 1)[-1] if isinstance(value, str) else None
        spec = next((spec for spec in SPACES.values() if point in spec.hook_points), None)
        if spec is not None:
            raise LensParallelError(
                f"{what} {value!r} is a TransformerLens hook point, not a space: its space is {spec.name!r} (m = "
                f"{spec.message}, r = {spec.reference}); accepted: {', '.join(literal_values(choice))}"
            )
    return check_choices(what, found, choice)


def value_space(name: str) -> ValueSpace:
    """The value space ``name`` (raises when ``name`` is not one)."""
    spec = SPACES[name]
    if not isinstance(spec, ValueSpace):
        raise LensParallelError(f"space {name!r} is not a value space")
    return spec


def residual_space(name: str) -> _ResidualSpace:
    """The residual space ``name`` (raises when ``name`` is not one)."""
    spec = SPACES[name]
    if not isinstance(spec, _ResidualSpace):
        raise LensParallelError(f"space {name!r} is not a residual space")
    return spec


@dataclass(frozen=True)
class ValueParts:
    """A layer's value-space quantities, per query head, the values per key-value head (query head h reads
    ``values[h // group]``; on a linear-attention layer per value head, a_tt as ``diag``):

    - ``o``: the value aggregate sum_s A_ts v_s (hook_z; the pre-gate A v under gated attention) ``[batch pos
      head_index d_head]``;
    - ``values``: the values ``[batch pos kv_head_index d_head]``, as hook_v holds them (never repeated per head
      for the statistics: :meth:`ValueSpace.alignment`);
    - ``diag``: A_tt ``[batch head_index pos]`` (None when not captured);
    - ``gate``: sigmoid(gate) ``[batch pos head_index d_head]`` under gated attention when captured, else None.
    """

    o: Float[Tensor, "batch pos head_index d_head"]
    values: Float[Tensor, "batch pos kv_head_index d_head"]
    diag: Float[Tensor, "batch head_index pos"] | None
    gate: Float[Tensor, "batch pos head_index d_head"] | None

    @functools.cached_property
    def v(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """The values repeated per query head (what an edit's per-head arithmetic reads)."""
        return expand_kv(self.values, self.o.shape[2])

    def self_term(self, *, gated: bool = False) -> Float[Tensor, "batch pos head_index d_head"]:
        """The head's own term A_tt v_t (needs ``diag``); ``gated``: sigmoid(gate) A_tt v_t, its share of hook_z."""
        if self.diag is None:
            raise LensParallelError("exclude-self needs A_tt: capture the kind's value_roles(info, diagonal=True)")
        own = geometry.split_self(self.o, self.values, self.diag)[0]
        if gated:
            assert self.gate is not None  # the post-gate site is refused without a gate
            return self.gate * own
        return own


def value_parts(captured: Mapping[str, Tensor], info: ModelInfo) -> ValueParts:
    """:class:`ValueParts` from a layer's captured roles (:func:`value_roles`): the one rebuild of the pre-gate
    aggregate A v under gated attention (Qwen3.5, where hook_z = sigmoid(gate) * A v): o = hook_z / sigmoid(gate).
    At a linear-attention layer (``lin_o`` captured): o =
    hook_recurrence_out, v = its hook_v, ``diag`` = a_tt (:func:`lens_parallel.geometry.linear_self_weights`) when
    q, k, beta are captured."""
    if "lin_o" in captured:
        diag = None
        if "lin_beta" in captured:
            diag = geometry.linear_self_weights(captured["lin_q"], captured["lin_k"], captured["lin_beta"])
        return ValueParts(o=captured["lin_o"], values=captured["lin_v"], diag=diag, gate=None)
    gate: Tensor | None = None
    o = captured["z"]
    if info.gate_role in captured:
        gate = torch.sigmoid(GATES[info.gate_role].heads(captured[info.gate_role], info.n_heads))
        o = o / gate
    return ValueParts(o=o, values=captured["v"], diag=captured.get("pattern_diag"), gate=gate)
