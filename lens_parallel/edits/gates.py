"""The training-time edits: gated removals (XSA, its random-direction control) and the learned per-token gate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import einops
import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.choices import GateBound
from lens_parallel.edits.base import (
    EditBase,
    Footprint,
    store,
)
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import (
    Hook,
    check_not_gated,
    expand_kv,
    hook_name,
    softmax_layers,
)
from lens_parallel.models import ModelInfo
from lens_parallel.validate import check_choice, check_eps


@dataclass(frozen=True, eq=False)
class GatedRemoval(EditBase):
    """Remove a gated rank-one component from every head's value aggregate (XSA and its controls), on hook_z:

        z'_t = y_t - g (y_t . u_t / |u_t|^2) u_t,   i.e. ``ComponentScale("value")`` with s_par = 1 - g along u_t.

    ``directions=None``: u_t = v_t, the head's own value at t (self-attention removal, XSA); a tensor
    ``[layer, head_index, d_head]``: a fixed direction per layer and head (the random-direction control).
    ``alpha=None``: g = 1 (fixed removal); a tensor ``[layer, head_index]``: g = tanh(alpha), learnable
    (``alpha = 0`` gives g = 0, and the edited forward equals the unedited one bit for bit), or with
    ``bound="sigmoid"`` g = sigmoid(alpha) in [0, 1]. Rows of the tensors are indexed by layer number; every
    softmax-attention layer is edited. Not defined for gated attention.

    Examples:
        >>> import lens_parallel as lp
        >>> import torch
        >>> gate = lp.GatedRemoval(alpha=torch.zeros(3, 4))  # one gate per layer and head
        >>> gate.bound
        'tanh'
    """

    kind: ClassVar[str] = "gated-removal"

    alpha: Float[Tensor, "layer head_index"] | None = None
    directions: Float[Tensor, "layer head_index d_head"] | None = None
    eps: float = geometry.EPS
    bound: GateBound = "tanh"
    layers: None = None  # every softmax-attention layer

    def __post_init__(self) -> None:
        check_choice("gate bound", self.bound, GateBound)
        check_eps(self.eps)

    def footprint(self, info: ModelInfo) -> Footprint:
        return Footprint(("v",) if self.directions is None else (), ("z",), "none", decode_safe=True)

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers = _training_layers(info, "GatedRemoval")
        for name, t in (("alpha", self.alpha), ("directions", self.directions)):
            want = (info.n_layers, info.n_heads) + ((info.d_head,) if name == "directions" else ())
            if t is not None and tuple(t.shape) != want:
                raise LensParallelError(f"GatedRemoval.{name} must have shape {want}, got {tuple(t.shape)}")
        out: list[Hook] = []
        for layer in layers:
            state: dict[str, Tensor] = {}
            if self.directions is None:
                out.append((hook_name(layer, "v"), partial(store, state=state, key="v")))
            out.append((hook_name(layer, "z"), _edit_z(self, state, layer, info.n_heads)))
        return out

    def direction_and_scale(
        self, z: Tensor, state: dict[str, Tensor], layer: int, n_heads: int
    ) -> tuple[Float[Tensor, "batch pos head_index d_head"], Float[Tensor, "batch pos head_index"]]:
        """u_t (the head's own value, or the layer's fixed direction) and s_par = 1 - g at every position."""
        d = self.directions
        u = expand_kv(state.pop("v"), n_heads) if d is None else d[layer].to(z).expand_as(z)
        if self.alpha is None:
            g = torch.ones((), dtype=z.dtype, device=z.device)
        else:
            g = (torch.tanh if self.bound == "tanh" else torch.sigmoid)(self.alpha[layer])
        return u, (1 - g).to(z).expand(z.shape[:-1])


@dataclass(frozen=True, eq=False)
class LearnedGate(EditBase):
    """Value-space parallel scaling with a learned per-token scale (the gating control):

        z'_t = y_t + (s_t - 1) y_par,   s_t = sigmoid(w_h . x_t + b_h),   y_par = projection of y_t on v_t,

    with x_t the block's residual input (hook_resid_pre) and one (w_h, b_h) per layer and query head:
    ``weight [layer, head_index, d_model]``, ``bias [layer, head_index]``. Every softmax-attention layer is edited.

    Examples:
        >>> import lens_parallel as lp
        >>> import torch
        >>> gate = lp.LearnedGate(weight=torch.zeros(3, 4, 64), bias=torch.zeros(3, 4))
        >>> gate.eps
        1e-08
    """

    kind: ClassVar[str] = "learned-gate"

    weight: Float[Tensor, "layer head_index d_model"]
    bias: Float[Tensor, "layer head_index"]
    eps: float = geometry.EPS
    layers: None = None  # every softmax-attention layer

    def __post_init__(self) -> None:
        check_eps(self.eps)

    def footprint(self, info: ModelInfo) -> Footprint:
        return Footprint(("resid_pre", "v"), ("z",), "none", decode_safe=True)

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        layers = _training_layers(info, "LearnedGate")
        want_weight, want_bias = (info.n_layers, info.n_heads, info.d_model), (info.n_layers, info.n_heads)
        if tuple(self.weight.shape) != want_weight or tuple(self.bias.shape) != want_bias:
            raise LensParallelError(
                f"LearnedGate needs weight {want_weight} and bias {want_bias}, "
                f"got {tuple(self.weight.shape)} and {tuple(self.bias.shape)}"
            )
        out: list[Hook] = []
        for layer in layers:
            state: dict[str, Tensor] = {}
            out += [
                (hook_name(layer, "resid_pre"), partial(store, state=state, key="x")),
                (hook_name(layer, "v"), partial(store, state=state, key="v")),
                (hook_name(layer, "z"), _edit_z(self, state, layer, info.n_heads)),
            ]
        return out

    def scale(self, x: Float[Tensor, "batch pos d_model"], layer: int) -> Float[Tensor, "batch pos head_index"]:
        """s_t = sigmoid(w_h . x_t + b_h) for every head of ``layer``."""
        w, b = self.weight[layer].to(x), self.bias[layer].to(x)
        return torch.sigmoid(einops.einsum(x, w, "b p m, h m -> b p h") + b)

    def direction_and_scale(
        self, z: Tensor, state: dict[str, Tensor], layer: int, n_heads: int
    ) -> tuple[Float[Tensor, "batch pos head_index d_head"], Float[Tensor, "batch pos head_index"]]:
        """u_t = v_t and s_par = s_t at every position."""
        return expand_kv(state.pop("v"), n_heads), self.scale(state.pop("x"), layer)


def _edit_z(
    edit: GatedRemoval | LearnedGate, state: dict[str, Tensor], layer: int, n_heads: int
) -> Callable[[Tensor, HookPoint], Tensor]:
    """The hook on ``layer``'s hook_z: z' = z + (s_par - 1) z_par along u, from ``edit.direction_and_scale``."""

    def edit_z(z: Float[Tensor, "batch pos head_index d_head"], hook: HookPoint) -> Tensor:
        u, s_par = edit.direction_and_scale(z, state, layer, n_heads)
        return z + geometry.scale_delta(z, u, s_par=s_par, eps=edit.eps)

    return edit_z


def _training_layers(info: ModelInfo, what: str) -> tuple[int, ...]:
    check_not_gated(info, what)
    return softmax_layers(info, None, what=what)[0]
