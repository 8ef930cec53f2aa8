"""Streaming capture: a :class:`LayerStream` captures only the hooks an analysis asks for, hands each layer's
tensors to a reducer as soon as the layer is complete, drops them, and stops the forward after the last layer it
needs (nothing past it is computed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.utils.checkpoint
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.attention import QUERY_BLOCK, Diagonal, rows_hook
from lens_parallel.errors import LensParallelError, LibraryError
from lens_parallel.geometry import expand_kv as expand_kv  # where the analyses and edits import it from
from lens_parallel.hooks.names import ROLE_HOOKS, Hook, check_shape, expected_shape, hook_name
from lens_parallel.hooks.running import StopForward, forward, raise_non_finite
from lens_parallel.models import ModelInfo

Reducer = Callable[[int, dict[str, Tensor]], None]
"""``reducer(layer, tensors)``: what a :class:`LayerStream` hands each layer's captured tensors to."""


class LayerStream:
    """Capture ``roles`` at ``layers``; call ``reduce(layer, tensors)`` once all roles of a layer are in.

    ``roles`` is one list for every layer or a dict layer -> roles (layers of different kinds need different hooks).

    ``pattern_diag`` is stored as its diagonal ``[batch, head_index, pos]`` only (A_tt), never as the full map.
    Tensors are detached copies in ``dtype`` (float64 by default, so that streamed sums match a cache to 1e-6), on
    the device of the tokens: a model whose layers sit on several devices hands the reducer tensors on one device.
    """

    def __init__(
        self,
        info: ModelInfo,
        layers: Sequence[int],
        roles: Sequence[str] | dict[int, Sequence[str]],
        reduce: Reducer,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.layers = sorted(set(layers))
        self.roles = {
            layer: tuple(dict.fromkeys(roles[layer] if isinstance(roles, dict) else roles)) for layer in self.layers
        }
        used = {role for layer_roles in self.roles.values() for role in layer_roles}
        unknown = sorted(used - set(ROLE_HOOKS))
        if unknown:
            raise LensParallelError(f"unknown activation roles {unknown}; known: {', '.join(ROLE_HOOKS)}")
        if "resid_mid" in used and info.parallel_attn_mlp:
            raise LensParallelError(f"{info.name} runs attention and MLP in parallel: it has no resid_mid")
        self.info, self.reduce, self.dtype = info, reduce, dtype
        self.device: torch.device | None = None
        self.stop = True
        self._buffers: dict[int, dict[str, Tensor]] = {}
        self._partial: dict[int, Tensor] = {}  # a diagonal's first blocks (the blocked attention path)
        self._finite: list[Tensor] = []  # per capture: its float32 sum, finite iff its values are (read once)

    def fwd_hooks(self) -> list[Hook]:
        def capture(layer: int, role: str) -> Callable[..., Tensor | None]:
            fn = partial(self._capture, layer=layer, role=role)
            if role != "pattern_diag":
                return fn
            # the diagonal is row-wise (blocks are joined), kept detached, and on the diagonal path comes as A_tt
            return rows_hook(fn, detached=True, diagonal=partial(self._capture_self_weights, layer=layer))

        return [(hook_name(layer, role), capture(layer, role)) for layer in self.layers for role in self.roles[layer]]

    def _capture(self, tensor: Tensor, hook: HookPoint, *, layer: int, role: str) -> None:
        check_shape(hook_name(layer, role), tensor, expected_shape(role, self.info))
        kept = tensor.detach()
        if role == "pattern_diag":
            kept, block = geometry.self_weights(kept), QUERY_BLOCK.get()
            if block is not None and block.start > 0:
                kept = torch.cat([self._partial.pop(layer), kept.to(device=self.device, dtype=self.dtype)], -1)
            if block is not None and block.stop < block.total:
                self._partial[layer] = kept.to(device=self.device, dtype=self.dtype)
                return
        self._keep(kept, layer=layer, role=role)

    def _capture_self_weights(self, rows: Diagonal, hook: HookPoint, *, layer: int) -> None:
        self._keep(rows.weight.to(rows.dtype), layer=layer, role="pattern_diag")

    def _keep(self, kept: Tensor, *, layer: int, role: str) -> None:
        # a NaN or an infinity in a capture makes its float32 sum so (one pass, no mask formed); a sum of finite
        # activations overflows float32 only past ~3e38 / n per element. Kept on the device: read after the forward
        self._finite.append(kept.sum(dtype=torch.float32))
        buffer = self._buffers.setdefault(layer, {})
        buffer[role] = kept.to(device=self.device, dtype=self.dtype)
        if len(buffer) == len(self.roles[layer]):
            self.reduce(layer, self._buffers.pop(layer))
            if layer == self.layers[-1] and self.stop:
                raise StopForward

    def run(
        self,
        model: TransformerBridge,
        tokens: Int[Tensor, "batch pos"],
        *,
        edit_hooks: Sequence[Hook] = (),
        resid: Float[Tensor, "batch pos d_model"] | None = None,
        start_at_layer: int | None = None,
        final: bool = False,
    ) -> Float[Tensor, "batch pos d_model"] | None:
        """One :func:`forward` over ``tokens`` (or from ``resid`` entering block ``start_at_layer``, earlier blocks
        not computed), with ``edit_hooks`` (compiled edits) applied first. Stops after the last layer's reduction,
        or with ``final=True`` goes on and returns the final normalised residual."""
        self._buffers.clear()
        self._partial.clear()
        self._finite.clear()
        self.device, self.stop = tokens.device, not final
        hooks = [*edit_hooks, *self.fwd_hooks()]
        out = forward(model, tokens, hooks, resid=resid, start_at_layer=start_at_layer)
        if self._buffers:
            missing = {layer: sorted(set(self.roles[layer]) - set(b)) for layer, b in self._buffers.items()}
            raise LibraryError(f"hooks never fired for layer/roles {missing}")
        sums = [total.to(tokens.device) for total in self._finite]  # the layers' devices, when placed over several
        if sums and not bool(torch.isfinite(torch.stack(sums)).all()):  # one read, after the forward
            raise_non_finite(model, tokens, edit_hooks, resid=resid, start_at_layer=start_at_layer)
        return out
