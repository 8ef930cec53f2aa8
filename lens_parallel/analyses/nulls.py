"""Null models for the head-value self-cosine: how much of cos(y_t, v_t) is specific to the token's own value.

With y_t the value aggregate (hook_z; for gated attention the pre-gate A v) and v the values expanded to query heads:

- causal null: cos_self = cos(y_t, v_t), cos_null = cos(y_t, v_j) with j drawn uniformly from [0, t) of the same
  document (t = 0 excluded); excess = mean(cos_self - cos_null); self-specific fraction = excess / mean cos_self;
  null share = mean cos_null / mean cos_self.
- GQA: within-group excess is the causal excess (own kv group); across-group excess = mean(cos(y_t, v'_t) -
  cos_null) with v' the neighbouring kv group's value ((kv + 1) mod n_kv) at the same position; the raw
  across-group cosine is kept too.

One draw of j per (document, position), shared by every layer and head, from ``numpy.random.default_rng(seed)``:
the same seed gives the same numbers bit for bit, and different seeds differ only in the null draws. A
reconstruction gate runs first: it rebuilds y = A @ expand(v) from the captured hooks and refuses to run if it does
not match hook_z.
"""

from __future__ import annotations

from dataclasses import dataclass

import einops
import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.data import TokenBlocks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import LayerStream, expand_kv, softmax_layers
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.plots.nulls import null_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.stats import bootstrap_mean_ci

RECONSTRUCTION_TOL = 1e-4


class ReconstructionError(LensParallelError):
    """The captured hooks do not reproduce hook_z: the checks would measure the wrong thing."""


def null_positions(n_docs: int, seq_len: int, seed: int) -> Int[Tensor, "batch pos"]:
    """j[b, t] uniform in [0, t) for t >= 1 (j[b, 0] = 0 is never used)."""
    u = np.random.default_rng(seed).random((n_docs, seq_len))
    t = np.arange(seq_len)[None, :]
    return torch.from_numpy(np.floor(u * t).astype(np.int64))


def _aggregate(t: dict[str, Tensor], info: ModelInfo) -> tuple[Tensor, Tensor]:
    """(y, v expanded): y = hook_z, or for gated attention the pre-gate A v rebuilt from the pattern."""
    v = expand_kv(t["v"], info.n_heads)
    if info.gated_attention:
        return geometry.value_aggregate(t["pattern_full"], v), v
    return t["z"], v


def reconstruction_error(model: TransformerBridge, tokens: Int[Tensor, "batch pos"], layers: list[int]) -> float:
    """Max over layers of |A @ expand(v) (x sigmoid(gate) if gated) - hook_z| / |hook_z|, on ``tokens``."""
    info = model_info(model)
    roles = ["v", "pattern_full", "z", *(["q_gate"] if info.gated_attention else [])]
    worst = [0.0]

    def reduce(layer: int, t: dict[str, Tensor]) -> None:
        y = geometry.value_aggregate(t["pattern_full"], expand_kv(t["v"], info.n_heads))
        if info.gated_attention:
            y = torch.sigmoid(einops.rearrange(t["q_gate"], "b p (h d) -> b p h d", h=info.n_heads)) * y
        worst[0] = max(worst[0], ((y - t["z"]).norm() / t["z"].norm().clamp_min(1e-30)).item())

    LayerStream(info, layers, roles, reduce).run(model, tokens)
    return worst[0]


@serializable
@dataclass(frozen=True)
class NullResult(ResultMixin):
    """Per-document means over t >= 1, ``[doc, layer, head]``: cos_self, cos_null and (GQA) cos_across."""

    layers: tuple[int, ...]
    seed: int
    cos_self: np.ndarray
    cos_null: np.ndarray
    cos_across: np.ndarray | None
    excess_lo: np.ndarray
    excess_hi: np.ndarray
    reconstruction_error: float
    provenance: Provenance

    @property
    def excess(self) -> np.ndarray:
        """mean(cos_self - cos_null) per ``[layer, head]``."""
        return (self.cos_self - self.cos_null).mean(0)

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (document, layer, head) with that document's mean cos_self, cos_null (and
        cos_across) over positions t >= 1."""
        info = self.info
        n_docs, n_layers, n_heads = self.cos_self.shape
        doc, layer, head = np.meshgrid(np.arange(n_docs), np.arange(n_layers), np.arange(n_heads), indexing="ij")
        layers = np.asarray(self.layers)[layer.ravel()]
        frame = {
            "model": info.name,
            "document": doc.ravel(),
            "layer": layers,
            "head": head.ravel(),
            "kv_head": head.ravel() // info.group_size,
            "label": [f"L{lay}H{h}" for lay, h in zip(layers, head.ravel(), strict=True)],
            "cos_self": self.cos_self.ravel(),
            "cos_null": self.cos_null.ravel(),
        }
        if self.cos_across is not None:
            frame["cos_across"] = self.cos_across.ravel()
        return pd.DataFrame(frame)

    def head_table(self) -> pd.DataFrame:
        """One row per (layer, head): means over documents, the excess with its bootstrap CI over documents, the
        self-specific fraction and null share of that head, and (GQA) within/across-group excess."""
        info, rows = self.info, []
        cs, cn = self.cos_self.mean(0), self.cos_null.mean(0)
        for i, layer in enumerate(self.layers):
            for h in range(cs.shape[1]):
                row = {
                    "model": info.name,
                    "layer": layer,
                    "head": h,
                    "kv_head": h // info.group_size,
                    "label": f"L{layer}H{h}",
                    "cos_self": cs[i, h],
                    "cos_null": cn[i, h],
                    "excess": self.excess[i, h],
                    "excess_lo": self.excess_lo[i, h],
                    "excess_hi": self.excess_hi[i, h],
                    "self_specific_fraction": self.excess[i, h] / cs[i, h],
                    "null_share": cn[i, h] / cs[i, h],
                }
                if self.cos_across is not None:
                    across = self.cos_across[:, i, h]
                    row |= {
                        "within_excess": self.excess[i, h],
                        "cos_across": across.mean(),
                        "across_excess": (across - self.cos_null[:, i, h]).mean(),
                    }
                rows.append(row)
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """Model-level row: unweighted means over heads of :meth:`head_table`."""
        df = self.head_table()
        cols = [c for c in df.columns if c not in ("model", "layer", "head", "kv_head", "label")]
        return pd.DataFrame([{"model": self.info.name, **df[cols].mean().to_dict()}])

    def figure(self):
        return null_figure(self)


def causal_null(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    seed: int = 0,
    across: bool = False,
    batch_size: int = 8,
    n_resamples: int = 2000,
    tol: float = RECONSTRUCTION_TOL,
) -> NullResult:
    """cos_self vs the earlier-position causal null per layer and head (see the module docstring), with a
    bootstrap CI of the excess over documents. ``across=True`` adds the neighbouring kv group (see
    :func:`gqa_alignment`). Linear-attention layers (Qwen3.5) are skipped and said so in the provenance."""
    info = model_info(model)
    toks = as_tokens(tokens)
    if toks.shape[1] < 2:
        raise LensParallelError(f"the causal null needs at least 2 positions per document, got {toks.shape[1]}")
    layers, skipped = softmax_layers(info, None, what="causal_null")
    error = reconstruction_error(model, toks[:batch_size], list(layers))
    if error > tol:
        raise ReconstructionError(
            f"A @ expand(v) does not reproduce hook_z: relative error {error:.3g} > tolerance {tol:.3g}; the hooks "
            "do not hold what the null model assumes (is the model loaded with processed weights?)"
        )
    n, n_l = len(toks), len(layers)
    j = null_positions(n, toks.shape[1], seed)
    out = {key: np.zeros((n, n_l, info.n_heads)) for key in ("self", "null", "across")}
    roles = ["v", "pattern_full"] if info.gated_attention else ["v", "z"]
    start = [0]

    def reduce(layer: int, t: dict[str, Tensor]) -> None:
        y, v = _aggregate(t, info)
        sl, i = slice(start[0], start[0] + len(y)), layers.index(layer)
        cos_self, cos_null = geometry.self_and_null_cosines(y, v, j[sl])
        out["self"][sl, i] = cos_self[:, 1:].mean(1).cpu().numpy()  # means over t >= 1
        out["null"][sl, i] = cos_null[:, 1:].mean(1).cpu().numpy()
        if across:
            neighbour = expand_kv(torch.roll(t["v"], shifts=-1, dims=2), info.n_heads)
            out["across"][sl, i] = torch.cosine_similarity(y, neighbour, dim=-1)[:, 1:].mean(1).cpu().numpy()

    stream = LayerStream(info, layers, roles, reduce)
    for s in range(0, n, batch_size):
        start[0] = s
        stream.run(model, toks[s : s + batch_size])
    lo, hi = bootstrap_mean_ci(out["self"] - out["null"], n_resamples=n_resamples, seed=seed)
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="gqa_alignment" if across else "causal_null",
        seed=seed,
        layers=list(layers),
        positions="t >= 1; null j ~ U[0, t) per (document, position), shared across layers and heads",
        reconstruction_error=error,
        skipped=skipped,
    )
    return NullResult(
        layers=layers,
        seed=seed,
        cos_self=out["self"],
        cos_null=out["null"],
        cos_across=out["across"] if across else None,
        excess_lo=lo,
        excess_hi=hi,
        reconstruction_error=error,
        provenance=provenance,
    )


def gqa_alignment(
    model: TransformerBridge, tokens: TokenBlocks | Int[Tensor, "batch pos"], *, seed: int = 0, **kwargs
) -> NullResult:
    """Within-group vs across-group excess (module docstring); needs at least 2 kv groups."""
    info = model_info(model)
    if info.n_kv_heads < 2:
        raise LensParallelError(f"{info.name} has {info.n_kv_heads} kv head: there is no neighbouring kv group")
    return causal_null(model, tokens, seed=seed, across=True, **kwargs)
