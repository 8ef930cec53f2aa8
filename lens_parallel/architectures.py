"""Which architectures lens_parallel analyses: every decoder-only causal language model that TransformerLens 4.3's
``TransformerBridge`` bridges and ``transformers`` can build from a config, less what is left out here, each with
its reason.

The candidates are enumerated, not listed by hand (:func:`bridged_causal_lms`): TransformerLens's supported
architectures that name a model type in transformers' causal-LM mapping. Of those:

- :data:`EXCLUDED`: not a decoder-only language model with attention (encoders, vision / audio wrappers, models
  with no attention at all); never loaded;
- :data:`REFUSED`: decoder LMs whose one feature has no exact definition here, refused before any weights load in
  one line naming that feature (the models guide argues each);
- every other one loads and is analysed; its layers' kinds (:mod:`lens_parallel.layers`) and its features
  (:mod:`lens_parallel.features`) are read from the loaded model. A bridge that hooks no residual stream on some
  block (post-LN blocks, a bridge without blocks) is refused after loading, also in one line
  (:func:`bridge_refusal`).

The support matrix (``tests/test_architectures.py``, ``docs/guides/architectures.md``) runs a toy of every one
(:data:`lens_parallel.toys.ARCHITECTURE_TOYS`).
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from typing import Any

import transformers

from lens_parallel import compat

FAMILIES: Mapping[str, str] = {
    "GPT2LMHeadModel": "gpt2",
    "GPTNeoXForCausalLM": "pythia",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3_5ForCausalLM": "qwen3.5",
    "Gemma3ForCausalLM": "gemma3",
}
"""The family names of the architectures lens_parallel started with (``ModelInfo.family``, as results saved before
have them); any other architecture's family is its Hugging Face ``model_type``."""

_ENCODER = "an encoder (bidirectional attention) with a language-model head, not a causal decoder"
_MULTIMODAL = "a vision/audio-language wrapper; its text decoder ({text}) is analysed on its own"
_NO_ATTENTION = "no attention at all ({what}): there is no head output to decompose"

EXCLUDED: Mapping[str, str] = {
    "bert": _ENCODER,
    "gemma3": _MULTIMODAL.format(text="gemma3_text"),
    "gemma3n": _MULTIMODAL.format(text="gemma3n_text, which TransformerLens does not bridge alone"),
    "gemma4": _MULTIMODAL.format(text="gemma4_text"),
    "gemma4_unified": _MULTIMODAL.format(text="gemma4_text"),
    "mamba": _NO_ATTENTION.format(what="a Mamba state-space model"),
    "mamba2": _NO_ATTENTION.format(what="a Mamba-2 state-space model"),
    "falcon_mamba": _NO_ATTENTION.format(what="a Mamba state-space model"),
    "rwkv": _NO_ATTENTION.format(what="RWKV's time mixing"),
}
"""Model types left out, and why (diffusion language models are not in transformers' causal-LM mapping)."""

_MLA = (
    "multi-head latent attention: TransformerLens 4.3's MLA bridge hands hook_v as [batch, head, pos, d_head] (every "
    "other bridge: [batch, pos, head, d_head]) and has no W_O per head, so no value or per-head residual space is read "
    "from it as from the others"
)
REFUSED: Mapping[str, str] = {
    "afmoe": "an attention output gate (sigmoid of its own projection) together with a gate TransformerLens 4.3's "
    "attention bridge does not expose per head in its own forward, and a post-norm: refused until checked per head",
    "bitnet": "an attention sub-norm: BitNet RMS-normalises all heads' outputs together before o_proj, so hook_z is "
    "not A v and the bridge hooks nothing between (no value space is defined on hook_z)",
    "codegen": "CodeGen's attention: TransformerLens 4.3's adapter fails on it with transformers 5 (CodeGenAttention "
    "has no embed_positions)",
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "gemma4_text": "a value norm (attention mixes v_norm(v), not hook_v) with keys and values shared across layers: "
    "the value spaces would read the wrong value",
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _MLA,
    "laguna": "a softplus output gate per head (z = softplus(g) * A v): the value spaces know the sigmoid gate only",
    "openai-gpt": "post-LN blocks (GPT-1): the residual stream is re-normalised after each sublayer, and "
    "TransformerLens 4.3's bridge never fires hook_resid_post",
    "youtu": _MLA,
}
"""Model types refused before any weights load, each by the feature that has no exact definition here."""


def text_config(config: Any) -> Any:
    """The text model's config (a multimodal wrapper's ``text_config``; the config itself otherwise)."""
    return getattr(config, "text_config", None) or config


def _model_type(cls: str, model_types: list[str]) -> str:
    """The model type whose config builds ``cls``, among those transformers maps to it (Llama 4's text config, not
    the multimodal one), from the config classes' names (importing every modeling module would take seconds)."""
    configs = transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    stem = cls.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
    for suffix in ("TextConfig", "Config"):
        if hits := [t for t in model_types if configs.get(t) == stem + suffix]:
            same = [t for t in hits if t.replace("_", "").replace("-", "") == stem.lower()]
            return (same or hits)[0]
    return model_types[0]


@functools.cache
def bridged_causal_lms() -> Mapping[str, str]:
    """Model type -> Hugging Face class of every architecture TransformerLens bridges that transformers' causal-LM
    mapping names (excluded and refused ones included), sorted by model type."""
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    by_class: dict[str, list[str]] = {}
    for model_type, cls in mapping.items():
        by_class.setdefault(cls, []).append(model_type)
    found = {_model_type(cls, by_class[cls]): cls for cls in compat.bridged_architectures() if cls in by_class}
    return dict(sorted(found.items()))


def analysed_model_types() -> tuple[str, ...]:
    """The model types of :func:`bridged_causal_lms` that are not :data:`EXCLUDED` (the refused ones included: the
    support matrix shows their refusal)."""
    return tuple(model_type for model_type in bridged_causal_lms() if model_type not in EXCLUDED)


def architecture_of(config: Any) -> str:
    """The Hugging Face class a config names (configs built in memory name none: from its model type)."""
    archs: list[str] = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return str(mapping.get(config.model_type, config.model_type))


def refusal(config: Any) -> str:
    """Why a model of ``config`` is not analysed (one line: what it is, and why it is left out or refused), or ""
    when it is."""
    arch, model_type = architecture_of(config), config.model_type
    if model_type in EXCLUDED:
        return f"{arch} ({model_type}) is left out: {EXCLUDED[model_type]}"
    if model_type in REFUSED:
        return f"{arch} ({model_type}) is refused: {REFUSED[model_type]}"
    if arch not in compat.bridged_architectures():
        return (
            f"{arch} ({model_type}): TransformerLens {importlib.metadata.version('transformer-lens')} does not bridge "
            "it, so it has no hook points to analyse"
        )
    return ""


def family(arch: str, config: Any) -> str:
    """A model's family name: :data:`FAMILIES`'s, else its model type."""
    return FAMILIES.get(arch, str(config.model_type))


def bridge_refusal(hooks: set[str], n_layers: int) -> str:
    """Why a loaded bridge is not analysed, or "": it must hook the residual stream entering and leaving every block
    (every analysis reads them), which post-LN blocks (GPT-1's stream is re-normalised after each sublayer) and a
    bridge without blocks do not."""
    missing = [
        layer
        for layer in range(n_layers)
        if not {f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post"} <= hooks
    ]
    if not missing and n_layers:
        return ""
    return (
        f"TransformerLens's bridge hooks no residual stream (hook_resid_pre and hook_resid_post) at blocks "
        f"{missing or 'any'} (post-LN blocks re-normalise the stream after each sublayer; or the bridge has no "
        "blocks): no space is defined on it"
    )
