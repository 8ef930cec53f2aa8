"""The attention-diagonal form of parallel-only scaling, as a change of one head's attention map.

Scaling a head's parallel part by s_par (off-diagonal attention fixed) is the same as changing only A_tt by

- value space:        dA_tt = (s_par - 1) (o_t . v_t) / |v_t|^2
- exclude-self:       dA_tt = (s_par - 1) (c_t . v_t) / |v_t|^2,   c_t = o_t - A_tt v_t
- residual (per head): dA_tt = (s_par - 1) (m_t . x_t) / ((W_O v_t) . x_t),   m_t = o_t W_O[h]

(each space's ``pattern_weight_change``). The first two are identities (tested against ``ComponentScale``). The
residual form is a *view*: W_O v_t is not parallel to x_t, so it reproduces the update's component along x_t but
also changes the update perpendicular to x_t by dA_tt (W_O v_t)_perp; that change is reported here beside it.

Beside the per-head residual view, the layer-level one of the directional-decomposition paper (its Fig. 4): one
δ_t shared by every head, δ_t = (s_par - 1) <y_t, x_t> / <W_O concat_h v_t^h, x_t> with y_t the layer's attention
update (``geometry.layer_diagonal_change``), which reproduces the update's component along x_t, with its own
perpendicular side effect reported.

On a linear-attention layer (Qwen3.5's gated delta rule) the head's map is its exact mixing weights M, o_t =
sum_s M_ts v_s (the rule is linear in the values: transformers' own chunked rule run on identity values), with
M_tt = a_tt = beta_t (k_t . q_t) on the diagonal; the value-space forms above hold as written with A -> M (a change
of a_tt alone reproduces the parallel scaling), and residual-attn is not viewed there (a head's write passes its
gated RMSNorm). The figure marks the layer type. Documents may be a prompt string: one sequence, its tokens only (the
boundary token first with ``prompt_boundary=True``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import DiagonalLayout, HeadSpace
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import Documents, DocumentsLike, document_batches
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import (
    check_heads,
    check_not_gated,
    expand_kv,
    head_layers,
    head_writes_note,
    output_weights,
)
from lens_parallel.models import ModelInfo, head_label
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.diagonal import diagonal_figure, paper_diagonal_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.spaces import HEAD_SPACES, SPACES, ResidualFrame, check_spaces
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, EditJob, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import (
    check_bool,
    check_choice,
    check_eps,
    check_finite,
    check_non_negative_int,
)


@dataclass(frozen=True, repr=False)
class DiagonalView(ResultMixin):
    """One head's empirical attention map on one document, the diagonal changes that reproduce a parallel-only
    scaling in each space, and per-head summaries of those changes over all documents of the layer.

    Arrays: ``pattern`` ``[query_pos, key_pos]`` (document ``doc``, head ``head``); ``d_a`` ``[space, pos]``;
    ``residual_perp`` and ``residual_par`` ``[pos]``: the norms of the change the residual view makes to the head's
    update perpendicular to and along x_t. ``da_*`` are ``[space, head]`` over documents and positions t >= 1:
    mean, min and max of dA_tt, the share of positions with A_tt + dA_tt < 0, and positions guarded (dA = 0).
    ``layer_*``: the layer-level residual view (one δ_t for every head; empty / NaN where residual-attn is not
    viewed): ``layer_delta`` ``[pos]`` on document ``doc`` with the norms of its change to the layer's update
    along (``layer_par``) and across (``layer_perp``) x_t; over all documents and t >= 1 the mean, min and max of
    δ, the mean side effect |δ_t (w_t)_perp| / |y_t| and the positions guarded.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> view = lp.diagonal_view(model, docs, layer=0, head=0, progress=False)
        >>> fig = view.figure()
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type space s_par dA_mean dA_min dA_max share_negative "
        "n_guarded dA_mean[<space>] share_negative[<space>] layer_delta_mean layer_side_effect"
    )

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
    da_mean: np.ndarray
    da_min: np.ndarray
    da_max: np.ndarray
    da_negative_share: np.ndarray
    da_guarded: np.ndarray
    layer_delta: np.ndarray
    layer_par: np.ndarray
    layer_perp: np.ndarray
    layer_delta_mean: float
    layer_delta_min: float
    layer_delta_max: float
    layer_side_effect: float
    layer_guarded: int
    provenance: Provenance

    def edited(self, space: str) -> np.ndarray:
        """The edited map A + diag(dA) of this head and document in ``space``."""
        return self.pattern + np.diag(self.d_a[self.spaces.index(space)])

    def layer_edited(self) -> np.ndarray:
        """The edited map A + diag(δ) of this head and document with the layer-level view's δ, one for every head
        (empty when the view has no residual-attn)."""
        return self.pattern + np.diag(self.layer_delta) if self.layer_delta.size else np.zeros((0, 0))

    def to_dataframe(self) -> pd.DataFrame:
        """Per (space, head) summaries of dA_tt over all documents and positions t >= 1 of the layer."""
        rows = []
        kind = {"layer_type": self.info.layer_types[self.layer]} if self.info.hybrid else {}
        for i, space in enumerate(self.spaces):
            for h in range(self.da_mean.shape[1]):
                rows.append(
                    {
                        "model": self.info.name,
                        "space": space,
                        "layer": self.layer,
                        **kind,
                        "head": h,
                        "kv_head": h // self.info.key_group(self.layer),
                        "label": head_label(self.layer, h),
                        "s_par": self.s_par,
                        "dA_mean": self.da_mean[i, h],
                        "dA_min": self.da_min[i, h],
                        "dA_max": self.da_max[i, h],
                        "share_negative": self.da_negative_share[i, h],
                        "n_guarded": int(self.da_guarded[i, h]),
                    }
                )
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """One row: the shown head and s_par, and per space the mean dA_tt over the layer's heads and the share of
        positions where the edited diagonal A_tt + dA_tt is negative."""
        row = {"model": self.info.name, "layer": self.layer, "head": self.head, "s_par": self.s_par}
        for i, space in enumerate(self.spaces):
            row[f"dA_mean[{space}]"] = float(self.da_mean[i].mean())
            row[f"share_negative[{space}]"] = float(self.da_negative_share[i].mean())
        row |= {"layer_delta_mean": self.layer_delta_mean, "layer_side_effect": self.layer_side_effect}
        return pd.DataFrame([row])

    def figure(self, *, max_tokens: int = 48, layout: DiagonalLayout = "full") -> go.Figure:
        """``layout="full"``: every map and the per-head strip; ``"paper"``: the directional-decomposition paper's
        Fig. 4 (empirical A, the layer-level residual map, the value-space map of this head)."""
        check_choice("layout", layout, DiagonalLayout)
        if layout == "paper":
            return paper_diagonal_figure(self, max_tokens=max_tokens)
        return diagonal_figure(self, max_tokens=max_tokens)


_SUMMARIES = ("total", "low", "high", "negative", "guarded", "count")
_LAYER_SUMMARIES = ("layer_total", "layer_low", "layer_high", "layer_side", "layer_guarded")


class _DiagonalMetric(Metric[EditJob]):
    """Per (space, head) over every document's real positions 1 <= t < length: the sum, min and max of dA_tt, the
    number of positions with A_tt + dA_tt < 0 and of guarded positions, and the number of positions."""

    name = "diagonal-view"

    def __init__(
        self,
        info: ModelInfo,
        layer: int,
        spaces: tuple[HeadSpace, ...],
        s_par: float,
        eps: float,
        W_O: Tensor | None,
    ):
        self.info, self.layer, self.spaces, self.s_par, self.eps, self.W_O = info, layer, spaces, s_par, eps, W_O

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "layer": self.layer, "spaces": list(self.spaces), "s_par": self.s_par}

    @property
    def layer_view(self) -> bool:
        return _head_writes(self.spaces) is not None

    def spec(self, job: EditJob) -> dict[str, ValueSpec]:
        shape = (len(self.spaces), self.info.output_heads(self.layer))
        out = {name: ValueSpec(() if name == "count" else shape) for name in _SUMMARIES}
        return out | ({name: ValueSpec(()) for name in _LAYER_SUMMARIES} if self.layer_view else {})

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[EditJob], batch: Batch) -> list[Values]:
        roles = {self.layer: diagonal_roles(self.info, self.layer, self.spaces)}
        t = with_map(self.info, self.layer, run_rows(context.model, self.info, batch, capture=roles).captured)
        d_a, valid = _changes(self.info, t, self.spaces, self.s_par, self.eps, self.W_O)
        diag = geometry.self_weights(t["pattern_full"])
        docs = batch.docs
        real = (docs.real & (torch.arange(docs.tokens.shape[1], device=docs.tokens.device) >= 1)).to(d_a.device)
        w = real[None, :, None, :]  # space batch head pos
        out = {
            "total": (d_a * w).sum((1, 3)).numpy(),
            "low": torch.where(w, d_a, torch.inf).amin((1, 3)).numpy(),
            "high": torch.where(w, d_a, -torch.inf).amax((1, 3)).numpy(),
            "negative": (((diag + d_a) < 0) & w).sum((1, 3)).double().numpy(),
            "guarded": (~valid & w).sum((1, 3)).double().numpy(),
            "count": np.asarray(float(w.sum())),
        }
        if self.layer_view:
            view = _layer_change(self.info, t, self.s_par, self.eps, self.W_O)
            side = view.change_perp.norm(dim=-1) / t["attn_out"].norm(dim=-1).clamp_min(self.eps)
            out |= {
                "layer_total": np.asarray(float((view.delta * real).sum())),
                "layer_low": np.asarray(float(torch.where(real, view.delta, torch.inf).min())),
                "layer_high": np.asarray(float(torch.where(real, view.delta, -torch.inf).max())),
                "layer_side": np.asarray(float((side * real).sum())),
                "layer_guarded": np.asarray(float((~view.valid & real).sum())),
            }
        return [out]

    def combine(self, job: EditJob, parts: Sequence[Values]) -> Values:
        out = super().combine(job, parts)  # sums
        for low, high in (("low", "high"), ("layer_low", "layer_high")):
            if low in out:
                out[low] = np.asarray(np.min([p[low] for p in parts], axis=0))
                out[high] = np.asarray(np.max([p[high] for p in parts], axis=0))
        return out


def diagonal_roles(info: ModelInfo, layer: int, spaces: tuple[HeadSpace, ...]) -> tuple[str, ...]:
    """What the view captures at ``layer`` (:meth:`~lens_parallel.layers.LayerKind.map_roles`): its map, values
    and resid_pre, and the layer's update too when residual-attn is viewed (the layer-level view)."""
    return info.kind(layer).map_roles(update=_head_writes(spaces) is not None)


def _head_writes(spaces: Sequence[HeadSpace]) -> int | None:
    """The index in ``spaces`` of the space that splits each head's residual write (residual-attn), or None."""
    return next((i for i, space in enumerate(spaces) if SPACES[space].head_writes), None)


def with_map(info: ModelInfo, layer: int, captured: dict[int, dict[str, Tensor]]) -> dict[str, Tensor]:
    """``layer``'s captures with its map as ``pattern_full`` and its values as ``v``
    (:meth:`~lens_parallel.layers.LayerKind.with_map`: on a linear-attention layer its mixing weights and value
    heads), so that every softmax-layer formula applies unchanged."""
    return info.kind(layer).with_map(captured[layer], info)


def _layer_change(
    info: ModelInfo, t: dict[str, Tensor], s_par: float, eps: float, W_O: Tensor | None
) -> geometry.LayerDiagonalChange:
    """The layer-level residual view of captures ``t`` (:func:`~lens_parallel.geometry.layer_diagonal_change`)."""
    v = expand_kv(t["v"], info.n_heads)  # residual-attn: softmax layers only
    assert W_O is not None  # read whenever residual-attn is viewed
    return geometry.layer_diagonal_change(t["attn_out"], t["resid_pre"], v, W_O.to(v), s_par=s_par, eps=eps)


def _changes(
    info: ModelInfo,
    t: dict[str, Tensor],
    spaces: tuple[HeadSpace, ...],
    s_par: float,
    eps: float,
    W_O: Tensor | None,
) -> tuple[Float[Tensor, "space batch head_index pos"], Bool[Tensor, "space batch head_index pos"]]:
    """dA_tt in every space, and where its denominator was above the guard."""
    x, pattern = t["resid_pre"], t["pattern_full"]
    v = expand_kv(t["v"], pattern.shape[1])  # a linear layer's values: one per value head already
    frame = None if W_O is None else ResidualFrame(x, W_O)
    changes = [SPACES[sp].pattern_weight_change(pattern, v, s_par=s_par, frame=frame, eps=eps) for sp in spaces]
    return torch.stack([c.d_a for c in changes]), torch.stack([c.valid for c in changes])


def _token_labels(model: TransformerBridge, tokens: Int[Tensor, " pos"]) -> tuple[str, ...]:
    pieces = model.tokenizer.convert_ids_to_tokens(tokens.tolist())
    text = [model.tokenizer.convert_tokens_to_string([p]) for p in pieces]
    return tuple(f"{i}:{t!r}"[:24] for i, t in enumerate(text))


@dataclass(frozen=True, kw_only=True)
class DiagonalSettings:
    """Which diagonal view: ``head`` of ``layer`` (both None: the head with the highest mean value-space
    self-cosine), at ``s_par``, in ``space`` (one or more), showing document ``doc``; guards ``eps``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.DiagonalSettings(layer=1, head=2, s_par=0.0).head
        2
    """

    layer: int | None = field(default=None, metadata={"help": "layer", "none": "the most self-aligned head's"})
    head: int | None = field(default=None, metadata={"help": "query head", "none": "the most self-aligned head"})
    s_par: float = field(default=0.0, metadata={"help": "the parallel scale whose diagonal form is shown"})
    space: tuple[HeadSpace, ...] = field(default=HEAD_SPACES, metadata={"help": "spaces of the view"})
    doc: int = field(default=0, metadata={"help": "the document whose map is shown"})
    eps: float = field(default=geometry.EPS, metadata={"help": "guard on the denominators"})
    prompt_boundary: bool = field(
        default=False, metadata={"help": "a prompt string gets the document-boundary token first"}
    )

    def __post_init__(self) -> None:
        if (self.layer is None) != (self.head is None):
            raise LensParallelError("give both layer and head, or neither (then the most self-aligned head is shown)")
        object.__setattr__(self, "space", check_spaces(self.space, choice=HeadSpace, what="diagonal space"))
        check_finite("s_par", self.s_par)
        check_non_negative_int("doc", self.doc)
        check_eps(self.eps)
        check_bool("prompt_boundary", self.prompt_boundary)


def _check_view(
    info: ModelInfo, spaces: tuple[HeadSpace, ...], one_space: bool, layer: int, head: int, doc: int, n_docs: int
) -> tuple[tuple[HeadSpace, ...], int, int]:
    """The spaces, layer and head of a diagonal view, checked (gated attention drops residual-attn from a list;
    ``one_space``: a single space was asked for, which is then refused instead)."""
    ((layer,), _) = head_layers(info, [layer], what="a diagonal view")
    value_only = tuple(s for s in spaces if not SPACES[s].head_writes)
    if info.gated_attention and value_only != spaces:  # also every linear-attention layer (Qwen3.5)
        if one_space:
            check_not_gated(info, "the residual-attn diagonal view", alternative="use value or value-exclude-self")
        spaces = value_only
        warnings.warn("gated attention: the residual-attn diagonal view is skipped (value spaces only)", stacklevel=3)
    if (note := head_writes_note(info, "the residual-attn diagonal view")) and value_only != spaces:
        if one_space:
            raise LensParallelError(note)
        spaces = value_only
        warnings.warn(note, stacklevel=3)
    (head,) = check_heads(info, layer, head)
    if not 0 <= doc < n_docs:
        raise LensParallelError(f"doc {doc} out of range: there are {n_docs} documents")
    return spaces, layer, head


@long_call
def diagonal_view(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: DiagonalSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> DiagonalView:
    """Diagonal changes dA_tt that reproduce scaling the parallel part by ``s_par``, for ``head`` at ``layer``
    (:class:`DiagonalSettings`; run options :class:`~lens_parallel.options.RunOptions`).

    One pass of the engine over the documents (each forward stopped after ``layer``) captures resid_pre, hook_v and
    hook_pattern of that layer and accumulates the summaries over every head and every document's real positions
    t >= 1; ``doc``'s map is kept for the figure (one more forward of that document).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> view = lp.diagonal_view(model, "Echo the final code exactly once: AX7Q-19", layer=1, head=2, progress=False)
        >>> (view.layer, view.head)
        (1, 2)
    """
    info = check_model(model)
    s, opts = resolve(DiagonalSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model, bos="boundary" if s.prompt_boundary else "none")
    layer, head = s.layer, s.head
    if layer is None or head is None:
        from lens_parallel.analyses.decompose import decompose  # the default head comes from the decomposition

        result = decompose(model, docs, space="value", options=dataclasses.replace(opts, store=None, progress=False))
        table = result.table("value", "head")
        i, h = np.unravel_index(np.nanargmax(table.self_cos), table.self_cos.shape)
        layer, head = int(table.layers[i]), int(h)
    spaces, layer, head = _check_view(info, s.space, len(s.space) == 1, layer, head, s.doc, len(docs))
    writes = _head_writes(spaces)
    W_O = output_weights(model, info, layer, dtype=torch.float64) if writes is not None else None
    metric = _DiagonalMetric(info, layer, spaces, s.s_par, s.eps, W_O)
    job = EditJob("unedited", ())
    run = run_sweep(model, docs, [job], metric=metric, options=opts, desc="diagonal")
    sums = run.value(job)
    one = next(document_batches(Documents.padded([docs.tokens[s.doc, : int(docs.lengths[s.doc])].tolist()], {}), 1))
    t = with_map(
        info, layer, run_rows(model, info, Batch(one), capture={layer: diagonal_roles(info, layer, spaces)}).captured
    )
    d_a, _ = _changes(info, t, spaces, s.s_par, s.eps, W_O)
    empty, nan = np.zeros(0), float("nan")
    layer_delta, layer_par, layer_perp = empty, empty, empty
    if writes is not None:
        view = _layer_change(info, t, s.s_par, s.eps, W_O)
        layer_delta = view.delta[0].numpy()
        layer_par, layer_perp = view.change_par[0].norm(dim=-1).numpy(), view.change_perp[0].norm(dim=-1).numpy()
    v, x = expand_kv(t["v"], info.output_heads(layer))[0, :, head], t["resid_pre"][0]
    n = sums["count"]
    residual_par = residual_perp = np.zeros(one.tokens.shape[1])
    if writes is not None and W_O is not None:
        change = d_a[writes, 0, head][:, None] * (v @ W_O[head])
        split = geometry.project(change, x)
        residual_par, residual_perp = split.par.norm(dim=-1).numpy(), split.perp.norm(dim=-1).numpy()
    provenance = Provenance.of(info, docs, "diagonal_view", s, run, layer=layer, head=head, spaces=list(spaces))
    return DiagonalView(
        layer=layer,
        head=head,
        doc=s.doc,
        s_par=float(s.s_par),
        spaces=spaces,
        token_labels=_token_labels(model, one.tokens[0]),
        pattern=t["pattern_full"][0, head].numpy(),
        d_a=d_a[:, 0, head].numpy(),
        residual_par=residual_par,
        residual_perp=residual_perp,
        da_mean=sums["total"] / n,
        da_min=sums["low"],
        da_max=sums["high"],
        da_negative_share=sums["negative"] / n,
        da_guarded=sums["guarded"].astype(np.int64),
        layer_delta=layer_delta,
        layer_par=layer_par,
        layer_perp=layer_perp,
        layer_delta_mean=float(sums["layer_total"] / n) if "layer_total" in sums else nan,
        layer_delta_min=float(sums["layer_low"]) if "layer_low" in sums else nan,
        layer_delta_max=float(sums["layer_high"]) if "layer_high" in sums else nan,
        layer_side_effect=float(sums["layer_side"] / n) if "layer_side" in sums else nan,
        layer_guarded=int(sums["layer_guarded"]) if "layer_guarded" in sums else 0,
        provenance=provenance,
    )


def _printed(result: DiagonalView, s: DiagonalSettings, display: None) -> tuple[str, pd.DataFrame]:
    title = (
        f"{result.info.name}: dA_tt per head at layer {result.layer} for s_par = {s.s_par} (figure: head {result.head})"
    )
    return title, result.to_dataframe().head(12)


ANALYSIS = Analysis(
    "diagonal",
    "attention-diagonal form of parallel scaling for one head",
    diagonal_view,
    DiagonalSettings,
    DiagonalView,
    _printed,
    data={"n_docs": 4},
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
