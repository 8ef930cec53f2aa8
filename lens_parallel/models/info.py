"""What lens_parallel knows of a loaded model (:class:`ModelInfo`, :func:`model_info`): its architecture, geometry,
layer kinds, attention features and the hooks it fires, read once from the bridge and its Hugging Face config; the
head and layer labels; and the architectures it refuses (:class:`ModelSpecError`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import transformers
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import architectures, attention, features, observers
from lens_parallel.choices import LayerType
from lens_parallel.errors import LensParallelError
from lens_parallel.kept import kept
from lens_parallel.layers import LAYER_KINDS, LayerKind, block_roles, layer_kind
from lens_parallel.models.digests import weights_state
from lens_parallel.toys import TOY_MODELS
from lens_parallel.weights import REAL_MODELS


@dataclass(frozen=True)
class ModelInfo:
    """What the analyses need to know about a model's attention, read from its Hugging Face config.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> info = lp.model_info(model)
        >>> info.kind(0).name
        'softmax'
    """

    name: str
    family: str
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_vocab: int
    n_ctx: int
    gated_attention: bool
    parallel_attn_mlp: bool
    positional: str  # "learned", "rotary", "alibi" or "none"
    config_hash: str
    layer_types: tuple[LayerType, ...] = ()  # per layer, its kind (lens_parallel.layers): softmax, linear or mixer
    n_linear_heads: int = 0  # linear-attention layers: value (= output) heads
    n_linear_key_heads: int = 0  # linear-attention layers: query/key heads, each read by a group of value heads
    post_norm: bool = False  # attention / MLP outputs are RMS-normalised before the residual add (Gemma 3)
    block_roles: tuple[tuple[str, ...], ...] = ()  # per layer, the block-level roles its bridge hooks (layers.py)
    features: tuple[str, ...] = ()  # the architecture's features (lens_parallel.features)
    gate_role: str = ""  # the role of the attention output gate (q_gate or attn_gate), "" without one
    rotary_hooks: bool = True  # rotary, its attention firing hook_rot_q/k (not GPT-NeoX's, Falcon's, GPT-J's)
    patterns_after: tuple[int, ...] = ()  # layers whose hook_pattern fires after their attention ran (read-only)
    attention_paths: tuple[str, ...] = ()  # per layer: "lens_parallel" (on the bridge's q, k, v), "lens_parallel:
    # the module's q, k, v" (the Hugging Face module's own, through the attention interface), "eager: <why>", or ""
    # (no softmax attention)
    dtype: str = ""  # the weights' dtype (float32, bfloat16, ...) when the model was read
    device: str = ""  # the device TransformerLens's config names (cpu, cuda:0; device_map: its first device)
    weights: str = ""  # how the weights were processed, read off the bridge (:func:`weights_state`)
    observer_hooks: tuple[str, ...] = ()  # hook points holding read-only hooks the user left (lens_parallel.observers)

    @property
    def group_size(self) -> int:
        """Query heads per kv head; query head h reads kv head h // group_size."""
        return self.n_heads // self.n_kv_heads

    def kind(self, layer: int) -> LayerKind:
        """Layer ``layer``'s :class:`~lens_parallel.layers.LayerKind`."""
        return LAYER_KINDS[self.layer_types[layer]]

    @property
    def softmax_layers(self) -> tuple[int, ...]:
        """Layers with softmax attention (hook_z, hook_pattern)."""
        return tuple(i for i in range(self.n_layers) if self.kind(i).pattern)

    @property
    def head_layers(self) -> tuple[int, ...]:
        """Layers with heads (softmax and linear attention): where the value spaces and per-head analyses exist."""
        return tuple(i for i in range(self.n_layers) if self.kind(i).heads)

    def output_heads(self, layer: int) -> int:
        """Heads whose outputs layer ``layer``'s token mixer projects and sums
        (:meth:`~lens_parallel.layers.LayerKind.output_heads`)."""
        return self.kind(layer).output_heads(self)

    def key_group(self, layer: int) -> int:
        """Output heads per key head at ``layer`` (:meth:`~lens_parallel.layers.LayerKind.key_group`)."""
        return self.kind(layer).key_group(self)

    def has_block_role(self, layer: int, role: str) -> bool:
        """Whether the bridge hooks the block-level ``role`` (:data:`~lens_parallel.layers.BLOCK_HOOKS`) at
        ``layer`` (a result saved before this was recorded: assumed)."""
        return not self.block_roles or role in self.block_roles[layer]

    @property
    def hybrid(self) -> bool:
        """Whether the layers are of more than one kind: tables then say each row's layer type."""
        return len(set(self.layer_types)) > 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def head_label(layer: int | None, head: int | Sequence[int] | None = None) -> str:
    """How every table and figure names heads: ``L{layer}H{head}``; a set of heads ``L{layer}H{h1}+{h2}``; all heads
    of a layer together ``L{layer}*``; ``layer=None``: the head alone, ``H{head}`` (an axis of a layer x head
    heatmap)."""
    if head is None:
        return f"{layer_label(layer)}*" if layer is not None else "*"
    heads = (head,) if isinstance(head, int) else tuple(head)
    return ("" if layer is None else layer_label(layer)) + "H" + "+".join(str(h) for h in heads)


def layer_label(layer: int) -> str:
    """How tables and figures name a layer (a sublayer update, an axis tick): ``L{layer}``."""
    return f"L{layer}"


class ModelSpecError(LensParallelError):
    """A model spec that cannot be loaded; the message says what was wrong and what is accepted.

    Examples:
        >>> import lens_parallel as lp
        >>> try:
        ...     lp.load_model("toy-nonexistent")
        ... except lp.ModelSpecError as error:
        ...     print("unknown model spec" in str(error))
        True
    """


def accepted_specs() -> str:
    toys = ", ".join(TOY_MODELS)
    return (
        f"accepted: {toys}, a toy of any other architecture (toy-mistral, toy-gemma2, ...: the models guide lists "
        f"them), {', '.join(REAL_MODELS)}, a local Hugging Face folder holding config.json, or a hub name like "
        "'openai-community/gpt2' (online only)"
    )


def check_architecture(config: transformers.PretrainedConfig, where: str) -> str:
    """The architecture (Hugging Face class) of ``config``, once lens_parallel analyses it
    (:func:`lens_parallel.architectures.refusal`); else :class:`ModelSpecError` in one line."""
    if reason := architectures.refusal(config):
        raise ModelSpecError(f"{where}: {reason}; the models guide lists every architecture and why")
    return architectures.architecture_of(config)


def config_hash(config: transformers.PretrainedConfig) -> str:
    """A short stable hash of a config's JSON (identifies the architecture and sizes in provenance)."""
    text = json.dumps(config.to_diff_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


POSITIONAL = {"standard": "learned"}
"""TransformerLens's positional embedding types as ModelInfo names them (the others as they are: rotary, alibi)."""


@dataclass(frozen=True)
class _Structure:
    """What a bridge's hook points, modules and attention sites say of its layers and features (read once per
    model, kept on it)."""

    layer_types: tuple[LayerType, ...]
    block_roles: tuple[tuple[str, ...], ...]
    post_norm: bool
    gate_role: str
    features: tuple[str, ...]
    rotary: bool
    sites: tuple[attention.AttentionSite | None, ...]
    """Per layer, its softmax attention's site (:mod:`lens_parallel.attention.site`); None on a layer without."""


def _structure(model: TransformerBridge) -> _Structure:
    """Each layer's kind (:func:`lens_parallel.layers.layer_kind`) and block-level roles, post-norms, the attention
    sites (their gate and features) and the model's features (:mod:`lens_parallel.features`), from the bridge's hook
    points and modules, read once per model."""
    return kept(model, "structure", lambda: _read_structure(model))


def _read_structure(model: TransformerBridge) -> _Structure:
    hooks = set(model.hook_dict)
    layers = range(model.cfg.n_layers)
    kinds = tuple(layer_kind(hooks, layer) for layer in layers)
    roles = tuple(block_roles(hooks, layer) for layer in layers)
    post_norm = any(f"blocks.{layer}.ln1_post.hook_in" in hooks for layer in layers)
    parallel = any({"attn_out", "mlp_out"} <= set(r) and "resid_mid" not in r for r in roles)
    every = attention.sites(model)
    sites = tuple(attention.site_of(model.blocks[i].attn) if LAYER_KINDS[kinds[i]].pattern else None for i in layers)
    gate = next((site.spec.gate for site in every if site.spec.gate is not None), None)
    found = features.Model(
        model.original_model,
        model.original_model.config,
        model.cfg.n_heads,
        model.cfg.n_key_value_heads or model.cfg.n_heads,
        kinds,
        parallel,
        post_norm,
        tuple(site.spec for site in every),
    )
    rotary = model.cfg.positional_embedding_type == "rotary" and all(  # TransformerLens's name for it
        site.fires_rotary for site in sites if site is not None
    )
    return _Structure(kinds, roles, post_norm, gate.role if gate else "", features.model_features(found), rotary, sites)


def model_info(model: TransformerBridge) -> ModelInfo:
    """Read :class:`ModelInfo` from a bridge's underlying Hugging Face config and its hook points.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> info = lp.model_info(model)
        >>> (info.n_layers, info.n_heads)
        (3, 4)
    """
    hf = cast(transformers.PretrainedConfig, model.original_model.config)
    arch = check_architecture(hf, "the loaded model")
    cfg = model.cfg
    n_kv = cfg.n_key_value_heads or cfg.n_heads
    structure = _structure(model)
    return ModelInfo(
        name=cfg.model_name,
        family=architectures.family(arch, hf),
        architecture=arch,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=n_kv,
        d_head=cfg.d_head,
        d_model=cfg.d_model,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        gated_attention=bool(structure.gate_role),
        parallel_attn_mlp="parallel-blocks" in structure.features,
        positional=POSITIONAL.get(cfg.positional_embedding_type, cfg.positional_embedding_type),
        config_hash=config_hash(hf),
        layer_types=structure.layer_types,
        n_linear_heads=getattr(hf, "linear_num_value_heads", 0) or 0,
        n_linear_key_heads=getattr(hf, "linear_num_key_heads", 0) or 0,
        post_norm=structure.post_norm,
        block_roles=structure.block_roles,
        features=structure.features,
        attention_paths=tuple(site.label if site else "" for site in structure.sites),
        dtype=str(cfg.dtype).removeprefix("torch."),
        device=str(cfg.device),
        weights=weights_state(model),
        observer_hooks=tuple(observers.user_hooks(model)),
        gate_role=structure.gate_role,
        rotary_hooks=structure.rotary,
        patterns_after=tuple(layer for layer, site in enumerate(structure.sites) if site and site.pattern_after),
    )
