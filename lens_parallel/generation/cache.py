"""The key/value cache as the bridge's layers must see it while decoding, and how a Hugging Face model is handed it.

TransformerLens 4.3's attention bridges extend a cache only when it arrives as ``past_key_values`` or
``layer_past``; transformers 5's decoder layers hand it over as ``cache=``, so the bridge's own cached decoding lets
each new token attend to itself alone (its ``generate`` with the cache is wrong on Llama-family models).
:func:`cache_reaches_attention` passes it on; ``tests/test_generation.py`` checks the tokens against Hugging Face's
own ``generate`` on the same weights and token ids.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import einops
from torch import nn

from lens_parallel import compat
from lens_parallel.attention.routes import cache_handed


def cache_keywords(hf_model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keywords that hand ``cache`` to ``hf_model``'s forward: ``cache=`` where it takes that name (transformers
    5.24 deprecates ``past_key_values``, to be removed in 5.40), else ``past_key_values=``; ``use_cache`` on."""
    compat.check("transformers")
    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _reading_cache(
    original: Any, layer: int | None, values: dict[int, Any] | None, k: Any, v: Any, **kwargs: Any
) -> Any:
    """An attention bridge's cache step that also takes the cache as ``cache=``, and hands ``values`` the layer's
    values over every key it reads."""
    k, v = original(k, v, **cache_handed(kwargs))
    if values is not None and layer is not None:
        values[layer] = einops.rearrange(v, "batch head_index pos d_head -> batch pos head_index d_head")
    return k, v


def _recurrent_reading_cache(mixer: Any, *args: Any, **kwargs: Any) -> Any:
    """A linear-attention bridge's forward that takes Hugging Face's cached path for a cache handed as ``cache=``
    too (else the prefill stores no recurrent state and each step starts from none)."""
    if kwargs.get("cache") is not None and kwargs.get("cache_params") is None:
        return compat.bridge_attribute(mixer, "native_forward")(*args, **kwargs)
    return type(mixer).forward(mixer, *args, **kwargs)


@contextlib.contextmanager
def cache_reaches_attention(model: nn.Module, *, values: dict[int, Any] | None = None) -> Iterator[None]:
    """While inside, the key/value cache reaches every attention bridge of ``model`` (each one's cache step takes
    ``cache=`` too) and every linear-attention bridge (Qwen3.5's ``GatedDeltaNetBridge`` takes Hugging Face's own
    cached path only for ``cache_params``: inside, for ``cache=`` too). ``values``, if given, receives at each
    forward every layer's values over all the positions its attention reads, cached and new (``values[layer]``:
    [batch, key_pos, head_index, d_head], key-value heads, a view of the cache), for the edits that need more than
    the current positions' own (:data:`lens_parallel.edits.STEP_VALUES`). Thread-safety is the caller's
    (:func:`lens_parallel.hooks.model_lock`)."""
    compat.check("transformers")
    classes = compat.bridge_classes()
    components = [m for m in model.modules() if isinstance(m, classes.generic)]
    recurrent = [m for m in model.modules() if isinstance(m, classes.recurrent)]

    updates = [
        functools.partial(
            _reading_cache, compat.bridge_attribute(c, "cache_update"), compat.bridge_attribute(c, "layer"), values
        )
        for c in components
    ]
    forwards = [functools.partial(_recurrent_reading_cache, mixer) for mixer in recurrent]
    with (
        compat.steps_replaced("cache_update", components, updates),
        compat.steps_replaced("forward", recurrent, forwards),
    ):
        yield
