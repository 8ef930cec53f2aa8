"""Attribution screening: every head's effect estimated from one forward and one backward per (sub-)batch.

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

Linear-attention layers (Qwen3.5's gated delta rule) are screened too, per value head, for the ablations defined
there (``zero``, ``parallel-value``): (m, r, g) = (o, v, g_o) with o_t = hook_recurrence_out in value space and
c = o - a_tt v in exclude-self; ``zero`` zeroes the head's gate input z (its gated-norm output norm(o) silu(z) is then
0), est = -sum_t g_z . z; a head's residual write is u_h W_out[h] (u_h the gated RMSNorm of o_h and z_h), with
g_out at the layer's output. NaN marks every entry past a layer's own heads in the ``[layer, head]`` arrays.

Loss is what :func:`~lens_parallel.losses.evaluate` reports: token-weighted mean next-token loss in nats/token, so
per-document sums are kept and every effect is sum over documents / number of scored tokens (bootstrap CIs over
documents). The estimate of a large edit (s_par = 0 removes a whole component) is a linearisation: how far it is
from the exact effect is what :func:`confirm` measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar

import einops
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.bridges import check_model
from lens_parallel.choices import Ablation, EditPositions, HeadSpace
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import ABLATION_KINDS, EDIT_POSITIONS, AblationKind, check_positions
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import (
    GradReducer,
    gradient_pass,
    head_writes_note,
    linear_head_inputs,
    output_weights,
)
from lens_parallel.losses import Unembedding, chunked_token_nll, scored_sums, unembedding
from lens_parallel.models import ModelInfo, head_label
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.attribution import attribution_figure
from lens_parallel.results import Provenance, ResultMixin, head_frame, layer_frame
from lens_parallel.spaces import HEAD_SPACES, SPACES, value_parts, value_space
from lens_parallel.stats import N_RESAMPLES, paired_bootstrap_ci
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, EditJob, Metric, SweepPlan, head_means, run_sweep
from lens_parallel.validate import (
    as_indices,
    check_choice,
    check_eps,
    check_non_negative_int,
    check_positive_int,
)


@dataclass(frozen=True, repr=False)
class AttributionResult(ResultMixin):
    """First-order edit estimates and exact scale derivatives, per document (nats, summed over its tokens).

    ``estimate`` is ``[doc, layer, head]``; ``d_s_par`` / ``d_s_perp`` are ``[space, doc, layer, head]`` (spaces in
    ``spaces``); ``loss_sum`` and ``n_tokens`` are ``[doc]``. NaN marks what does not exist: a head past a layer's
    own heads (a hybrid model's head axis is as wide as its widest layer), residual-attn on a linear layer.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> attr = lp.head_attribution(model, docs, progress=False)
        >>> fig = attr.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type ablation estimate ci_lo ci_hi positions loss n_heads "
        "top_head top_estimate sum_of_estimates n_docs mean_dloss_ds_par_<space> mean_dloss_ds_perp_<space>"
    )

    ablation: Ablation
    positions: EditPositions
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
        estimate: np.ndarray = self.estimate.sum(0) / self.n_tokens.sum()
        return estimate

    def top_heads(self, k: int) -> list[tuple[int, int]]:
        """The ``k`` (layer, head) with the largest |estimated effect|, largest first."""
        flat = np.argsort(-np.abs(self.head_estimate()), axis=None, kind="stable")[:k]
        n_heads = self.estimate.shape[2]
        return [(self.layers[i // n_heads], int(i % n_heads)) for i in flat]

    def _per_token(self, per_doc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sum over documents / tokens of ``per_doc [doc, k]``, with its bootstrap CI over documents (NaN for a
        column holding NaN: something that does not exist)."""
        real = ~np.isnan(per_doc).any(0)
        lo, hi = np.full(real.shape, np.nan), np.full(real.shape, np.nan)
        if real.any():
            x = per_doc[:, real]
            weights = np.broadcast_to(self.n_tokens[:, None], x.shape)
            lo[real], hi[real] = paired_bootstrap_ci(
                x, np.zeros_like(x), weights, n_resamples=self.n_resamples, seed=self.seed, what="attribution"
            )
        return np.asarray(per_doc.sum(0) / self.n_tokens.sum()), lo, hi

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head and one per layer's joint edit (head <NA>, label ``L{l}*``): the estimated effect in
        nats/token with its 95% bootstrap CI over documents (columns as :class:`SensitivityResult`'s)."""
        n_docs, n_layers, n_heads = self.estimate.shape
        per_doc = np.concatenate([self.estimate.reshape(n_docs, -1), np.nansum(self.estimate, 2)], axis=1)
        est, lo, hi = self._per_token(per_doc)
        k = n_layers * n_heads
        front = {"ablation": self.ablation}
        heads = head_frame(
            self.info,
            self.layers,
            {
                "estimate": est[:k].reshape(n_layers, n_heads),
                "ci_lo": lo[:k].reshape(n_layers, n_heads),
                "ci_hi": hi[:k].reshape(n_layers, n_heads),
            },
            front=front,
        )
        joint = layer_frame(
            self.info, self.layers, {"estimate": est[k:], "ci_lo": lo[k:], "ci_hi": hi[k:]}, front=front
        )
        return pd.concat([heads, joint], ignore_index=True).astype({"head": "Int64", "kv_head": "Int64"})

    def derivatives_table(self) -> pd.DataFrame:
        """dloss/ds_par and dloss/ds_perp at s = 1 per space and head (nats/token per unit of scale), long format,
        with 95% bootstrap CIs over documents."""
        n_docs, n_layers, n_heads = self.estimate.shape
        frames = []
        for i, space in enumerate(self.spaces):
            for scale, arr in (("s_par", self.d_s_par), ("s_perp", self.d_s_perp)):
                value, lo, hi = (x.reshape(n_layers, n_heads) for x in self._per_token(arr[i].reshape(n_docs, -1)))
                values = {"derivative": value, "ci_lo": lo, "ci_hi": hi}
                frames.append(head_frame(self.info, self.layers, values, front={"space": space, "scale": scale}))
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> pd.DataFrame:
        est = self.head_estimate()
        layer, head = self.top_heads(1)[0]
        row = {"model": self.info.name, "ablation": self.ablation, "positions": self.positions, "loss": self.loss}
        row |= {
            "n_heads": int(np.isfinite(est).sum()),
            "top_head": head_label(layer, head),
            "top_estimate": est[self.layers.index(layer), head],
        }
        row |= {"sum_of_estimates": np.nansum(est), "n_docs": len(self.n_tokens)}
        for i, space in enumerate(self.spaces):  # means over the heads that have the derivative
            row[f"mean_dloss_ds_par_{space}"] = np.nanmean(self.d_s_par[i].sum(0)) / self.n_tokens.sum()
            row[f"mean_dloss_ds_perp_{space}"] = np.nanmean(self.d_s_perp[i].sum(0)) / self.n_tokens.sum()
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return attribution_figure(self)


def _roles(info: ModelInfo, ablation: str, spaces: tuple[str, ...], layer: int) -> tuple[list[str], list[str]]:
    """Activations read (forward) and activations whose loss gradient is needed (backward) at ``layer``: its kind's
    (:meth:`~lens_parallel.layers.LayerKind.attribution_roles`)."""
    kind = ABLATION_KINDS[ablation]
    residual = any(SPACES[space].head_writes for space in (*spaces, *_removed(kind)))
    return info.kind(layer).attribution_roles(info, zero=kind.gate_input, residual=residual)


def _removed(kind: AblationKind) -> tuple[HeadSpace, ...]:
    """The space whose parallel part ``kind`` removes, if it is a removal."""
    return () if kind.removed_space is None else (kind.removed_space,)


def backward_rows(n_docs: int, n_layers: int) -> int:
    """Documents per backward of a batch of ``n_docs``: ``max(1, n_docs // n_layers)``. The checkpointed backward
    keeps the residual entering every block (:func:`~lens_parallel.hooks.gradient_pass`), ``n_layers`` residuals of
    its rows; with this many rows they add up to at most one residual of the whole batch, about what a forward to
    the final residual holds at a time. Documents are independent, so the split changes no value."""
    return max(1, n_docs // n_layers)


def _loss_sums(
    final: Float[Tensor, "batch pos d_model"],
    *,
    unembed: Unembedding,
    tokens: Int[Tensor, "batch pos"],
    lengths: Tensor,
    first: Tensor,
) -> Float[Tensor, " batch"]:
    """Each document's next-token loss sum from its final normalised residual (chunked: no full logits)."""
    return scored_sums(chunked_token_nll(final, unembed, tokens, lengths, first=first), lengths, first)


def _masked_sum(per_pos: Tensor, weight: Tensor) -> Tensor:
    """``[batch, pos, head]`` -> ``[batch, head]``, positions weighted ``[batch, pos]`` (1 at a document's real
    positions, 0 past its end and, for ``after-first``, at position 0)."""
    return einops.einsum(per_pos, weight, "batch pos head_index, batch pos -> batch head_index")


def _reducer(
    info: ModelInfo,
    s: AttributionSettings,
    spaces: tuple[HeadSpace, ...],
    W_O: Callable[[int], Tensor],
    head_inputs: Callable[[int], Callable[[Tensor, Tensor], Tensor]],
    means: dict[int, Tensor],
    weight: Tensor,
    out: dict[str, Tensor],
    layers: tuple[int, ...],
) -> GradReducer:
    """The reduction of one batch's activations and gradients into ``out`` (estimates and scale derivatives, on the
    gradients' device: nothing waits for the device while the backward runs). ``W_O(layer)``: the layer's per-head
    output projection; ``head_inputs(layer)``: a linear layer's per-head projection inputs from its o and gate."""
    li = {layer: i for i, layer in enumerate(layers)}
    ablation, eps = ABLATION_KINDS[s.ablation], s.eps

    def reduce(layer: int, a: dict[str, Tensor], g: dict[str, Tensor]) -> None:
        i = li[layer]
        parts = value_parts(a, info)  # gated attention: o = A v, z = sigmoid(gate) * o; edits' changes pass the gate
        o = parts.o
        if "lin_o" in a:  # a linear layer: o = hook_recurrence_out; zero acts on the gate input (z, g_z)
            g_o = g["lin_o"]
            z, g_z = (a["lin_gate"], g["lin_gate"]) if ablation.gate_input else (o, g_o)
            writes = head_inputs(layer)(a["lin_o"], a["lin_gate"]) if "lin_out" in g else None
        else:
            z, g_z = a["z"], g["z"]
            g_o = g_z if parts.gate is None else g_z * parts.gate
            writes = z
        n = o.shape[2]

        def along(m: Tensor, r: Tensor, g_m: Tensor) -> tuple[Tensor, Tensor]:
            split = geometry.project(m, r, eps=eps)  # the edits' own split and guard
            return _masked_sum((g_m * split.par).sum(-1), weight), _masked_sum((g_m * split.perp).sum(-1), weight)

        derivs = {space: along(*value_space(space).units(o, parts), g_o) for space in spaces if SPACES[space].value}
        g_out = g.get("attn_out", g.get("lin_out"))
        if g_out is not None and writes is not None:  # per-head residual writes: z_h W_O[h], u_h W_out[h]
            d_par, d_perp = geometry.head_write_derivatives(writes, W_O(layer), a["resid_pre"], g_out, eps=eps)
            written = (_masked_sum(d_par, weight), _masked_sum(d_perp, weight))
            derivs |= {space: written for space in spaces if SPACES[space].head_writes}
        for k, space in enumerate(spaces):
            if space in derivs:
                out["d_s_par"][k, :, i, :n] = derivs[space][0]
                out["d_s_perp"][k, :, i, :n] = derivs[space][1]
        if ablation.removed_space is not None:  # a removal: minus its scaling's derivative at s = 1
            est = -derivs[ablation.removed_space][0]
        else:  # a fill: g . (fill - z)
            fill = means[layer].to(z) if ablation.needs_means else torch.zeros_like(z)
            est = _masked_sum((g_z * (fill - z)).sum(-1), weight)
        out["estimate"][:, i, :n] = est

    return reduce


@dataclass(frozen=True, kw_only=True)
class AttributionSettings:
    """What an attribution screen computes: the first-order estimate of ``ablation`` (at ``positions``) on ``layers``
    (None: every layer the ablation is defined on, :data:`~lens_parallel.edits.LINEAR_ABLATIONS` on linear ones), CIs
    from ``n_resamples`` bootstrap resamples seeded by ``seed``, projections guarded by ``eps``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.AttributionSettings().__class__.__name__
        'AttributionSettings'
    """

    ablation: Ablation = field(default="parallel-value", metadata={"help": "the edit whose effect is estimated"})
    positions: EditPositions = field(default="all", metadata={"help": "after-first: leave the boundary token"})
    layers: tuple[int, ...] | None = field(
        default=None, metadata={"help": "layers", "none": "every layer the ablation is defined on"}
    )
    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the CIs"})
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap"})
    eps: float = field(default=geometry.EPS, metadata={"help": "guard on the norms of the references"})

    def __post_init__(self) -> None:
        check_choice("ablation", self.ablation, Ablation)
        check_positions(self.positions)
        object.__setattr__(self, "layers", as_indices(self.layers))
        check_positive_int("n_resamples", self.n_resamples)
        check_non_negative_int("seed", self.seed)
        check_eps(self.eps)


class _GradientMetric(Metric[EditJob]):
    """Per document: the loss sum, the first-order estimates and the exact scale derivatives of every head, from
    one forward and one backward per sub-batch of :func:`backward_rows` documents
    (:func:`~lens_parallel.hooks.gradient_pass`)."""

    name = "attribution"

    def __init__(
        self,
        info: ModelInfo,
        s: AttributionSettings,
        layers: tuple[int, ...],
        spaces: tuple[HeadSpace, ...],
        means: dict[int, Tensor],
    ) -> None:
        self.info, self.s, self.layers, self.spaces, self.means = info, s, layers, spaces, means
        roles = {layer: _roles(info, s.ablation, spaces, layer) for layer in layers}
        self.acts: dict[int, Sequence[str]] = {layer: acts for layer, (acts, _) in roles.items()}
        self.grads: dict[int, Sequence[str]] = {layer: grads for layer, (_, grads) in roles.items()}
        self.width = max(info.output_heads(layer) for layer in layers)

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "ablation": self.s.ablation, "positions": self.s.positions, "eps": self.s.eps}

    def spec(self, job: EditJob) -> dict[str, ValueSpec]:
        shape = ("docs", len(self.layers), self.width)
        derivs = ValueSpec((len(self.spaces), *shape), allow_nan=True)
        estimate = ValueSpec(shape, allow_nan=True)
        return {"loss_sum": ValueSpec(("docs",)), "estimate": estimate, "d_s_par": derivs, "d_s_perp": derivs}

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[EditJob], batch: Batch) -> list[Values]:
        docs, n, n_l, n_h = batch.docs, len(batch.docs.lengths), len(self.layers), self.width
        device = docs.tokens.device  # the gradients' (gradient_pass): every reduction stays there until the end
        out = {  # NaN where nothing is defined: written by the reduction for every head that exists
            "estimate": torch.full((n, n_l, n_h), torch.nan, dtype=torch.float64, device=device),
            "d_s_par": torch.full((len(self.spaces), n, n_l, n_h), torch.nan, dtype=torch.float64, device=device),
            "d_s_perp": torch.full((len(self.spaces), n, n_l, n_h), torch.nan, dtype=torch.float64, device=device),
        }
        weight = EDIT_POSITIONS[self.s.positions].weights(docs.real.to(device=device, dtype=torch.float64))
        unembed, rows, per_doc = unembedding(context.model).frozen(), backward_rows(n, self.info.n_layers), []
        # each layer's W_O in float64 when its reduction needs it, not every layer's for the whole pass
        W_O = partial(output_weights, context.model, self.info, dtype=torch.float64)
        inputs = partial(linear_head_inputs, context.model)
        for start in range(0, n, rows):  # documents are independent: each sub-batch's values are its own
            sub = slice(start, start + rows)
            view = {
                "estimate": out["estimate"][sub],
                "d_s_par": out["d_s_par"][:, sub],
                "d_s_perp": out["d_s_perp"][:, sub],
            }
            tokens, lengths, first = docs.tokens[sub], docs.lengths[sub], docs.first[sub]
            per_doc.append(
                gradient_pass(
                    context.model,
                    tokens,
                    self.info,
                    roles=self.acts,
                    grad_roles=self.grads,
                    objective=partial(_loss_sums, unembed=unembed, tokens=tokens, lengths=lengths, first=first),
                    reduce=_reducer(
                        self.info, self.s, self.spaces, W_O, inputs, self.means, weight[sub], view, self.layers
                    ),
                )
            )
        arrays = {name: value.cpu().numpy() for name, value in out.items()}  # one copy to the host per batch
        return [{"loss_sum": torch.cat(per_doc).double().cpu().numpy(), **arrays}]


@long_call
def head_attribution(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: AttributionSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> AttributionResult:
    """Screen every head: first-order estimate of ``ablation``'s effect (zero, mean, parallel-value, parallel-residual)
    and exact dloss/ds_par, dloss/ds_perp at s = 1 in value, value-exclude-self and (per head) residual-attn space, from
    one forward and one backward per batch (module docstring for the formulas; :class:`AttributionSettings`, run options
    :class:`~lens_parallel.options.RunOptions`). ``positions``: ``all`` or ``after-first`` (position 0 neither edited
    nor scaled). Linear-attention layers are screened for ``zero`` and ``parallel-value`` (module docstring) and skipped
    for the other ablations (said in the provenance); on models with a post-attention norm the residual-attn derivatives
    and ``parallel-residual`` are undefined (skipped / refused with one line).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> attr = lp.head_attribution(model, docs, progress=False)
        >>> attr.to_dataframe().shape[0]  # every head of every layer (12), and each layer's heads together (3)
        15
    """
    info = check_model(model)
    s, opts = resolve(AttributionSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    what = f"head_attribution of a {s.ablation} ablation"
    layer_idx, skipped = ABLATION_KINDS[s.ablation].layers(info, s.layers, what=what)
    note = head_writes_note(info, "the per-head residual-attn derivative")
    if note and any(SPACES[space].head_writes for space in _removed(ABLATION_KINDS[s.ablation])):
        raise LensParallelError(head_writes_note(info, "head_attribution(ablation='parallel-residual')"))
    spaces = tuple(sp for sp in HEAD_SPACES if not (note and SPACES[sp].head_writes))
    skipped_notes = [n for n in (skipped, note) if n]
    means_batch = opts.batch_size if isinstance(opts.batch_size, int) else 1  # "auto" sizes the sweep, not this pass
    means = head_means(model, docs, layer_idx, batch_size=means_batch) if ABLATION_KINDS[s.ablation].needs_means else {}
    metric = _GradientMetric(info, s, layer_idx, spaces, means)
    job = EditJob("screen", ())
    run = run_sweep(model, docs, [job], metric=metric, options=opts, desc="attribution")
    out = run.value(job)
    provenance = Provenance.of(
        info, docs, "head_attribution", s, run, layers=list(layer_idx), spaces=list(spaces), skipped=skipped_notes
    )
    return AttributionResult(
        ablation=s.ablation,
        positions=s.positions,
        layers=layer_idx,
        spaces=spaces,
        loss_sum=out["loss_sum"],
        n_tokens=docs.n_tokens,
        n_resamples=s.n_resamples,
        seed=s.seed,
        provenance=provenance,
        estimate=out["estimate"],
        d_s_par=out["d_s_par"],
        d_s_perp=out["d_s_perp"],
    )
