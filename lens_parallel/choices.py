"""Every string choice of the package as a ``Literal`` type (this module holds types only, no functions).

A value is checked against its choice by :func:`lens_parallel.validate.check_choice`, which reads the accepted values
from the type, so the static type checker, the error message and the CLI's ``choices`` can never disagree. Where one
word could mean two things, the two meanings have two names: ``EditPositions`` (which positions an edit acts on) and
``ScoredPositions`` (which positions an analysis scores). At test time the runtime type checker treats these types as
``str`` (``tests/typecheck.py``), so that a bad value reaches the package's own check and its one-line error.
"""

from __future__ import annotations

from typing import Literal

Space = Literal["value", "value-exclude-self", "value-merged", "residual-attn", "residual-mlp", "residual-block"]
"""A decomposition / scaling space (the spaces' guide): the message m and its reference r. ``value-merged``:
one projection per position of the concatenated head outputs on the concatenated values (the directional-decomposition
paper's ``xsa_middle``; GQA: each query head's own kv head's value)."""
HeadSpace = Literal["value", "value-exclude-self", "residual-attn"]
"""Spaces with a per-head level: the two value spaces and each head's residual write z_h W_O[h]."""
ValueSite = Literal["pre-gate", "post-gate"]
"""Where a value-space edit reads its message under gated attention (Qwen3.5: z = sigmoid(gate) * A v):
``pre-gate`` (o = A v, the change passed through the gate; lens_parallel's default) or ``post-gate`` (z itself, the
input of the output projection: the directional-decomposition authors' site). Without a gate the two coincide."""
DiagonalLayout = Literal["full", "paper"]
"""The diagonal view's figure: ``full`` (every map, and the per-head strip) or ``paper`` (the directional-decomposition
paper's Fig. 4: empirical A, the layer-level residual map, the value-space map, one head)."""
ScaleMetric = Literal["token_perplexity", "word_perplexity"]
"""What a scaling sweep scores: next-token loss per token (its exp the token perplexity) on any documents, or lm-eval's
perplexity per word of whole texts (:class:`~lens_parallel.documents.TextWindows`; the directional-decomposition
paper's Fig. 3 metric)."""
ReferenceGuard = Literal["exclude", "clamp"]
"""How a scaling treats a tiny reference r: ``exclude`` (positions with |r| <= eps scale as purely perpendicular) or
``clamp`` (the denominator |r|^2 floored at eps^2, every position projected: the directional-decomposition paper's
``clamp_min(1e-6)`` on |r|^2 is ``eps=1e-3``)."""
EditPositions = Literal["all", "after-first"]
"""Which positions an edit acts on: every one, or all but position 0 (the boundary token)."""
ScoredPositions = Literal["last", "all"]
"""Which positions an analysis scores: each prompt's last, or every position after the first."""
Ablation = Literal["zero", "mean", "parallel-value", "parallel-residual"]
"""How a head ablation removes a head's contribution."""
Null = Literal["sampled", "exact"]
"""The causal null: one sampled earlier position per observation (the paper's), or the exact expectation."""
Groups = Literal["neighbour", "all"]
"""The GQA across-group comparison: the neighbouring kv group (the paper's roll), or every other group."""
DominanceScale = Literal["qkv", "js", "js_distance"]
"""Effect scales of head dominance: relative Q/K/V change, JS divergence of the attention row, its square root."""
MaskScale = Literal["qkv", "js"]
"""Scales the weak/strong halves of head dominance can be ranked on."""
StatisticAblation = Literal["parallel-value", "zero"]
"""The single-head ablations whose change :func:`~lens_parallel.head_statistics` describes (value space)."""
HeadStatistic = Literal["para_ratio", "para_over_ref", "edit_over_y", "edit_over_ref"]
"""The per-head statistics the directional-decomposition paper correlates with sensitivity, in its order."""
SignFlipWeights = Literal["documents", "tokens"]
"""What a sign flip flips: each document's mean Δ (every document weighs the same) or its Δ sum (token-weighted)."""
SplitHalfMethod = Literal["pooled", "cross-half"]
"""How split-half reliability forms rho_raw: the paper's pooled diagnostic, or across halves."""
Sublayer = Literal["attn", "mlp", "block"]
"""The updates compression error decomposes: a block's attention and MLP sublayers, and the whole block."""
CompressionMode = Literal["local", "global"]
"""How compression error feeds the compressed blocks: ``local`` each the dense model's input (one block swapped at a
time), ``global`` the compressed model's own (every block compressed, errors compound)."""
Architecture = Literal["gpt2", "gpt-neox", "qwen3"]
"""Architectures of the small trained models."""
Precision = Literal["auto", "float32", "bfloat16"]
"""Training precision: bf16 autocast on CUDA, float32 elsewhere (``auto``), or as named."""
Arm = Literal[
    "baseline",
    "value-parallel-removal",
    "xsa-gated",
    "residual-parallel-removal",
    "random-direction",
    "random-direction-gated",
    "learned-gate",
    "learned-gate-layer",
    "xsa-alpha-layer",
]
"""The arms of a training experiment (:mod:`lens_parallel.training.arms`)."""
CurveLoss = Literal["validation", "training"]
"""Which loss a training figure plots: the periodic validation loss, or the training loss of every step."""
GateBound = Literal["tanh", "sigmoid"]
"""How :class:`~lens_parallel.edits.GatedRemoval` bounds its learnable strength: g = tanh(alpha) (``xsa-gated``,
from 0) or g = sigmoid(alpha) in [0, 1] (``xsa-alpha-layer``, the directional-decomposition paper's)."""
Dtype = Literal["float32", "bfloat16", "float16", "float64"]
"""Model precisions :func:`lens_parallel.models.load_model` takes (statistics accumulate in float64 anyway)."""
SensitivityMethod = Literal["exact", "attribution"]
"""``exact``: one ablation per head on the engine; ``attribution``: every head from one forward and one backward."""
ExplorerEdit = Literal["scale", "random-direction", "random-direction-norm-matched", "zero-diagonal"]
"""The explorer's edit: ``scale`` is ``ComponentScale(space, s_par, s_perp)`` against its matched no-op; the others
are the paper's comparison edits (``RandomDirectionRemoval``, norm-matched or not, and ``ZeroDiagonal``) against the
unedited model."""
HeadsAll = Literal["all"]
"""``heads="all"``: every head, each edited on its own write (no bias); ``heads=None`` is the whole sublayer."""
AttentionPath = Literal["auto", "fused", "diagonal", "blocked", "eager"]
"""How softmax attention is computed (:func:`lens_parallel.attention.attention_path`)."""
ContextForm = Literal["short", "full"]
"""How :meth:`~lens_parallel.downstream.effects.TaskResult.samples` shows an item's context: its end, or whole."""
DeviceKind = Literal["cpu", "cuda"]
"""The kinds of device whose work sizes differ (:mod:`lens_parallel.devices`)."""
TextBos = Literal["model", "none", "boundary"]
"""What goes before a text's tokens when text is given as documents: ``model``, TransformerLens's ``to_tokens``
(its BOS where the model's ``default_prepend_bos`` says so: GPT-2 yes, Pythia and Qwen no); ``none``, nothing (the
text's own tokens); ``boundary``, lens_parallel's document-boundary token (:mod:`lens_parallel.data`)."""
LayerType = Literal["softmax", "linear", "mixer"]
"""A layer's kind (:mod:`lens_parallel.layers`): softmax attention, linear attention (gated delta rule), or a token
mixer without heads (state-space, convolution, recurrence)."""

CHOICES = (
    ValueSite,
    DiagonalLayout,
    ScaleMetric,
    Space,
    HeadSpace,
    ReferenceGuard,
    EditPositions,
    ScoredPositions,
    Ablation,
    Null,
    Groups,
    DominanceScale,
    MaskScale,
    StatisticAblation,
    HeadStatistic,
    SignFlipWeights,
    SplitHalfMethod,
    Sublayer,
    CompressionMode,
    Architecture,
    Precision,
    Arm,
    CurveLoss,
    GateBound,
    Dtype,
    SensitivityMethod,
    ExplorerEdit,
    HeadsAll,
    AttentionPath,
    ContextForm,
    TextBos,
    DeviceKind,
    LayerType,
)
"""Every choice type above."""
