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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from lens_parallel import geometry
from lens_parallel.choices import HeadSpace, Space
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import expand_kv, residual_reference_role
from lens_parallel.layers import BLOCK_HOOKS
from lens_parallel.models import ModelInfo

Level = Literal["head", "sublayer"]
"""A space's unit: one query head, or a whole sublayer update (one per layer)."""
Family = Literal["value", "residual"]
"""Where a space's message lives: a head's value aggregate (hook_z), or an update of the residual stream."""


@dataclass(frozen=True)
class SpaceSpec:
    """One space: what it splits, where it is read and which levels it has.

    Attributes:
        name: the space's name (:data:`~lens_parallel.choices.Space`).
        message, reference: m and r in words (help texts, the spaces' table in docs/guides/decompositions.md).
        family: ``value`` (read from the heads: m from hook_z or the pre-gate A v, r = v_t) or ``residual``.
        level: the space's own unit: ``head`` (value, value-exclude-self) or ``sublayer`` (one unit per layer).
        per_head: whether it also has a head level (the value spaces; residual-attn's per-head writes z_h W_O[h], on a
            linear-attention layer u_h W_out[h]).
        sublayer: the sublayer whose output an edit of this space changes (``attn``: hook_z or hook_attn_out;
            ``mlp``: hook_mlp_out; ``block``: hook_resid_post).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SPACES["value"].reference
        'v_t'
    """

    name: Space
    message: str
    reference: str
    family: Family
    level: Level
    per_head: bool
    sublayer: Literal["attn", "mlp", "block"]

    @property
    def value(self) -> bool:
        """Whether this is a value space (the gate site applies; gated models read the pre-gate aggregate)."""
        return self.family == "value"

    def roles(self, info: ModelInfo, layer: int, *, heads: bool = False) -> tuple[str, ...]:
        """The activation roles (:data:`lens_parallel.hooks.ROLE_HOOKS`) this space's (m, r) are formed from at
        ``layer``, as its :class:`~lens_parallel.layers.LayerKind` has them; ``heads``: also what its per-head level
        needs (residual-attn: what one head's write is formed from). A mixer without heads has no value spaces, and
        its residual-attn update is resid_mid - resid_pre."""
        kind = info.kind(layer)
        if self.value:
            return kind.value_roles(info, diagonal=self.name == "value-exclude-self")
        if self.name == "residual-attn":
            if not kind.update_role:
                return ("resid_pre", "resid_mid")
            return ("resid_pre", *(kind.head_roles if heads else ()), kind.update_role)
        if self.name == "residual-mlp":
            return (residual_reference_role(info, "mlp"), "mlp_out")
        return ("resid_pre", "resid_post")

    @property
    def edit_needs(self) -> str:
        """What an edit of this space needs of a layer, in words (:meth:`editable_at`)."""
        if self.value:
            return "heads (softmax or linear attention)"
        what = {"attn": "an attention output hook (softmax or linear attention)", "mlp": "an MLP output hook"}
        return what.get(self.sublayer, "hook_resid_pre and hook_resid_post")

    def editable_at(self, info: ModelInfo, layer: int) -> bool:
        """Whether an edit of this space can act at ``layer``: where the space is :meth:`defined_at` and its message
        is a hook an edit rewrites (a mixer's residual-attn update, resid_mid - resid_pre, is measured only)."""
        kind = info.kind(layer)
        if self.name == "residual-attn" and not kind.update_role:
            return False
        return self.defined_at(info, layer)

    def undefined_reason(self, info: ModelInfo, layers: Sequence[int]) -> str:
        """Why this space is not :meth:`defined_at` ``layers``: their kinds have no heads, or their blocks hook no
        such update."""
        kinds = ", ".join(sorted({info.kind(layer).title for layer in layers}))
        if self.value:
            return f"the value spaces need heads, and these layers are {kinds}"
        missing = sorted({r for layer in layers for r in self.roles(info, layer) if not info.has_block_role(layer, r)})
        return f"their blocks ({kinds}) have no {', '.join('hook_' + r for r in missing)}"

    def defined_at(self, info: ModelInfo, layer: int) -> bool:
        """Whether this space exists at ``layer``: the value spaces on layers with heads; residual-attn on a mixer
        where its block has resid_mid (a sequential block); residual-mlp where the block has an MLP output; the
        whole block everywhere."""
        if self.value:
            return info.kind(layer).heads
        return all(info.has_block_role(layer, role) for role in self.roles(info, layer) if role in BLOCK_HOOKS)


def _value(name: Space, message: str, reference: str, *, level: Level) -> SpaceSpec:
    return SpaceSpec(name, message, reference, "value", level, level == "head", "attn")


def _residual(name: Space, message: str, reference: str, *, sublayer: Literal["attn", "mlp", "block"]) -> SpaceSpec:
    return SpaceSpec(name, message, reference, "residual", "sublayer", sublayer == "attn", sublayer)


SPACES: Mapping[str, SpaceSpec] = {
    spec.name: spec
    for spec in (
        _value("value", "o_t = sum_s A_ts v_s (hook_z)", "v_t", level="head"),
        _value("value-exclude-self", "c_t = o_t - A_tt v_t", "v_t", level="head"),
        _value("value-merged", "concat_h o_t^h", "concat_h v_t^h", level="sublayer"),
        _residual("residual-attn", "hook_attn_out (per head: z_h W_O[h])", "resid_pre", sublayer="attn"),
        _residual(
            "residual-mlp", "hook_mlp_out", "resid_mid (resid_pre when attention and MLP are parallel)", sublayer="mlp"
        ),
        _residual("residual-block", "resid_post - resid_pre", "resid_pre", sublayer="block"),
    )
}
"""Every space, in the order of :data:`lens_parallel.choices.Space`."""

SPACE_NAMES: tuple[Space, ...] = tuple(s.name for s in SPACES.values())
"""Every space's name."""
HEAD_SPACES = cast(tuple[HeadSpace, ...], tuple(s.name for s in SPACES.values() if s.per_head))
"""Spaces with a per-head level (:data:`~lens_parallel.choices.HeadSpace`): scalings and diagonal views per head."""


@dataclass(frozen=True)
class ValueParts:
    """A layer's value-space quantities, per query head (``v`` expanded under GQA; on a linear-attention layer per
    value head, a_tt as ``diag``):

    - ``o``: the value aggregate sum_s A_ts v_s (hook_z; the pre-gate A v under gated attention) ``[batch pos
      head_index d_head]``;
    - ``v``: the values ``[batch pos head_index d_head]``;
    - ``diag``: A_tt ``[batch head_index pos]`` (None when not captured);
    - ``gate``: sigmoid(gate) ``[batch pos head_index d_head]`` under gated attention when captured, else None.
    """

    o: Float[Tensor, "batch pos head_index d_head"]
    v: Float[Tensor, "batch pos head_index d_head"]
    diag: Float[Tensor, "batch head_index pos"] | None
    gate: Float[Tensor, "batch pos head_index d_head"] | None

    def exclude_self(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """c_t = o_t - A_tt v_t (needs ``diag``)."""
        if self.diag is None:
            raise LensParallelError("exclude-self needs A_tt: capture the kind's value_roles(info, diagonal=True)")
        return geometry.split_self(self.o, self.v, self.diag)[1]

    def message(self, space: str) -> Float[Tensor, "batch pos head_index d_head"]:
        """The per-head message m of a head-level value space (value: o; value-exclude-self: c)."""
        return self.exclude_self() if space == "value-exclude-self" else self.o


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
        return ValueParts(o=captured["lin_o"], v=captured["lin_v"], diag=diag, gate=None)
    v = expand_kv(captured["v"], info.n_heads)
    gate: Tensor | None = None
    o = captured["z"]
    if info.gate_role in captured:
        gate = torch.sigmoid(einops.rearrange(captured[info.gate_role], "b p (h d) -> b p h d", h=info.n_heads))
        o = o / gate
    return ValueParts(o=o, v=v, diag=captured.get("pattern_diag"), gate=gate)


def residual_message(
    space: str, captured: Mapping[str, Tensor], info: ModelInfo
) -> tuple[Float[Tensor, "batch pos d_model"], Float[Tensor, "batch pos d_model"]]:
    """(m, x) of a residual space at one layer: the sublayer's update and the residual state it is added to."""
    if space == "residual-attn":  # a linear-attention layer's update: its hook_out; a mixer's: resid_mid - resid_pre
        update = next((captured[role] for role in ("attn_out", "lin_out") if role in captured), None)
        if update is None:
            update = captured["resid_mid"] - captured["resid_pre"]
        return update, captured["resid_pre"]
    if space == "residual-mlp":
        return captured["mlp_out"], captured[residual_reference_role(info, "mlp")]
    return captured["resid_post"] - captured["resid_pre"], captured["resid_pre"]
