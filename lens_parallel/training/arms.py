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
``learned-gate-layer``         the directional-decomposition paper's gate: one per layer, shared by its heads,
                               scaling the removed part, s_par = 1 - sigmoid(w . x_t + b) (x_t: the block's
                               residual input), w = 0 and b = logit(gate_init) at init
                               (``TrainConfig.gate_init``); d_model + 1
                               parameters per layer
``xsa-alpha-layer``            the paper's learnable strength: s_par = 1 - sigmoid(a) per layer (all heads),
                               ``GatedRemoval(bound="sigmoid")``, a = logit(1 - 1e-6) = 13.8155 at init, as the
                               authors' ``train.py`` initialises it (its target alpha = 1, clamped into
                               [1e-6, 1 - 1e-6]): the arm starts at full removal (s_par = 1e-6); one parameter
                               per layer
=============================  ===========================================================================

The two ``-layer`` arms follow the authors' code (Shwai-He/Transformer-Geometry, ``pretraining_nanogpt``): its
token gate is ``sigmoid(Linear(n_embd, 1)(x))`` on the block input with the weight zeroed and the bias at
logit(``xsa_forward_gate_init``), multiplying the removed component ``(y . v / |v|^2) v`` of every head; its
learnable alpha is ``alpha_min + (alpha_max - alpha_min) sigmoid(raw)`` with [0, 1] bounds. The gate is written
here through :class:`~lens_parallel.edits.LearnedGate`, its parameters stored as (-w, -b) (``weight [layer,
d_model]``, ``bias [layer]``, sigmoid(-u) = 1 - sigmoid(u)) and broadcast over heads as views, so gradients reach
the one shared pair of each layer. Negation is exact and AdamW's update is odd in the gradient (no weight decay on
gate parameters), so training them is the authors' parametrisation, sign flipped.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lens_parallel import geometry
from lens_parallel.choices import Arm
from lens_parallel.edits import ComponentScale, Edit, GatedRemoval, LearnedGate
from lens_parallel.errors import LensParallelError
from lens_parallel.models import ModelInfo
from lens_parallel.training.config import GATE_INIT
from lens_parallel.validate import literal_values

ARMS: tuple[str, ...] = literal_values(Arm)
ARM_EDITS: dict[str, str | None] = {
    "baseline": None,
    "value-parallel-removal": "scale",
    "xsa-gated": "gated-removal",
    "residual-parallel-removal": "scale",
    "random-direction": "gated-removal",
    "random-direction-gated": "gated-removal",
    "learned-gate": "learned-gate",
    "learned-gate-layer": "learned-gate",
    "xsa-alpha-layer": "gated-removal",
}
"""The registered edit kind (:data:`lens_parallel.edits.EDITS`) each arm trains with (None: no edit). An arm is
not an edit kind: the ``random-direction`` arm is the ``gated-removal`` edit along fixed random directions (g = 1),
the training form of the frozen ``random-direction`` edit (:class:`~lens_parallel.edits.RandomDirectionRemoval`),
which removes along the same kind of direction with no gate; both are seeded per layer."""
DIRECTION_SEED = 1_000_003
"""Random directions of layer l come from ``torch.Generator().manual_seed(DIRECTION_SEED + l)``: the same for every
training seed and every arm that uses them."""


ALPHA_INIT = 1 - 1e-6
"""sigmoid(a) at init for ``xsa-alpha-layer``: the authors' target alpha = 1 clamped to ``alpha_max - 1e-6``."""


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

    def __init__(self, arm: str, info: ModelInfo, *, gate_init: float = GATE_INIT):
        super().__init__()
        (self.arm,) = check_arms(arm)
        self.n_heads = info.n_heads
        shape = (info.n_layers, info.n_heads)
        if arm in ("xsa-gated", "random-direction-gated"):
            self.alpha = nn.Parameter(torch.zeros(shape, device="cpu"))  # moved with the module
        if arm == "xsa-alpha-layer":
            self.alpha = nn.Parameter(
                torch.full((info.n_layers,), math.log(ALPHA_INIT / (1 - ALPHA_INIT)), device="cpu")
            )
        if arm.startswith("random-direction"):
            self.register_buffer("directions", random_directions(info))
        if arm == "learned-gate":
            self.weight = nn.Parameter(torch.zeros(*shape, info.d_model, device="cpu"))
            self.bias = nn.Parameter(torch.zeros(shape, device="cpu"))
        if arm == "learned-gate-layer":  # stored as (-w, -b): s_par = sigmoid(-w.x - b) = 1 - sigmoid(w.x + b)
            self.weight = nn.Parameter(torch.zeros(info.n_layers, info.d_model, device="cpu"))
            self.bias = nn.Parameter(torch.full((info.n_layers,), -math.log(gate_init / (1 - gate_init)), device="cpu"))

    def _per_head(self, t: torch.Tensor) -> torch.Tensor:
        """A per-layer tensor ``[layer, ...]`` broadcast to ``[layer, head_index, ...]`` (a view: gradients sum
        over heads)."""
        return t.unsqueeze(1).expand(t.shape[0], self.n_heads, *t.shape[1:])

    def edits(self) -> list[Edit]:
        """The arm's edits, each an instance of its :data:`ARM_EDITS` kind (``tests/test_registries.py``)."""
        if self.arm == "baseline":
            return []
        if self.arm == "value-parallel-removal":
            return [ComponentScale("value", s_par=0.0)]
        if self.arm == "residual-parallel-removal":
            return [ComponentScale("residual-attn", s_par=0.0)]
        if self.arm == "learned-gate":
            return [LearnedGate(self.weight, self.bias)]
        if self.arm == "learned-gate-layer":  # views of the parameters: hooks compiled once see every update
            return [LearnedGate(self._per_head(self.weight), self._per_head(self.bias))]
        if self.arm == "xsa-alpha-layer":
            return [GatedRemoval(alpha=self._per_head(self.alpha), bound="sigmoid")]
        return [GatedRemoval(alpha=getattr(self, "alpha", None), directions=getattr(self, "directions", None))]

    def gates(self) -> torch.Tensor | None:
        """The removal strength g ``[layer, head_index]`` of the gated arms (s_par = 1 - g): tanh(alpha), or
        sigmoid(alpha) broadcast over heads for ``xsa-alpha-layer``; else None."""
        if self.arm == "xsa-alpha-layer":
            return torch.sigmoid(self._per_head(self.alpha.detach())).cpu()
        return torch.tanh(self.alpha.detach()).cpu() if hasattr(self, "alpha") else None
