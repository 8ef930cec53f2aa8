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
(:meth:`LayerKind.output_heads`), their key groups, whether it has a softmax pattern, how its ticks are marked.
Adding a kind: its name in :data:`lens_parallel.choices.LayerType`, its :class:`LayerKind` in :data:`LAYER_KINDS`,
and how :func:`layer_kind` recognises it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lens_parallel.choices import LayerType
from lens_parallel.errors import LensParallelError

if TYPE_CHECKING:
    from lens_parallel.models import ModelInfo


@dataclass(frozen=True)
class LayerKind:
    """One layer kind.

    Attributes:
        name: the kind (:data:`~lens_parallel.choices.LayerType`), as tables' ``layer_type`` column says it.
        title: the kind in words, as errors and notes name a layer of it (``a linear-attention layer``).
        short: its short name in figures (``soft``, ``lin``, ``mix``).
        tick: what a figure adds to a layer's tick label (``L3 lin``); empty for softmax attention.
        unit: what one head is on this kind (``query head``, ``value head``); empty where it has no heads.
        pattern: whether it has a softmax pattern (diagonal views and edits of A, ``mean`` ablations, the post-gate
            site, what is built on hook_pattern).
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
    decodes_with_hooks: bool

    @property
    def heads(self) -> bool:
        """Whether the layer has heads the per-head analyses read (the value spaces, head ablations, the nulls)."""
        return bool(self.unit)

    def output_heads(self, info: ModelInfo) -> int:
        """The heads whose outputs the layer's mixer projects and sums: query heads (softmax), value heads (linear),
        none (mixer)."""
        if self.name == "softmax":
            return info.n_heads
        return info.n_linear_heads if self.name == "linear" else 0

    def key_group(self, info: ModelInfo) -> int:
        """Output heads per key head: head h reads key head h // key_group (query heads per kv head on softmax
        attention; value heads per query/key head on linear attention; 1 where there are no heads)."""
        if self.name == "softmax":
            return info.n_heads // info.n_kv_heads
        if self.name == "linear":
            return info.n_linear_heads // info.n_linear_key_heads
        return 1

    @property
    def update_role(self) -> str:
        """The role (:data:`lens_parallel.hooks.ROLE_HOOKS`) holding the mixer's update to the residual: hook_attn_out
        (softmax), the linear-attention block's hook_out (linear); none on a mixer, whose update is measured as
        resid_mid - resid_pre."""
        return {"softmax": "attn_out", "linear": "lin_out"}.get(self.name, "")

    @property
    def head_roles(self) -> tuple[str, ...]:
        """What one head's write to the residual is formed from: hook_z (softmax: z_h W_O[h]); the delta rule's output
        and the gate of its gated RMSNorm (linear: u_h W_out[h]); nothing on a mixer."""
        return {"softmax": ("z",), "linear": ("lin_o", "lin_gate")}.get(self.name, ())

    def value_roles(self, info: ModelInfo, *, diagonal: bool = False) -> tuple[str, ...]:
        """The roles the value spaces read at a layer of this kind (:func:`lens_parallel.spaces.value_parts`): v and
        hook_z, with the gate input under gated attention (the pre-gate A v is hook_z / sigmoid(gate)) and the
        pattern's diagonal A_tt when ``diagonal`` (softmax); v and o (hook_recurrence_out), with the queries, keys
        and beta of the self weight a_tt = beta_t (k_t . q_t) when ``diagonal`` (linear). A mixer has none."""
        if self.name == "softmax":
            gate = (info.gate_role,) if info.gate_role else ()
            return ("v", "z", *gate, *(("pattern_diag",) if diagonal else ()))
        if self.name == "linear":
            return ("lin_v", "lin_o", *(("lin_q", "lin_k", "lin_beta") if diagonal else ()))
        raise LensParallelError(f"a {self.title} layer has no value spaces (no heads)")

    def key_heads(self, info: ModelInfo) -> int:
        """The key (kv) heads: what the GQA analyses group the output heads by."""
        heads = self.output_heads(info)
        return heads // self.key_group(info) if heads else 0


LAYER_KINDS: Mapping[str, LayerKind] = {
    kind.name: kind
    for kind in (
        LayerKind("softmax", "softmax-attention", "soft", "", "query head", pattern=True, decodes_with_hooks=True),
        LayerKind(
            "linear",
            "linear-attention",
            "lin",
            "lin",
            "value head",
            pattern=False,
            decodes_with_hooks=False,
        ),
        LayerKind(
            "mixer",
            "mixer (no heads)",
            "mix",
            "mix",
            "",
            pattern=False,
            decodes_with_hooks=False,
        ),
    )
}
"""Every layer kind, by name."""

BLOCK_HOOKS: Mapping[str, str] = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "resid_post": "hook_resid_post",
}
"""The block-level roles and their hook points (relative to ``blocks.{layer}``): a block may lack some (a parallel
attention/MLP block has no resid_mid; a block holding one mixer and no MLP has neither attn_out nor mlp_out)."""
GATE_HOOKS: Mapping[str, str] = {"q_gate": "attn.hook_q_gate", "attn_gate": "attn.gate.hook_out"}
"""The roles of a sigmoid output gate on softmax attention, z = sigmoid(gate) * A v, and their hook points: a gate
split off the query projection (Qwen3.5, Qwen3-Next: [batch, pos, head * d_head]), or a gate projection of its own
(AFMoE: the same shape)."""
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
