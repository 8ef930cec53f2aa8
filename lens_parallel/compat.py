"""Every use of another package's private API or internals, in one place, each checked against the version range it
was verified on (:data:`CHECKED`): a newer release that may have moved them fails loudly, in one line naming the
package and its version, instead of silently computing something else. Nothing else in lens_parallel imports a
private name of another package (``tests/test_compat.py`` checks both).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from collections.abc import Iterator, Sequence
from typing import Any, cast

import einops
from torch import nn

from lens_parallel.errors import LibraryError

CHECKED: dict[str, tuple[tuple[int, int], tuple[int, int], str]] = {
    "transformer-lens": (
        (4, 3),
        (5, 0),
        "TransformerBridge internals: a component's wrapped Hugging Face module (original_component, the "
        "'._original_component' segment of parameter names), align_offloaded_subtree, and start_at_layer swapping "
        "the caller's residual in at block k (prefix reuse), attention bridges' _update_kv_cache reading the cache "
        "only as past_key_values / layer_past and returning the whole [batch, head, pos, d_head] values, each "
        "attention bridge's _layer_idx; GatedDeltaNetBridge taking HF's cached path (_native_forward) only for "
        "cache_params",
    ),
    "lm_eval": (
        (0, 4),
        (0, 5),
        "lm_eval.models.utils._add_special_kwargs (how the hf model sets add_special_tokens), "
        "lm_eval.tasks._yaml_loader.load_yaml (a task's YAML read without importing its !function helpers)",
    ),
    "transformers": (
        (5, 0),
        (6, 0),
        "a config's quantization_config removed through its __dict__ (GGUF export); decoder layers handing their "
        "attention the key/value cache as cache=",
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


def cache_keywords(hf_model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keywords that hand ``cache`` to ``hf_model``'s forward: ``cache=`` where it takes that name (transformers
    5.24 deprecates ``past_key_values``, to be removed in 5.40), else ``past_key_values=``; ``use_cache`` on."""
    check("transformers")
    import inspect

    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


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


# -- transformers ------------------------------------------------------------------------------------------------


def drop_config_field(config: Any, name: str) -> None:
    """Remove ``name`` from a transformers config (a GGUF-loaded model's quantizer, which cannot be saved)."""
    check("transformers")
    config.__dict__.pop(name, None)
