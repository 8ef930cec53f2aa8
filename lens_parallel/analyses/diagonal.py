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
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.data import TokenBlocks
from lens_parallel.edits import DIAGONAL_SPACES
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import check_indices, expand_kv, hook_name, softmax_layers
from lens_parallel.models import model_info
from lens_parallel.plots.diagonal import diagonal_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable


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


def _token_labels(model: TransformerBridge, tokens: Int[Tensor, " pos"]) -> tuple[str, ...]:
    pieces = model.tokenizer.convert_ids_to_tokens(tokens.tolist())
    text = [model.tokenizer.convert_tokens_to_string([p]) for p in pieces]
    return tuple(f"{i}:{t!r}"[:24] for i, t in enumerate(text))


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
) -> DiagonalView:
    """Diagonal changes dA_tt that reproduce scaling the parallel part by ``s_par``, for ``head`` at ``layer``.

    One forward (stopped after ``layer``) captures resid_pre, hook_v and hook_pattern of that layer for all
    documents; ``doc`` picks the document whose map is kept for the figure. Summaries cover every head.
    """
    info = model_info(model)
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
        warnings.warn("gated attention: the residual-attn diagonal view is skipped (value spaces only)", stacklevel=2)
    (head,) = check_indices("heads", head, info.n_heads)
    if not np.isfinite(s_par):
        raise LensParallelError(f"s_par must be a finite number, got {s_par!r}")
    toks = as_tokens(tokens)
    if not 0 <= doc < len(toks):
        raise LensParallelError(f"doc {doc} out of range: there are {len(toks)} documents")
    names = [hook_name(layer, r) for r in ("resid_pre", "v", "pattern")]
    stop = layer + 1 if layer + 1 < info.n_layers else None
    with torch.inference_mode():
        _, cache = model.run_with_cache(toks, names_filter=names, stop_at_layer=stop)
    x, pattern = cache[names[0]].double(), cache[names[2]].double()
    v = expand_kv(cache[names[1]].double(), info.n_heads)
    W_O = model.blocks[layer].attn.W_O.detach().double()
    changes = [geometry.diagonal_change(pattern, v, s, s_par=s_par, x=x, W_O=W_O, eps=eps) for s in spaces]
    d_a = torch.stack([c.d_a for c in changes])  # [space, batch, head_index, pos]
    guarded = ~torch.stack([c.valid for c in changes])
    diag = torch.diagonal(pattern, dim1=-2, dim2=-1)
    after = (diag + d_a)[..., 1:]
    residual_par = residual_perp = np.zeros(toks.shape[1])
    if "residual-attn" in spaces:
        change = d_a[spaces.index("residual-attn"), doc, head][:, None] * (v[doc, :, head] @ W_O[head])
        split = geometry.project(change, x[doc])
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
    )
    return DiagonalView(
        layer=layer,
        head=head,
        doc=doc,
        s_par=float(s_par),
        spaces=spaces,
        token_labels=_token_labels(model, toks[doc]),
        pattern=pattern[doc, head].numpy(),
        d_a=d_a[:, doc, head].numpy(),
        residual_par=residual_par,
        residual_perp=residual_perp,
        summary_mean=d_a[..., 1:].mean((1, 3)).numpy(),
        summary_min=d_a[..., 1:].amin((1, 3)).numpy(),
        summary_max=d_a[..., 1:].amax((1, 3)).numpy(),
        summary_negative_share=(after < 0).double().mean((1, 3)).numpy(),
        summary_guarded=guarded[..., 1:].sum((1, 3)).numpy(),
        provenance=provenance,
    )
