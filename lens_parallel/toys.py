"""Toy models: tiny random models of any architecture, built offline from its own Hugging Face config by one
template.

:func:`toy_config` takes an architecture's config class with its own defaults (``AutoConfig.for_model``) and shrinks
it: each field of :data:`SHRUNK` that the config has is set to the toy size (so a config keeps its own
activation, norms, biases, rotary fraction, window, soft cap, multipliers, ...), a token id past the toy's
vocabulary is brought inside it, and a :class:`Toy`'s ``overrides`` set what one architecture needs beyond that (a
layer pattern that holds every layer kind, a family's historical sizes). Weights are seeded random
(:data:`TOY_SEED`), with the global random state left as it was.

Two tables:

- :data:`TOY_MODELS`: the families the whole test suite runs on (``toy-gpt2``, ``toy-pythia``, ``toy-qwen2``,
  ``toy-qwen3``, ``toy-llama``, ``toy-qwen3.5``), each with its family's real tokenizer (bundled);
- :func:`architecture_toys`: one toy per other architecture of the support matrix
  (:mod:`lens_parallel.architectures`), named ``toy-`` and the Hugging Face ``model_type`` (underscores as
  hyphens: ``toy-gpt-oss``), all with the GPT-2 tokenizer.

Every toy loads with :func:`lens_parallel.load_model` (``load_model("toy-mistral")``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import transformers

from lens_parallel import architectures
from lens_parallel.errors import LensParallelError

TOY_SEED = 0
"""The seed of every toy's weights."""

SHRUNK: Mapping[str, Any] = {
    "vocab_size": 50257,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # mixture-of-experts
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    # linear attention (gated delta rule)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    # state-space layers (Mamba, Mamba-2)
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 16,
    "mamba_dt_rank": 8,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "chunk_size": 16,
}
"""Standard config field -> toy size, set where an architecture's config has that field (a name its
``attribute_map`` translates counts: GPT-2's ``n_embd`` is ``hidden_size``)."""


@dataclass(frozen=True)
class Toy:
    """One toy: the Hugging Face ``model_type`` whose config is shrunk, the bundled ``tokenizer``
    (:mod:`lens_parallel.tokenizers`), and the ``overrides`` beyond :data:`SHRUNK` (standard or the config's own
    field names)."""

    model_type: str
    tokenizer: str = "gpt2"
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def config(self, *, n_ctx: int | None = None) -> transformers.PretrainedConfig:
        """The shrunk config (:func:`toy_config`), with ``n_ctx`` positions when given."""
        extra = {} if n_ctx is None else {"max_position_embeddings": n_ctx}
        return toy_config(self.model_type, **{**self.overrides, **extra})

    def build(self, *, n_ctx: int | None = None) -> transformers.PreTrainedModel:
        """The toy's Hugging Face model in float32, eval mode, weights drawn from :data:`TOY_SEED` (the global random
        state is left as it was)."""
        config = self.config(n_ctx=n_ctx)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TOY_SEED)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.architectures = [type(model).__name__]  # as save_pretrained records it (the bridge reads it)
        return cast(transformers.PreTrainedModel, model.eval())


def settable(config: transformers.PretrainedConfig, name: str) -> bool:
    """Whether ``config`` has a field ``name`` that can be set (not a read-only property such as Falcon's
    ``head_dim``, nor one that differs per layer, such as Gemma 4's)."""
    try:
        getattr(config, name)
    except Exception:  # absent, or ambiguous (a per-layer field read globally)
        return False
    attribute = getattr(type(config), config.attribute_map.get(name, name), None)
    return not (isinstance(attribute, property) and attribute.fset is None)


def toy_config(model_type: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The config of ``model_type`` with its own defaults, shrunk by :data:`SHRUNK` where it has those fields, then
    ``overrides``; a pad, bos or eos id past the vocabulary is set to its last token (an embedding's padding row must
    exist)."""
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except ValueError as exc:
        raise LensParallelError(f"transformers knows no model_type {model_type!r}") from exc
    fields = {name: size for name, size in SHRUNK.items() if settable(default, name)} | overrides
    vocab = fields.get("vocab_size", default.vocab_size)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = fields.get(name, getattr(default, name, None))
        if isinstance(value, int) and value >= vocab:
            fields[name] = vocab - 1
        elif isinstance(value, list) and any(i >= vocab for i in value):  # several end tokens (GLM)
            fields[name] = sorted({min(i, vocab - 1) for i in value})
    return transformers.AutoConfig.for_model(model_type, **fields)


_QWEN_SHAPE: Mapping[str, Any] = {
    "hidden_size": 96,
    "num_attention_heads": 6,
    "intermediate_size": 192,
    "num_hidden_layers": 3,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "tie_word_embeddings": True,
}
"""The Qwen family toys' sizes (GQA 6 query / 2 kv heads of 16, Qwen2.5's vocabulary)."""

TOY_MODELS: Mapping[str, Toy] = {
    "toy-gpt2": Toy("gpt2", "gpt2", {"num_hidden_layers": 3, "n_inner": 256}),
    "toy-pythia": Toy(
        "gpt_neox",
        "gpt-neox",
        {"num_hidden_layers": 3, "intermediate_size": 256, "vocab_size": 50304, "eos_token_id": 0},
    ),
    "toy-qwen2": Toy("qwen2", "qwen3", _QWEN_SHAPE),
    "toy-qwen3": Toy("qwen3", "qwen3", _QWEN_SHAPE),
    "toy-llama": Toy(
        "llama",
        "gpt-neox",
        {"hidden_size": 96, "num_attention_heads": 6, "intermediate_size": 192, "num_hidden_layers": 3}
        | {"vocab_size": 50304, "bos_token_id": 0, "eos_token_id": 0},
    ),
    "toy-qwen3.5": Toy(
        "qwen3_5_text",
        "qwen3",
        {
            **_QWEN_SHAPE,
            "num_hidden_layers": 5,
            "layer_types": [*("linear_attention", "full_attention", "full_attention"), *["linear_attention"] * 2],
        },
    ),
}
"""The families the test suite runs every analysis on. Their sizes predate the template and are kept (the golden
references were made on them): GPT-2 (3 layers, 4 heads of 16, learned positions), Pythia (GPT-NeoX: parallel
attention and MLP, a quarter of each head rotary), Qwen2 and Qwen3 (GQA 6/2, Qwen3's q/k norms), Llama (GQA 6/2;
GPT-NeoX's tokenizer, as no Llama tokenizer is available offline) and Qwen3.5 (hybrid: linear-attention blocks 0, 3
and 4 with 4 value heads reading 2 key heads, gated softmax-attention blocks 1 and 2, so that its adjacent layer pairs
cover all four combinations of layer types)."""

_ALTERNATING: Mapping[str, Any] = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
"""A sliding-window layer then a global one, with a window shorter than the test documents."""
_HYBRID: Mapping[str, Any] = {"num_hidden_layers": 3}
"""Hybrids get three layers: a mixer, an attention layer, a mixer (every adjacent pair of kinds)."""
_GRANITE: Mapping[str, Any] = {
    "embedding_multiplier": 2.0,
    "attention_multiplier": 0.2,
    "residual_multiplier": 0.5,
    "logits_scaling": 4.0,
}
"""Granite's multipliers away from 1 (its defaults), so that the matrix sees what each one does."""
_LINEAR_HYBRID: Mapping[str, Any] = {
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    **_HYBRID,
}

ARCHITECTURE_OVERRIDES: Mapping[str, Mapping[str, Any]] = {
    "afmoe": _ALTERNATING,
    "bamba": {"attn_layer_indices": [1], **_HYBRID},
    "codegen": {"rotary_dim": 8},
    "cohere2": _ALTERNATING,
    "exaone4": _ALTERNATING,
    "falcon_h1": {
        "mamba_d_ssm": 64,
        "mamba_n_heads": 4,
        "lm_head_multiplier": 0.5,
        "attention_in_multiplier": 0.8,
        "attention_out_multiplier": 0.9,
        "ssm_out_multiplier": 1.1,
        "key_multiplier": 0.7,
    },
    "gemma2": _ALTERNATING,
    "gemma3_text": _ALTERNATING,
    "gemma4_text": {
        **_ALTERNATING,
        "per_layer_config": {},
        "vocab_size_per_layer_input": 50257,
        "hidden_size_per_layer_input": 16,
    },
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "gpt_oss": _ALTERNATING,
    "gptj": {"rotary_dim": 8},
    "granite": _GRANITE,
    "granitemoe": _GRANITE,
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"], "position_embedding_type": "rope", **_HYBRID},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1}
    | dict(_HYBRID),
    "laguna": {"num_attention_heads_per_layer": [4, 4]},
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "llama4_text": {"layer_types": ["chunked_attention", "full_attention"], "attention_chunk_size": 8},
    "mistral": {"sliding_window": 8},
    "modernbert-decoder": _ALTERNATING,
    "nemotron_h": {"layers_block_type": ["mamba", "attention", "moe"], "n_groups": 1, **_HYBRID},
    "olmo3": _ALTERNATING,
    "olmo_hybrid": _LINEAR_HYBRID,
    "qwen3_5_moe_text": _LINEAR_HYBRID,
    "qwen3_next": _LINEAR_HYBRID,
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 8, "lru_width": 64}
    | dict(_HYBRID),
    "starcoder2": {"sliding_window": 8},
    "vaultgemma": _ALTERNATING,
    "zamba2": {
        "layers_block_type": ["mamba", "hybrid", "mamba"],
        "hybrid_layer_ids": [1],
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
        "mamba_headdim": 16,
        "n_mamba_heads": 8,
        "kv_channels": 16,
        **_HYBRID,
    },
} | dict.fromkeys(
    ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa", "youtu"),
    {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8}
    | {"v_head_dim": 16, "head_dim": 8},
)
"""What an architecture's toy needs beyond :data:`SHRUNK`: a layer pattern holding every kind it has and windows
shorter than a test document, multipliers away from 1, sizes its config checks against each other (multi-head
latent attention's ranks, Mamba's heads, partial rotary dimensions)."""


def toy_spec(model_type: str) -> str:
    """The spec of ``model_type``'s toy: ``toy-`` and the model type, underscores as hyphens."""
    return "toy-" + model_type.replace("_", "-")


FAMILY_MODEL_TYPES: Mapping[str, str] = {toy.model_type: spec for spec, toy in TOY_MODELS.items()}
"""Model type -> the family toy that stands for it in the support matrix."""


@functools.cache
def architecture_toys() -> Mapping[str, Toy]:
    """A toy of every other architecture the support matrix runs (:func:`lens_parallel.architectures.
    analysed_model_types`, refused ones included), by spec (read when first asked for: enumerating the bridged
    architectures imports every TransformerLens adapter, about 5 s)."""
    return {
        toy_spec(model_type): Toy(model_type, overrides=ARCHITECTURE_OVERRIDES.get(model_type, {}))
        for model_type in architectures.analysed_model_types()
        if model_type not in FAMILY_MODEL_TYPES
    }


def find_toy(spec: str) -> Toy | None:
    """The toy named ``spec`` (a family's or an architecture's), or None; an architecture toy is looked for only
    for a ``toy-`` spec that is not a family's."""
    if spec in TOY_MODELS:
        return TOY_MODELS[spec]
    return architecture_toys().get(spec) if spec.startswith("toy-") else None
