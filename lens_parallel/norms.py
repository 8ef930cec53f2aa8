"""The bridge's normalisation layers as Hugging Face computes them, without the statistics nobody reads.

TransformerLens 4.3's ``NormalizationBridge`` on Hugging Face's own norm (``use_native_layernorm_autograd``: every
bridge ``boot_transformers`` makes but GPT-2's) computes each norm's statistics for its ``hook_scale`` and
``hook_normalized`` (x - mean, the mean of x^2, its rsqrt and sqrt, x times the rsqrt) whether a hook reads them or
not, and then, when no hook edited them, returns the Hugging Face module's own output: every norm of the model is
computed twice (smollm2-135m at 4 x 512 tokens: the forward 1.07x Hugging Face's SDPA forward with that work, 0.96x
without, in one process). :func:`install` gives each such component a forward that is TransformerLens's less that
dead work: with nothing on ``hook_scale`` or ``hook_normalized``, ``hook_in``, the Hugging Face module, ``hook_out``
(its output cast to the input's dtype), which is what TransformerLens's returns then, to the bit. A hook on either
(``run_with_cache``) takes TransformerLens's own forward, whose source is pinned (:data:`NORM_SOURCES`); a norm
TransformerLens computes itself (GPT-2's, an identity slot) keeps it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lens_parallel import compat

NORM_SOURCES: Mapping[str, str] = {
    "NormalizationBridge.forward": "bdc0cd3ff1c5caed",
    "NormalizationBridge._hf_autograd_forward_with_hooks": "6937e584f90ada1e",
}
"""The TransformerLens 4.3.0 forward :func:`install` stands in for, by the first 16 hex digits of the SHA-256 of its
source (``tests/test_hooks.py`` checks them): a release that changes it must be checked again."""


def _forward(component: Any, hidden_states: Tensor, **kwargs: Any) -> Tensor:
    """A normalisation component's forward (module docstring)."""
    hooked = component.hook_scale.has_hooks() or component.hook_normalized.has_hooks()
    if hooked or not component.use_native_layernorm_autograd:
        own: Tensor = type(component).forward(component, hidden_states, **kwargs)
        return own
    x = component.hook_in(hidden_states)
    out: Tensor = compat.hf_module(component)(x)
    hooked_out: Tensor = component.hook_out(out if out.dtype == x.dtype else out.to(x.dtype))
    return hooked_out


def install(model: nn.Module) -> int:
    """Give every normalisation component of ``model`` (a TransformerBridge) on Hugging Face's own norm the forward
    of the module docstring; returns how many took it. Idempotent."""
    norm = compat.bridge_classes().norm
    taken = 0
    for component in model.modules():
        native = isinstance(component, norm) and component.use_native_layernorm_autograd
        if native and type(component).forward is norm.forward and _wraps_a_norm(component):
            compat.install_step(component, "forward", functools.partial(_forward, component))
            taken += 1
    return taken


def _wraps_a_norm(component: Any) -> bool:
    """Whether ``component`` wraps a Hugging Face norm (not an identity slot: ModernBERT-decoder's first layer)."""
    module = compat.hf_module(component)
    return module is not None and not isinstance(module, nn.Identity)
