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

Linear-attention layers (Qwen3.5's gated delta rule) are checked too, per value head: y_t = o_t (hook_recurrence_out),
v_t its own value. There each value head has its own values and a key head is shared by ``n_v / n_k`` consecutive
value heads: a key head is the group, and "another group's value at the same position" is that of the value head
at the same place in the neighbouring key group, h - n_v / n_k (mod n_v) (``neighbour``), or in every other group
(``all``). Per-head arrays are as wide as the widest layer's heads; a narrower layer's extra entries are NaN (no row
in the tables). On a hybrid model the summary's per-layer-type columns keep the two kinds apart.
The same seed gives the same numbers bit for bit, whatever the batch size. A reconstruction gate runs first: it
rebuilds y = A @ expand(v) (x sigmoid(gate) for gated attention) from the captured hooks on one document and
refuses to run if its relative Frobenius error exceeds ``gate_tol`` (the paper's 1e-2) or is not finite, on the
first, middle and last softmax-attention layers by default (a linear layer's o_t has no pattern to rebuild it
from).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import einops
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.bridges import check_model
from lens_parallel.choices import Groups, Null
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import Documents, DocumentsLike, document_batches
from lens_parallel.errors import LensParallelError, LibraryError, long_call
from lens_parallel.hooks import head_layers
from lens_parallel.layers import LAYER_KINDS
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.nulls import null_figure
from lens_parallel.results import Provenance, ResultMixin, head_frame
from lens_parallel.spaces import value_parts
from lens_parallel.stats import N_RESAMPLES, bootstrap_mean_ci
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, EditJob, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import (
    as_indices,
    check_choice,
    check_finite,
    check_non_negative_int,
    check_positive_int,
    literal_values,
)

RECONSTRUCTION_TOL = 1e-2
NULLS = literal_values(Null)
GROUPS = literal_values(Groups)


class ReconstructionError(LibraryError):
    """The captured hooks do not reproduce hook_z: the checks would measure the wrong thing (an incompatible
    TransformerLens, or a model whose weights were processed)."""


def null_positions(n_docs: int, seq_len: int, n_heads: int, *, seed: int, layer: int) -> Int[Tensor, "batch pos head"]:
    """j[b, t, h] uniform in [0, t) for t >= 1 (j[b, 0, h] = 0 is never used), from ``default_rng([seed, layer])``:
    one draw per document, position and head, for all documents at once (so batching changes nothing)."""
    u = np.random.default_rng([seed, layer]).random((n_docs, n_heads, seq_len))
    j = np.floor(u * np.arange(seq_len)).astype(np.int64)
    return torch.from_numpy(einops.rearrange(j, "b h p -> b p h"))


def default_gate_layers(layers: tuple[int, ...]) -> list[int]:
    """The layers the reconstruction gate checks by default: the first, middle and last of ``layers``."""
    return sorted({layers[0], layers[len(layers) // 2], layers[-1]})


GATE_POSITIONS = 512
"""The reconstruction gate reads the first document's first this many positions: attention is causal, so they are
exactly those of the whole document, and the whole pattern it compares (T x T per head) stays small at any length."""


def reconstruction_error(model: TransformerBridge, documents: Documents, layers: list[int]) -> float:
    """Max over layers of |A @ expand(v) (x sigmoid(gate) if gated) - hook_z| / |hook_z|, on the first document's
    first :data:`GATE_POSITIONS` positions."""
    info = model_info(model)
    roles = ["pattern_full", *LAYER_KINDS["softmax"].value_roles(info)]
    whole = next(document_batches(documents, 1))
    first = dataclasses.replace(
        whole, tokens=whole.tokens[:, :GATE_POSITIONS], lengths=whole.lengths.clamp(max=GATE_POSITIONS)
    )
    got = run_rows(model, info, Batch(first), capture={layer: roles for layer in layers}).captured
    worst = 0.0
    for t in got.values():
        parts = value_parts(t, info)
        y = geometry.value_aggregate(t["pattern_full"], parts.v)  # A @ expand(v), from the pattern in every model
        if parts.gate is not None:
            y = parts.gate * y
        error = ((y - t["z"]).norm() / t["z"].norm().clamp_min(1e-30)).item()
        worst = max(worst, error) if np.isfinite(error) else float("inf")
    return worst


@dataclass(frozen=True, repr=False)
class NullResult(ResultMixin):
    """Per-document means over t >= 1, ``[doc, layer, head]``: cos_self, cos_null and (GQA) cos_across; ``null``
    says how cos_null was computed (``sampled`` or ``exact``), ``groups`` which other kv groups cos_across uses.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> null = lp.causal_null(model, docs, n_resamples=100, progress=False)
        >>> fig = null.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type document cos_self cos_null cos_across null n_heads excess "
        "self_specific_fraction null_share median_head_self_specific_fraction median_head_null_share "
        "within_excess across_excess"
    )

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
        excess: np.ndarray = (self.cos_self - self.cos_null).mean(0)
        return excess

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (document, layer, head) with that document's mean cos_self, cos_null (and
        cos_across) over its positions t >= 1."""
        values = {"cos_self": self.cos_self, "cos_null": self.cos_null}
        values |= {} if self.cos_across is None else {"cos_across": self.cos_across}
        return head_frame(self.info, self.layers, values, outer=("document", range(len(self.cos_self))))

    def head_table(self) -> pd.DataFrame:
        """One row per (layer, head): means over documents, the excess with its bootstrap CI over documents, the
        self-specific fraction and null share of that head, and (GQA) within/across-group excess."""
        cs, cn = self.cos_self.mean(0), self.cos_null.mean(0)
        values = {
            "cos_self": cs,
            "cos_null": cn,
            "excess": self.excess,
            "excess_lo": self.excess_lo,
            "excess_hi": self.excess_hi,
            "self_specific_fraction": self.excess / cs,
            "null_share": cn / cs,
        }
        if self.cos_across is not None:
            values |= {
                "within_excess": self.excess,
                "cos_across": self.cos_across.mean(0),
                "across_excess": (self.cos_across - self.cos_null).mean(0),
            }
        return head_frame(self.info, self.layers, values)

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
        if self.info.hybrid:
            for kind, rows in df.groupby("layer_type"):
                row |= {f"{k}[{kind}]": rows[k].mean() for k in ("cos_self", "cos_null", "excess")}
                if self.cos_across is not None:
                    row |= {f"across_excess[{kind}]": rows["across_excess"].mean()}
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return null_figure(self)


@dataclass(frozen=True, kw_only=True)
class NullSettings:
    """What the null model computes: ``null`` (``sampled``, the paper's, seeded by ``seed``; or ``exact``),
    ``groups`` (None; or ``neighbour`` / ``all``: the across-kv-group cosine, :func:`gqa_alignment`), the bootstrap
    CI of the excess from ``n_resamples`` resamples, and the reconstruction gate (``gate_tol`` on ``gate_layers``,
    default the first, middle and last softmax-attention layers).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.NullSettings(null="exact").null
        'exact'
    """

    null: Null = field(default="sampled", metadata={"help": "causal null: sampled (the paper's) or exact"})
    groups: Groups | None = field(default=None, metadata={"help": "GQA across-group comparison", "none": "none"})
    seed: int = field(default=0, metadata={"help": "seed of the null draws and the bootstrap"})
    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the excess CI"})
    gate_tol: float = field(default=RECONSTRUCTION_TOL, metadata={"help": "reconstruction gate tolerance"})
    gate_layers: tuple[int, ...] | None = field(
        default=None, metadata={"help": "layers the gate checks", "none": "first, middle and last"}
    )

    def __post_init__(self) -> None:
        check_choice("null", self.null, Null)
        if self.groups is not None:
            check_choice("groups", self.groups, Groups)
        check_non_negative_int("seed", self.seed)
        check_positive_int("n_resamples", self.n_resamples)
        check_finite("gate_tol", self.gate_tol)
        object.__setattr__(self, "gate_layers", as_indices(self.gate_layers, what="gate_layers"))


class _NullMetric(Metric[EditJob]):
    """Per document, layer and head: the means over positions 1 <= t < length of cos_self, cos_null (and the
    across-group cosine)."""

    name = "causal-null"

    def __init__(self, info: ModelInfo, layers: tuple[int, ...], settings: NullSettings, seq_len: int, n_docs: int):
        self.info, self.layers, self.s = info, layers, settings
        self.roles = {layer: info.kind(layer).value_roles(info) for layer in layers}
        self.width = max(info.output_heads(layer) for layer in layers)
        self.draws = {}
        if settings.null == "sampled":
            self.draws = {
                layer: null_positions(n_docs, seq_len, info.output_heads(layer), seed=settings.seed, layer=layer)
                for layer in layers
            }

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "null": self.s.null, "groups": self.s.groups, "seed": self.s.seed}

    def spec(self, job: EditJob) -> dict[str, ValueSpec]:
        shape = ("docs", len(self.layers), self.width)
        names = ("self", "null", "across") if self.s.groups else ("self", "null")
        return {name: ValueSpec(shape, allow_nan=True) for name in names}

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[EditJob], batch: Batch) -> list[Values]:
        info, docs = self.info, batch.docs
        weight = (docs.real & (torch.arange(docs.tokens.shape[1], device=docs.tokens.device) >= 1)).double()[..., None]
        shape = (len(docs.lengths), len(self.layers), self.width)
        out = {  # on the tokens' device: read on the host once the forward has ended; NaN where a layer has no head
            name: torch.full(shape, torch.nan, dtype=torch.float64, device=weight.device) for name in self.spec(jobs[0])
        }
        index = {layer: i for i, layer in enumerate(self.layers)}

        def reduce(layer: int, t: dict[str, Tensor]) -> None:  # each layer in the forward, then dropped
            parts = value_parts(t, info)
            y = parts.o
            w = weight.to(y.device)

            def mean(x: Tensor) -> Tensor:  # over the real positions t >= 1 of each document
                return ((x * w).sum(1) / w.sum(1)).to(weight.device, non_blocking=True)

            if self.s.null == "sampled":
                j = self.draws[layer][docs.rows, : y.shape[1]].to(y.device)
                cos_self, cos_null = geometry.self_and_null_cosines(y, parts.v, j)
            else:  # the values read per key-value head, never repeated per query head
                cos_self = geometry.self_cosines(y, parts.values)
                cos_null = geometry.mean_earlier_cosine(y, parts.values)
            i, n = index[layer], y.shape[2]
            out["self"][:, i, :n], out["null"][:, i, :n] = mean(cos_self), mean(cos_null)
            if self.s.groups is not None:
                out["across"][:, i, :n] = mean(_across(y, t, info, layer, self.s.groups))

        run_rows(context.model, info, batch, capture=self.roles, reduce=reduce)
        return [{name: value.cpu().numpy() for name, value in out.items()}]


@long_call
def causal_null(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: NullSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> NullResult:
    """cos_self vs the earlier-position causal null per layer and head (see the module docstring), with a
    bootstrap CI of the excess over documents (:class:`NullSettings`; run options
    :class:`~lens_parallel.options.RunOptions`; both as keyword shortcuts). One pass of the engine over the
    documents (ragged included: only real positions count). Linear-attention layers (Qwen3.5) are checked per value
    head (module docstring).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> null = lp.causal_null(model, docs, n_resamples=100, progress=False)
        >>> type(null).__name__
        'NullResult'
    """
    info = check_model(model)
    s, opts = resolve(NullSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    layers, skipped = head_layers(info, None, what="the causal null (value heads' cosines)")
    softmax = info.softmax_layers
    checked = default_gate_layers(softmax) if s.gate_layers is None else list(s.gate_layers)
    if not set(checked) <= set(softmax):
        raise LensParallelError(f"gate layers {checked} must be softmax-attention layers among {list(softmax)}")
    error = reconstruction_error(model, docs, checked)
    if not error <= s.gate_tol:
        raise ReconstructionError(
            f"A @ expand(v) does not reproduce hook_z on layers {checked}: relative error {error:.3g} > tolerance "
            f"{s.gate_tol:.3g}; the hooks do not hold what the null model assumes (is the model loaded with processed "
            "weights?)"
        )
    metric = _NullMetric(info, layers, s, docs.tokens.shape[1], len(docs))
    job = EditJob("unedited", ())
    run = run_sweep(model, docs, [job], metric=metric, options=opts, desc="causal null")
    out = run.value(job)
    excess = out["self"] - out["null"]
    heads = ~np.isnan(excess[0])  # [layer, head]: the heads each layer has
    lo, hi = np.full(heads.shape, np.nan), np.full(heads.shape, np.nan)
    lo[heads], hi[heads] = bootstrap_mean_ci(
        excess[:, heads], n_resamples=s.n_resamples, seed=s.seed, what="causal null: per-document excess"
    )
    provenance = Provenance.of(
        info,
        docs,
        "gqa_alignment" if s.groups else "causal_null",
        s,
        run,
        layers=list(layers),
        positions="1 <= t < length; null j ~ U[0, t) per (document, layer, head, position)"
        if s.null == "sampled"
        else "1 <= t < length; null = exact mean over j in [0, t)",
        reconstruction_error=error,
        gate={"layers": checked, "tolerance": s.gate_tol, "documents": 1},
        skipped=skipped,
    )
    return NullResult(
        layers=layers,
        seed=s.seed,
        null=s.null,
        groups=s.groups,
        cos_self=out["self"],
        cos_null=out["null"],
        cos_across=out["across"] if s.groups else None,
        excess_lo=lo,
        excess_hi=hi,
        reconstruction_error=error,
        provenance=provenance,
    )


def _across(y: Tensor, t: dict[str, Tensor], info: ModelInfo, layer: int, groups: str) -> Tensor:
    """cos(y_t, v'_t) with v' another group's value: group (g - 1) mod n_groups (the paper's roll), or the mean of the
    cosines with every other group. A softmax layer's groups are its kv heads (each value expanded to its query
    heads); a linear layer's are its key heads, v' the value head at the same place in the other group."""
    rolled = info.kind(layer).other_groups(t, info)
    if groups == "neighbour":
        rolled = rolled[:1]
    return torch.stack([torch.cosine_similarity(y, other, dim=-1) for other in rolled]).mean(0)


def is_grouped(info: ModelInfo) -> bool:
    """Grouped-query attention: several kv groups, each shared by several query heads (on every softmax layer);
    the same holds on a linear layer's key heads, each shared by several value heads."""
    return all(1 < info.kind(layer).key_heads(info) < info.output_heads(layer) for layer in info.head_layers)


@long_call
def gqa_alignment(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: NullSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> NullResult:
    """Within-group vs across-group excess (module docstring); needs grouped-query attention. As
    :func:`causal_null` with ``groups`` (default here: ``neighbour``).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-qwen2")  # grouped-query attention
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> result = lp.gqa_alignment(model, docs, n_resamples=100, progress=False)
        >>> type(result).__name__
        'NullResult'
    """
    info = check_model(model)
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
    s, opts = resolve(NullSettings, settings, options, protocol, changes)
    if s.groups is None:
        s = dataclasses.replace(s, groups="neighbour")
    return causal_null(model, documents, settings=s, options=opts)
