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
- :data:`ARCHITECTURE_TOYS`: one toy per other architecture of the support matrix
  (:mod:`lens_parallel.architectures`), named ``toy-`` and the Hugging Face ``model_type`` (underscores as
  hyphens: ``toy-gpt-oss``), all with the GPT-2 tokenizer.

Every toy loads with :func:`lens_parallel.load_model` (``load_model("toy-mistral")``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers

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
            model: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32
            )
        return model.eval()


def _settable(config: transformers.PretrainedConfig, name: str) -> bool:
    """Whether ``config`` has a field ``name`` that can be set (not a read-only property such as Falcon's
    ``head_dim``)."""
    if not hasattr(config, name):
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
    fields = {name: size for name, size in SHRUNK.items() if _settable(default, name)} | overrides
    vocab = fields.get("vocab_size", default.vocab_size)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = fields.get(name, getattr(default, name, None))
        if isinstance(value, int) and value >= vocab:
            fields[name] = vocab - 1
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
