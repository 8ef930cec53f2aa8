"""Layer sensitivity: each head ablated alone, and all heads of a layer together.

Effects are token-weighted next-token loss differences, ablated minus unedited (nats/token), with a paired
bootstrap 95% CI over documents, a two-sided sign-flip permutation p-value on the per-document differences, and
Benjamini-Hochberg q-values across all single heads. Runs on the ablation engine (prefix reuse, resumable).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import Ablation, EditPositions, SignFlipWeights
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import ABLATION_KINDS, check_positions
from lens_parallel.errors import long_call
from lens_parallel.losses import DocLosses, edit_effect
from lens_parallel.models import head_label
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.sensitivity import sensitivity_figure
from lens_parallel.results import Provenance, ResultMixin, head_frame, layer_frame
from lens_parallel.stats import N_RESAMPLES, benjamini_hochberg, sign_flip_pvalue
from lens_parallel.sweep import AblationJob, run_sweep
from lens_parallel.validate import as_indices, check_choice, check_non_negative_int, check_positive_int


@dataclass(frozen=True, repr=False)
class SensitivityResult(ResultMixin):
    """``head_*`` arrays are ``[layer, head]`` (on a hybrid model as wide as the widest layer: a linear-attention
    layer's value heads; a narrower layer's extra entries are NaN); ``joint_*`` are ``[layer]`` (all heads of the
    layer together); ``head_doc_delta`` ``[doc, layer, head]`` each document's edited - base loss sum (nats) of
    each single-head ablation and ``doc_tokens`` ``[doc]`` its scored tokens (for split-half statistics).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> sens = lp.head_sensitivity(model, docs, layers=[0], progress=False)
        >>> fig = sens.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type ablation delta_loss ci_lo ci_hi p q_bh loss_base "
        "most_sensitive_layer max_joint_delta_loss max_head_delta_loss max_head n_heads_q05"
    )

    ablation: Ablation
    layers: tuple[int, ...]
    loss_base: float
    head_delta: np.ndarray
    head_lo: np.ndarray
    head_hi: np.ndarray
    head_p: np.ndarray
    head_q: np.ndarray
    joint_delta: np.ndarray
    joint_lo: np.ndarray
    joint_hi: np.ndarray
    joint_p: np.ndarray
    head_doc_delta: np.ndarray
    doc_tokens: np.ndarray
    provenance: Provenance

    def to_dataframe(self) -> pd.DataFrame:
        """One row per single head and, after each layer's heads, one per layer's joint edit (head <NA>, label
        ``L{l}*``)."""
        front = {"ablation": self.ablation}
        heads = head_frame(
            self.info,
            self.layers,
            {"delta_loss": self.head_delta, "ci_lo": self.head_lo, "ci_hi": self.head_hi, "p": self.head_p},
            front=front,
        ).assign(q_bh=self.head_q[~np.isnan(self.head_delta)])
        joint = layer_frame(
            self.info,
            self.layers,
            {"delta_loss": self.joint_delta, "ci_lo": self.joint_lo, "ci_hi": self.joint_hi, "p": self.joint_p},
            front=front,
        ).assign(q_bh=np.nan)
        df = pd.concat([heads, joint], ignore_index=True).sort_values("layer", kind="stable", ignore_index=True)
        return df.astype({"head": "Int64", "kv_head": "Int64"})

    def summary(self) -> pd.DataFrame:
        """One row: the base loss, the most sensitive layer (largest joint effect), the largest single-head
        effect, and how many single heads have q_BH < 0.05."""
        i, (li, h) = (
            int(np.argmax(self.joint_delta)),
            np.unravel_index(np.nanargmax(self.head_delta), self.head_delta.shape),
        )
        row = {
            "model": self.info.name,
            "ablation": self.ablation,
            "loss_base": self.loss_base,
            "most_sensitive_layer": self.layers[i],
            "max_joint_delta_loss": float(self.joint_delta[i]),
            "max_head_delta_loss": float(self.head_delta[li, h]),
            "max_head": head_label(self.layers[li], int(h)),
            "n_heads_q05": int((self.head_q < 0.05).sum()),
        }
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return sensitivity_figure(self)


def _stats(base: DocLosses, edited: DocLosses, s: SensitivitySettings, label: str) -> tuple[float, float, float, float]:
    """Δloss (token-weighted), its paired bootstrap CI and the sign-flip p-value of one ablation. The sign flips
    act on each document's mean Δ (``documents``: every document weighs the same) or on its Δ sum (``tokens``:
    the token-weighted mean, as the directional-decomposition paper's ``paired_sign_flip_pvalue``)."""
    effect = edit_effect(base, edited, n_resamples=s.n_resamples, seed=s.seed, what=f"{label}: losses")
    per_doc = edited.loss_sum - base.loss_sum
    if s.sign_flip_weights == "documents":
        per_doc = per_doc / base.n_tokens
    p = sign_flip_pvalue(per_doc, n_resamples=s.n_permutations, seed=s.seed, what=f"{label}: per-document delta loss")
    return effect.delta_loss, *effect.delta_loss_ci, p


@dataclass(frozen=True, kw_only=True)
class SensitivitySettings:
    """What layer sensitivity computes: each head ablated alone and all heads of a layer jointly (``ablation``, at
    ``positions``) on ``layers`` (None: every layer the ablation is defined on), with ``n_resamples`` bootstrap
    resamples and ``n_permutations`` sign flips (of each document's mean Δ, or with ``sign_flip_weights="tokens"`` of
    its Δ sum: the token-weighted mean), seeded by ``seed``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.SensitivitySettings(layers=(0, 1)).layers
        (0, 1)
    """

    ablation: Ablation = field(default="parallel-value", metadata={"help": "how heads are removed"})
    positions: EditPositions = field(default="all", metadata={"help": "after-first: leave the boundary token"})
    layers: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "layers",
            "none": "every layer the ablation is defined on (linear ones: zero, parallel-value)",
        },
    )
    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the CIs"})
    n_permutations: int = field(default=10000, metadata={"help": "sign flips of the p-values"})
    sign_flip_weights: SignFlipWeights = field(
        default="documents", metadata={"help": "sign flips weigh documents equally or by their tokens"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap and the sign flips"})

    def __post_init__(self) -> None:
        check_choice("ablation", self.ablation, Ablation)
        check_positions(self.positions)
        object.__setattr__(self, "layers", as_indices(self.layers))
        check_positive_int("n_resamples", self.n_resamples)
        check_positive_int("n_permutations", self.n_permutations)
        check_choice("sign_flip_weights", self.sign_flip_weights, SignFlipWeights)
        check_non_negative_int("seed", self.seed)


@long_call
def head_sensitivity(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: SensitivitySettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> SensitivityResult:
    """Per layer: every head ablated alone and all heads jointly (:class:`SensitivitySettings`; run options
    :class:`~lens_parallel.options.RunOptions`: ``store=`` makes the sweep resumable, ``workers=`` runs it on Ray;
    both as keyword shortcuts too). Linear-attention layers (Qwen3.5) are included for the ablations defined there
    (:data:`~lens_parallel.edits.LINEAR_ABLATIONS`, on their value heads); for the others ``layers=None`` skips
    them, and the result's provenance says so.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> sens = lp.head_sensitivity(model, docs, layers=[0], progress=False)
        >>> sens.to_dataframe().shape[0]  # one row per head of layer 0, and one for all of them
        5
    """
    info = check_model(model)
    s, opts = resolve(SensitivitySettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    layer_idx, skipped = ABLATION_KINDS[s.ablation].layers(info, s.layers, what=f"a {s.ablation} head ablation")
    singles = [AblationJob(layer, (h,)) for layer in layer_idx for h in range(info.output_heads(layer))]
    joints = [AblationJob(layer, tuple(range(info.output_heads(layer)))) for layer in layer_idx]
    run = run_sweep(model, docs, singles + joints, ablation=s.ablation, positions=s.positions, options=opts)
    assert run.base is not None
    single = np.array([_stats(run.base, run[j], s, head_label(j.layer, j.heads[0])) for j in singles])
    joint = np.array([_stats(run.base, run[j], s, head_label(j.layer)) for j in joints])
    where = [(layer_idx.index(j.layer), j.heads[0]) for j in singles]

    def per_head(values: np.ndarray) -> np.ndarray:
        """``values`` of the single heads (the last axis) as ``[..., layer, head]``, NaN past a layer's heads."""
        width = max(info.output_heads(layer) for layer in layer_idx)
        out = np.full((*values.shape[:-1], len(layer_idx), width), np.nan)
        out[..., [i for i, _ in where], [h for _, h in where]] = values
        return out

    return SensitivityResult(
        ablation=s.ablation,
        layers=layer_idx,
        loss_base=run.base.loss,
        head_delta=per_head(single[:, 0]),
        head_lo=per_head(single[:, 1]),
        head_hi=per_head(single[:, 2]),
        head_p=per_head(single[:, 3]),
        head_q=per_head(benjamini_hochberg(single[:, 3])),
        joint_delta=joint[:, 0],
        joint_lo=joint[:, 1],
        joint_hi=joint[:, 2],
        joint_p=joint[:, 3],
        head_doc_delta=per_head(np.stack([run[j].loss_sum - run.base.loss_sum for j in singles], axis=-1)),
        doc_tokens=run.base.n_tokens,
        provenance=Provenance.of(info, docs, "head_sensitivity", s, run, layers=list(layer_idx), skipped=skipped),
    )


def _printed(result: SensitivityResult, s: SensitivitySettings, display: None) -> tuple[str, pd.DataFrame]:
    joint = result.to_dataframe()
    joint = joint[joint["head"].isna()]
    title = f"{result.info.name}: joint {s.ablation} ablation per layer (delta loss, nats/token)"
    return title, joint[["label", "delta_loss", "ci_lo", "ci_hi", "p"]].round(4)


ANALYSIS = Analysis(
    "sensitivity",
    "per-head and joint ablation effects, layer by layer",
    head_sensitivity,
    SensitivitySettings,
    SensitivityResult,
    _printed,
    data={"n_docs": 8},
    sweep=True,
    store="sensitivity_store.jsonl",
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
