"""Layer kinds: what a layer's token mixer is, as far as the analyses are concerned, each defined once here.

A layer's kind is read from what TransformerLens's bridge exposes at that layer (:func:`layer_kind`), never from an
architecture's name:

=========  ===================================================  =========================  =====================
kind       the layer's token mixer                               heads (units of analysis)  spaces
=========  ===================================================  =========================  =====================
softmax    softmax attention with per-head hooks (``hook_z``,    query heads                every space
           ``hook_v``, ``hook_pattern``)
linear     linear attention, Qwen3.5 / Qwen3-Next's gated delta  value heads                every space
           rule (``linear_attn.hook_recurrence_out``, ...)
mixer      a mixer the bridge does not open into heads: Mamba /  none                       residual-attn (measured
           Mamba-2 and other state-space layers, short                                      as resid_mid -
           convolutions (LFM2), recurrences (RG-LRU), and                                   resid_pre), -mlp,
           attention without per-head hooks                                                 -block
=========  ===================================================  =========================  =====================

Analyses ask a layer's :class:`LayerKind` (``info.kind(layer)``) what it has instead of comparing names: its heads
(:meth:`LayerKind.output_heads`, :meth:`LayerKind.head_counts`), their key groups, the roles its writes and values
are read from, whether it has a softmax pattern, how its ticks are marked; each kind is a class whose methods
answer for it. Adding a kind: its name in :data:`lens_parallel.choices.LayerType`, its class and instance in
:data:`LAYER_KINDS`, and how :func:`layer_kind` recognises it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import einops
import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from lens_parallel import compat, geometry
from lens_parallel.choices import Ablation, LayerType
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import literal_values, named_table

if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge


@runtime_checkable
class ModelShape(Protocol):
    """What a layer kind reads of a model (:class:`~lens_parallel.models.ModelInfo` is one): its name, its query and
    key-value heads, the linear-attention layers' value and key heads, its output gate's role and each layer's kind.
    Here, so that the layer kinds need nothing of the module that detects them."""

    @property
    def name(self) -> str: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def n_linear_heads(self) -> int: ...

    @property
    def n_linear_key_heads(self) -> int: ...

    @property
    def gate_role(self) -> str: ...

    def kind(self, layer: int) -> LayerKind: ...


@dataclass(frozen=True)
class MixingMap:
    """A kind's exact mixing map o_t = sum_s M_ts v_s, as figures and views name and draw it.

    Attributes:
        symbol: the map's symbol (``A``: a softmax pattern; ``M``: the delta rule's mixing weights).
        name: what it is, in a title (``attention pattern``).
        kind: the kind's map in a figure's subtitle (``softmax attention``).
        self_symbol: the self weight's symbol (``A`` in A_tt, ``a`` in a_tt).
        self_title: the self weight's axis title, with its unit.
        signed: whether it may be negative (a colour range symmetric about 0; a softmax pattern lies in [0, 1]).
    """

    symbol: str
    name: str
    kind: str
    self_symbol: str
    self_title: str
    signed: bool

    def bound(self, values: np.ndarray) -> float:
        """The colour range's bound for ``values`` of this map: max |M| where it is signed, else 1."""
        return (float(np.abs(values).max()) or 1.0) if self.signed else 1.0


SOFTMAX_MAP = MixingMap("A", "attention pattern", "softmax attention", "A", "attention to itself (probability)", False)
DELTA_RULE_MAP = MixingMap(
    "M",
    "delta-rule mixing weights M (linear attention)",
    "linear attention: delta-rule mixing weights M, M_tt = a_tt",
    "a",  # a_tt = beta_t (k_t . q_t)
    "self weight a_tt (not a probability)",
    True,
)


@dataclass(frozen=True)
class LayerKind:
    """One layer kind: what the analyses ask of a layer, answered by its class (:class:`SoftmaxAttention`,
    :class:`LinearAttention`, :class:`Mixer`), never by comparing its name. This base class is a layer without heads.

    Attributes:
        name: the kind (:data:`~lens_parallel.choices.LayerType`), as tables' ``layer_type`` column says it.
        title: the kind in words, as errors and notes name a layer of it (``a linear-attention layer``).
        short: its short name in figures (``soft``, ``lin``, ``mix``).
        tick: what a figure adds to a layer's tick label (``L3 lin``); empty for softmax attention.
        unit: what one head is on this kind (``query head``, ``value head``); empty where it has no heads.
        pattern: whether it has a softmax pattern (diagonal views and edits of A, ``mean`` ablations, the post-gate
            site, what is built on hook_pattern).
        mixing_map: its exact mixing map o_t = sum_s M_ts v_s as views and figures draw it (:class:`MixingMap`);
            None on a mixer without heads.
        decodes_with_hooks: whether its hooks fire at a cached decoding step (so an edit there stays exact with the
            key/value cache): TransformerLens's linear-attention bridge hands a cached step to Hugging Face's module,
            where only its hook_in / hook_out fire.
    """

    name: LayerType
    title: str
    short: str
    tick: str
    unit: str
    pattern: bool
    mixing_map: MixingMap | None
    decodes_with_hooks: bool

    @property
    def heads(self) -> bool:
        """Whether the layer has heads the per-head analyses read (the value spaces, head ablations, the nulls)."""
        return bool(self.unit)

    def head_counts(self, info: ModelShape) -> tuple[int, int, int]:
        """(query heads, key heads, value heads) of the layer's mixer; none on a mixer without heads."""
        return 0, 0, 0

    def output_heads(self, info: ModelShape) -> int:
        """The heads whose outputs the layer's mixer projects and sums (one per value or query head); none here."""
        return 0

    def key_group(self, info: ModelShape) -> int:
        """Output heads per key head: head h reads key head h // key_group (1 where there are no heads)."""
        return 1

    @property
    def update_role(self) -> str:
        """The role (:data:`lens_parallel.hooks.ROLE_HOOKS`) holding the mixer's update to the residual; none on a
        mixer, whose update is measured as resid_mid - resid_pre."""
        return ""

    @property
    def head_roles(self) -> tuple[str, ...]:
        """What one head's write to the residual is formed from; nothing on a mixer."""
        return ()

    def value_roles(self, info: ModelShape, *, diagonal: bool = False) -> tuple[str, ...]:
        """The roles the value spaces read at a layer of this kind (:func:`lens_parallel.spaces.value_parts`), with
        what the self weight a_tt is formed from when ``diagonal``; a mixer has none."""
        raise LensParallelError(f"a {self.title} layer has no value spaces (no heads)")

    def key_heads(self, info: ModelShape) -> int:
        """The key (kv) heads: what the GQA analyses group the output heads by."""
        heads = self.output_heads(info)
        return heads // self.key_group(info) if heads else 0

    def _no_heads(self, what: str) -> LensParallelError:
        return LensParallelError(f"a {self.title} layer has no heads, so no {what}")

    def map_roles(self, *, update: bool = False) -> tuple[str, ...]:
        """What a view of the layer's exact mixing map captures (with resid_pre; the layer's update too when
        ``update``, for the layer-level residual view)."""
        raise self._no_heads("mixing map")

    def with_map(self, t: dict[str, Tensor], info: ModelShape) -> dict[str, Tensor]:
        """Captures ``t`` of :meth:`map_roles` with the map as ``pattern_full`` and the values as ``v`` (each per
        output head's own key group), so that every softmax-layer formula applies unchanged."""
        raise self._no_heads("mixing map")

    def output_weights(
        self, model: TransformerBridge, info: ModelShape, layer: int
    ) -> Float[Tensor, "head d_head d_model"]:
        """The output projection per head (a detached copy, materialised where accelerate offloaded it): head h
        writes its input times ``[h]`` to the residual."""
        raise LensParallelError(f"layer {layer} of {info.name} is a {self.title} layer: no heads, so no W_O per head")

    def receiver_roles(self, qk: tuple[str, str]) -> tuple[str, ...]:
        """What the next-layer dominance analysis captures at a receiving layer of this kind (``qk``: the roles of
        the queries and keys attention uses there)."""
        raise self._no_heads("queries, keys and values")

    def zeroed_map(self, pattern: Float[Tensor, "... query_pos key_pos"]) -> Float[Tensor, "... query_pos key_pos"]:
        """The map with the self weights removed, as ZeroDiagonal removes them here."""
        raise self._no_heads("mixing map")

    def other_groups(
        self, t: dict[str, Tensor], info: ModelShape
    ) -> list[Float[Tensor, "batch pos head_index d_head"]]:
        """Per output head, the value of the head at the same place in each other key group (rolled 1, 2, ...
        groups), from captures holding :meth:`value_roles`: the GQA alignment's contrast."""
        raise self._no_heads("key groups")

    @property
    def ablations(self) -> tuple[Ablation, ...]:
        """The head ablations (:class:`lens_parallel.edits.HeadEdit`) defined on the layer's heads; none here."""
        return ()

    @property
    def zero_role(self) -> str:
        """The role whose zeroing removes a head's write (a zero ablation's site); none here."""
        return ""

    def attribution_roles(self, info: ModelShape, *, zero: bool, residual: bool) -> tuple[list[str], list[str]]:
        """What head attribution captures at a layer of this kind (forward) and whose loss gradient it needs
        (backward): for a ``zero`` ablation, for a ``residual`` space or ablation."""
        raise self._no_heads("head attribution")

    def residual_map_refusal(self, layer: int) -> str:
        """Why the layer-level residual-attn view of the layer's map is undefined ("" where it is, or where the
        layer has no map to view: the view's own checks say so)."""
        return ""


@dataclass(frozen=True)
class SoftmaxAttention(LayerKind):
    """Softmax attention with per-head hooks: its heads are query heads, grouped under kv heads."""

    def head_counts(self, info: ModelShape) -> tuple[int, int, int]:
        return info.n_heads, info.n_kv_heads, info.n_kv_heads

    def output_heads(self, info: ModelShape) -> int:
        return info.n_heads

    def key_group(self, info: ModelShape) -> int:
        """Query heads per kv head."""
        return info.n_heads // info.n_kv_heads

    @property
    def update_role(self) -> str:
        """hook_attn_out."""
        return "attn_out"

    @property
    def head_roles(self) -> tuple[str, ...]:
        """hook_z: head h writes z_h W_O[h]."""
        return ("z",)

    def value_roles(self, info: ModelShape, *, diagonal: bool = False) -> tuple[str, ...]:
        """v and hook_z, with the gate input under gated attention (the pre-gate A v is hook_z / sigmoid(gate)) and
        the pattern's diagonal A_tt when ``diagonal``."""
        gate = (info.gate_role,) if info.gate_role else ()
        return ("v", "z", *gate, *(("pattern_diag",) if diagonal else ()))

    def map_roles(self, *, update: bool = False) -> tuple[str, ...]:
        """resid_pre, v and the whole pattern (hook_attn_out too when ``update``)."""
        return ("resid_pre", "v", "pattern_full", *(("attn_out",) if update else ()))

    def with_map(self, t: dict[str, Tensor], info: ModelShape) -> dict[str, Tensor]:
        """The pattern is the map."""
        return t

    def output_weights(
        self, model: TransformerBridge, info: ModelShape, layer: int
    ) -> Float[Tensor, "head d_head d_model"]:
        """The bridge's W_O."""
        attn: Any = model.blocks[layer].attn
        with compat.weights_materialised(attn):
            weights: Tensor = attn.W_O.detach().clone()
        return weights

    def receiver_roles(self, qk: tuple[str, str]) -> tuple[str, ...]:
        """The queries and keys attention uses, the values and the pattern."""
        return (*qk, "v", "pattern_full")

    def zeroed_map(self, pattern: Float[Tensor, "... query_pos key_pos"]) -> Float[Tensor, "... query_pos key_pos"]:
        """A_tt set to 0 and the rest of each row renormalised (:func:`lens_parallel.geometry.zero_diagonal`)."""
        return geometry.zero_diagonal(pattern)[0]

    def other_groups(
        self, t: dict[str, Tensor], info: ModelShape
    ) -> list[Float[Tensor, "batch pos head_index d_head"]]:
        """The kv heads rolled, each expanded to its query heads."""
        v = t["v"]
        return [geometry.expand_kv(torch.roll(v, shifts=s, dims=2), info.n_heads) for s in range(1, v.shape[2])]

    @property
    def ablations(self) -> tuple[Ablation, ...]:
        """Every ablation."""
        return literal_values(Ablation)

    @property
    def zero_role(self) -> str:
        """hook_z."""
        return "z"

    def attribution_roles(self, info: ModelShape, *, zero: bool, residual: bool) -> tuple[list[str], list[str]]:
        """hook_z and the value roles with the pattern's diagonal (resid_pre too for a residual space); the gradient
        at hook_z (and at hook_attn_out for a residual space)."""
        acts = list(dict.fromkeys(["z", *self.value_roles(info, diagonal=True)]))
        return acts + (["resid_pre"] if residual else []), ["z", *(["attn_out"] if residual else [])]


@dataclass(frozen=True)
class LinearAttention(LayerKind):
    """Linear attention (the gated delta rule): its heads are value heads, grouped under query/key heads."""

    def head_counts(self, info: ModelShape) -> tuple[int, int, int]:
        return info.n_linear_key_heads, info.n_linear_key_heads, info.n_linear_heads

    def output_heads(self, info: ModelShape) -> int:
        return info.n_linear_heads

    def key_group(self, info: ModelShape) -> int:
        """Value heads per query/key head."""
        return info.n_linear_heads // info.n_linear_key_heads

    @property
    def update_role(self) -> str:
        """The linear-attention block's hook_out."""
        return "lin_out"

    @property
    def head_roles(self) -> tuple[str, ...]:
        """The delta rule's output and the gate of its gated RMSNorm: head h writes u_h W_out[h]."""
        return ("lin_o", "lin_gate")

    def value_roles(self, info: ModelShape, *, diagonal: bool = False) -> tuple[str, ...]:
        """v and o (hook_recurrence_out), with the queries, keys and beta of the self weight a_tt = beta_t (k_t . q_t)
        when ``diagonal``."""
        return ("lin_v", "lin_o", *(("lin_q", "lin_k", "lin_beta") if diagonal else ()))

    def map_roles(self, *, update: bool = False) -> tuple[str, ...]:
        """resid_pre and everything the mixing weights M are made of (no layer-level residual view here)."""
        return ("resid_pre", "lin_q", "lin_k", "lin_v", "lin_beta", "lin_decay")

    def with_map(self, t: dict[str, Tensor], info: ModelShape) -> dict[str, Tensor]:
        """The mixing weights M (:func:`linear_mixing_weights`) and the value heads."""
        return {**t, "pattern_full": linear_mixing_weights(t, info.n_linear_heads), "v": t["lin_v"]}

    def output_weights(
        self, model: TransformerBridge, info: ModelShape, layer: int
    ) -> Float[Tensor, "head d_head d_model"]:
        """The module's out_proj per value head, ``[head, d_v, d_model]``."""
        module: Any = compat.hf_module(model.blocks[layer].linear_attn)
        with compat.weights_materialised(module):
            flat: Tensor = module.out_proj.weight.detach().clone()
        return einops.rearrange(flat, "d_model (head d_head) -> head d_head d_model", head=info.n_linear_heads)

    def receiver_roles(self, qk: tuple[str, str]) -> tuple[str, ...]:
        """The delta rule's queries, keys and values (its map is not a hook)."""
        return ("lin_q", "lin_k", "lin_v")

    def zeroed_map(self, pattern: Float[Tensor, "... query_pos key_pos"]) -> Float[Tensor, "... query_pos key_pos"]:
        """The self term a_tt v_t removed, nothing renormalised (M is not a distribution)."""
        return pattern - torch.diag_embed(geometry.self_weights(pattern))

    def other_groups(
        self, t: dict[str, Tensor], info: ModelShape
    ) -> list[Float[Tensor, "batch pos head_index d_head"]]:
        """The value heads rolled by whole key groups: v' the value head at the same place in the other group."""
        v, group = t["lin_v"], self.key_group(info)
        return [torch.roll(v, shifts=s * group, dims=2) for s in range(1, v.shape[2] // group)]

    @property
    def ablations(self) -> tuple[Ablation, ...]:
        """zero (the head's gate input: its gated RMSNorm then writes 0), parallel-value and parallel-residual; not
        mean (no per-head hook_z to fill)."""
        return ("zero", "parallel-value", "parallel-residual")

    @property
    def zero_role(self) -> str:
        """The gate input of the gated RMSNorm (hook_gate_input): a zero gate writes 0."""
        return "lin_gate"

    def attribution_roles(self, info: ModelShape, *, zero: bool, residual: bool) -> tuple[list[str], list[str]]:
        """The value roles with the self weight's queries, keys and beta, the gate input where a zero ablation acts
        on it or a head's write is formed (a residual space), resid_pre for a residual space; the gradient at o
        (hook_recurrence_out), at the gate input for ``zero``, at the block's output for a residual space."""
        gate = ["lin_gate"] if zero or residual else []
        acts = [*self.value_roles(info, diagonal=True), *gate, *(["resid_pre"] if residual else [])]
        return acts, ["lin_o", *(["lin_gate"] if zero else []), *(["lin_out"] if residual else [])]

    def residual_map_refusal(self, layer: int) -> str:
        """A head's write passes its gated RMSNorm, not linearly through M."""
        return (
            f"layer {layer} is a linear-attention layer: residual-attn has no diagonal view there (a head's write "
            "passes its gated RMSNorm, not linearly through M); choose value or value-exclude-self"
        )


def linear_mixing_weights(t: dict[str, Tensor], n_heads: int) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """A linear-attention layer's exact mixing weights M (o_t = sum_s M_ts v_s, M_ts = 0 for s > t, M_tt = a_tt),
    per value head, from its captured q, k, beta and log decay: transformers' own chunked gated delta rule run on
    identity values (:func:`lens_parallel.compat.gated_delta_rule`), in float32 as the model runs it."""
    q, k = (geometry.expand_kv(t[role], n_heads).float() for role in ("lin_q", "lin_k"))  # a key head per value head
    batch, pos = q.shape[:2]
    eye = torch.eye(pos, device=q.device).expand(batch, n_heads, pos, pos)
    identity = einops.rearrange(eye, "batch head query key -> batch query head key")
    out = compat.gated_delta_rule(q, k, identity, t["lin_decay"].float(), t["lin_beta"].float())
    return einops.rearrange(out, "batch query head key -> batch head query key").to(t["lin_v"].dtype)


LAYER_KINDS: Mapping[str, LayerKind] = named_table(
    LayerType,
    (
        SoftmaxAttention(
            "softmax",
            "softmax-attention",
            "soft",
            "",
            "query head",
            pattern=True,
            mixing_map=SOFTMAX_MAP,
            decodes_with_hooks=True,
        ),
        LinearAttention(
            "linear",
            "linear-attention",
            "lin",
            "lin",
            "value head",
            pattern=False,
            mixing_map=DELTA_RULE_MAP,
            decodes_with_hooks=False,
        ),
        LayerKind(
            "mixer", "mixer (no heads)", "mix", "mix", "", pattern=False, mixing_map=None, decodes_with_hooks=False
        ),
    ),
)
"""Every layer kind, by its name in :data:`lens_parallel.choices.LayerType`."""

BLOCK_HOOKS: Mapping[str, str] = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}
"""The block-level roles and their hook points (relative to ``blocks.{layer}``): a block may lack some (a parallel
attention/MLP block has no resid_mid; a block holding one mixer and no MLP has neither attn_out nor mlp_out)."""


SOFTMAX_HOOKS = ("attn.hook_z", "attn.hook_v", "attn.hook_pattern")
"""What a softmax-attention layer exposes (relative to ``blocks.{layer}``)."""
LINEAR_HOOKS = ("linear_attn.hook_recurrence_out", "linear_attn.hook_v", "linear_attn.hook_beta")
"""What a linear-attention (gated delta rule) layer exposes."""


def layer_kind(hooks: Collection[str], layer: int) -> LayerType:
    """The kind of ``layer`` from the full names of the hook points a bridge has (``model.hook_dict``)."""

    def has(names: tuple[str, ...]) -> bool:
        return all(f"blocks.{layer}.{name}" in hooks for name in names)

    if has(SOFTMAX_HOOKS):
        return "softmax"
    return "linear" if has(LINEAR_HOOKS) else "mixer"


def block_roles(hooks: Collection[str], layer: int) -> tuple[str, ...]:
    """The block-level roles (:data:`BLOCK_HOOKS`) whose hook points the bridge has at ``layer``."""
    return tuple(role for role, name in BLOCK_HOOKS.items() if f"blocks.{layer}.{name}" in hooks)
