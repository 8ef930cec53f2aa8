"""Gradient checkpointing of whole blocks: what a gradient pass recomputes instead of keeping."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.utils.checkpoint
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat, geometry
from lens_parallel.attention import QUERY_BLOCK, Diagonal, rows_hook
from lens_parallel.errors import LibraryError, NonFiniteError
from lens_parallel.geometry import expand_kv as expand_kv  # where the analyses and edits import it from
from lens_parallel.hooks.names import Hook, check_shape, expected_shape, hook_name
from lens_parallel.hooks.running import forward, is_finite, model_lock
from lens_parallel.models import ModelInfo

GradReducer = Callable[[int, dict[str, Tensor], dict[str, Tensor]], None]
"""``reducer(layer, activations, gradients)``: what a gradient pass hands each layer's captures to."""


@contextlib.contextmanager
def checkpointed_blocks(model: TransformerBridge, recomputing: list[bool]) -> Iterator[None]:
    """Activation checkpointing of every block, for a forward whose backward follows: each block keeps only its
    inputs and is recomputed (hooks and all) when the backward reaches it, so at most one block's graph exists at a
    time instead of every layer's attention maps and MLP activations. Hooks must stay attached until the backward
    has ended (the recompute runs them again). ``recomputing[0]`` is True while a block is being recomputed, so
    hooks can tell the recompute (same values, its graph never backpropagated) from the
    forward. Non-reentrant :func:`torch.utils.checkpoint.checkpoint` without early stop (every hook of a recomputed
    block fires). One gradient pass at a time per model (its blocks are patched meanwhile: :func:`model_lock`)."""

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        recomputing[0] = True
        try:
            yield
        finally:
            recomputing[0] = False

    def wrap(block: torch.nn.Module) -> Callable[..., Any]:
        plain = block.forward

        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(
                plain, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), recompute()), **kwargs
            )

        return checkpointed

    blocks = list(model.blocks)
    forwards = [wrap(block) for block in blocks]
    with (
        model_lock(model),
        torch.utils.checkpoint.set_checkpoint_early_stop(False),
        compat.steps_replaced("forward", blocks, forwards),
    ):
        yield


def gradient_pass(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    info: ModelInfo,
    roles: dict[int, Sequence[str]],
    grad_roles: dict[int, Sequence[str]],
    objective: Callable[[Float[Tensor, "batch pos d_model"]], Float[Tensor, " batch"]],
    reduce: GradReducer,
) -> Float[Tensor, " batch"]:
    """One forward and one backward over ``tokens``: per layer, the activations of ``roles`` (detached float64
    copies; ``pattern_diag`` kept as its diagonal) and the gradients of ``objective(final).sum()`` (``final``: the final
    normalised residual) with respect to the activations of ``grad_roles`` (float64; both on the tokens' device),
    handed to ``reduce(layer, acts, grads)`` as soon as the backward has passed the layer. Documents are
    independent, so each document's gradient is that of its own objective.
    Every block is checkpointed (:func:`checkpointed_blocks`): the activations of ``roles`` are read when the
    backward recomputes their block, just before that block's gradients, so one layer's copies and one block's
    graph are held at a time (memory: the residual entering each block, plus one block). Returns
    ``objective(final)`` per document. Nothing in the forward changes: every hook returns its input."""
    acts: dict[int, dict[str, Tensor]] = {layer: {} for layer in roles}
    grads: dict[int, dict[str, Tensor]] = {layer: {} for layer in grad_roles}
    roots: list[Tensor] = []
    recomputing = [False]

    def grad_root(resid: Tensor, hook: HookPoint) -> Tensor:
        # the residual entering block 0, detached and made a leaf that requires grad: the backward starts its graph
        # here (same values; no parameter gradient is ever formed, whether or not the weights require grad)
        root = resid.detach().requires_grad_(True)
        if not recomputing[0]:
            roots.append(root)
        return root

    def on_grad(g: Tensor, *, layer: int, role: str) -> None:
        if not is_finite(g):
            raise NonFiniteError(
                f"{info.name}: the loss gradient at {hook_name(layer, role)} is not finite (the forward was; "
                f"{g.dtype} gradients overflow more easily): run in float32"
            )
        grads[layer][role] = g.detach().to(device=tokens.device, dtype=torch.float64)
        if len(grads[layer]) == len(grad_roles[layer]):
            reduce(layer, acts.pop(layer), grads.pop(layer))

    def capture(tensor: Tensor, hook: HookPoint, *, layer: int, role: str) -> Tensor:
        check_shape(hook_name(layer, role), tensor, expected_shape(role, info))
        if recomputing[0] and role in roles.get(layer, ()):
            kept = geometry.self_weights(tensor) if role == "pattern_diag" else tensor
            kept = kept.detach().to(device=tokens.device, dtype=torch.float64)
            block = QUERY_BLOCK.get() if role == "pattern_diag" else None
            if block is not None and block.start > 0:  # the blocked attention path: the diagonal's blocks in order
                kept = torch.cat([acts[layer][role], kept], -1)
            acts[layer][role] = kept
        if not recomputing[0] and role in grad_roles.get(layer, ()):
            tensor.register_hook(partial(on_grad, layer=layer, role=role))  # holds no reference to the tensor
        # returned unchanged: the bridge hands some hooks a reshaped view and, when a hook returns nothing, goes on
        # with the tensor it had, so only a returned tensor is sure to be the one the rest of the forward uses.
        return tensor

    names = {(layer, role) for layer, rs in [*roles.items(), *grad_roles.items()] for role in rs}
    hooks: list[Hook] = [(hook_name(0, "resid_pre"), grad_root)]

    def capture_self_weights(rows: Diagonal, hook: HookPoint, *, layer: int) -> None:
        if recomputing[0]:
            acts[layer]["pattern_diag"] = rows.weight.to(rows.dtype).to(device=tokens.device, dtype=torch.float64)

    def hook(layer: int, role: str) -> Callable[..., Tensor | None]:
        fn = partial(capture, layer=layer, role=role)
        if role != "pattern_diag" or role in grad_roles.get(layer, ()):
            return fn
        return rows_hook(fn, detached=True, diagonal=partial(capture_self_weights, layer=layer))

    hooks += [(hook_name(layer, role), hook(layer, role)) for layer, role in sorted(names)]
    # the hooks stay attached through the backward: the recomputed blocks run them again
    with torch.enable_grad(), checkpointed_blocks(model, recomputing), model.hooks(fwd_hooks=hooks):
        final = forward(model, tokens, grad=True)
        if final is None:
            raise LibraryError("the gradient pass ended before the unembedding")
        per_doc = objective(final)
        torch.autograd.grad(per_doc.sum(), roots)  # the hooks on the way down read the gradients
    if grads:
        raise LibraryError(f"no gradient reached layers {sorted(grads)}")
    return per_doc.detach()
