"""Layer sensitivity: each head ablated alone, and all heads of a layer together.

Effects are token-weighted next-token loss differences, ablated minus unedited (nats/token), with a paired
bootstrap 95% CI over documents, a two-sided sign-flip permutation p-value on the per-document differences, and
Benjamini-Hochberg q-values across all single heads. Runs on the ablation engine (prefix reuse, resumable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.data import TokenBlocks
from lens_parallel.hooks import softmax_layers
from lens_parallel.losses import DocLosses, edit_effect
from lens_parallel.models import head_label, model_info
from lens_parallel.plots.sensitivity import sensitivity_figure
from lens_parallel.results import Provenance, ResultMixin, serializable
from lens_parallel.stats import benjamini_hochberg, sign_flip_pvalue
from lens_parallel.sweep import AblationJob, run_sweep


@serializable
@dataclass(frozen=True)
class SensitivityResult(ResultMixin):
    """``head_*`` arrays are ``[layer, head]``; ``joint_*`` are ``[layer]`` (all heads of the layer together)."""

    edit: str
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
    provenance: Provenance

    def to_dataframe(self) -> pd.DataFrame:
        """One row per single head and one per layer's joint edit (head <NA>, label ``L{l}*``)."""
        rows = []
        g = self.info.group_size
        for i, layer in enumerate(self.layers):
            for h in range(self.head_delta.shape[1]):
                rows.append(
                    {
                        "model": self.info.name,
                        "edit": self.edit,
                        "layer": layer,
                        "head": h,
                        "kv_head": h // g,
                        "label": f"L{layer}H{h}",
                        "delta_loss": self.head_delta[i, h],
                        "ci_lo": self.head_lo[i, h],
                        "ci_hi": self.head_hi[i, h],
                        "p": self.head_p[i, h],
                        "q_bh": self.head_q[i, h],
                    }
                )
            rows.append(
                {
                    "model": self.info.name,
                    "edit": self.edit,
                    "layer": layer,
                    "head": None,
                    "kv_head": None,
                    "label": f"L{layer}*",
                    "delta_loss": self.joint_delta[i],
                    "ci_lo": self.joint_lo[i],
                    "ci_hi": self.joint_hi[i],
                    "p": self.joint_p[i],
                    "q_bh": np.nan,
                }
            )
        return pd.DataFrame(rows).astype({"head": "Int64", "kv_head": "Int64"})

    def summary(self) -> pd.DataFrame:
        """One row: the base loss, the most sensitive layer (largest joint effect), the largest single-head
        effect, and how many single heads have q_BH < 0.05."""
        i, (li, h) = (
            int(np.argmax(self.joint_delta)),
            np.unravel_index(np.argmax(self.head_delta), self.head_delta.shape),
        )
        row = {
            "model": self.info.name,
            "edit": self.edit,
            "loss_base": self.loss_base,
            "most_sensitive_layer": self.layers[i],
            "max_joint_delta_loss": float(self.joint_delta[i]),
            "max_head_delta_loss": float(self.head_delta[li, h]),
            "max_head": f"L{self.layers[li]}H{h}",
            "n_heads_q05": int((self.head_q < 0.05).sum()),
        }
        return pd.DataFrame([row])

    def figure(self):
        return sensitivity_figure(self)


def _stats(
    base: DocLosses, edited: DocLosses, n_resamples: int, n_permutations: int, seed: int, label: str
) -> tuple[float, float, float, float]:
    effect = edit_effect(base, edited, n_resamples=n_resamples, seed=seed, what=f"{label}: losses")
    per_doc = (edited.loss_sum - base.loss_sum) / base.n_tokens
    p = sign_flip_pvalue(per_doc, n_resamples=n_permutations, seed=seed, what=f"{label}: per-document delta loss")
    return effect.delta_loss, *effect.delta_loss_ci, p


def head_sensitivity(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    edit: str = "parallel-value",
    positions: str = "all",
    layers: int | Sequence[int] | None = None,
    batch_size: int = 8,
    rows_per_forward: int = 8,
    n_resamples: int = 2000,
    n_permutations: int = 10000,
    seed: int = 0,
    store: str | Path | None = None,
    progress: bool = True,
    workers: int = 1,
    ray_address: str | None = None,
) -> SensitivityResult:
    """Per layer: every head ablated alone and all heads jointly (``edit``: zero, mean, parallel-value,
    parallel-residual; ``positions``: ``all`` or ``after-first``). ``store``: a JSON-lines file that makes the
    sweep resumable (see :func:`lens_parallel.sweep.run_sweep`). With ``layers=None`` linear-attention layers
    (Qwen3.5) are skipped, and the result's provenance says so. ``workers`` / ``ray_address``: run the sweep on Ray
    workers (:mod:`lens_parallel.distributed`; same numbers as one process)."""
    info = model_info(model)
    layer_idx, skipped = softmax_layers(info, layers, what="head_sensitivity")
    singles = [AblationJob(layer, (h,)) for layer in layer_idx for h in range(info.n_heads)]
    joints = [AblationJob(layer, tuple(range(info.n_heads))) for layer in layer_idx]
    run = run_sweep(
        model,
        tokens,
        singles + joints,
        edit=edit,
        positions=positions,
        batch_size=batch_size,
        rows_per_forward=rows_per_forward,
        store=store,
        progress=progress,
        workers=workers,
        ray_address=ray_address,
    )
    single = np.array(
        [_stats(run.base, run[j], n_resamples, n_permutations, seed, head_label(j.layer, j.heads[0])) for j in singles]
    )
    joint = np.array([_stats(run.base, run[j], n_resamples, n_permutations, seed, head_label(j.layer)) for j in joints])
    shape = (len(layer_idx), info.n_heads)
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="head_sensitivity",
        edit=edit,
        positions=positions,
        layers=list(layer_idx),
        batch_size=batch_size,
        n_resamples=n_resamples,
        n_permutations=n_permutations,
        seed=seed,
        skipped=skipped,
    )
    return SensitivityResult(
        edit=edit,
        layers=layer_idx,
        loss_base=run.base.loss,
        head_delta=single[:, 0].reshape(shape),
        head_lo=single[:, 1].reshape(shape),
        head_hi=single[:, 2].reshape(shape),
        head_p=single[:, 3].reshape(shape),
        head_q=benjamini_hochberg(single[:, 3]).reshape(shape),
        joint_delta=joint[:, 0],
        joint_lo=joint[:, 1],
        joint_hi=joint[:, 2],
        joint_p=joint[:, 3],
        provenance=provenance,
    )
