"""Null models for the head-value self-cosine: how much of cos(y_t, v_t) is specific to the token's own value.

With y_t the value aggregate (hook_z; for gated attention the pre-gate A v) and v the values expanded to query heads:

- causal null (the sanity-checks paper, arXiv 2611.13543, Check 1): cos_self = cos(y_t, v_t), cos_null =
  cos(y_t, v_j) with j uniform over the earlier positions [0, t) of the same document, the first token excluded.
  ``null="sampled"`` (the paper's): one draw of j per (document, layer, head, position), from
  ``numpy.random.default_rng([seed, layer])``; ``null="exact"``: the expectation over j, (1/t) sum_{j<t} cos(y_t,
  v_j), from a running sum of unit values (no Monte-Carlo noise). Per head: excess = mean(cos_self - cos_null).
  Model level as the paper computes it: means over heads of cos_self and cos_null, excess = their difference,
  self-specific fraction = (mean cos_self - mean cos_null) / mean cos_self (a ratio of means; per-head medians of
  the per-head ratios are reported beside it).
- GQA: within-group excess is the causal excess (own kv group); across-group excess = mean(cos(y_t, v'_t) -
  cos_null) with v' the neighbouring kv group's value at the same position, kv group (g - 1) mod n_kv as the
  paper's code rolls it (``groups="neighbour"``), or the mean over every other group (``groups="all"``); the raw
  across-group cosine is kept too. Defined for grouped-query attention only (1 < n_kv_heads < n_heads).

The same seed gives the same numbers bit for bit, whatever the batch size. A reconstruction gate runs first: it
rebuilds y = A @ expand(v) (x sigmoid(gate) for gated attention) from the captured hooks on one document and
refuses to run if its relative Frobenius error exceeds ``gate_tol`` (the paper's 1e-2) or is not finite, on the
first, middle and last layers by default.
"""

from __future__ import annotations

from collections.abc import Sequence
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

RECONSTRUCTION_TOL = 1e-2
NULLS = ("sampled", "exact")
GROUPS = ("neighbour", "all")


class ReconstructionError(LensParallelError):
    """The captured hooks do not reproduce hook_z: the checks would measure the wrong thing."""


def null_positions(n_docs: int, seq_len: int, n_heads: int, *, seed: int, layer: int) -> Int[Tensor, "batch pos head"]:
    """j[b, t, h] uniform in [0, t) for t >= 1 (j[b, 0, h] = 0 is never used), from ``default_rng([seed, layer])``:
    one draw per document, position and head, for all documents at once (so batching changes nothing)."""
    u = np.random.default_rng([seed, layer]).random((n_docs, n_heads, seq_len))
    j = np.floor(u * np.arange(seq_len)).astype(np.int64)
    return torch.from_numpy(einops.rearrange(j, "b h p -> b p h"))


def default_gate_layers(layers: tuple[int, ...]) -> list[int]:
    """The layers the reconstruction gate checks by default: the first, middle and last of ``layers``."""
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


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
        error = ((y - t["z"]).norm() / t["z"].norm().clamp_min(1e-30)).item()
        worst[0] = max(worst[0], error) if np.isfinite(error) else float("inf")

    LayerStream(info, layers, roles, reduce).run(model, tokens)
    return worst[0]


@serializable
@dataclass(frozen=True)
class NullResult(ResultMixin):
    """Per-document means over t >= 1, ``[doc, layer, head]``: cos_self, cos_null and (GQA) cos_across; ``null``
    says how cos_null was computed (``sampled`` or ``exact``), ``groups`` which other kv groups cos_across uses."""

    layers: tuple[int, ...]
    seed: int
    null: str
    groups: str | None
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
        """Model-level row as the paper computes it: means over heads of cos_self, cos_null (and the GQA columns),
        excess = mean cos_self - mean cos_null, self_specific_fraction = excess / mean cos_self and null_share = mean
        cos_null / mean cos_self (ratios of means); the medians over heads of the per-head ratios beside them."""
        df = self.head_table()
        cs, cn = df.cos_self.mean(), df.cos_null.mean()
        row = {"model": self.info.name, "null": self.null, "n_heads": len(df), "cos_self": cs, "cos_null": cn}
        row |= {"excess": cs - cn, "self_specific_fraction": (cs - cn) / cs, "null_share": cn / cs}
        row |= {f"median_head_{k}": df[k].median() for k in ("self_specific_fraction", "null_share")}
        if self.cos_across is not None:
            row |= {k: df[k].mean() for k in ("within_excess", "cos_across", "across_excess")}
        return pd.DataFrame([row])

    def figure(self):
        return null_figure(self)


def causal_null(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    seed: int = 0,
    null: str = "sampled",
    groups: str | None = None,
    batch_size: int = 8,
    n_resamples: int = 2000,
    gate_tol: float = RECONSTRUCTION_TOL,
    gate_layers: Sequence[int] | None = None,
) -> NullResult:
    """cos_self vs the earlier-position causal null per layer and head (see the module docstring), with a
    bootstrap CI of the excess over documents. ``null``: ``sampled`` (the paper's) or ``exact``. ``groups``:
    ``neighbour`` or ``all`` adds the across-kv-group cosine (see :func:`gqa_alignment`). The reconstruction gate
    checks ``gate_layers`` (default: first, middle, last) on the first document against ``gate_tol``.
    Linear-attention layers (Qwen3.5) are skipped and said so in the provenance."""
    info = model_info(model)
    toks = as_tokens(tokens)
    if toks.shape[1] < 2:
        raise LensParallelError(f"the causal null needs at least 2 positions per document, got {toks.shape[1]}")
    if null not in NULLS:
        raise LensParallelError(f"unknown null {null!r}; accepted: {', '.join(NULLS)}")
    if groups is not None and groups not in GROUPS:
        raise LensParallelError(f"unknown groups {groups!r}; accepted: {', '.join(GROUPS)}")
    layers, skipped = softmax_layers(info, None, what="causal_null")
    checked = default_gate_layers(layers) if gate_layers is None else [int(x) for x in gate_layers]
    if not set(checked) <= set(layers):
        raise LensParallelError(f"gate layers {checked} must be softmax-attention layers among {list(layers)}")
    error = reconstruction_error(model, toks[:1], checked)
    if not error <= gate_tol:
        raise ReconstructionError(
            f"A @ expand(v) does not reproduce hook_z on layers {checked}: relative error {error:.3g} > tolerance "
            f"{gate_tol:.3g}; the hooks do not hold what the null model assumes (is the model loaded with processed "
            "weights?)"
        )
    n, n_l = len(toks), len(layers)
    if null == "sampled":
        j = {layer: null_positions(n, toks.shape[1], info.n_heads, seed=seed, layer=layer) for layer in layers}
    out = {key: np.zeros((n, n_l, info.n_heads)) for key in ("self", "null", "across")}
    roles = ["v", "pattern_full"] if info.gated_attention else ["v", "z"]
    start = [0]

    def reduce(layer: int, t: dict[str, Tensor]) -> None:
        y, v = _aggregate(t, info)
        sl, i = slice(start[0], start[0] + len(y)), layers.index(layer)
        if null == "sampled":
            cos_self, cos_null = geometry.self_and_null_cosines(y, v, j[layer][sl])
        else:
            cos_self, cos_null = torch.cosine_similarity(y, v, dim=-1), geometry.mean_earlier_cosine(y, v)
        out["self"][sl, i] = cos_self[:, 1:].mean(1).cpu().numpy()  # means over t >= 1
        out["null"][sl, i] = cos_null[:, 1:].mean(1).cpu().numpy()
        if groups is not None:
            out["across"][sl, i] = _across(y, t["v"], info, groups)[:, 1:].mean(1).cpu().numpy()

    stream = LayerStream(info, layers, roles, reduce)
    for s in range(0, n, batch_size):
        start[0] = s
        stream.run(model, toks[s : s + batch_size])
    lo, hi = bootstrap_mean_ci(
        out["self"] - out["null"], n_resamples=n_resamples, seed=seed, what="causal null: per-document excess"
    )
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="gqa_alignment" if groups else "causal_null",
        seed=seed,
        null=null,
        groups=groups,
        layers=list(layers),
        positions="t >= 1; null j ~ U[0, t) per (document, layer, head, position)"
        if null == "sampled"
        else "t >= 1; null = exact mean over j in [0, t)",
        reconstruction_error=error,
        gate={"layers": checked, "tolerance": gate_tol, "documents": 1},
        skipped=skipped,
    )
    return NullResult(
        layers=layers,
        seed=seed,
        null=null,
        groups=groups,
        cos_self=out["self"],
        cos_null=out["null"],
        cos_across=out["across"] if groups else None,
        excess_lo=lo,
        excess_hi=hi,
        reconstruction_error=error,
        provenance=provenance,
    )


def _across(y: Tensor, v_kv: Tensor, info: ModelInfo, groups: str) -> Tensor:
    """cos(y_t, v'_t) with v' another kv group's value: group (g - 1) mod n_kv (the paper's roll), or the mean of the
    cosines with every other group."""
    if groups == "neighbour":
        return torch.cosine_similarity(y, expand_kv(torch.roll(v_kv, shifts=1, dims=2), info.n_heads), dim=-1)
    others = [torch.roll(v_kv, shifts=s, dims=2) for s in range(1, info.n_kv_heads)]
    return torch.stack([torch.cosine_similarity(y, expand_kv(o, info.n_heads), dim=-1) for o in others]).mean(0)


def is_grouped(info: ModelInfo) -> bool:
    """Grouped-query attention: several kv groups, each shared by several query heads."""
    return 1 < info.n_kv_heads < info.n_heads


def gqa_alignment(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    groups: str = "neighbour",
    seed: int = 0,
    **kwargs,
) -> NullResult:
    """Within-group vs across-group excess (module docstring); needs grouped-query attention."""
    info = model_info(model)
    if info.n_kv_heads == 1:
        raise LensParallelError(
            f"{info.name}: all {info.n_heads} query heads share one kv head, so there is no other group to compare "
            "with and the within/across-group contrast is undefined (use causal_null for the self vs null check)"
        )
    if not is_grouped(info):
        raise LensParallelError(
            f"{info.name} has {info.n_heads} query heads and {info.n_kv_heads} kv heads: no groups of query heads "
            "share a value projection, so the within/across-group contrast is undefined (it needs grouped-query "
            "attention, 1 < n_kv_heads < n_heads)"
        )
    return causal_null(model, tokens, seed=seed, groups=groups, **kwargs)
