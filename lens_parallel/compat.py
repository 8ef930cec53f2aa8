"""Every private name of another package that lens_parallel uses, in one place, each checked against the version
range it was verified on (:data:`CHECKED`): a newer release that may have moved them fails loudly, in one line
naming the package and its version, instead of silently computing something else. Nothing else in lens_parallel
names a private attribute, module or import of another package (``tests/test_compat.py`` checks both); what is done
with them (which attention route a layer takes, how lm-eval's task index is reused, the key/value cache's shims)
lives with its users, calling these.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from lens_parallel.errors import LibraryError

CHECKED: dict[str, tuple[tuple[int, int], tuple[int, int], str]] = {
    "transformer-lens": (
        (4, 3),
        (5, 0),
        "SUPPORTED_ARCHITECTURES, original_component (and '._original_component' in parameter names), "
        "align_offloaded_subtree, the generalized_components' classes and the attributes of compat.PRIVATE "
        "(_update_kv_cache reading the cache as past_key_values / layer_past), start_at_layer swapping the "
        "caller's residual in at block k",
    ),
    "lm_eval": (
        (0, 4),
        (0, 5),
        "_add_special_kwargs, _yaml_loader.load_yaml, a TaskManager's _factory (TaskFactory), _index (Kind) and "
        "_all_* name lists; what lens_parallel replaces while it runs (the evaluator's get_git_commit_hash and "
        "add_env_info, lm_eval.api.task.tqdm, lm_eval.utils.apply_template, nltk.data.find in RULER's import)",
    ),
    "datasets": ((4, 0), (6, 0), "datasets.config.HF_HUB_OFFLINE read at each load_dataset call"),
    "torch": (
        (2, 13),
        (3, 0),
        "aten._scaled_dot_product_flash_attention_for_cpu, _efficient_attention (log-sum-exp kernels; else the "
        "diagonal path falls back to the blocked one), _python_dispatch.TorchDispatchMode",
    ),
    "transformers": (
        (5, 0),
        (6, 0),
        "a config's __dict__ (GGUF export) and _attn_implementation, decoder layers handing their attention the "
        "key/value cache as cache=, qwen3_5's torch_chunk_gated_delta_rule",
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


@functools.cache
def bridged_architectures() -> frozenset[str]:
    """The Hugging Face classes TransformerLens's ``TransformerBridge`` has an adapter for."""
    check("transformer-lens")
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    return frozenset(SUPPORTED_ARCHITECTURES)


@dataclasses.dataclass(frozen=True)
class BridgeClasses:
    """TransformerLens's attention and recurrent bridge classes (its ``generalized_components``)."""

    generic: Any
    position: Any
    joint: Any
    joint_rotary: Any
    bloom: Any
    mpt: Any
    recurrent: Any
    norm: Any


@functools.cache
def bridge_classes() -> BridgeClasses:
    """TransformerLens's :class:`BridgeClasses`."""
    check("transformer-lens")
    from transformer_lens.model_bridge import generalized_components

    parts: Any = generalized_components  # its __init__ imports these without listing every one in __all__
    return BridgeClasses(
        parts.AttentionBridge,
        parts.PositionEmbeddingsAttentionBridge,
        parts.JointQKVAttentionBridge,
        parts.JointQKVPositionEmbeddingsAttentionBridge,
        parts.BloomAttentionBridge,
        parts.MPTALiBiAttentionBridge,
        parts.GatedDeltaNetBridge,
        parts.NormalizationBridge,
    )


def hf_module(component: nn.Module) -> nn.Module:
    """The Hugging Face module a TransformerBridge component wraps."""
    return cast(nn.Module, component.original_component)


def plain_name(name: str) -> str:
    """A bridge parameter or state-dict name as the Hugging Face model spells it."""
    return name.replace("._original_component", "")


@contextlib.contextmanager
def weights_materialised(module: nn.Module) -> Iterator[None]:
    """``module``'s weights present on their device while inside, also when accelerate offloaded them."""
    check("transformer-lens")
    from transformer_lens.model_bridge.generalized_components.base import align_offloaded_subtree

    with align_offloaded_subtree(module):
        yield


PRIVATE: Mapping[str, str] = {
    "layer": "_layer_idx",  # an attention or recurrent bridge's layer index
    "upcast": "_reorder_and_upcast_attn",  # GPT-2's attention in float32
    "softmax_scale": "_softmax_scale",  # a joint-QKV bridge's own scale (MPT's), or None
    "clip_qkv": "_clip_qkv",  # MPT's clip of q, k and v, or None
    "weights_processed": "_weights_processed",  # process_weights ran (not which folds)
    "position_hooks": "_apply_position_embedding_hooks",  # (cos, sin) through hook_cos / hook_sin
    "to_heads": "_reshape_qkv_to_heads",  # a joint-QKV bridge's steps of its _reconstruct_attention ...
    "rotary": "_apply_rotary_pos_emb",
    "cache_update": "_update_kv_cache",
    "merge_heads": "_reshape_attn_output",
    "project": "_apply_output_projection",
    "reconstruction": "_reconstruct_attention",  # ... and the whole of it
    "native_forward": "_native_forward",  # a linear-attention bridge's Hugging Face module, cached
    "norm_statistics": "_hf_autograd_forward_with_hooks",  # a norm's hooked statistics, then its module
    "forward": "forward",
}
"""What lens_parallel calls TransformerLens's private attributes of a bridge or component, and their names."""


def bridge_attribute(owner: Any, name: str) -> Any:
    """``owner``'s TransformerLens attribute ``name`` (:data:`PRIVATE`), None where it has none."""
    return getattr(owner, PRIVATE[name], None)


def install_step(component: nn.Module, name: str, fn: Callable[..., Any]) -> None:
    """Give ``component`` its own ``name`` (:data:`PRIVATE`: ``forward``, ``reconstruction``), written into the
    instance's dictionary (a bridge component passes attribute writes through to the module it wraps)."""
    vars(component)[PRIVATE[name]] = fn


@contextlib.contextmanager
def steps_replaced(name: str, components: Sequence[nn.Module], steps: Sequence[Any]) -> Iterator[None]:
    """Each component's ``name`` (:data:`PRIVATE`) replaced by the matching one of ``steps`` while inside."""
    for component, step in zip(components, steps, strict=True):
        install_step(component, name, step)
    try:
        yield
    finally:
        for component in components:
            del vars(component)[PRIVATE[name]]


# -- torch -------------------------------------------------------------------------------------------------------


@functools.cache  # asked at every layer's forward: the installed torch's version is read once
def lse_attention_kernel(device_type: str) -> Callable[..., Any] | None:
    """PyTorch's fused attention kernel that returns each row's log-sum-exp on ``device_type`` (CPU; CUDA's
    memory-efficient one, ``meta`` too), or None."""
    low, high, _ = CHECKED["torch"]
    if not low <= version_of("torch") < high:
        return None
    if device_type == "cpu":
        return cast(Callable[..., Any], torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    if device_type in ("cuda", "meta"):
        return cast(Callable[..., Any], torch.ops.aten._scaled_dot_product_efficient_attention)
    return None


def dispatch_mode(seen: Callable[[str, bool], None]) -> contextlib.AbstractContextManager[Any]:
    """A PyTorch ``TorchDispatchMode`` that calls ``seen(name, view)`` for every aten operation dispatched inside it
    (``view``: its outputs alias an input without writing it, so it launches no kernel)."""
    check("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            returns = [r.alias_info for r in func._schema.returns]
            seen(str(func.overloadpacket.__name__), bool(returns) and all(a and not a.is_write for a in returns))
            return func(*args, **(kwargs or {}))

    return cast(contextlib.AbstractContextManager[Any], Mode())  # type: ignore[no-untyped-call]


# -- transformers ------------------------------------------------------------------------------------------------


def drop_config_field(config: Any, name: str) -> None:
    """Remove ``name`` from a transformers config (a GGUF-loaded model's quantizer, which cannot be saved)."""
    check("transformers")
    config.__dict__.pop(name, None)


def name_attention_implementation(config: Any, name: str) -> None:
    """Set a config's attention implementation by name alone (a model that builds its masks by the name and
    accepts it without an attention backend: Bloom)."""
    check("transformers")
    config._attn_implementation = name


def gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """transformers' chunked gated delta rule (Qwen3.5's linear attention), q and k l2-normalised in the kernel:
    ``[batch, pos, head, d_k]`` (one per value head), ``value`` ``[..., d_v]``, g and beta ``[batch, pos, head]``."""
    check("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    out, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    return cast(torch.Tensor, out)


# -- lm-evaluation-harness ---------------------------------------------------------------------------------------


def add_special_kwargs(add_special_tokens: bool | None, add_bos_token: bool | None) -> dict[str, Any]:
    """The tokenizer keywords lm-eval's ``hf`` model passes."""
    check("lm_eval")
    from lm_eval.models.utils import _add_special_kwargs

    out: dict[str, Any] = _add_special_kwargs(add_special_tokens, add_bos_token)
    return out


def task_yaml(path: str) -> dict[str, Any]:
    """An lm-eval task YAML (its ``include:`` chain merged) as data, its ``!function`` helpers left unimported."""
    check("lm_eval")
    from lm_eval.tasks._yaml_loader import load_yaml

    return cast(dict[str, Any], load_yaml(path, resolve_func=False, recursive=True))


def task_index(manager: Any) -> dict[str, Any]:
    """A ``TaskManager``'s index of task YAMLs (name -> entry; its entries pickle)."""
    check("lm_eval")
    return cast(dict[str, Any], manager._index)


def with_task_index(manager: Any, index: dict[str, Any]) -> Any:
    """A copy of ``manager`` over ``index``, its name lists rebuilt from it."""
    check("lm_eval")
    from lm_eval.tasks._index import Kind

    merged = copy.copy(manager)
    merged._index = index
    kinds: dict[Any, list[str]] = {kind: [] for kind in Kind}
    for name, entry in index.items():
        kinds[entry.kind].append(name)
    merged._all_tasks = sorted(index)
    merged._all_subtasks = sorted([*kinds[Kind.TASK], *kinds[Kind.PY_TASK]])
    merged._all_groups = sorted(kinds[Kind.GROUP])
    merged._all_tags = sorted(kinds[Kind.TAG])
    return merged


def with_task_metadata(manager: Any, metadata: dict[str, Any]) -> Any:
    """A copy of ``manager`` that hands ``metadata`` to every task it loads, sharing its index."""
    check("lm_eval")
    from lm_eval.tasks._factory import TaskFactory

    copied = copy.copy(manager)
    copied.metadata = metadata
    copied._factory = TaskFactory(meta=metadata)
    return copied
