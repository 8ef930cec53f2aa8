"""The arms of a training experiment: which edit every attention layer trains with, and its learnable parameters.

Every arm is built from the edits of :mod:`lens_parallel.edits`, the same code the frozen analyses use:

=============================  ===========================================================================
``baseline``                   no edit
``value-parallel-removal``     ``ComponentScale("value", s_par=0)``: z = y - y_par along v_t (XSA, g = 1)
``xsa-gated``                  ``GatedRemoval(alpha)``: z = y - tanh(alpha) (y . v_hat) v_hat, alpha per
                               layer and head, learned, initialised at 0 (so the arm starts as ``baseline``)
``residual-parallel-removal``  ``ComponentScale("residual-attn", s_par=0)``: the attention update loses its
                               component along the residual state it is added to
``random-direction``           ``GatedRemoval(directions=u)``: the same rank-one removal (g = 1) along a
                               fixed random unit direction per layer and head, seeded by layer; matched to
                               ``value-parallel-removal``
``random-direction-gated``     ``GatedRemoval(alpha, directions=u)``: matched to ``xsa-gated``
``learned-gate``               ``LearnedGate``: s_par = sigmoid(w . x_t + b) per token and head, w = 0 and
                               b = 0 at init (s_par = 0.5)
=============================  ===========================================================================
"""

from __future__ import annotations

import torch
from torch import nn

from lens_parallel import geometry
from lens_parallel.choices import Arm
from lens_parallel.edits import ComponentScale, Edit, GatedRemoval, LearnedGate
from lens_parallel.errors import LensParallelError
from lens_parallel.models import ModelInfo
from lens_parallel.validate import options

ARMS: tuple[str, ...] = options(Arm)
DIRECTION_SEED = 1_000_003
"""Random directions of layer l come from ``torch.Generator().manual_seed(DIRECTION_SEED + l)``: the same for every
training seed and every arm that uses them."""


def check_arms(arms: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    arms = (arms,) if isinstance(arms, str) else tuple(arms)
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise LensParallelError(f"unknown arm(s) {bad or list(arms)}; accepted: {', '.join(ARMS)}")
    return arms


def random_directions(info: ModelInfo) -> torch.Tensor:
    """Unit vectors ``[layer, head_index, d_head]``, one per layer and head, seeded by layer
    (:data:`DIRECTION_SEED`)."""
    return geometry.random_unit_directions(info.n_layers, info.n_heads, info.d_head, seed=DIRECTION_SEED)


class ArmParameters(nn.Module):
    """The learnable (and fixed) tensors of one arm; ``edits()`` gives the edits that use them."""

    def __init__(self, arm: str, info: ModelInfo):
        super().__init__()
        (self.arm,) = check_arms(arm)
        shape = (info.n_layers, info.n_heads)
        if arm in ("xsa-gated", "random-direction-gated"):
            self.alpha = nn.Parameter(torch.zeros(shape))
        if arm.startswith("random-direction"):
            self.register_buffer("directions", random_directions(info))
        if arm == "learned-gate":
            self.weight = nn.Parameter(torch.zeros(*shape, info.d_model))
            self.bias = nn.Parameter(torch.zeros(shape))

    def edits(self) -> list[Edit]:
        if self.arm == "baseline":
            return []
        if self.arm == "value-parallel-removal":
            return [ComponentScale("value", s_par=0.0)]
        if self.arm == "residual-parallel-removal":
            return [ComponentScale("residual-attn", s_par=0.0)]
        if self.arm == "learned-gate":
            return [LearnedGate(self.weight, self.bias)]
        return [GatedRemoval(alpha=getattr(self, "alpha", None), directions=getattr(self, "directions", None))]

    def gates(self) -> torch.Tensor | None:
        """g = tanh(alpha) ``[layer, head_index]`` for the gated arms, else None."""
        return torch.tanh(self.alpha.detach()).cpu() if hasattr(self, "alpha") else None
