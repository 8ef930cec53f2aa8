"""A sigmoid output gate on softmax attention, z = sigmoid(gate) * A v (Qwen3.5, Qwen3-Next; AFMoE's projection).

The Hugging Face module applies it after the attention (the route through the module hands the attention its
queries, keys and values and gates what comes back); the value spaces read the pre-gate A v = hook_z /
sigmoid(gate), the gate read where both TransformerLens's forward and the route fire it (:attr:`AttentionGate.hook`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import einops
from jaxtyping import Float
from torch import Tensor

from lens_parallel.attention.features.base import Feature, Source


@dataclasses.dataclass(frozen=True)
class AttentionGate(Feature):
    """A gate of its own projection (AFMoE's ``gate``, ``[batch, pos, head * d_head]``): its role, the hook point
    whose presence marks it (``declared_by``, relative to ``blocks.{layer}``) and the one it is read from
    (``hook``), both the same on TransformerLens's forward and on lens_parallel's (:meth:`heads` turns what
    ``hook`` fires into the gate). lens_parallel's attention does not serve it (no toy reaches one)."""

    role: ClassVar[str] = "attn_gate"
    declared_by: ClassVar[str] = "attn.gate.hook_out"
    hook: ClassVar[str] = "attn.gate.hook_out"

    name: ClassVar[str] = "gated-attention"
    title: ClassVar[str] = "an output gate on attention, z = sigmoid(gate) * A v"
    handling: ClassVar[str] = (
        "the value spaces read the pre-gate A v = hook_z / sigmoid(gate), the gate read where both forwards fire it "
        "(a query-split gate from hook_q)"
    )

    @classmethod
    def recognise(cls, source: Source) -> AttentionGate | None:
        """A gate split off the query projection (the bridge declares ``hook_q_gate``), else one of its own
        projection (a ``gate`` submodule), else None."""
        children = dict(source.component.named_children())
        if children.get("hook_q_gate") is not None:
            return QueryGate()
        return AttentionGate() if children.get("gate") is not None else None

    @property
    def reason(self) -> str:
        return "a separate gate projection"

    def heads(self, captured: Tensor, n_heads: int) -> Float[Tensor, "batch pos head_index d_head"]:
        """The gate's logits per head from what :attr:`hook` fired ``[batch, pos, head_index * d_head]``."""
        return einops.rearrange(captured, "batch pos (head d) -> batch pos head d", head=n_heads)

    def dims(self, n_heads: int, d_head: int) -> tuple[tuple[str, int], ...]:
        """The named sizes of what :attr:`hook` fires after ``batch, pos``."""
        return (("n_heads * d_head", n_heads * d_head),)


@dataclasses.dataclass(frozen=True)
class QueryGate(AttentionGate):
    """A gate split off the query projection, each head's ``[query | gate]`` (Qwen3.5, Qwen3-Next). Read from
    ``hook_q``, which fires the projection as 2 x head_index heads of d_head (each head's query, then its gate), on
    TransformerLens's forward and on the route through the module alike; ``hook_q_gate`` fires only on
    TransformerLens's."""

    role: ClassVar[str] = "q_gate"
    declared_by: ClassVar[str] = "attn.hook_q_gate"
    hook: ClassVar[str] = "attn.hook_q"

    @property
    def reason(self) -> str:
        return ""

    def heads(self, captured: Tensor, n_heads: int) -> Float[Tensor, "batch pos head_index d_head"]:
        return einops.rearrange(captured, "batch pos (head two) d -> two batch pos head d", two=2)[1]

    def dims(self, n_heads: int, d_head: int) -> tuple[tuple[str, int], ...]:
        return ("2 * n_heads", 2 * n_heads), ("d_head", d_head)


GATES: Mapping[str, AttentionGate] = {gate.role: gate for gate in (QueryGate(), AttentionGate())}
"""The roles of a sigmoid output gate on softmax attention (:class:`AttentionGate`): a gate split off the query
projection (``q_gate``), or a gate projection of its own (``attn_gate``)."""
