"""Model features: what an architecture brings that the analyses must get right, each defined once.

A :class:`Feature` names one thing (a final soft cap, parallel blocks, post-norms, ...), how it is recognised on a
loaded model (from its Hugging Face config and modules, never its name) and what lens_parallel does with it.
:func:`model_features` lists the features of a model; they are part of :class:`~lens_parallel.ModelInfo` (so every
result's provenance names them), of the support matrix and of the models guide (``docs/guides/architectures.md``),
which read :func:`all_features`. The features of the attention itself (sliding windows, soft caps, ALiBi, sinks,
query/key norms, output gates) are the attention's own objects (:data:`lens_parallel.attention.FEATURES`), recognised
per layer on its site and listed here as they are there.

Where a feature is handled:

- the attention (:mod:`lens_parallel.attention`): each attention feature, grouped and multi-query heads; where the
  queries and keys come from (rotary of either layout, partial rotary, biases, key multipliers) is the Hugging Face
  module's own forward or the joint-QKV bridge's own steps;
- the unembedding (:func:`lens_parallel.losses.unembedding`): the final soft cap and the logit multipliers;
- the residual spaces: parallel blocks (residual-mlp is read against resid_pre), post-norms (one head's write is no
  term of the update), mixture-of-experts MLPs (residual-mlp is the routed block's output, which the router computes
  from the residual as edited in every forward and decoding step: nothing to do);
- the layer kinds (:mod:`lens_parallel.layers`): linear attention, mixers without heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from lens_parallel.architectures import text_config
from lens_parallel.attention import Feature as AttentionFeature
from lens_parallel.attention import ScoreSpec
from lens_parallel.attention import features as attention_features
from lens_parallel.layers import LAYER_KINDS, LinearAttention

LOGIT_MULTIPLIERS: Mapping[str, str] = {
    "logits_scaling": "divide",
    "logit_scale": "multiply",
    "lm_head_multiplier": "multiply",
    "output_multiplier_scale": "multiply",
}
"""Config fields that scale the logits after the unembedding (Granite's ``logits_scaling`` divides them; Cohere's
``logit_scale`` and Falcon-H1's ``lm_head_multiplier`` multiply them), read by :func:`logit_scale`."""
FINAL_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap")
"""Config fields of a final logit soft cap c (logits = c tanh(logits / c)): Gemma 2's, RecurrentGemma's."""
MULTIPLIERS = (
    "embedding_multiplier",
    "attention_multiplier",
    "residual_multiplier",
    "attention_in_multiplier",
    "attention_out_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
    "key_multiplier",
    *LOGIT_MULTIPLIERS,
)
"""Config fields of scalar multipliers inside the network (Granite's, Falcon-H1's, Cohere's, ...)."""


def _number(config: Any, name: str) -> float | None:
    value = getattr(text_config(config), name, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def logit_scale(config: Any) -> float:
    """The factor the model applies to its logits after the unembedding (:data:`LOGIT_MULTIPLIERS`; 1.0 without)."""
    scale = 1.0
    for name, how in LOGIT_MULTIPLIERS.items():
        value = _number(config, name)
        if value:
            scale = scale / value if how == "divide" else scale * value
    return scale


def final_softcap(config: Any) -> float | None:
    """The final logit soft cap c (:data:`FINAL_SOFTCAPS`), or None."""
    return next((value for name in FINAL_SOFTCAPS if (value := _number(config, name))), None)


@dataclass(frozen=True)
class Model:
    """What features are recognised on: the Hugging Face model, its config, what the bridge's hook points say (the
    layer kinds, parallel blocks, post-norms: :class:`~lens_parallel.ModelInfo`'s) and the score spec of each
    attention layer (:mod:`lens_parallel.attention.spec`)."""

    hf: nn.Module
    config: Any
    n_heads: int
    n_kv_heads: int
    layer_types: tuple[str, ...]
    parallel: bool
    post_norm: bool
    attention: tuple[ScoreSpec, ...]

    def modules_with(self, name: str) -> list[Any]:
        """The values of attribute ``name`` on every submodule that sets it to something other than None."""
        return [value for m in self.hf.modules() if (value := getattr(m, name, None)) is not None]


@dataclass(frozen=True)
class Feature:
    """One feature: its ``name`` (the support matrix's word), what it is (``title``), how it is recognised
    (``present``) and what lens_parallel does with it (``handling``, the models guide's sentence)."""

    name: str
    title: str
    present: Callable[[Model], bool]
    handling: str


def _partial_rotary(m: Model) -> bool:
    config = text_config(m.config)
    rope = getattr(config, "rope_parameters", None) or {}
    fractions = [getattr(config, "partial_rotary_factor", None), getattr(config, "rotary_pct", None)]
    fractions.append(rope.get("partial_rotary_factor") if isinstance(rope, dict) else None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // m.n_heads
    rotary_dim = getattr(config, "rotary_dim", None)
    return any(f is not None and f < 1 for f in fractions) or (rotary_dim is not None and rotary_dim < head_dim)


def _biases(m: Model) -> bool:
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "query_key_value", "c_attn", "qkv_proj", "Wqkv", "dense")
    return any(
        isinstance(layer, nn.Linear) and layer.bias is not None
        for module in m.hf.modules()
        if type(module).__name__.endswith("Attention")
        for name in names
        if (layer := getattr(module, name, None)) is not None
    )


def _experts(m: Model) -> bool:
    config = text_config(m.config)
    counts = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    return any((getattr(config, name, None) or 0) > 1 for name in counts)


def _multipliers(m: Model) -> bool:
    return any((value := _number(m.config, name)) is not None and value != 1.0 for name in MULTIPLIERS)


def _attention(kind: type[AttentionFeature]) -> Feature:
    """An attention feature (:data:`lens_parallel.attention.FEATURES`) as the model has it: on any attention layer's
    spec."""
    return Feature(kind.name, kind.title, lambda m: any(spec.find(kind) for spec in m.attention), kind.handling)


HEADS: tuple[Feature, ...] = (
    Feature(
        "grouped-query",
        "grouped-query attention: several query heads share a kv head",
        lambda m: 1 < m.n_kv_heads < m.n_heads,
        "the statistics group each kv head's query heads against its one value (no copy per query head); the "
        "GQA within/across-group contrast is defined",
    ),
    Feature(
        "multi-query",
        "multi-query attention: every query head shares one kv head",
        lambda m: m.n_kv_heads == 1 < m.n_heads,
        "every query head read against the one value (no copy per query head); the GQA contrast is undefined "
        "(one group) and says so",
    ),
)
"""The heads' grouping."""
BLOCKS: tuple[Feature, ...] = (
    Feature(
        "final-softcap",
        "final logits soft-capped",
        lambda m: final_softcap(m.config) is not None,
        "applied by the chunked unembedding of every loss",
    ),
    Feature(
        "partial-rotary",
        "rotary embedding on part of each head's dimensions",
        _partial_rotary,
        "the queries and keys the module rotates (the route through the module; the joint-QKV bridges' own steps)",
    ),
    Feature(
        "parallel-blocks",
        "attention and MLP read the same residual and add to it together",
        lambda m: m.parallel,
        "residual-mlp's reference is resid_pre; resid_mid does not exist; residual-block is their sum",
    ),
    Feature(
        "multipliers",
        "scalar multipliers of embeddings, attention, residual updates or logits",
        _multipliers,
        "inside the network they are the bridge's own forward (Granite's residual multiplier is inside "
        "hook_attn_out / hook_mlp_out; Falcon-H1's attention-out multiplier comes after hook_attn_out: cosines and "
        "fractions are the update's, the parallel coefficient the sublayer output's); the logit multipliers are "
        "applied by the chunked unembedding of every loss",
    ),
    Feature(
        "position-offset",
        "learned positions read at an offset (OPT: position + 2)",
        lambda m: any(isinstance(x, int) and x > 0 for x in m.modules_with("offset")),
        "positions come from Hugging Face's own embedding, padded batches included",
    ),
    Feature(
        "biases",
        "biases on the query, key, value or output projections",
        _biases,
        "unprocessed: value biases stay in v (folding them into b_O would change every split)",
    ),
    Feature(
        "mixture-of-experts",
        "mixture-of-experts MLPs",
        _experts,
        "residual-mlp is the routed block's output; the router reads the residual as edited, in every forward "
        "and decoding step",
    ),
    Feature(
        "post-norm",
        "sublayer outputs normalised before the residual add",
        lambda m: m.post_norm,
        "one head's write z_h W_O[h] is no term of the update: per-head residual-attn is refused (one line)",
    ),
    Feature(
        "linear-attention",
        "linear-attention layers (gated delta rule)",
        lambda m: any(isinstance(LAYER_KINDS[t], LinearAttention) for t in m.layer_types),
        "every space per value head, with the exact diagonal a_tt = beta_t (k_t . q_t)",
    ),
    Feature(
        "mixer-layers",
        "layers whose token mixer has no heads the bridge opens (state-space, convolution, recurrence)",
        lambda m: any(not LAYER_KINDS[t].heads for t in m.layer_types),
        "the residual spaces only, marked in tables and figures",
    ),
)
"""The features of the blocks and the unembedding."""


def all_features() -> Mapping[str, Feature]:
    """Every feature, by name, in the support matrix's order: the heads' grouping (:data:`HEADS`), the attention's
    own (:data:`lens_parallel.attention.FEATURES`, read at each call: a feature added there is here too), the blocks'
    (:data:`BLOCKS`)."""
    return {f.name: f for f in (*HEADS, *(_attention(kind) for kind in attention_features.FEATURES), *BLOCKS)}


def model_features(model: Model) -> tuple[str, ...]:
    """The names of the features (:func:`all_features`) ``model`` has."""
    return tuple(name for name, feature in all_features().items() if feature.present(model))
