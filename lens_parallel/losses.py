"""Token-weighted next-token loss and perplexity: the NLL of each scored token, per-document sums, edit effects.

Every position t < length - 1 predicts token t+1 (position 0, the boundary token, is context only), so a document
of length T scores T-1 tokens. Loss is the token-weighted mean NLL in nats; perplexity is exp(loss). An edit's
effect is always *edited minus matched no-op*: the same hooks with every scale at 1, evaluated in the same run
(``ComponentScale`` and ``DiagonalEdit`` make that no-op exact, so it also equals the unhooked model). The runs
themselves are :func:`lens_parallel.analyses.evaluate.document_losses` and
:func:`~lens_parallel.analyses.evaluate.evaluate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import einops
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
import transformers
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.documents import scored_mask
from lens_parallel.errors import LensParallelError
from lens_parallel.plots.losses import edit_effect_figure
from lens_parallel.results import Provenance, ResultMixin, serializable
from lens_parallel.stats import paired_bootstrap_ci


@serializable
@dataclass(frozen=True)
class DocLosses:
    """Per-document sums of next-token NLL (nats) and the number of scored tokens."""

    loss_sum: np.ndarray
    n_tokens: np.ndarray

    @property
    def loss(self) -> float:
        return float(self.loss_sum.sum() / self.n_tokens.sum())


@serializable
@dataclass(frozen=True)
class EditEffect(ResultMixin):
    """Edited minus matched no-op: loss (nats/token) and perplexity, with paired bootstrap CIs over documents; from
    :func:`~lens_parallel.analyses.evaluate.evaluate` also KL(no-op || edited) of the next-token distributions
    (nats per scored position) and the fraction of positions whose top-1 token is unchanged, with CIs.

    ``provenance`` is set by :func:`evaluate`; effects computed inside a larger result (a sweep point) leave it None
    (the enclosing result carries it)."""

    loss_noop: float
    loss_edited: float
    delta_loss: float
    delta_loss_ci: tuple[float, float]
    ppl_noop: float
    ppl_edited: float
    delta_ppl: float
    delta_ppl_ci: tuple[float, float]
    n_docs: int
    n_tokens: int
    kl: float | None = None
    kl_ci: tuple[float, float] | None = None
    top1_agreement: float | None = None
    top1_agreement_ci: tuple[float, float] | None = None
    provenance: Provenance | None = None

    def to_dataframe(self) -> pd.DataFrame:
        """One row: every field but the provenance, CIs as ``*_lo`` / ``*_hi``."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "provenance"}
        for name in ("delta_loss_ci", "delta_ppl_ci", "kl_ci", "top1_agreement_ci"):
            low_high = row.pop(name) or (None, None)
            row[name.replace("_ci", "_lo")], row[name.replace("_ci", "_hi")] = low_high
        model = {} if self.provenance is None else {"model": self.info.name}
        return pd.DataFrame([model | row])

    def summary(self) -> pd.DataFrame:
        return self.to_dataframe()

    def figure(self) -> go.Figure:
        return edit_effect_figure(self)


def _delta_ppl(edited: np.ndarray, base: np.ndarray, weights: np.ndarray, axis: int = -1) -> np.ndarray | float:
    delta: np.ndarray | float = np.exp(edited.sum(axis) / weights.sum(axis)) - np.exp(
        base.sum(axis) / weights.sum(axis)
    )
    return delta


def _interval(ci: tuple[float, float] | tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """A confidence interval of one statistic as two floats."""
    return float(ci[0]), float(ci[1])


def distribution_shift(
    kl_sum: np.ndarray, agree_sum: np.ndarray, n_tokens: np.ndarray, *, n_resamples: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """The :class:`EditEffect` fields of a distribution shift from per-document sums: the token-weighted mean KL
    (nats) and top-1 agreement, each with a bootstrap CI over documents (ratio of sums)."""
    w = n_tokens.astype(np.float64)
    zero = np.zeros_like(w)
    kw: dict[str, Any] = {"n_resamples": n_resamples, "seed": seed}
    return {
        "kl": float(kl_sum.sum() / w.sum()),
        "kl_ci": _interval(paired_bootstrap_ci(kl_sum, zero, w, what="KL sums", **kw)),
        "top1_agreement": float(agree_sum.sum() / w.sum()),
        "top1_agreement_ci": _interval(paired_bootstrap_ci(agree_sum, zero, w, what="top-1 agreements", **kw)),
    }


def edit_effect(
    noop_losses: DocLosses, edited: DocLosses, *, n_resamples: int = 2000, seed: int = 0, what: str = "edited losses"
) -> EditEffect:
    """Compare two :class:`DocLosses` of the same documents (``what`` names them in the error for a non-finite
    loss)."""
    if not np.array_equal(noop_losses.n_tokens, edited.n_tokens):
        raise LensParallelError("the two DocLosses do not score the same documents")
    e, b, w = edited.loss_sum, noop_losses.loss_sum, noop_losses.n_tokens.astype(np.float64)
    kw: dict[str, Any] = {"n_resamples": n_resamples, "seed": seed, "what": what}
    return EditEffect(
        loss_noop=noop_losses.loss,
        loss_edited=edited.loss,
        delta_loss=edited.loss - noop_losses.loss,
        delta_loss_ci=_interval(paired_bootstrap_ci(e, b, w, **kw)),
        ppl_noop=float(np.exp(noop_losses.loss)),
        ppl_edited=float(np.exp(edited.loss)),
        delta_ppl=float(np.exp(edited.loss) - np.exp(noop_losses.loss)),
        delta_ppl_ci=_interval(paired_bootstrap_ci(e, b, w, statistic=_delta_ppl, **kw)),
        n_docs=len(e),
        n_tokens=int(w.sum()),
    )


def token_nll(
    logits: Float[Tensor, "batch pos d_vocab"],
    tokens: Int[Tensor, "batch pos"],
    lengths: Int[Tensor, " batch"] | None = None,
) -> Float[Tensor, "batch scored"]:
    """-log p(token_{t+1} | ..t) for t = 0..T-2, in float32 (float64 for a float64 model); with ``lengths`` (the
    documents' real tokens, right-padded), NaN where token t+1 is past the document's end."""
    logp = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return _unscored_nan(-logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), lengths)


def _unscored_nan(
    nll: Float[Tensor, "batch scored"],
    lengths: Int[Tensor, " batch"] | None,
    first: Int[Tensor, " batch"] | None = None,
) -> Float[Tensor, "batch scored"]:
    """``nll`` with NaN where token t+1 is past the document's end, or t is before ``first`` (context only; nothing
    masked without ``lengths`` and ``first``): :func:`~lens_parallel.documents.scored_mask`."""
    return torch.where(scored_mask(nll.shape[1], lengths, first).to(nll.device), nll, torch.nan)


LOSS_CHUNK_BYTES = 64 * 2**20
"""The float32 logits one chunk of :func:`chunked_token_nll` may hold (64 MiB: 64 positions of a 262,144-token
vocabulary); the chunk's model-dtype logits and, under grad, its softmax come on top."""


@dataclass(frozen=True)
class Unembedding:
    """The model's map from the final normalised residual to logits:
    ``logits = c * tanh((x W_U^T + b_U) / c)`` with ``c = softcap`` (Gemma 2's ``final_logit_softcapping``), or
    without the tanh when ``softcap`` is None. ``W_U`` is in Hugging Face's layout ``[d_vocab, d_model]`` and is the
    model's own parameter (tied to the embedding where the model ties them), so gradients reach it."""

    W_U: Float[Tensor, "d_vocab d_model"]
    b_U: Float[Tensor, " d_vocab"] | None
    softcap: float | None


def unembedding(model: TransformerBridge) -> Unembedding:
    """The :class:`Unembedding` of a bridge: its Hugging Face ``lm_head`` and the config's final-logit soft cap."""
    head = cast(torch.nn.Linear, model.unembed.original_component)
    config = cast(transformers.PretrainedConfig, model.original_model.config)
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(
        getattr(config, "text_config", None), "final_logit_softcapping", None
    )
    return Unembedding(head.weight, head.bias, float(softcap) if softcap else None)


def _logits(resid: Float[Tensor, "row d_model"], unembed: Unembedding) -> Float[Tensor, "row d_vocab"]:
    """The logits of rows of final residual: the matmul in the model's dtype (as its own lm_head computes them),
    then float32 (float64 for a float64 model) and the soft cap."""
    logits = F.linear(resid, unembed.W_U, unembed.b_U)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if unembed.softcap is not None:
        logits = unembed.softcap * torch.tanh(logits / unembed.softcap)
    return logits


def _chunk_nll(
    resid: Float[Tensor, "row d_model"], target: Int[Tensor, " row"], unembed: Unembedding
) -> Float[Tensor, " row"]:
    """-log softmax(logits)[target] of each row; the logits in the model's dtype (as its own lm_head computes
    them), the log-sum-exp in float32 (float64 for a float64 model), as :func:`token_nll` does."""
    logits = _logits(resid, unembed)
    return torch.logsumexp(logits, dim=-1) - logits.gather(-1, target[:, None]).squeeze(-1)


def scored_rows(
    resid: Float[Tensor, "row d_model"],
    unembed: Unembedding,
    target: Int[Tensor, " row"],
    *,
    chunk_bytes: int = LOSS_CHUNK_BYTES,
) -> tuple[Float[Tensor, " row"], Bool[Tensor, " row"]]:
    """Per row of final normalised residual: the NLL of ``target`` and whether ``target`` is the argmax of the
    logits (greedy), unembedded ``max(1, chunk_bytes // (4 d_vocab))`` rows at a time as
    :func:`chunked_token_nll` (never the full logits; no gradients)."""
    rows = max(1, chunk_bytes // (4 * unembed.W_U.shape[0]))
    nll, greedy = [], []
    for x_c, t_c in zip(resid.split(rows), target.to(resid.device).split(rows), strict=True):
        logits = _logits(x_c, unembed)
        nll.append(torch.logsumexp(logits, dim=-1) - logits.gather(-1, t_c[:, None]).squeeze(-1))
        greedy.append(logits.argmax(-1) == t_c)
    return torch.cat(nll), torch.cat(greedy)


def chunked_divergence(
    resid_p: Float[Tensor, "batch pos d_model"],
    resid_q: Float[Tensor, "batch pos d_model"],
    unembed: Unembedding,
    tokens: Int[Tensor, "batch pos"],
    lengths: Int[Tensor, " batch"] | None = None,
    *,
    first: Int[Tensor, " batch"] | None = None,
    chunk_bytes: int = LOSS_CHUNK_BYTES,
) -> tuple[Float[Tensor, "batch scored"], ...]:
    """Per predicting position t < T - 1, from one unembedding of each of two final residuals (p: e.g. the
    unedited model, q: the edited one): the NLL of token t+1 under p and under q (as :func:`token_nll`), KL(p_t ||
    q_t) = sum_v p_t(v) (log p_t(v) - log q_t(v)) (nats), and 1.0 where their top-1 tokens agree (else 0.0); NaN
    past each document's end and before its ``first`` scored position. Unembedded in chunks of rows as
    :func:`chunked_token_nll` (half the rows: two distributions per row), log-softmax in float32; never the full
    logits or log-probabilities."""
    x_p = einops.rearrange(resid_p[:, :-1], "batch pos d_model -> (batch pos) d_model")
    x_q = einops.rearrange(resid_q[:, :-1], "batch pos d_model -> (batch pos) d_model")
    target = einops.rearrange(tokens[:, 1:].to(resid_p.device), "batch pos -> (batch pos)")
    rows = max(1, chunk_bytes // (8 * unembed.W_U.shape[0]))
    parts: list[list[Tensor]] = [[], [], [], []]
    for p_c, q_c, t_c in zip(x_p.split(rows), x_q.split(rows), target.split(rows), strict=True):
        log_p = torch.log_softmax(_logits(p_c, unembed), dim=-1)
        log_q = torch.log_softmax(_logits(q_c, unembed), dim=-1)
        parts[0].append(-log_p.gather(-1, t_c[:, None]).squeeze(-1))
        parts[1].append(-log_q.gather(-1, t_c[:, None]).squeeze(-1))
        parts[2].append((log_p.exp() * (log_p - log_q)).sum(-1))
        parts[3].append((log_p.argmax(-1) == log_q.argmax(-1)).to(log_p.dtype))
    batch = resid_p.shape[0]
    return tuple(
        _unscored_nan(einops.rearrange(torch.cat(part), "(batch pos) -> batch pos", batch=batch), lengths, first)
        for part in parts
    )


def chunked_token_nll(
    resid: Float[Tensor, "batch pos d_model"],
    unembed: Unembedding,
    tokens: Int[Tensor, "batch pos"],
    lengths: Int[Tensor, " batch"] | None = None,
    *,
    first: Int[Tensor, " batch"] | None = None,
    chunk_bytes: int = LOSS_CHUNK_BYTES,
) -> Float[Tensor, "batch scored"]:
    """:func:`token_nll` of the logits ``unembed`` makes of the final normalised residual ``resid``, without ever
    holding them (NaN also before each row's ``first`` scored position, when given): the (batch x (pos-1))
    positions are unembedded in chunks of
    ``max(1, chunk_bytes // (4 d_vocab))`` rows, each reduced to its NLL before the next. Equal to
    ``token_nll(logits, tokens, lengths)`` to float rounding (the same matmul and log-sum-exp, row by row).

    Under grad (attribution, training) every chunk is checkpointed: the backward recomputes one chunk's logits at a
    time, so it never holds the full logits either; gradients reach ``resid`` and the unembedding's parameters.
    A chunk's backward holds about four float32 copies of its logits (recomputed logits, their softmax, its
    gradient, the model-dtype logits), so under grad a chunk has a quarter of the rows.
    The vocabulary is not split: one position's float32 row of a 262,144-token vocabulary is 1 MiB."""
    x = einops.rearrange(resid[:, :-1], "batch pos d_model -> (batch pos) d_model")
    target = einops.rearrange(tokens[:, 1:].to(resid.device), "batch pos -> (batch pos)")
    grad = torch.is_grad_enabled() and (x.requires_grad or unembed.W_U.requires_grad)
    rows = max(1, chunk_bytes // (4 * unembed.W_U.shape[0] * (4 if grad else 1)))
    parts = [
        cast(Tensor, checkpoint(_chunk_nll, x_c, t_c, unembed, use_reentrant=False))
        if grad
        else _chunk_nll(x_c, t_c, unembed)
        for x_c, t_c in zip(x.split(rows), target.split(rows), strict=True)
    ]
    nll = einops.rearrange(torch.cat(parts), "(batch pos) -> batch pos", batch=tokens.shape[0])
    return _unscored_nan(nll, lengths, first)
