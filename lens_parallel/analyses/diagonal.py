"""The attention-diagonal form of parallel-only scaling, as a change of one head's attention map.

Scaling a head's parallel part by s_par (off-diagonal attention fixed) is the same as changing only A_tt by

- value space:        dA_tt = (s_par - 1) (o_t . v_t) / |v_t|^2
- exclude-self:       dA_tt = (s_par - 1) (c_t . v_t) / |v_t|^2,   c_t = o_t - A_tt v_t
- residual (per head): dA_tt = (s_par - 1) (m_t . x_t) / ((W_O v_t) . x_t),   m_t = o_t W_O[h]

(``geometry.diagonal_change``). The first two are identities (tested against ``ComponentScale``). The residual form
is a *view*: W_O v_t is not parallel to x_t, so it reproduces the update's component along x_t but also changes
the update perpendicular to x_t by dA_tt (W_O v_t)_perp; that change is reported here beside it.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.data import TokenBlocks
from lens_parallel.edits import DIAGONAL_SPACES
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import check_indices, expand_kv, head_writes_note, output_weights, softmax_layers
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.plots.diagonal import diagonal_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.sweep import capture


@serializable
@dataclass(frozen=True)
class DiagonalView(ResultMixin):
    """One head's empirical attention map on one document, the diagonal changes that reproduce a parallel-only
    scaling in each space, and per-head summaries of those changes over all documents of the layer.

    Arrays: ``pattern`` ``[query_pos, key_pos]`` (document ``doc``, head ``head``); ``d_a`` ``[space, pos]``;
    ``residual_perp`` and ``residual_par`` ``[pos]``: the norms of the change the residual view makes to the head's
    update perpendicular to and along x_t. ``summary_*`` are ``[space, head]`` over documents and positions t >= 1:
    mean, min and max of dA_tt, the share of positions with A_tt + dA_tt < 0, and positions guarded (dA = 0).
    """

    layer: int
    head: int
    doc: int
    s_par: float
    spaces: tuple[str, ...]
    token_labels: tuple[str, ...]
    pattern: np.ndarray
    d_a: np.ndarray
    residual_par: np.ndarray
    residual_perp: np.ndarray
    summary_mean: np.ndarray
    summary_min: np.ndarray
    summary_max: np.ndarray
    summary_negative_share: np.ndarray
    summary_guarded: np.ndarray
    provenance: Provenance

    def edited(self, space: str) -> np.ndarray:
        """The edited map A + diag(dA) of this head and document in ``space``."""
        return self.pattern + np.diag(self.d_a[self.spaces.index(space)])

    def to_dataframe(self) -> pd.DataFrame:
        """Per (space, head) summaries of dA_tt over all documents and positions t >= 1 of the layer."""
        rows = []
        for i, space in enumerate(self.spaces):
            for h in range(self.summary_mean.shape[1]):
                rows.append(
                    {
                        "model": self.info.name,
                        "space": space,
                        "layer": self.layer,
                        "head": h,
                        "kv_head": h // self.info.group_size,
                        "label": f"L{self.layer}H{h}",
                        "s_par": self.s_par,
                        "dA_mean": self.summary_mean[i, h],
                        "dA_min": self.summary_min[i, h],
                        "dA_max": self.summary_max[i, h],
                        "share_negative": self.summary_negative_share[i, h],
                        "n_guarded": int(self.summary_guarded[i, h]),
                    }
                )
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """One row: the shown head and s_par, and per space the mean dA_tt over the layer's heads and the share of
        positions where the edited diagonal A_tt + dA_tt is negative."""
        row = {"model": self.info.name, "layer": self.layer, "head": self.head, "s_par": self.s_par}
        for i, space in enumerate(self.spaces):
            row[f"dA_mean[{space}]"] = float(self.summary_mean[i].mean())
            row[f"share_negative[{space}]"] = float(self.summary_negative_share[i].mean())
        return pd.DataFrame([row])

    def figure(self, *, max_tokens: int = 48):
        return diagonal_figure(self, max_tokens=max_tokens)


class _DiagonalSummary:
    """Running per (space, head) sums over documents and positions t >= 1 of dA_tt: mean, min, max, the share of
    positions with A_tt + dA_tt < 0, and the number of guarded positions."""

    def __init__(self, n_spaces: int, n_heads: int) -> None:
        shape = (n_spaces, n_heads)
        self.total = torch.zeros(shape, dtype=torch.float64)
        self.low = torch.full(shape, torch.inf, dtype=torch.float64)
        self.high = torch.full(shape, -torch.inf, dtype=torch.float64)
        self.negative = torch.zeros(shape, dtype=torch.int64)
        self.guarded = torch.zeros(shape, dtype=torch.int64)
        self.count = 0

    def add(
        self,
        d_a: Float[Tensor, "space batch head_index pos"],
        diag: Float[Tensor, "batch head_index pos"],
        guarded: Bool[Tensor, "space batch head_index pos"],
    ) -> None:
        d = d_a[..., 1:]
        self.total += d.sum((1, 3))
        self.low = torch.minimum(self.low, d.amin((1, 3)))
        self.high = torch.maximum(self.high, d.amax((1, 3)))
        self.negative += ((diag + d_a)[..., 1:] < 0).sum((1, 3))
        self.guarded += guarded[..., 1:].sum((1, 3))
        self.count += d.shape[1] * d.shape[3]

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "summary_mean": (self.total / self.count).numpy(),
            "summary_min": self.low.numpy(),
            "summary_max": self.high.numpy(),
            "summary_negative_share": (self.negative.double() / self.count).numpy(),
            "summary_guarded": self.guarded.numpy(),
        }


def _token_labels(model: TransformerBridge, tokens: Int[Tensor, " pos"]) -> tuple[str, ...]:
    pieces = model.tokenizer.convert_ids_to_tokens(tokens.tolist())
    text = [model.tokenizer.convert_tokens_to_string([p]) for p in pieces]
    return tuple(f"{i}:{t!r}"[:24] for i, t in enumerate(text))


def _check_view(
    info: ModelInfo, space: str | Sequence[str], layer: int, head: int, s_par: float, doc: int, n_docs: int
) -> tuple[tuple[str, ...], int, int]:
    """The spaces, layer and head of a diagonal view, checked (gated attention drops residual-attn from a list)."""
    spaces = (space,) if isinstance(space, str) else tuple(space)
    bad = [s for s in spaces if s not in DIAGONAL_SPACES]
    if bad or not spaces:
        raise LensParallelError(
            f"unknown diagonal space(s) {bad or list(spaces)}; accepted: {', '.join(DIAGONAL_SPACES)}"
        )
    (layer,), _ = softmax_layers(info, [layer], what="diagonal_view")
    if info.gated_attention and "residual-attn" in spaces:
        if isinstance(space, str):
            raise LensParallelError(
                "the residual-attn diagonal view is not defined for gated attention (the head's write is "
                "sigmoid(gate) * A v); use value or value-exclude-self"
            )
        spaces = tuple(s for s in spaces if s != "residual-attn")
        warnings.warn("gated attention: the residual-attn diagonal view is skipped (value spaces only)", stacklevel=3)
    if (note := head_writes_note(info, "the residual-attn diagonal view")) and "residual-attn" in spaces:
        if isinstance(space, str):
            raise LensParallelError(note)
        spaces = tuple(s for s in spaces if s != "residual-attn")
        warnings.warn(note, stacklevel=3)
    (head,) = check_indices("heads", head, info.n_heads)
    if not np.isfinite(s_par):
        raise LensParallelError(f"s_par must be a finite number, got {s_par!r}")
    if not 0 <= doc < n_docs:
        raise LensParallelError(f"doc {doc} out of range: there are {n_docs} documents")
    return spaces, layer, head


def diagonal_view(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    layer: int,
    head: int,
    s_par: float = 0.0,
    space: str | Sequence[str] = DIAGONAL_SPACES,
    doc: int = 0,
    eps: float = geometry.EPS,
    batch_size: int = 8,
) -> DiagonalView:
    """Diagonal changes dA_tt that reproduce scaling the parallel part by ``s_par``, for ``head`` at ``layer``.

    One forward per batch of ``batch_size`` documents (stopped after ``layer``) captures resid_pre, hook_v and
    hook_pattern of that layer; the summaries over every head are accumulated batch by batch, and ``doc`` picks the
    document whose map is kept for the figure.
    """
    info, toks = model_info(model), as_tokens(tokens)
    spaces, layer, head = _check_view(info, space, layer, head, s_par, doc, len(toks))
    W_O = output_weights(model, layer, dtype=torch.float64)
    acc = _DiagonalSummary(len(spaces), info.n_heads)
    kept: dict[str, Tensor] = {}

    def reduce(rows: slice, _: int, t: dict[str, Tensor]) -> None:
        x, pattern, v = t["resid_pre"], t["pattern_full"], expand_kv(t["v"], info.n_heads)
        changes = [geometry.diagonal_change(pattern, v, s, s_par=s_par, x=x, W_O=W_O, eps=eps) for s in spaces]
        d_a = torch.stack([c.d_a for c in changes])  # [space, batch, head_index, pos]
        acc.add(d_a, torch.diagonal(pattern, dim1=-2, dim2=-1), ~torch.stack([c.valid for c in changes]))
        if rows.start <= doc < rows.stop:
            i = doc - rows.start
            kept.update(pattern=pattern[i, head], d_a=d_a[:, i, head], v=v[i, :, head], x=x[i])

    roles = ("resid_pre", "v", "pattern_full")
    capture(model, toks, [layer], roles, reduce, batch_size=batch_size)
    residual_par = residual_perp = np.zeros(toks.shape[1])
    if "residual-attn" in spaces:
        change = kept["d_a"][spaces.index("residual-attn")][:, None] * (kept["v"] @ W_O[head])
        split = geometry.project(change, kept["x"])
        residual_par, residual_perp = split.par.norm(dim=-1).numpy(), split.perp.norm(dim=-1).numpy()
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="diagonal_view",
        layer=layer,
        head=head,
        s_par=s_par,
        spaces=list(spaces),
        doc=doc,
        eps=eps,
        batch_size=batch_size,
    )
    return DiagonalView(
        layer=layer,
        head=head,
        doc=doc,
        s_par=float(s_par),
        spaces=spaces,
        token_labels=_token_labels(model, toks[doc]),
        pattern=kept["pattern"].numpy(),
        d_a=kept["d_a"].numpy(),
        residual_par=residual_par,
        residual_perp=residual_perp,
        **acc.arrays(),
        provenance=provenance,
    )
