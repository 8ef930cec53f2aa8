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
from typing import Any, ClassVar, cast

import einops
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
import transformers
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.nn import functional as F
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat, devices, features
from lens_parallel.documents import scored_mask
from lens_parallel.errors import LensParallelError
from lens_parallel.plots.losses import edit_effect_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.stats import N_RESAMPLES, paired_bootstrap_ci


@dataclass(frozen=True)
class DocLosses:
    """Per-document sums of next-token NLL (nats) and the number of scored tokens.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> losses = lp.document_losses(model, ["A short text.", "A longer text of a few more words."], progress=False)
        >>> losses.loss > 0
        True
    """

    loss_sum: np.ndarray
    n_tokens: np.ndarray

    @property
    def loss(self) -> float:
        return float(self.loss_sum.sum() / self.n_tokens.sum())

    def to_dataframe(self) -> pd.DataFrame:
        """One row per document: doc, loss_sum, n_tokens and loss (its mean NLL per scored token, nats)."""
        return pd.DataFrame(
            {"doc": np.arange(len(self.loss_sum)), "loss_sum": self.loss_sum, "n_tokens": self.n_tokens}
        ).assign(loss=lambda df: df.loss_sum / df.n_tokens)


@dataclass(frozen=True, repr=False)
class EditEffect(ResultMixin):
    """Edited minus matched no-op: loss (nats/token) and perplexity, with paired bootstrap CIs over documents; from
    :func:`~lens_parallel.analyses.evaluate.evaluate` also KL(no-op || edited) of the next-token distributions
    (nats per scored position) and the fraction of positions whose top-1 token is unchanged, with CIs.

    ``provenance`` is set by :func:`evaluate`; effects computed inside a larger result (a sweep point) leave it None
    (the enclosing result carries it).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> effect = lp.evaluate(model, docs, lp.HeadEdit("zero", 0, 1), n_resamples=50, progress=False)
        >>> "delta_loss" in effect.to_dataframe().columns
        True
    """

    columns: ClassVar[str] = (
        "model loss_noop loss_edited delta_loss ppl_noop ppl_edited delta_ppl n_docs n_tokens kl "
        "top1_agreement delta_loss_lo delta_loss_hi delta_ppl_lo delta_ppl_hi kl_lo kl_hi top1_agreement_lo "
        "top1_agreement_hi"
    )

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
    kl_sum: np.ndarray, agree_sum: np.ndarray, n_tokens: np.ndarray, *, n_resamples: int = N_RESAMPLES, seed: int = 0
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
    noop_losses: DocLosses,
    edited: DocLosses,
    *,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    what: str = "edited losses",
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


def scored_sums(
    per_token: Float[Tensor, "batch scored"],
    lengths: Int[Tensor, " batch"] | None,
    first: Int[Tensor, " batch"] | None = None,
) -> Float[Tensor, " batch"]:
    """Each document's sum of ``per_token`` over its scored positions (:func:`~lens_parallel.documents.scored_mask`):
    positions not scored (NaN by convention) are left out, and a NaN or infinity at a scored position stays in
    the sum: a non-finite loss is never read as 0."""
    scored = scored_mask(per_token.shape[1], lengths, first).to(per_token.device)
    return torch.where(scored, per_token, 0.0).sum(-1)


@dataclass(frozen=True)
class Unembedding:
    """The model's map from the final normalised residual to logits:
    ``logits = c * tanh(s (x W_U^T + b_U) / c)`` with ``s = scale`` (a logit multiplier: Granite's 1 /
    ``logits_scaling``, Cohere's ``logit_scale``) and ``c = softcap`` (Gemma 2's ``final_logit_softcapping``), or
    without the tanh when ``softcap`` is None (:mod:`lens_parallel.features`). ``W_U`` is in Hugging Face's layout
    ``[d_vocab, d_model]`` and is the model's own parameter (tied to the embedding where the model ties them), so
    gradients reach it."""

    W_U: Float[Tensor, "d_vocab d_model"]
    b_U: Float[Tensor, " d_vocab"] | None
    softcap: float | None
    scale: float = 1.0

    def frozen(self) -> Unembedding:
        """The same map with its parameters detached: gradients reach the residual only. For a backward that needs
        no parameter gradient (attribution): :class:`_ChunkedNLL` computes d/dW_U whenever W_U requires grad (a
        custom function cannot see ``torch.autograd.grad``'s ``inputs``), a d_vocab x d_model matrix."""
        return dataclasses.replace(self, W_U=self.W_U.detach(), b_U=None if self.b_U is None else self.b_U.detach())

    def columns(self, start: int, stop: int) -> Unembedding:
        """The same map restricted to the vocabulary's tokens ``[start, stop)``."""
        bias = None if self.b_U is None else self.b_U[start:stop]
        return dataclasses.replace(self, W_U=self.W_U[start:stop], b_U=bias)


def unembedding(model: TransformerBridge) -> Unembedding:
    """The :class:`Unembedding` of a bridge: its Hugging Face ``lm_head``, the config's logit multipliers and final
    soft cap (:func:`lens_parallel.features.logit_scale`, :func:`~lens_parallel.features.final_softcap`)."""
    head = cast(torch.nn.Linear, compat.hf_module(model.unembed))
    config = cast(transformers.PretrainedConfig, model.original_model.config)
    return Unembedding(head.weight, head.bias, features.final_softcap(config), features.logit_scale(config))


def logits_of(resid: Float[Tensor, "row d_model"], unembed: Unembedding) -> Float[Tensor, "row d_vocab"]:
    """The logits of rows of final residual: the matmul in the model's dtype (as its own lm_head computes them),
    then float32 (float64 for a float64 model) and the soft cap."""
    logits = F.linear(resid, unembed.W_U, unembed.b_U)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if unembed.scale != 1.0:
        logits = logits * unembed.scale
    if unembed.softcap is not None:
        logits = unembed.softcap * torch.tanh(logits / unembed.softcap)
    return logits


def scored_rows(
    resid: Float[Tensor, "row d_model"], unembed: Unembedding, target: Int[Tensor, " row"]
) -> tuple[Float[Tensor, " row"], Bool[Tensor, " row"]]:
    """Per row of final normalised residual: the NLL of ``target`` and whether ``target`` is the argmax of the
    logits (greedy), from :func:`_vocab_scan` (never the full logits; no gradients)."""
    ((lse, picked, arg),), _ = _vocab_scan((resid,), target.to(resid.device), unembed)
    return lse - picked, arg == target.to(resid.device)


def chunked_divergence(
    resid_p: Float[Tensor, "batch pos d_model"],
    resid_q: Float[Tensor, "batch pos d_model"],
    unembed: Unembedding,
    tokens: Int[Tensor, "batch pos"],
    lengths: Int[Tensor, " batch"] | None = None,
    *,
    first: Int[Tensor, " batch"] | None = None,
    rows: int | None = None,
    block_bytes: int | None = None,
) -> tuple[Float[Tensor, "batch scored"], ...]:
    """Per predicting position t < T - 1, from one unembedding of each of two final residuals (p: e.g. the
    unedited model, q: the edited one): the NLL of token t+1 under p and under q (as :func:`token_nll`), KL(p_t ||
    q_t) = sum_v p_t(v) (log p_t(v) - log q_t(v)) (nats), and 1.0 where their top-1 tokens agree (else 0.0); NaN
    past each document's end and before its ``first`` scored position. Unembedded a block of ``rows`` positions
    and vocabulary columns (``block_bytes`` of float32 logits) at a time (:func:`_vocab_scan`; default: the
    device's :class:`~lens_parallel.devices.WorkSizes`), without gradients; never the full logits or
    log-probabilities."""
    x_p = einops.rearrange(resid_p[:, :-1], "batch pos d_model -> (batch pos) d_model")
    x_q = einops.rearrange(resid_q[:, :-1], "batch pos d_model -> (batch pos) d_model")
    target = einops.rearrange(tokens[:, 1:].to(resid_p.device), "batch pos -> (batch pos)")
    ((lse_p, picked_p, arg_p), (lse_q, picked_q, arg_q)), kl = _vocab_scan(
        (x_p, x_q), target, unembed, rows=rows, block_bytes=block_bytes
    )
    assert kl is not None
    per_row = (lse_p - picked_p, lse_q - picked_q, kl, (arg_p == arg_q).to(kl.dtype))
    batch = resid_p.shape[0]
    return tuple(
        _unscored_nan(einops.rearrange(x, "(batch pos) -> batch pos", batch=batch), lengths, first) for x in per_row
    )


def _vocab_scan(
    xs: tuple[Float[Tensor, "row d_model"], ...],
    target: Int[Tensor, " row"],
    unembed: Unembedding,
    *,
    rows: int | None = None,
    block_bytes: int | None = None,
) -> tuple[list[tuple[Tensor, Tensor, Tensor]], Tensor | None]:
    """For each of one or two sets of rows of final residual, per row: the log-sum-exp of its logits, the logit of
    ``target`` and the argmax; for two (p and q), also KL(p || q). The logits are formed a block of ``rows`` rows
    and ``block_bytes // (4 rows)`` vocabulary columns at a time (:func:`_chunk_logits`: the model's matmul, float32,
    the soft cap) and folded into running sums, as an online softmax does: with r the row's largest logit in the
    first block, a = l - r, M the largest a so far and S = sum exp(a - M) (rescaled by exp(M_old - M_new) when M
    grows), lse = r + M + log S; for the pair, with d = a_p - a_q and D = sum exp(a_p - M_p) d likewise,

        KL = sum_v p_v (log p_v - log q_v) = D / S_p - (M_p + log S_p) + (M_q + log S_q)

    (exactly 0 where the logits agree). Logits are taken relative to r, so that no term is the size of a logit and
    a shift of every logit costs no precision. No gradients; memory: three blocks. ``rows`` and ``block_bytes``
    default to the device's :class:`~lens_parallel.devices.WorkSizes` (``scan_rows``, ``scan_bytes``: cache-sized
    on a CPU, few large blocks on a GPU)."""
    sized = devices.sizes(xs[0].device)
    rows = sized.scan_rows if rows is None else rows
    block_bytes = sized.scan_bytes if block_bytes is None else block_bytes
    n_vocab = unembed.W_U.shape[0]
    cols = min(n_vocab, max(1, block_bytes // (4 * rows)))  # one split of the vocabulary, whatever the batch
    found: list[list[list[Tensor]]] = [[[], [], []] for _ in xs]
    kls: list[Tensor] = []
    with torch.no_grad():
        for start in range(0, len(target), rows):
            x_rows, t = [x[start : start + rows] for x in xs], target[start : start + rows]
            n = len(t)
            raw, bufs = _buffers(xs[0], n, cols, n=len(xs) + 1)  # each set's logits, d
            states: list[dict[str, Tensor]] = [{} for _ in xs]
            for v0 in range(0, n_vocab, cols):
                v1 = min(n_vocab, v0 + cols)
                block = unembed.columns(v0, v1)
                inside, column = (t >= v0) & (t < v1), (t - v0).clamp(0, v1 - v0 - 1)[:, None]
                shifted = []
                for x_c, buf, state in zip(x_rows, bufs[: len(xs)], states, strict=True):
                    out = buf[:, : v1 - v0]
                    logits = _chunk_logits(x_c, block, out if raw is bufs[0] else raw[:, : v1 - v0], out)
                    top, arg = logits.max(-1)
                    picked = logits.gather(-1, column).squeeze(-1)
                    if not state:
                        zero = torch.zeros_like(top)
                        state.update(top=top, arg=arg, picked=picked, ref=top.clone(), M=zero, S=zero, D=zero)
                    else:
                        better = top > state["top"]
                        state["arg"] = torch.where(better, arg + v0, state["arg"])
                        state["top"] = torch.maximum(top, state["top"])
                        state["picked"] = torch.where(inside, picked, state["picked"])
                    shifted.append(logits.sub_(state["ref"][:, None]))
                d = torch.sub(shifted[0], shifted[1], out=bufs[-1][:, : v1 - v0]) if len(xs) == 2 else None
                for i, (a, state) in enumerate(zip(shifted, states, strict=True)):
                    grown = torch.maximum(state["M"], state["top"] - state["ref"])
                    rescale = (state["M"] - grown).exp_()
                    e = a.sub_(grown[:, None]).exp_()
                    state["S"] = state["S"] * rescale + e.sum(-1)
                    if d is not None and i == 0:  # p's weights of d
                        state["D"] = state["D"] * rescale + torch.linalg.vecdot(e, d)
                    state["M"] = grown
            log_sums = [state["M"] + state["S"].log() for state in states]
            for store, state, log_sum in zip(found, states, log_sums, strict=True):
                for part, value in zip(store, (state["ref"] + log_sum, state["picked"], state["arg"]), strict=True):
                    part.append(value)
            if len(xs) == 2:
                kls.append(states[0]["D"] / states[0]["S"] - log_sums[0] + log_sums[1])
    per_x = [(torch.cat(lse), torch.cat(picked), torch.cat(arg)) for lse, picked, arg in found]
    return per_x, torch.cat(kls) if kls else None


def chunked_token_nll(
    resid: Float[Tensor, "batch pos d_model"],
    unembed: Unembedding,
    tokens: Int[Tensor, "batch pos"],
    lengths: Int[Tensor, " batch"] | None = None,
    *,
    first: Int[Tensor, " batch"] | None = None,
    chunk_bytes: int | None = None,
) -> Float[Tensor, "batch scored"]:
    """:func:`token_nll` of the logits ``unembed`` makes of the final normalised residual ``resid``, without ever
    holding them (NaN also before each row's ``first`` scored position, when given): the (batch x (pos-1))
    positions are unembedded a block of the device's ``scan_rows`` positions and vocabulary columns at a time,
    each block folded into running log-sum-exps (:func:`_vocab_scan`). Equal to ``token_nll(logits, tokens,
    lengths)`` to float rounding (the same matmul; the log-sum-exp in float32).

    Under grad (attribution, training) the gradients come from :class:`_ChunkedNLL`'s backward, which recomputes
    the logits ``max(1, chunk_bytes // (8 d_vocab))`` positions at a time (default: the device's
    ``loss_chunk_bytes``, :class:`~lens_parallel.devices.WorkSizes`) into reused buffers: d nll / d logits =
    softmax - onehot(target), through the soft cap's 1 - tanh^2, then to ``resid`` (x W_U) and the unembedding's
    parameters. The backward never holds the full logits, and no chunk allocates afresh: with glibc, freshly
    allocated and freed chunks of logits left the process's heap growing by hundreds of MB (0.46 GB over 8 x 512
    tokens of gemma-3-270m under the checkpointed chunks this replaces). The backward does not split the
    vocabulary: one position's float32 row of a 262,144-token vocabulary is 1 MiB."""
    x = einops.rearrange(resid[:, :-1], "batch pos d_model -> (batch pos) d_model")
    target = einops.rearrange(tokens[:, 1:].to(resid.device), "batch pos -> (batch pos)")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, unembed.W_U, unembed.b_U))
    if grad:
        chunk_bytes = devices.sizes(x.device).loss_chunk_bytes if chunk_bytes is None else chunk_bytes
        rows = max(1, chunk_bytes // (8 * unembed.W_U.shape[0]))
        args = (x, target, unembed.W_U, unembed.b_U, unembed.softcap, unembed.scale, rows)
        flat = cast(Tensor, _ChunkedNLL.apply(*args))  # type: ignore[no-untyped-call, unused-ignore]
    else:
        flat = _nll_and_lse(x, target, unembed)[0]
    nll = einops.rearrange(flat, "(batch pos) -> batch pos", batch=tokens.shape[0])
    return _unscored_nan(nll, lengths, first)


def _chunk_logits(
    x: Float[Tensor, "row d_model"], unembed: Unembedding, raw: Tensor, out: Tensor, *, capped: bool = True
) -> Float[Tensor, "row d_vocab"]:
    """:func:`logits_of` of ``x`` written into preallocated buffers: ``raw`` (model dtype) takes the matmul, ``out``
    (float32, float64 for a float64 model; may be ``raw`` itself) the scaled logits, soft-capped unless ``capped``
    is False."""
    W_T = unembed.W_U.t()
    if unembed.b_U is None:
        torch.mm(x, W_T, out=raw)
    else:
        torch.addmm(unembed.b_U, x, W_T, out=raw)
    if out is not raw:
        out.copy_(raw)
    if unembed.scale != 1.0:
        out.mul_(unembed.scale)
    if capped and unembed.softcap is not None:
        out.div_(unembed.softcap).tanh_().mul_(unembed.softcap)
    return out


def _buffers(x: Tensor, rows: int, cols: int, n: int = 1) -> tuple[Tensor, list[Tensor]]:
    """One model-dtype buffer of ``rows x cols`` logits and ``n`` float32 ones (float64 for a float64 model; the
    first is the model-dtype one when the dtypes agree)."""
    raw = x.new_empty(rows, cols)
    wide = torch.promote_types(raw.dtype, torch.float32)
    out = [raw if (i == 0 and wide == raw.dtype) else x.new_empty(rows, cols, dtype=wide) for i in range(n)]
    return raw, out


def _nll_and_lse(
    x: Float[Tensor, "row d_model"], target: Int[Tensor, " row"], unembed: Unembedding
) -> tuple[Float[Tensor, " row"], Float[Tensor, " row"]]:
    """Per row: -log softmax(logits)[target] and log sum_v exp(logits_v) (:func:`_vocab_scan`)."""
    ((lse, picked, _),), _ = _vocab_scan((x,), target, unembed)
    return lse - picked, lse


class _ChunkedNLL(torch.autograd.Function):
    """:func:`chunked_token_nll`'s rows with their gradient: the forward keeps only each row's log-sum-exp, the
    backward recomputes the logits chunk by chunk (module docstring of :func:`chunked_token_nll`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        target: Tensor,
        W_U: Tensor,
        b_U: Tensor | None,
        softcap: float | None,
        scale: float,
        rows: int,
    ) -> Tensor:
        nll, lse = _nll_and_lse(x, target, Unembedding(W_U, b_U, softcap, scale))
        ctx.save_for_backward(x, target, W_U, b_U, lse)
        ctx.softcap, ctx.scale, ctx.rows = softcap, scale, rows
        return nll

    @staticmethod
    def backward(ctx: Any, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        x, target, W_U, b_U, lse = ctx.saved_tensors
        need_x, _, need_W, need_b = ctx.needs_input_grad[:4]
        unembed, rows, cap = Unembedding(W_U, b_U, ctx.softcap, ctx.scale), ctx.rows, ctx.softcap
        grad_x = torch.empty_like(x) if need_x else None
        grad_W = torch.zeros_like(W_U) if need_W else None
        grad_b = torch.zeros_like(b_U) if need_b else None
        raw, bufs = _buffers(x, min(rows, len(x)), W_U.shape[0], n=2 if cap is not None else 1)
        for start in range(0, len(x), rows):
            x_c, n = x[start : start + rows], min(rows, len(x) - start)
            # g = d nll / d logits = softmax - onehot(target), times the incoming gradient
            g = _chunk_logits(x_c, unembed, raw[:n], bufs[0][:n], capped=False)
            if cap is not None:  # logits = c tanh(raw / c), as the forward's; tanh kept for d logits / d raw
                tanh = g.div_(cap).tanh_()
                g = bufs[1][:n].copy_(tanh).mul_(cap)
            g.sub_(lse[start : start + n, None]).exp_()
            g[torch.arange(n, device=g.device), target[start : start + n]] -= 1.0
            g.mul_(grad_nll[start : start + n, None])
            if cap is not None:
                g.mul_(tanh.square_().neg_().add_(1.0))
            if ctx.scale != 1.0:  # d logits / d raw: the logit multiplier
                g.mul_(ctx.scale)
            g_model = g.to(W_U.dtype)
            if grad_x is not None:
                torch.mm(g_model, W_U, out=grad_x[start : start + n])
            if grad_W is not None:
                grad_W.addmm_(g_model.t(), x_c)
            if grad_b is not None:
                grad_b += g_model.sum(0)
        return grad_x, None, grad_W, grad_b, None, None, None
