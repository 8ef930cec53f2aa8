"""Attribution screening: every head's effect estimated from one forward and one backward per batch.

For a head h of layer l with output z_h (hook_z) and an edit that changes it by dz_h, the first-order estimate of
the change of a document's next-token loss sum is

    est_h = sum_t g_{h,t} . dz_{h,t},    g = d(loss sum) / d z_h,

with dz = -z (``zero``), mean_h - z (``mean``), -o_par (``parallel-value``: o = z, or the pre-gate aggregate A v
under gated attention, whose change passes through the gate). ``parallel-residual`` edits the head's residual
write m_h = z_h W_O[h] against x = resid_pre: est = -g_out . m_par with g_out the gradient at hook_attn_out. The
estimate for all heads of a layer together is the sum of theirs (first order is linear).

The loss's sensitivity to each head's own scales at the model as trained (s = 1), in every space where a head has
its own message, is exact, not an approximation: since m' = m + (s_par - 1) m_par + (s_perp - 1) m_perp,

    dloss/ds_par = sum_t g_t . m_par,t,   dloss/ds_perp = sum_t g_t . m_perp,t

with (m, r, g) = (o, v, g_o) in value space, (c = o - A_tt v, v, g_o) in exclude-self and (m_h, x, g_out) in
residual-attn (per head; undefined with a post-attention norm, where it is skipped with a note). So
``parallel-value``'s estimate is -dloss/ds_par(value).

Loss is what :func:`~lens_parallel.losses.evaluate` reports: token-weighted mean next-token loss in nats/token, so
per-document sums are kept and every effect is sum over documents / number of scored tokens (bootstrap CIs over
documents). The estimate of a large edit (s_par = 0 removes a whole component) is a linearisation: how far it is
from the exact effect is what :func:`confirm` measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import einops
import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.data import TokenBlocks, document_batches
from lens_parallel.edits import ABLATIONS, check_positions
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import expand_kv, gradient_pass, head_writes_note, output_weights, softmax_layers
from lens_parallel.losses import next_token_nll
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.plots.attribution import attribution_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.stats import paired_bootstrap_ci
from lens_parallel.sweep import head_means

SPACES = ("value", "value-exclude-self", "residual-attn")


@serializable
@dataclass(frozen=True)
class AttributionResult(ResultMixin):
    """First-order edit estimates and exact scale derivatives, per document (nats, summed over its tokens).

    ``estimate`` is ``[doc, layer, head]``; ``d_s_par`` / ``d_s_perp`` are ``[space, doc, layer, head]`` (spaces in
    ``spaces``); ``loss_sum`` and ``n_tokens`` are ``[doc]``.
    """

    edit: str
    positions: str
    layers: tuple[int, ...]
    spaces: tuple[str, ...]
    loss_sum: np.ndarray
    n_tokens: np.ndarray
    estimate: np.ndarray
    d_s_par: np.ndarray
    d_s_perp: np.ndarray
    n_resamples: int
    seed: int
    provenance: Provenance

    @property
    def loss(self) -> float:
        """Token-weighted mean next-token loss of the unedited model (nats/token)."""
        return float(self.loss_sum.sum() / self.n_tokens.sum())

    def head_estimate(self) -> np.ndarray:
        """Estimated effect per ``[layer, head]`` in nats/token (sum over documents / scored tokens)."""
        return self.estimate.sum(0) / self.n_tokens.sum()

    def top_heads(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` (layer, head) with the largest |estimated effect|, largest first."""
        flat = np.argsort(-np.abs(self.head_estimate()), axis=None, kind="stable")[:k]
        n_heads = self.estimate.shape[2]
        return [(self.layers[i // n_heads], int(i % n_heads)) for i in flat]

    def _per_token(self, per_doc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sum over documents / tokens of ``per_doc [doc, k]``, with its bootstrap CI over documents."""
        weights = np.broadcast_to(self.n_tokens[:, None], per_doc.shape)
        lo, hi = paired_bootstrap_ci(
            per_doc, np.zeros_like(per_doc), weights, n_resamples=self.n_resamples, seed=self.seed, what="attribution"
        )
        return per_doc.sum(0) / self.n_tokens.sum(), lo, hi

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head and one per layer's joint edit (head <NA>, label ``L{l}*``): the estimated effect in
        nats/token with its 95% bootstrap CI over documents (columns as :class:`SensitivityResult`'s)."""
        n_docs, _, n_heads = self.estimate.shape
        per_doc = np.concatenate([self.estimate.reshape(n_docs, -1), self.estimate.sum(2)], axis=1)
        est, lo, hi = self._per_token(per_doc)
        g = self.info.group_size
        rows = [
            {"layer": layer, "head": h, "kv_head": h // g, "label": f"L{layer}H{h}"}
            for layer in self.layers
            for h in range(n_heads)
        ]
        rows += [{"layer": layer, "head": pd.NA, "kv_head": pd.NA, "label": f"L{layer}*"} for layer in self.layers]
        df = pd.DataFrame(rows).astype({"head": "Int64", "kv_head": "Int64"})
        return df.assign(model=self.info.name, edit=self.edit, estimate=est, ci_lo=lo, ci_hi=hi)[
            ["model", "edit", "layer", "head", "kv_head", "label", "estimate", "ci_lo", "ci_hi"]
        ]

    def derivatives_table(self) -> pd.DataFrame:
        """dloss/ds_par and dloss/ds_perp at s = 1 per space and head (nats/token per unit of scale), long format,
        with 95% bootstrap CIs over documents."""
        n_docs, n_heads = self.estimate.shape[0], self.estimate.shape[2]
        frames = []
        for i, space in enumerate(self.spaces):
            for scale, arr in (("s_par", self.d_s_par), ("s_perp", self.d_s_perp)):
                value, lo, hi = self._per_token(arr[i].reshape(n_docs, -1))
                frames.append(
                    pd.DataFrame(
                        {
                            "model": self.info.name,
                            "space": space,
                            "scale": scale,
                            "layer": np.repeat(self.layers, n_heads),
                            "head": np.tile(np.arange(n_heads), len(self.layers)),
                            "label": [f"L{layer}H{h}" for layer in self.layers for h in range(n_heads)],
                            "derivative": value,
                            "ci_lo": lo,
                            "ci_hi": hi,
                        }
                    )
                )
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        est = self.head_estimate()
        layer, head = self.top_heads(1)[0]
        row = {"model": self.info.name, "edit": self.edit, "positions": self.positions, "loss": self.loss}
        row |= {"n_heads": est.size, "top_head": f"L{layer}H{head}", "top_estimate": est.flat[np.abs(est).argmax()]}
        row |= {"sum_of_estimates": est.sum(), "n_docs": len(self.n_tokens)}
        for i, space in enumerate(self.spaces):
            row[f"mean_dloss_ds_par_{space}"] = self.d_s_par[i].sum(0).mean() / self.n_tokens.sum()
            row[f"mean_dloss_ds_perp_{space}"] = self.d_s_perp[i].sum(0).mean() / self.n_tokens.sum()
        return pd.DataFrame([row])

    def figure(self):
        return attribution_figure(self)


def _roles(info: ModelInfo, edit: str, spaces: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Activations read (forward) and activations whose loss gradient is needed (backward) at each layer."""
    acts = ["z", "v"]
    acts += ["pattern_full", "q_gate"] if info.gated_attention else ["pattern"]
    grads = ["z"]
    if "residual-attn" in spaces or edit == "parallel-residual":
        acts.append("resid_pre")
        grads.append("attn_out")
    return acts, grads


def _masked_sum(per_pos: Tensor, weight: Tensor) -> Tensor:
    """``[batch, pos, head]`` -> ``[batch, head]``, positions weighted (0 at position 0 for ``after-first``)."""
    return einops.einsum(per_pos, weight, "batch pos head_index, pos -> batch head_index")


def _reducer(info, edit, spaces, W_O, means, weight, out, rows, eps):
    li = {layer: i for i, layer in enumerate(out["layers"])}

    def reduce(layer: int, a: dict[str, Tensor], g: dict[str, Tensor]) -> None:
        i = li[layer]
        z, g_z = a["z"], g["z"]
        v = expand_kv(a["v"], info.n_heads)
        if info.gated_attention:  # z = sigmoid(gate) * o: value-space edits act on o, their change passes the gate
            o = geometry.value_aggregate(a["pattern_full"], v)
            gate = torch.sigmoid(a["q_gate"].reshape(*z.shape))
            g_o, diag = g_z * gate, torch.diagonal(a["pattern_full"], dim1=-2, dim2=-1)
        else:
            o, g_o, diag = z, g_z, a["pattern"]

        def along(m: Tensor, r: Tensor, g_m: Tensor) -> tuple[Tensor, Tensor]:
            split = geometry.project(m, r, eps=eps)  # the edits' own split and guard
            return _masked_sum((g_m * split.par).sum(-1), weight), _masked_sum((g_m * split.perp).sum(-1), weight)

        derivs = {"value": along(o, v, g_o), "value-exclude-self": along(geometry.split_self(o, v, diag)[1], v, g_o)}
        if "attn_out" in g:
            d_par, d_perp = geometry.head_write_derivatives(z, W_O[layer], a["resid_pre"], g["attn_out"], eps=eps)
            derivs["residual-attn"] = (_masked_sum(d_par, weight), _masked_sum(d_perp, weight))
        for s, space in enumerate(spaces):
            out["d_s_par"][s, rows, i] = derivs[space][0].numpy()
            out["d_s_perp"][s, rows, i] = derivs[space][1].numpy()
        if edit == "zero":
            est = _masked_sum((g_z * -z).sum(-1), weight)
        elif edit == "mean":
            est = _masked_sum((g_z * (means[layer].double() - z)).sum(-1), weight)
        elif edit == "parallel-value":
            est = -derivs["value"][0]
        else:
            est = -derivs["residual-attn"][0]
        out["estimate"][rows, i] = est.numpy()

    return reduce


def head_attribution(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    edit: str = "parallel-value",
    positions: str = "all",
    layers: int | Sequence[int] | None = None,
    batch_size: int = 8,
    n_resamples: int = 2000,
    seed: int = 0,
    eps: float = geometry.EPS,
    progress: bool = True,
) -> AttributionResult:
    """Screen every head: first-order estimate of ``edit``'s effect (zero, mean, parallel-value,
    parallel-residual) and exact dloss/ds_par, dloss/ds_perp at s = 1 in value, value-exclude-self and (per head)
    residual-attn space, from one forward and one backward per batch of ``batch_size`` documents (module
    docstring for the formulas). ``positions``: ``all`` or ``after-first`` (position 0 neither edited nor scaled).
    Linear-attention layers are skipped (said in the provenance); on models with a post-attention norm the
    residual-attn derivatives and ``parallel-residual`` are undefined (skipped / refused with one line)."""
    info = model_info(model)
    toks = as_tokens(tokens)
    if edit not in ABLATIONS:
        raise LensParallelError(f"unknown edit {edit!r}; accepted: {', '.join(ABLATIONS)}")
    check_positions(positions)
    if batch_size < 1:
        raise LensParallelError(f"batch_size must be >= 1, got {batch_size}")
    if toks.shape[1] < 2:
        raise LensParallelError(f"need at least 2 positions per document (one scored token), got {toks.shape[1]}")
    layer_idx, skipped = softmax_layers(info, layers, what="head_attribution")
    note = head_writes_note(info, "the per-head residual-attn derivative")
    if edit == "parallel-residual" and note:
        raise LensParallelError(head_writes_note(info, "head_attribution(edit='parallel-residual')"))
    spaces = SPACES[:2] if note else SPACES
    skipped = [s for s in (skipped, note) if s]
    acts, grads = _roles(info, edit, spaces)
    W_O = {layer: output_weights(model, layer, dtype=torch.float64) for layer in layer_idx if "attn_out" in grads}
    means = head_means(model, toks, layer_idx) if edit == "mean" else {}
    n_docs, n_heads = toks.shape[0], info.n_heads
    out = {
        "layers": layer_idx,
        "estimate": np.zeros((n_docs, len(layer_idx), n_heads)),
        "d_s_par": np.zeros((len(spaces), n_docs, len(layer_idx), n_heads)),
        "d_s_perp": np.zeros((len(spaces), n_docs, len(layer_idx), n_heads)),
    }
    weight = torch.ones(toks.shape[1], dtype=torch.float64)
    if positions == "after-first":
        weight[0] = 0.0
    loss_sums = []
    for rows, batch in document_batches(toks, batch_size, progress=progress, desc="attribution"):
        reduce = _reducer(info, edit, spaces, W_O, means, weight, out, rows, eps)
        per_doc = gradient_pass(
            model,
            batch,
            info,
            roles=dict.fromkeys(layer_idx, acts),
            grad_roles=dict.fromkeys(layer_idx, grads),
            objective=partial(next_token_nll, tokens=batch),
            reduce=reduce,
        )
        loss_sums.append(per_doc.double().cpu().numpy())
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="head_attribution",
        edit=edit,
        positions=positions,
        layers=list(layer_idx),
        spaces=list(spaces),
        batch_size=batch_size,
        n_resamples=n_resamples,
        seed=seed,
        eps=eps,
        skipped=skipped,
    )
    return AttributionResult(
        edit=edit,
        positions=positions,
        layers=layer_idx,
        spaces=spaces,
        loss_sum=np.concatenate(loss_sums),
        n_tokens=np.full(n_docs, toks.shape[1] - 1, dtype=np.int64),
        n_resamples=n_resamples,
        seed=seed,
        provenance=provenance,
        **{k: out[k] for k in ("estimate", "d_s_par", "d_s_perp")},
    )
