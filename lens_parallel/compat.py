"""Every use of another package's private API or internals, in one place, each checked against the version range it
was verified on (:data:`CHECKED`): a newer release that may have moved them fails loudly, in one line naming the
package and its version, instead of silently computing something else. Nothing else in lens_parallel imports a
private name of another package (``tests/test_compat.py`` checks both).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import pickle
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import einops
import torch
from torch import nn

from lens_parallel.errors import LensParallelError, LibraryError

CHECKED: dict[str, tuple[tuple[int, int], tuple[int, int], str]] = {
    "transformer-lens": (
        (4, 3),
        (5, 0),
        "TransformerBridge internals: the adapters' SUPPORTED_ARCHITECTURES, a component's wrapped Hugging Face "
        "module (original_component, the "
        "'._original_component' segment of parameter names), align_offloaded_subtree, and start_at_layer swapping "
        "the caller's residual in at block k (prefix reuse), attention bridges' _update_kv_cache reading the cache "
        "only as past_key_values / layer_past and returning the whole [batch, head, pos, d_head] values, each "
        "attention bridge's _layer_idx; GatedDeltaNetBridge taking HF's cached path (_native_forward) only for "
        "cache_params, a bridge's _weights_processed flag (process_weights / enable_compatibility_mode ran); a "
        "PositionEmbeddingsAttentionBridge's projections being its Hugging Face module's own (q_proj is q, ...), its "
        "_apply_position_embedding_hooks, _qk_norm_phase and config.qk_norm_after_rope, and AttentionBridge.forward "
        "calling the module as it is",
    ),
    "lm_eval": (
        (0, 4),
        (0, 5),
        "lm_eval.models.utils._add_special_kwargs (how the hf model sets add_special_tokens), "
        "lm_eval.tasks._yaml_loader.load_yaml (a task's YAML read without importing its !function helpers), "
        "lm_eval.evaluator's get_git_commit_hash (run in the working folder, its git's stderr shown) and add_env_info "
        "(torch's collect_env, subprocesses), "
        "lm_eval.tasks.ruler.prepare_niah importing nltk and downloading punkt_tab when nltk.data.find fails, "
        "lm_eval.utils.apply_template(template, doc) rendering template in lm_eval.utils.env, the tasks calling it "
        "through that module, "
        "a TaskManager's metadata living in its metadata and _factory (lm_eval.tasks._factory.TaskFactory) alone, "
        "and its index in _index (name -> entry, later paths overriding; lm_eval.tasks._index.Kind) with the name "
        "lists _all_tasks, _all_subtasks, _all_groups and _all_tags built from it; its entries "
        "(lm_eval.tasks._index.Entry) pickle and compare equal after unpickling",
    ),
    "datasets": (
        (4, 0),
        (6, 0),
        "datasets.config.HF_HUB_OFFLINE read at each load_dataset call (offline: the local cache or one error, "
        "no retries)",
    ),
    "torch": (
        (2, 13),
        (3, 0),
        "aten._scaled_dot_product_flash_attention_for_cpu (the fused CPU kernel, which also returns each row's "
        "log-sum-exp) and aten._scaled_dot_product_efficient_attention (CUDA's memory-efficient kernel, which "
        "returns it with compute_log_sumexp, padded to a multiple of 32 queries); outside this range the diagonal "
        "attention path falls back to the blocked one; torch.utils._python_dispatch.TorchDispatchMode (counting "
        "the operations a call dispatches)",
    ),
    "transformers": (
        (5, 0),
        (6, 0),
        "a config's quantization_config removed through its __dict__ (GGUF export); decoder layers handing their "
        "attention the key/value cache as cache=; qwen3_5's torch_chunk_gated_delta_rule (its signature and "
        "use_qk_l2norm_in_kernel)",
    ),
}
"""Package -> [from, to) major.minor versions on which each use was verified, and what is used."""


def version_of(package: str) -> tuple[int, int]:
    """The installed major.minor version of ``package``."""
    text = importlib.metadata.version(package)
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2])
    return major, minor


@functools.cache
def check(package: str) -> None:
    """Raise :class:`LibraryError` (one line) when the installed ``package`` leaves its :data:`CHECKED` range."""
    low, high, what = CHECKED[package]
    installed = version_of(package)
    if not low <= installed < high:
        raise LibraryError(
            f"{package} {importlib.metadata.version(package)} is installed, but lens_parallel's use of its internals "
            f"({what}) was checked on {package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}: install that range"
        )


# -- TransformerLens ---------------------------------------------------------------------------------------------


def version_text(package: str) -> str:
    """The installed version of ``package`` as it spells it."""
    return importlib.metadata.version(package)


@functools.cache
def bridged_architectures() -> frozenset[str]:
    """The Hugging Face classes TransformerLens's ``TransformerBridge`` has an adapter for."""
    check("transformer-lens")
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    return frozenset(SUPPORTED_ARCHITECTURES)


def hf_module(component: nn.Module) -> nn.Module:
    """The Hugging Face module a TransformerBridge component wraps."""
    check("transformer-lens")
    return cast(nn.Module, component.original_component)


def plain_name(name: str) -> str:
    """A bridge parameter or state-dict name as the Hugging Face model spells it."""
    check("transformer-lens")
    return name.replace("._original_component", "")


@contextlib.contextmanager
def weights_materialised(module: nn.Module) -> Iterator[None]:
    """``module``'s weights present on their device while inside, also when accelerate offloaded them."""
    check("transformer-lens")
    from transformer_lens.model_bridge.generalized_components.base import align_offloaded_subtree

    with align_offloaded_subtree(module):
        yield


def _passthrough(hidden_states: Any, *args: object, **kwargs: object) -> Any:
    return hidden_states


@contextlib.contextmanager
def passthrough(modules: Sequence[nn.Module], depth: dict[int, int]) -> Iterator[None]:
    """Each module's forward replaced by the identity on its first argument while inside (re-entrant through the
    caller's ``depth`` counts). With TransformerLens 4.3's ``start_at_layer``, which still runs every earlier block
    and then swaps the caller's residual in, this skips blocks whose output is discarded anyway."""
    check("transformer-lens")
    for module in modules:
        count = depth.get(id(module), 0)
        if count == 0:
            module.forward = _passthrough
        depth[id(module)] = count + 1
    try:
        yield
    finally:
        for module in modules:
            depth[id(module)] -= 1
            if depth[id(module)] == 0:
                del depth[id(module)]
                del module.forward


@contextlib.contextmanager
def component_forwards(components: Sequence[nn.Module], forwards: Sequence[Any]) -> Iterator[None]:
    """Each bridge component's forward replaced by the matching one while inside, written into the instance's own
    dictionary (a bridge component passes attribute writes through to the module it wraps)."""
    check("transformer-lens")
    for component, forward in zip(components, forwards, strict=True):
        vars(component)["forward"] = forward
    try:
        yield
    finally:
        for component in components:
            del vars(component)["forward"]


def _update_kv_cache_reading_cache(
    original: Any, layer: int | None, values: dict[int, Any] | None, k: Any, v: Any, **kwargs: Any
) -> Any:
    if kwargs.get("past_key_values") is None and kwargs.get("layer_past") is None and "cache" in kwargs:
        kwargs["past_key_values"] = kwargs["cache"]
    k, v = original(k, v, **kwargs)
    if values is not None and layer is not None:
        values[layer] = einops.rearrange(v, "batch head_index pos d_head -> batch pos head_index d_head")
    return k, v


def _recurrent_forward_reading_cache(component: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("cache") is not None and kwargs.get("cache_params") is None:
        return component._native_forward(*args, **kwargs)
    return type(component).forward(component, *args, **kwargs)


@contextlib.contextmanager
def cache_reaches_attention(model: nn.Module, *, values: dict[int, Any] | None = None) -> Iterator[None]:
    """While inside, the key/value cache reaches every attention bridge of ``model``.

    TransformerLens 4.3's attention bridges extend a cache only when it arrives as ``past_key_values`` or
    ``layer_past`` (``AttentionBridge._update_kv_cache``); transformers 5's decoder layers hand it over as ``cache=``,
    so the bridge's cached decoding lets each new token attend to itself alone (its ``generate`` with the cache is
    wrong on Llama-family models). Inside, each attention component's ``_update_kv_cache`` also takes ``cache``
    (written into the instance's own dictionary, as :func:`component_forwards`). Linear-attention blocks
    (``GatedDeltaNetBridge``, Qwen3.5) take Hugging Face's own cached path only when the cache arrives as
    ``cache_params``; inside, one handed ``cache=`` takes it too (else the prefill stores no recurrent state and
    each step starts from none). ``values``, if given, receives at
    each forward every layer's values over all the positions its attention reads, cached and new
    (``values[layer]``: [batch, key_pos, head_index, d_head], key-value heads, a view of the cache), for the
    edits that need more than the current positions' own (:data:`lens_parallel.edits.STEP_VALUES`).
    Thread-safety is the caller's (:func:`lens_parallel.hooks.model_lock`)."""
    check("transformer-lens")
    check("transformers")
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
    from transformer_lens.model_bridge.generalized_components.gated_delta_net import GatedDeltaNetBridge

    components = [m for m in model.modules() if isinstance(m, AttentionBridge)]
    recurrent = [m for m in model.modules() if isinstance(m, GatedDeltaNetBridge)]
    for component in components:
        vars(component)["_update_kv_cache"] = functools.partial(
            _update_kv_cache_reading_cache, component._update_kv_cache, component._layer_idx, values
        )
    for mixer in recurrent:
        vars(mixer)["forward"] = functools.partial(_recurrent_forward_reading_cache, mixer)
    try:
        yield
    finally:
        for component in components:
            del vars(component)["_update_kv_cache"]
        for mixer in recurrent:
            del vars(mixer)["forward"]


ATTENTION_SOURCES = {
    "AttentionBridge.forward": "ee8f78b0e8f340d6",
    "PositionEmbeddingsAttentionBridge.forward": "792c3e1b665a0ae2",
    "JointQKVAttentionBridge._reconstruct_attention": "6b9aae7f4356029e",
    "JointQKVPositionEmbeddingsAttentionBridge._reconstruct_attention": "b507ec0b79b97b83",
    "BloomAttentionBridge._reconstruct_attention": "b4743a44b10ee000",
    "MPTALiBiAttentionBridge._reconstruct_attention": "8237bcd82422b574",
}
"""The TransformerLens 4.3.0 attention forwards lens_parallel's path stands in for (:func:`install_attention`): the
joint-QKV bridges' ``_reconstruct_attention``, whose steps (the bridge's own methods) :func:`_joint_attention` calls
around lens_parallel's attention; PositionEmbeddingsAttentionBridge's forward, whose hook points the route through
the module fires (:data:`ROUTE_FIRES`) or hands back to it; the generic bridge's, whose call of the Hugging Face
module (and after-the-fact hook_pattern) the attention-interface route relies on. Each by the first 16 hex digits of
the SHA-256 of its source: a release that changes one must be checked again."""


def attention_sources() -> dict[str, str]:
    """The installed TransformerLens's versions of :data:`ATTENTION_SOURCES` (the same digests of their source)."""
    import hashlib
    import inspect

    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
    from transformer_lens.model_bridge.generalized_components.joint_qkv_attention import JointQKVAttentionBridge
    from transformer_lens.model_bridge.generalized_components.joint_qkv_position_embeddings_attention import (
        JointQKVPositionEmbeddingsAttentionBridge,
    )
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    functions = (
        AttentionBridge.forward,
        PositionEmbeddingsAttentionBridge.forward,
        JointQKVAttentionBridge._reconstruct_attention,
        JointQKVPositionEmbeddingsAttentionBridge._reconstruct_attention,
        *(cast(Any, bridge)._reconstruct_attention for bridge in _alibi_biases()),
    )
    return {f.__qualname__: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16] for f in functions}


_OWN_ATTENTION: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def weights_processed(model: nn.Module) -> bool:
    """Whether TransformerLens processed a bridge's weights (``process_weights``, which
    ``enable_compatibility_mode()`` runs unless ``no_processing=True``): its ``_weights_processed`` flag, the one
    record TransformerLens 4.3 keeps of it (not which folds ran)."""
    check("transformer-lens")
    return bool(getattr(model, "_weights_processed", False))


def has_own_attention(component: nn.Module) -> bool:
    """Whether ``component`` computes its attention on lens_parallel's path now (:func:`install_attention` took it)."""
    return component in _OWN_ATTENTION


def _reasons(component: nn.Module) -> list[str]:
    """Why lens_parallel's attention cannot take ``component`` (none: it can). A PositionEmbeddingsAttentionBridge
    (or a subclass) takes the route through its module (:func:`_takes_module_route`), which computes its queries,
    keys and values as Hugging Face does (rotary of either layout, query/key norms wherever they sit, clipping, key
    multipliers, Llama 4's query scaling, the output gate), so only what the attention itself does differently keeps
    it off: its module not computing its attention through the attention interface, or with projections that are not
    the bridge's; a separate gate projection (no toy reaches one). A joint-QKV bridge takes :func:`_joint_attention`,
    which follows its own steps; a generic AttentionBridge the interface route (:func:`_routable`)."""
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    hf_attn: Any = component.original_component
    config: Any = getattr(hf_attn, "config", None)
    bridged: Any = component.config
    heads = bridged.n_heads
    generic = type(component).forward is AttentionBridge.forward
    position = isinstance(component, PositionEmbeddingsAttentionBridge)
    interface = _calls_attention_interface(hf_attn)
    children = list(hf_attn.children())
    checks = [
        (
            f"{type(hf_attn).__name__} computes its attention itself, not through transformers' attention interface"
            + (" (TransformerLens's generic AttentionBridge calls it whole)" if generic else ""),
            (generic or position) and not interface,
        ),
        (
            f"{type(hf_attn).__name__} fires hook_pattern itself (accepts_pattern_fn)",
            generic and bool(getattr(hf_attn, "accepts_pattern_fn", False)),
        ),
        (
            f"{type(component).__name__}, a bridge lens_parallel's path does not reproduce",
            not (generic or position or type(component) in (*_joint_bridges(), *_alibi_biases())),
        ),
        (
            f"{type(hf_attn).__name__}'s projections are not the bridge's q, k, v and o",
            position and not all(any(child is component._modules.get(part) for child in children) for part in "qkvo"),
        ),
        (
            "not causal self-attention",
            not component.is_causal
            or component.is_cross_attention
            or getattr(hf_attn, "is_causal", True) is False
            or bool(getattr(config, "use_bidirectional_attention", False)),
        ),
        (
            "ALiBi with grouped-query heads",
            type(component) in _alibi_biases() and (getattr(bridged, "n_key_value_heads", None) or heads) != heads,
        ),
        ("a separate gate projection", component._modules.get("gate") is not None),
        (
            "float32-upcast attention (reorder_and_upcast_attn)",
            bool(getattr(component, "_reorder_and_upcast_attn", False)),
        ),
    ]
    return [reason for reason, found in checks if found]


def _takes_module_route(component: nn.Module) -> bool:
    """Whether ``component`` is a PositionEmbeddingsAttentionBridge (or a subclass) lens_parallel's attention takes
    (:func:`_reasons`): its Hugging Face module computes its attention through the attention interface with the
    bridge's own projections, so the module's forward fires hook_q, hook_k, hook_v and hook_z as the bridge's does."""
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    return isinstance(component, PositionEmbeddingsAttentionBridge) and not _reasons(component)


def own_attention_reason(component: nn.Module) -> str:
    """Why ``component`` keeps TransformerLens's own attention forward ("" when lens_parallel computes its
    attention, :func:`_reasons`)."""
    check("transformer-lens")
    return "; ".join(_reasons(component))


def module_route(component: nn.Module) -> bool:
    """Whether lens_parallel's attention, once installed on ``component``, takes its queries, keys and values from
    its Hugging Face module's own forward (through the attention interface: :func:`_routable`,
    :func:`_takes_module_route`) rather than from a joint-QKV bridge's steps (:func:`_joint_attention`)."""
    return _routable(component) or _takes_module_route(component)


def pattern_after_attention(component: nn.Module) -> bool:
    """Whether an attention bridge fires hook_pattern only after its attention has run: TransformerLens 4.3's generic
    ``AttentionBridge`` (GPT-J, OPT, GPT-Neo, Jamba, Llama 4, ...) calls the Hugging Face module and fires
    hook_pattern on the weights it returns, so an edit of the pattern changes nothing and the pattern is not there
    before hook_z. lens_parallel's own path and the bridges that compute the pattern in their forward serve it
    inline."""
    check("transformer-lens")
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    if component in _OWN_ATTENTION or getattr(component.original_component, "accepts_pattern_fn", False):
        return False
    return type(component).forward is AttentionBridge.forward


def fires_rotary_hooks(component: nn.Module) -> bool:
    """Whether an attention bridge fires hook_rot_q / hook_rot_k (the queries and keys after rotary): TransformerLens
    4.3's PositionEmbeddingsAttentionBridge does; its joint-QKV rotary bridge (GPT-NeoX, Falcon) and its plain
    AttentionBridge (GPT-J) declare them and never fire them."""
    check("transformer-lens")
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    return isinstance(component, PositionEmbeddingsAttentionBridge)


def _eager_now(component: Any) -> bool:
    """Options switched on after boot that only TransformerLens's forward serves."""
    config = component.config
    dropout = getattr(component.original_component, "attention_dropout", 0.0)
    return (
        component.compatibility_mode
        or any(bool(getattr(config, flag, False)) for flag in ("use_split_qkv_input", "use_attn_in", "use_attn_result"))
        or (component.training and isinstance(dropout, float) and dropout > 0.0)
    )


ROUTE_FIRES = frozenset(
    {"hook_in", "hook_out", "hook_attn_scores", "hook_pattern", "hook_rot_q", "hook_rot_k", "hook_cos", "hook_sin"}
)
"""The hook points of a PositionEmbeddingsAttentionBridge that the route through its module fires itself (its
projections' hook points, hook_q, hook_k, hook_v and hook_z among them, fire as the module calls them); hook_rot_q /
hook_rot_k only where the query/key norm comes before rotary (after it, the module's queries are normed). A hook on
any other of its hook points (hook_q_normed, hook_q_gate, the norms' own, whose module sees the heads in another
layout, Falcon-H1's scaled hook_k, ...) runs that forward on TransformerLens's own."""
ROUTE_PROJECTIONS = frozenset("qkvo")
"""The bridge's submodules whose hook points fire on the route as on TransformerLens's forward (the module calls
them on the same tensors)."""
_MODULE_ROUTE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _route_fires(component: Any) -> frozenset[str]:
    if getattr(component.config, "qk_norm_after_rope", False):
        return ROUTE_FIRES - {"hook_rot_q", "hook_rot_k"}
    return ROUTE_FIRES


def _unfired(component: nn.Module) -> tuple[Any, ...]:
    """The hook points of ``component`` the route through its module does not fire as TransformerLens's forward
    does (:data:`ROUTE_FIRES`, :data:`ROUTE_PROJECTIONS`)."""
    from transformer_lens.hook_points import HookPoint

    fired = [point for name, point in component._modules.items() if name in _route_fires(component)]
    for name in ROUTE_PROJECTIONS:
        projection = component._modules.get(name)
        fired.extend(projection.modules() if projection is not None else ())
    return tuple(
        point for point in component.modules() if isinstance(point, HookPoint) and not any(point is p for p in fired)
    )


def _module_forward(component: Any, unfired: tuple[Any, ...], *args: Any, **kwargs: Any) -> Any:
    """The forward of a component on the route through its module (:func:`_takes_module_route`): TransformerLens's
    generic AttentionBridge forward (hook_in, the Hugging Face module, hook_out), the module computing its queries,
    keys and values as it does, its attention lens_parallel's (:func:`_routed_attention`), hook_cos / hook_sin fired
    on the position embeddings handed to it. TransformerLens's own forward where a hook waits on a point the route
    does not fire (``unfired``, :func:`_unfired`) or an option only that forward serves is on."""
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    if any(point.has_hooks() for point in unfired) or _eager_now(component):
        return type(component).forward(component, *args, **kwargs)
    if kwargs.get("position_embeddings") is not None:
        kwargs["position_embeddings"] = component._apply_position_embedding_hooks(kwargs["position_embeddings"])
    return AttentionBridge.forward(component, *args, **kwargs)


def _rotary_hooks(component: Any, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hook_rot_q on the queries a module on the route hands the attention interface, hook_rot_k on its new keys
    (the last ``query_pos`` of the keys: the module's cache holds the earlier ones, and keeps the new ones as they
    were before the hook), ``[batch, head_index, pos, d_head]`` as TransformerLens's forward fires them."""
    if component not in _MODULE_ROUTE or "hook_rot_q" not in _route_fires(component):
        return query, key
    query = component.hook_rot_q(query)
    new = key[:, :, -query.shape[2] :]
    hooked = component.hook_rot_k(new)
    return query, key if hooked is new else torch.cat([key[:, :, : -query.shape[2]], hooked], dim=2)


def _bloom_bias(component: Any, kwargs: dict[str, Any], batch: int, n_key: int) -> tuple[Any, Any]:
    """Bloom's ALiBi as its block hands it to the attention (``alibi``: ``[batch * head, 1, key_pos]``, slope times
    the key's position among the row's tokens, added to the scaled scores) and its mask (SDPA's: none where
    causal alone suffices, else boolean, True where a key is allowed)."""
    alibi = kwargs.get("alibi")
    if alibi is None or alibi.shape[-1] < n_key:
        raise LibraryError(
            f"Bloom's block handed its attention an ALiBi bias of {None if alibi is None else alibi.shape[-1]} keys "
            f"for {n_key}: a transformers release changed it"
        )
    bias = einops.rearrange(alibi[..., :n_key], "(batch head) 1 key -> batch head key", batch=batch)
    return bias, kwargs.get("attention_mask")


def _mpt_bias(component: Any, kwargs: dict[str, Any], batch: int, n_key: int) -> tuple[Any, Any]:
    """MPT's ALiBi as its block hands it (``position_bias``: ``[head, 1, max_seq_len]``, slope times the distance
    from the last position, its last ``key_pos`` read, added to the scaled scores) and its mask, boolean with True
    where a key is hidden (returned as the keys allowed)."""
    position_bias, mask = kwargs.get("position_bias"), kwargs.get("attention_mask")
    if position_bias is None:
        raise LibraryError("MPT's block handed its attention no ALiBi bias: a transformers release changed it")
    if position_bias.shape[-1] < n_key:
        raise LensParallelError(
            f"MPT's ALiBi covers {position_bias.shape[-1]} positions (its config's max_seq_len), fewer than the "
            f"{n_key} keys of this forward: give it at most {position_bias.shape[-1]} tokens"
        )
    return position_bias[None, :, 0, -n_key:], None if mask is None else ~mask


def _bloom_eager_kwargs(kwargs: dict[str, Any], n_query: int, dtype: torch.dtype) -> dict[str, Any]:
    """What TransformerLens's own Bloom forward reads, whose blocks add their mask to the scores, where the model
    builds SDPA's masks: the mask as eager's additive ``[batch | 1, 1, query_pos, key_pos]`` (0 where allowed, the
    dtype's minimum where hidden; causal, the queries the last of the keys, where SDPA's is none)."""
    mask, alibi = kwargs.get("attention_mask"), kwargs["alibi"]
    if mask is not None and mask.dtype != torch.bool:
        return kwargs
    n_key = alibi.shape[-1]
    allowed = torch.ones(n_query, n_key, dtype=torch.bool, device=alibi.device).tril(n_key - n_query)
    allowed = allowed[None, None] if mask is None else mask
    zero = torch.zeros((), dtype=dtype, device=alibi.device)
    return kwargs | {"attention_mask": torch.where(allowed, zero, torch.finfo(dtype).min)}


@dataclasses.dataclass(frozen=True)
class _AlibiBridge:
    """How one ALiBi bridge's block hands its attention the bias and the mask.

    Attributes:
        bias: ``(component, kwargs, batch, key_pos) -> (bias [batch | 1, head, key_pos], mask)``, the mask as
            :func:`lens_parallel.attention.attend` reads it.
        eager_kwargs: ``(kwargs, query_pos, dtype) -> kwargs`` for TransformerLens's own forward where the Hugging
            Face model builds SDPA's masks (none, or boolean) rather than eager's square; None where the model keeps
            eager's (its blocks read no other).
    """

    bias: Callable[[Any, dict[str, Any], int, int], tuple[Any, Any]]
    eager_kwargs: Callable[[dict[str, Any], int, torch.dtype], dict[str, Any]] | None


@functools.cache
def _joint_bridges() -> tuple[type, ...]:
    """The joint-QKV bridges of TransformerLens 4.3 whose ``_reconstruct_attention`` :func:`_joint_attention` follows
    (the ALiBi ones, :func:`_alibi_biases`, besides)."""
    from transformer_lens.model_bridge.generalized_components.joint_qkv_attention import JointQKVAttentionBridge
    from transformer_lens.model_bridge.generalized_components.joint_qkv_position_embeddings_attention import (
        JointQKVPositionEmbeddingsAttentionBridge,
    )

    return JointQKVAttentionBridge, JointQKVPositionEmbeddingsAttentionBridge


@functools.cache
def _alibi_biases() -> dict[type, _AlibiBridge]:
    """The ALiBi bridges of TransformerLens 4.3 whose attention lens_parallel computes (:class:`_AlibiBridge`):
    Bloom (its model's masks SDPA's, so no square mask is built where causal alone suffices) and MPT (whose model
    turns eager's mask into booleans itself). What else their ``_reconstruct_attention`` does (the joint-QKV split,
    clip_qkv, MPT's softmax scale, the cache) is what :func:`_joint_attention` does. (Falcon's
    ``ALiBiJointQKVAttentionBridge``, alibi=True, adds the bias before scaling: no toy reaches it yet.)"""
    from transformer_lens.model_bridge.generalized_components.bloom_attention import BloomAttentionBridge
    from transformer_lens.model_bridge.generalized_components.mpt_alibi_attention import MPTALiBiAttentionBridge

    return {
        BloomAttentionBridge: _AlibiBridge(_bloom_bias, _bloom_eager_kwargs),
        MPTALiBiAttentionBridge: _AlibiBridge(_mpt_bias, None),
    }


def _joint_attention(
    component: Any, attend: Any, choose: Any, rotary: bool, q: Any, k: Any, v: Any, **kwargs: Any
) -> Any:
    """A joint-QKV bridge's ``_reconstruct_attention`` (TransformerLens 4.3) with the attention itself from
    ``attend``: the bridge's own steps (``_reshape_qkv_to_heads``, ``_apply_rotary_pos_emb``, ``_update_kv_cache``,
    ``_reshape_attn_output``, ``_apply_output_projection``) around it, which this calls rather than copies; on an
    ALiBi bridge (:func:`_alibi_biases`) its bias on the scores too, after its clip_qkv (``_clip_qkv``) and with its
    softmax scale (``_softmax_scale``). These bridges split one fused projection into q, k and v with hooks of their
    own, so their Hugging Face module (which calls the fused projection) cannot make them."""
    alibi = _alibi_biases().get(type(component))
    path = None if _eager_now(component) else choose(component)
    if path is None or path.whole_square:  # TransformerLens's own reconstruction forms the square
        if alibi is not None and alibi.eager_kwargs is not None:
            kwargs = alibi.eager_kwargs(kwargs, q.shape[1], q.dtype)
        return type(component)._reconstruct_attention(component, q, k, v, **kwargs)
    clip = getattr(component, "_clip_qkv", None)
    if clip:
        from transformer_lens.utilities.attention import clamp_qkv

        q, k, v = clamp_qkv(q, k, v, clip)
    n_heads = component.config.n_heads
    n_kv = getattr(component.config, "n_key_value_heads", None) or n_heads
    q, k, v, batch, pos, head_dim = component._reshape_qkv_to_heads(q, k, v, n_heads, n_kv)
    embeddings = kwargs.get("position_embeddings")
    if rotary and isinstance(embeddings, tuple):
        cos, sin = component._apply_position_embedding_hooks(embeddings)
        q, k = component._apply_rotary_pos_emb(q, k, cos, sin)
    k, v = component._update_kv_cache(k, v, **kwargs)
    scale = getattr(component, "_softmax_scale", None) or head_dim**-0.5
    if not rotary and getattr(component.config, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(component._layer_idx + 1)
    bias, mask = alibi.bias(component, kwargs, batch, k.shape[2]) if alibi else (None, kwargs.get("attention_mask"))
    z = attend(component, q, k, v, mask, path=path, scale=scale, softcap=None, layer=component._layer_idx, bias=bias)
    out = component._reshape_attn_output(z, batch, pos, n_heads, head_dim)
    return component._apply_output_projection(out), None


INTERFACE = "lens_parallel"
"""The name lens_parallel registers with transformers' attention interface (and its mask interface, as SDPA's)."""
_ROUTED: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, Any]] = weakref.WeakKeyDictionary()
"""Hugging Face attention module -> its TransformerLens component and the function computing its attention."""


def _routed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface under :data:`INTERFACE`: a module lens_parallel routed
    (:func:`install_attention`) has its attention computed by lens_parallel's path for its component; any other
    module (of a model that only shares the config's implementation name), and a module training with dropout, run
    transformers' SDPA function as they would otherwise. Returns ``(attn_output [batch, query_pos, head, d_head],
    None)``: no weights, so the bridge fires no read-only pattern after the fact (hook_pattern fired inside)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    routed = _ROUTED.get(module)
    if routed is None or (module.training and dropout):
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    unknown = [name for name in ("position_bias",) if kwargs.get(name) is not None]
    if unknown or kwargs.get("is_causal") is False:
        raise LibraryError(
            f"{type(module).__name__} hands the attention interface {unknown or 'is_causal=False'}, which "
            "lens_parallel's routed attention does not compute: a TransformerLens or transformers release changed it"
        )
    component, attend_routed = routed
    query, key = _rotary_hooks(component, query, key)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    z = attend_routed(
        component,
        query,
        key,
        value,
        attention_mask,
        scale=scale,
        softcap=kwargs.get("softcap"),
        window=kwargs.get("sliding_window"),
        layer=getattr(module, "layer_idx", None),
        sinks=kwargs.get("s_aux"),
    )
    return einops.rearrange(z, "batch head pos d -> batch pos head d").contiguous(), None


def _calls_attention_interface(module: nn.Module) -> bool:
    """Whether a Hugging Face attention module's forward computes its attention through transformers' attention
    interface (``ALL_ATTENTION_FUNCTIONS``), as transformers 5's modules do (GPT-Neo's and XGLM's do not)."""
    return _source_names_interface(type(module).forward)


@functools.cache
def _source_names_interface(forward: Callable[..., Any]) -> bool:
    """Whether ``forward``'s source names ``ALL_ATTENTION_FUNCTIONS`` (read once per function: reading the source
    took about 2 ms, and every :func:`lens_parallel.models.model_info` asks for each layer)."""
    import inspect

    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def _routable(component: nn.Module) -> bool:
    """Whether ``component`` is TransformerLens's generic ``AttentionBridge`` over a causal module that computes its
    attention through the attention interface: lens_parallel computes that attention itself (the route)."""
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    hf_attn: Any = component.original_component
    return (
        type(component).forward is AttentionBridge.forward
        and not getattr(hf_attn, "accepts_pattern_fn", False)
        and getattr(hf_attn, "is_causal", True) is not False
        and _calls_attention_interface(hf_attn)
    )


def _register_interface() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(INTERFACE, _routed_attention)
    AttentionMaskInterface.register(INTERFACE, sdpa_mask)


def install_attention(model: nn.Module, attend: Any, choose: Any, attend_routed: Any) -> int:
    """Give every attention component of ``model`` for which :func:`own_attention_reason` is empty lens_parallel's
    attention, written into the instance's own dictionary: the forward of a PositionEmbeddingsAttentionBridge (the
    route through its module, :func:`_module_forward`), the ``_reconstruct_attention`` of a joint-QKV bridge
    (``attend``, on the path ``choose(component)`` picks); the attention interface's function (``attend_routed``)
    for a module on a route. The Hugging Face model builds its masks for SDPA (a
    boolean mask, or none when causal alone suffices) instead of eager's additive float square, where it allows SDPA
    (Gemma 2 does not: its additive mask is read); every path reads either. Returns how many components took it."""
    check("transformer-lens")
    check("transformers")
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
    from transformer_lens.model_bridge.generalized_components.joint_qkv_position_embeddings_attention import (
        JointQKVPositionEmbeddingsAttentionBridge,
    )

    taken = 0
    for component in [m for m in model.modules() if isinstance(m, AttentionBridge)]:
        if own_attention_reason(component):
            continue
        taken += 1
        if component in _OWN_ATTENTION:
            continue
        if _routable(component):
            _ROUTED[hf_module(component)] = (component, attend_routed)
        elif _takes_module_route(component):
            _ROUTED[hf_module(component)] = (component, attend_routed)
            vars(component)["forward"] = functools.partial(_module_forward, component, _unfired(component))
            _MODULE_ROUTE.add(component)
        else:
            rotary = isinstance(component, JointQKVPositionEmbeddingsAttentionBridge)
            vars(component)["_reconstruct_attention"] = functools.partial(
                _joint_attention, component, attend, choose, rotary
            )
        _OWN_ATTENTION.add(component)
    alibis = [_alibi_biases()[type(m)] for m in model.modules() if type(m) in _alibi_biases()]
    if taken and all(alibi.eager_kwargs is not None for alibi in alibis):  # MPT's blocks read eager's masks only
        _register_interface()
        hf_model: Any = model.original_model
        with contextlib.suppress(ValueError):  # a model that refuses it keeps eager's additive mask, which is read
            hf_model.set_attn_implementation(INTERFACE)
        if alibis:  # Bloom accepts the name and keeps eager (no attention backend): its masks only are built here
            hf_model.config._attn_implementation = INTERFACE
    return taken


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Softmax attention from a fused kernel that also returns each row's log-sum-exp, log sum_s exp(s_ts):
    ``(out [batch, head, query, d], lse [batch, head, query])``; ``q``, ``k``, ``v`` with the same heads, ``mask``
    additive in the queries' dtype (``causal``: queries and keys aligned at the top-left). On a CPU, PyTorch's fused
    CPU kernel; on CUDA (and on the ``meta`` device, which checks its shapes without a GPU), the memory-efficient
    kernel with ``compute_log_sumexp`` (its log-sum-exp is padded to a multiple of 32 queries, and its bias must
    have rows aligned to 16 elements: the mask is copied into such rows where they are not, as PyTorch's own
    ``scaled_dot_product_attention`` does). None where no such kernel serves (another device, a torch outside
    :data:`CHECKED`, values of another head size than the keys', a configuration the CUDA kernel refuses): the
    caller computes the rows itself."""
    low, high, _ = CHECKED["torch"]
    if v.shape[-1] != k.shape[-1] or not low <= version_of("torch") < high:
        return None
    if q.device.type == "cpu":
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = kernel(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        return out, lse
    if q.device.type not in ("cuda", "meta"):
        return None
    bias = None
    if mask is not None:  # broadcast over batch and heads as given (stride 0), rows aligned to 16 elements
        bias = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        if bias.stride(-2) % 16 or bias.stride(-1) != 1:
            width = -(-k.shape[2] // 16) * 16
            bias = bias.new_empty(*bias.shape[:-1], width)[..., : k.shape[2]].copy_(bias)
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )
    except RuntimeError:  # a head size, dtype or alignment the kernel does not take: the caller's own rows
        return None
    return out, lse[..., : q.shape[2]]


class _Counting:
    """The operations dispatched while a :func:`dispatch_counts` block runs: ``kernels`` excludes views (operations
    whose outputs alias an input without writing it: reshapes, slices, transposes), which launch no kernel."""

    def __init__(self) -> None:
        self.all: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def dispatch_counts() -> Iterator[_Counting]:
    """Count every aten operation dispatched inside (PyTorch's ``TorchDispatchMode``): a device-independent measure
    of how many kernels a computation launches, so that a loop of small blocks (cheap on a CPU, launch-bound on a
    GPU) shows on a CPU too."""
    check("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = _Counting()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = str(func.overloadpacket.__name__)
            counts.all[name] += 1
            returns = func._schema.returns
            if not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)):
                counts.kernels[name] += 1
            return func(*args, **(kwargs or {}))

    with Mode():  # type: ignore[no-untyped-call]
        yield counts


def cache_keywords(hf_model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keywords that hand ``cache`` to ``hf_model``'s forward: ``cache=`` where it takes that name (transformers
    5.24 deprecates ``past_key_values``, to be removed in 5.40), else ``past_key_values=``; ``use_cache`` on."""
    check("transformers")
    import inspect

    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """transformers' own chunked gated delta rule (Qwen3.5's linear attention, ``torch_chunk_gated_delta_rule``,
    float32 inside), q and k l2-normalised in the kernel: ``query``/``key`` ``[batch, pos, head, d_k]`` (already one
    per value head), ``value`` ``[batch, pos, head, d_v]``, ``g``/``beta`` ``[batch, pos, head]``; returns o
    ``[batch, pos, head, d_v]``. The rule is linear in the values, so identity values give its mixing weights."""
    check("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    out, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    return cast(torch.Tensor, out)


# -- lm-evaluation-harness ---------------------------------------------------------------------------------------


def add_special_kwargs(add_special_tokens: bool | None, add_bos_token: bool | None) -> dict[str, Any]:
    """The tokenizer keywords lm-eval's ``hf`` model passes (its private ``_add_special_kwargs``)."""
    check("lm_eval")
    from lm_eval.models.utils import _add_special_kwargs

    out: dict[str, Any] = _add_special_kwargs(add_special_tokens, add_bos_token)
    return out


def task_yaml(path: str) -> dict[str, Any]:
    """An lm-eval task YAML (its ``include:`` chain merged) as data, its ``!function`` helpers left unimported (some
    import metrics from the Hugging Face hub: HumanEval's ``code_eval``)."""
    check("lm_eval")
    from lm_eval.tasks._yaml_loader import load_yaml

    return cast(dict[str, Any], load_yaml(path, resolve_func=False, recursive=True))


def task_manager_with_metadata(manager: Any, metadata: dict[str, Any]) -> Any:
    """A copy of lm-eval's ``TaskManager`` ``manager`` that hands ``metadata`` to every task it loads, sharing its
    index of task YAMLs (which a new manager would scan again: about 20 s here)."""
    check("lm_eval")
    from lm_eval.tasks._factory import TaskFactory

    copied = copy.copy(manager)
    copied.metadata = metadata
    copied._factory = TaskFactory(meta=metadata)
    return copied


def _with_index(manager: Any, index: dict[str, Any]) -> Any:
    """A copy of lm-eval's ``TaskManager`` ``manager`` over ``index`` (name -> entry), its name lists rebuilt."""
    from lm_eval.tasks._index import Kind

    merged = copy.copy(manager)
    merged._index = index
    kinds: dict[Any, list[str]] = collections.defaultdict(list)
    for name, entry in index.items():
        kinds[entry.kind].append(name)
    merged._all_tasks = sorted(index)
    merged._all_subtasks = sorted([*kinds[Kind.TASK], *kinds[Kind.PY_TASK]])
    merged._all_groups = sorted(kinds[Kind.GROUP])
    merged._all_tags = sorted(kinds[Kind.TAG])
    return merged


def task_manager_from_cache(cache: Path) -> Any:
    """lm-eval's ``TaskManager`` of its own tasks, its index (every task YAML parsed: about 6 s here, 11 s on a busy
    machine) read from a file in ``cache`` written by the first build, when that file was written for the same
    installed lm-eval: its version, its tasks folder and the name, size and modification time of every file there
    (about 0.1 s to read; any edit, addition or removal rebuilds it). The file is written atomically; one that cannot
    be read is rebuilt."""
    check("lm_eval")
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    folder = Path(lm_eval.tasks.__file__).parent
    digest = hashlib.sha256(f"{version_text('lm_eval')}|{folder}".encode())
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            stat = os.stat(os.path.join(root, name))
            digest.update(f"{root}/{name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    path = cache / f"lm_eval_task_index-{digest.hexdigest()[:16]}.pickle"
    with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        index = pickle.loads(path.read_bytes())  # this process's own cache, written below
        return _with_index(TaskManager(include_defaults=False), index)
    manager = TaskManager()
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_bytes(pickle.dumps(manager._index, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(tmp, path)
    return manager


def task_manager_with_include(manager: Any, include_path: str) -> Any:
    """lm-eval's ``TaskManager`` ``manager`` (its index of lm-eval's own task YAMLs) with the YAMLs of
    ``include_path`` added, as ``TaskManager(include_path=...)`` indexes them (later paths override): only the
    folder is scanned, not lm-eval's thousands of YAMLs again (about 10 s here)."""
    check("lm_eval")
    from lm_eval.tasks import TaskManager

    added = TaskManager(include_path=include_path, include_defaults=False, metadata=manager.metadata)
    merged = _with_index(manager, {**manager._index, **added._index})
    merged.include_path = include_path
    return merged


@contextlib.contextmanager
def lm_eval_quietly(*, progress: bool) -> Iterator[None]:
    """Inside, lm-eval's evaluator records no git commit (its ``get_git_commit_hash`` runs ``git describe`` in the
    working folder, which prints ``fatal: not a git repository`` outside a checkout: the run's provenance holds
    lens_parallel's version instead) and no environment (its ``add_env_info`` runs torch's ``collect_env``, which
    runs ``pip list`` and a dozen other commands: 0.6 s per evaluation, per setting; the provenance holds the
    versions that make the numbers), and without ``progress`` its tasks build their requests without a progress bar
    (``Task.build_all_requests`` draws one that no argument turns off). Its prompt templates are compiled once each
    (``lm_eval.utils.apply_template`` compiles its Jinja source at every call: for every document and every
    few-shot example of it, 2,387 compilations and 3.7 s of a 33 s profiled run of the general tasks), rendered as
    before."""
    check("lm_eval")
    import lm_eval.api.task
    import lm_eval.evaluator
    import lm_eval.utils

    real = (
        lm_eval.evaluator.get_git_commit_hash,
        lm_eval.evaluator.add_env_info,
        lm_eval.api.task.tqdm,
        lm_eval.utils.apply_template,
    )
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    lm_eval.evaluator.add_env_info = lambda results: None
    lm_eval.utils.apply_template = lambda template, doc: _lm_eval_template(template).render(**doc)
    if not progress:
        lm_eval.api.task.tqdm = functools.partial(real[2], disable=True)
    try:
        yield
    finally:
        (
            lm_eval.evaluator.get_git_commit_hash,
            lm_eval.evaluator.add_env_info,
            lm_eval.api.task.tqdm,
            lm_eval.utils.apply_template,
        ) = real


@functools.lru_cache(maxsize=4096)
def _lm_eval_template(source: str) -> Any:
    """lm-eval's prompt template ``source`` compiled in its own Jinja environment (``lm_eval.utils.env``)."""
    import lm_eval.utils

    return lm_eval.utils.env.from_string(source)


def import_ruler_without_download() -> None:
    """Import lm-eval's RULER haystack module, which on import downloads NLTK's ``punkt_tab`` when it is missing
    (and then prints that it did, even when the download failed offline), with that download skipped: ``punkt_tab``
    serves only the essay haystacks (Paul Graham's essays, a hub dataset), which
    :func:`lens_parallel.downstream.data.ruler_metadata` refuses without it."""
    import sys

    name = "lm_eval.tasks.ruler.prepare_niah"
    if name in sys.modules:
        return
    check("lm_eval")
    import importlib

    import nltk

    real = nltk.data.find

    def find(resource: str, *args: Any, **kwargs: Any) -> Any:
        return None if resource == "tokenizers/punkt_tab" else real(resource, *args, **kwargs)

    nltk.data.find = find
    try:
        importlib.import_module(name)
    finally:
        nltk.data.find = real


@contextlib.contextmanager
def hub_offline_mode(offline: bool) -> Iterator[None]:
    """Inside, when ``offline``, ``datasets`` and ``huggingface_hub`` act as under ``HF_HUB_OFFLINE=1`` (read from
    their caches or fail at once, where they would otherwise retry the network for about a minute)."""
    if not offline:
        yield
        return
    check("datasets")
    import datasets.config
    import huggingface_hub.constants

    before = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = before


# -- transformers ------------------------------------------------------------------------------------------------


def drop_config_field(config: Any, name: str) -> None:
    """Remove ``name`` from a transformers config (a GGUF-loaded model's quantizer, which cannot be saved)."""
    check("transformers")
    config.__dict__.pop(name, None)
