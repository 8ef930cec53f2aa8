"""Running forwards: one per model at a time (:func:`model_lock`), to the unembedding's input and no further
(:func:`forward`), skipping the blocks a resumed forward does not need, and saying where a
NaN or an infinity first appeared (:func:`raise_non_finite`). Nothing here computes the logits."""

from __future__ import annotations

import contextlib
import threading
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat, observers
from lens_parallel.errors import NonFiniteError
from lens_parallel.geometry import expand_kv as expand_kv  # where the analyses and edits import it from
from lens_parallel.hooks.names import Hook
from lens_parallel.kept import kept


@contextlib.contextmanager
def model_lock(model: TransformerBridge) -> Iterator[None]:
    """The lock of one model's forwards (re-entrant, kept on the model): its hooks and patched blocks are that
    model's shared state, so forwards of one model from several threads take turns, while forwards of different
    models run at once. Inside, the forward is lens_parallel's (:func:`lens_parallel.observers.analysing`: hooks the
    user left on the bridge are watched)."""
    with kept(model, "lock", threading.RLock), observers.analysing(model):
        yield


def _passthrough(hidden_states: Any, *args: object, **kwargs: object) -> Any:
    return hidden_states


@contextlib.contextmanager
def _passing_through(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Each module's forward replaced by the identity on its first argument while inside (re-entrant: nested
    contexts count per module, :data:`_SKIP_DEPTH`)."""
    for module in modules:
        count = _SKIP_DEPTH.get(id(module), 0)
        if count == 0:
            module.forward = _passthrough
        _SKIP_DEPTH[id(module)] = count + 1
    try:
        yield
    finally:
        for module in modules:
            _SKIP_DEPTH[id(module)] -= 1
            if _SKIP_DEPTH[id(module)] == 0:
                del _SKIP_DEPTH[id(module)]
                del module.forward


_SKIP_DEPTH: dict[int, int] = {}
"""How many :func:`skip_blocks_before` contexts hold each skipped module (by id, while they hold it)."""


@contextlib.contextmanager
def skip_blocks_before(model: TransformerBridge, layer: int) -> Iterator[None]:
    """Make blocks ``0..layer-1`` return their input untouched, for a forward with ``start_at_layer=layer``.

    TransformerLens 4.3's ``start_at_layer`` still runs every earlier block and then swaps the caller's residual
    in at ``layer``, so reusing a cached prefix saves nothing by itself (there is no supported way to skip them).
    Inside this context the earlier blocks' Hugging Face layers (which in transformers 5 return the bare
    hidden-state tensor) are skipped; their output was discarded anyway, so the forward's result is unchanged
    (tested against the full forward on every toy family). Re-entrant (nested contexts count per block) and
    thread-safe (the model's lock, :func:`model_lock`, held for the context's duration: forwards of the same model
    in other threads wait); the installed TransformerLens is checked first (:data:`lens_parallel.compat.CHECKED`).
    """
    compat.check("transformer-lens")
    with model_lock(model), _passing_through([compat.hf_module(model.blocks[i]) for i in range(layer)]):
        yield


FINAL_HOOK = "unembed.hook_in"
"""Where the final normalised residual enters the unembedding: every forward here ends at this hook."""


def forward(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[Hook] = (),
    *,
    resid: Float[Tensor, "batch pos d_model"] | None = None,
    start_at_layer: int | None = None,
    grad: bool = False,
) -> Float[Tensor, "batch pos d_model"] | None:
    """The one forward every analysis runs: over ``tokens`` (or from ``resid`` entering block ``start_at_layer``,
    the earlier blocks not computed: :func:`skip_blocks_before`) under ``hooks``, without gradients (``grad``: under
    the caller's grad mode, for training and gradient passes), ended before the unembedding. Returns the final
    normalised residual (the unembedding's input), or None when a hook ended the forward earlier by raising
    :class:`StopForward`. The logits are never computed (losses come from
    :func:`lens_parallel.losses.chunked_token_nll`): TransformerLens 4.3's ``stop_at_layer=n_layers`` still runs the
    unembedding. No key/value cache is built (``use_cache=False``): nothing here decodes, and a checkpointed block's
    recompute (:func:`checkpointed_blocks`) must not extend one. Thread-safe: forwards of the same model in other
    threads wait (:func:`model_lock`). A final residual holding NaN or infinity is
    refused by :func:`raise_non_finite` (where it first appears, and why); :meth:`LayerStream.run` does the same for
    its captures."""
    kept: list[Tensor] = []

    def stop_at_unembedding(tensor: Tensor, hook: HookPoint) -> None:
        kept.append(tensor)
        raise StopForward

    with contextlib.nullcontext() if grad else torch.inference_mode():
        _run(model, tokens, [*hooks, (FINAL_HOOK, stop_at_unembedding)], resid, start_at_layer)
    if kept and not is_finite(kept[0]):
        raise_non_finite(model, tokens, hooks, resid=resid, start_at_layer=start_at_layer)
    return kept[0] if kept else None


def _run(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[tuple[str | Callable[[str], bool], Callable[..., Tensor | None]]],
    resid: Float[Tensor, "batch pos d_model"] | None,
    start_at_layer: int | None,
) -> None:
    """The bridge's forward over ``tokens``, or from ``resid`` entering block ``start_at_layer``, under ``hooks``
    (a hook name or a name filter each; no logits are returned, no key/value cache is built), ended quietly by
    :class:`StopForward`. One forward at a time: hooks are the model's shared state, and another thread's stop hook
    registered on the same model would end this forward first."""
    try:
        with model_lock(model), model.hooks(fwd_hooks=list(hooks)):
            if resid is None:
                model(tokens, return_type=None, use_cache=False)
            else:
                with skip_blocks_before(model, start_at_layer or 0):
                    model(resid, start_at_layer=start_at_layer, return_type=None, use_cache=False)
    except StopForward:
        pass


def is_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (neither NaN nor infinite)."""
    return bool(torch.isfinite(tensor).all())


def raise_non_finite(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[Hook] = (),
    *,
    resid: Float[Tensor, "batch pos d_model"] | None = None,
    start_at_layer: int | None = None,
    output: str = "the final residual",
) -> typing.NoReturn:
    """Refuse a forward that produced NaN or infinity, naming where it first appears: the forward is rerun with
    ``hooks`` and a check after them at every hook point (attention scores excepted: masked scores are -inf by
    design; an overflow there reaches the pattern), and the model's parameters are searched for non-finite values.
    Raises :class:`~lens_parallel.errors.NonFiniteError`, whose message names the model, that hook point (else
    ``output``, where the caller found it: the final residual, or a decoding step's logits), any non-finite
    parameter and the likely cause."""
    found: list[str] = []

    def check(tensor: Tensor, hook: HookPoint) -> None:
        if not found and isinstance(tensor, Tensor) and tensor.is_floating_point() and not is_finite(tensor):
            found.append(str(hook.name))
            raise StopForward

    def checked(name: str) -> bool:
        return name != FINAL_HOOK and not name.endswith("hook_attn_scores")

    with warnings.catch_warnings():  # a name filter: hook points switched off (hook_mlp_in, ...) are skipped, warned
        warnings.simplefilter("ignore")
        _run(model, tokens, [*hooks, (checked, check)], resid, start_at_layer)
    params = model.original_model.named_parameters()
    param = next((compat.plain_name(n) for n, p in params if not is_finite(p.detach())), None)
    dtype = next(model.parameters()).dtype
    where = f"first at {found[0]}" if found else f"in {output}"
    dtype_name = str(dtype).removeprefix("torch.")
    if param is not None:
        cause = f"the parameter {param} holds NaN or infinity: check the weights"
    elif dtype in (torch.float16, torch.bfloat16):
        cause = f"likely a {dtype_name} overflow: load the model in float32"
        cause += " or bfloat16" if dtype == torch.float16 else ""
    else:
        cause = "likely an edit or a hook that divides by zero, or weights too large for the dtype"
    raise NonFiniteError(
        f"{model.cfg.model_name}: the forward produced non-finite activations {where} ({dtype_name}); {cause}"
    )


class StopForward(Exception):
    """Raised by the last needed hook to end a forward early (:func:`forward` ends quietly)."""
