"""Component-scaling sweeps: how loss and perplexity move when every head keeps s_par of its parallel part.

For each space, two one-dimensional sweeps through the matched no-op (s_par = s_perp = 1): vary s_par at
s_perp = 1, and vary s_perp at s_par = 1. Each setting is one forward of the edited model per batch (the edits
compute their references inside that forward; nothing is re-captured per setting). With ``per_layer=True`` each
layer is edited alone, and the unedited prefix is computed once per batch: the forward resumes at the edited
layer from the cached ``resid_pre``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, cast

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import EditPositions, HeadsAll, ReferenceGuard, ScaleMetric, Space, ValueSite
from lens_parallel.documents import Documents, DocumentsLike, TextWindows
from lens_parallel.edits import ComponentScale, check_positions
from lens_parallel.errors import LensParallelError, LibraryError, long_call
from lens_parallel.hooks import check_indices
from lens_parallel.losses import DocLosses, EditEffect, edit_effect
from lens_parallel.models import ModelInfo
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.scaling import scaling_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.spaces import SPACES, check_spaces
from lens_parallel.stats import N_RESAMPLES
from lens_parallel.sweep import EditJob, SweepRun, run_sweep
from lens_parallel.validate import (
    as_indices,
    as_tuple,
    check_bool,
    check_choice,
    check_eps,
    check_finite,
    check_non_negative_int,
    check_positive_int,
)

DEFAULT_S_PAR = (-1.0, -0.5, 0.0, 0.5, 1.5, 2.0, 3.0)
DEFAULT_S_PERP = (0.0, 0.25, 0.5, 0.75, 1.5)


@dataclass(frozen=True)
class SweepPoint:
    """One setting: ``vary`` is "s_par" or "s_perp" (the other scale is 1); ``layer`` is None for all layers."""

    space: str
    vary: str
    s_par: float
    s_perp: float
    layer: int | None
    effect: EditEffect


@dataclass(frozen=True, repr=False)
class ScalingResult(ResultMixin):
    """Edited-minus-no-op loss and perplexity for every (space, setting[, layer]): per scored token, or with
    ``metric="word_perplexity"`` per word (loss in nats/word, perplexity the word perplexity, ``n_words``).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> sweep = lp.scale_sweep(model, docs, space="value", s_par=[0.0, 1.0], layers=[0], progress=False)
        >>> fig = sweep.figure()
    """

    columns: ClassVar[str] = (
        "model space vary s_par s_perp layer loss_noop loss_edited delta_loss delta_loss_lo delta_loss_hi "
        "ppl_noop ppl_edited delta_ppl delta_ppl_lo delta_ppl_hi n_docs n_tokens "
        "delta_loss[<space>,<setting>]"
    )

    points: tuple[SweepPoint, ...]
    provenance: Provenance

    @property
    def metric(self) -> ScaleMetric:
        return cast(ScaleMetric, self.provenance.settings.get("metric", "token_perplexity"))

    @property
    def unit(self) -> str:
        """What the loss is per: ``"token"`` or ``"word"``."""
        return "word" if self.metric == "word_perplexity" else "token"

    def to_dataframe(self) -> pd.DataFrame:
        rows = []
        for p in self.points:
            e = p.effect
            rows.append(
                {
                    "model": self.info.name,
                    "space": p.space,
                    "vary": p.vary,
                    "s_par": p.s_par,
                    "s_perp": p.s_perp,
                    "layer": p.layer,
                    "loss_noop": e.loss_noop,
                    "loss_edited": e.loss_edited,
                    "delta_loss": e.delta_loss,
                    "delta_loss_lo": e.delta_loss_ci[0],
                    "delta_loss_hi": e.delta_loss_ci[1],
                    "ppl_noop": e.ppl_noop,
                    "ppl_edited": e.ppl_edited,
                    "delta_ppl": e.delta_ppl,
                    "delta_ppl_lo": e.delta_ppl_ci[0],
                    "delta_ppl_hi": e.delta_ppl_ci[1],
                    "n_docs": e.n_docs,
                    f"n_{self.unit}s": e.n_tokens,
                }
            )
        return pd.DataFrame(rows).astype({"layer": "Int64"})

    def summary(self) -> pd.DataFrame:
        """One row: the no-op loss and the delta loss (nats/token, or nats/word) of every setting, as
        ``delta_loss[<space>,s_par=<v>]`` / ``delta_loss[<space>,s_perp=<v>]`` (per-layer sweeps: mean over layers)."""
        df = self.to_dataframe()
        row = {"model": self.info.name, "loss_noop": float(df["loss_noop"].iloc[0])}
        for (space, vary, s_par, s_perp), g in df.groupby(["space", "vary", "s_par", "s_perp"], sort=False):
            value = s_par if vary == "s_par" else s_perp
            row[f"delta_loss[{space},{vary}={value:g}]"] = float(g["delta_loss"].mean())
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return scaling_figure(self)


@dataclass(frozen=True, kw_only=True)
class ScaleSettings:
    """What a scaling sweep computes: in each ``space``, s_par over ``s_par`` at s_perp = 1 and s_perp over
    ``s_perp`` (``residual_s_perp`` in the residual spaces, when given) at s_par = 1, editing ``layers`` (None:
    all) but the first ``skip_first_layers`` together or, with ``per_layer``, one at a time; ``heads``, ``eps`` and
    ``guard`` as :class:`~lens_parallel.edits.ComponentScale`'s; at ``positions``; CIs from ``n_resamples``
    bootstrap resamples seeded by ``seed``. ``unedited_check``: also run the unedited model and require each
    space's matched no-op to give the same loss per document, to the rounding of the model's precision
    (:data:`UNEDITED_ULPS`; the paper's scale-1 canary: deltas are against the matched no-op, which this shows to
    be the unedited model).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.ScaleSettings(space=("value",), s_par=(0.0, 0.5)).s_par
        (0.0, 0.5)
    """

    space: tuple[Space, ...] = field(default=("value",), metadata={"help": "spaces whose components are scaled"})
    s_par: tuple[float, ...] = field(default=DEFAULT_S_PAR, metadata={"help": "s_par values (at s_perp = 1)"})
    s_perp: tuple[float, ...] = field(default=DEFAULT_S_PERP, metadata={"help": "s_perp values (at s_par = 1)"})
    layers: tuple[int, ...] | None = field(default=None, metadata={"help": "layers edited", "none": "all"})
    per_layer: bool = field(default=False, metadata={"help": "edit one layer at a time instead of all together"})
    heads: tuple[int, ...] | HeadsAll | None = field(
        default=None,
        metadata={
            "help": "query heads, or all (each head on its own write)",
            "none": "every head; the whole sublayer in residual-attn",
        },
    )
    positions: EditPositions = field(default="all", metadata={"help": "after-first: leave the boundary token"})
    residual_s_perp: tuple[float, ...] | None = field(
        default=None, metadata={"help": "s_perp values in the residual spaces", "none": "as s_perp"}
    )
    skip_first_layers: int = field(
        default=0, metadata={"help": "layers 0..n-1 never edited (not the first token: that is positions)"}
    )
    guard: ReferenceGuard = field(default="exclude", metadata={"help": "a tiny reference: exclude or clamp"})
    eps: float = field(default=geometry.EPS, metadata={"help": "guard on |r| (clamp: |r|^2 floored at eps^2)"})
    unedited_check: bool = field(
        default=False, metadata={"help": "also run the unedited model: the no-op must equal it (to rounding)"}
    )
    site: ValueSite = field(
        default="pre-gate", metadata={"help": "gated attention: value spaces read A v (pre-gate) or z (post-gate)"}
    )
    metric: ScaleMetric = field(
        default="token_perplexity",
        metadata={"help": "loss per token, or lm-eval's word perplexity of whole texts (TextWindows)"},
    )
    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the CIs"})
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "space", check_spaces(self.space))
        for name in ("s_par", "s_perp", "residual_s_perp"):
            if getattr(self, name) is None:
                continue
            values = tuple(check_finite(name, v) for v in as_tuple(getattr(self, name)))
            object.__setattr__(self, name, values)
        check_non_negative_int("skip_first_layers", self.skip_first_layers)
        check_bool("per_layer", self.per_layer)
        check_bool("unedited_check", self.unedited_check)
        check_choice("guard", self.guard, ReferenceGuard)
        check_choice("metric", self.metric, ScaleMetric)
        check_choice("site", self.site, ValueSite)
        check_eps(self.eps)
        object.__setattr__(self, "layers", as_indices(self.layers))
        if self.heads in ("all", ("all",)):
            object.__setattr__(self, "heads", "all")
        else:
            object.__setattr__(self, "heads", as_indices(self.heads, what="heads"))
        check_positions(self.positions)
        check_positive_int("n_resamples", self.n_resamples)
        check_non_negative_int("seed", self.seed)


def _space_layers(s: ScaleSettings, info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """The layers each space edits (:meth:`ComponentScale.edited_layers`: every layer, Qwen3.5's linear-attention
    blocks included, except where a scaling is built on softmax layers only); layers before ``skip_first_layers``
    never."""
    found = {
        sp: ComponentScale(sp, layers=s.layers, heads=s.heads, site=_site(s, sp)).edited_layers(info) for sp in s.space
    }
    out: dict[str, tuple[int, ...]] = {
        sp: tuple(n for n in kept if n >= s.skip_first_layers) for sp, kept in found.items()
    }
    empty = [sp for sp, kept in out.items() if not kept]
    if empty:
        raise LensParallelError(
            f"skip_first_layers={s.skip_first_layers} leaves no layer to edit in {', '.join(empty)}"
        )
    return out


def _grid(s: ScaleSettings, space: Space) -> list[tuple[str, float, float]]:
    """The (vary, s_par, s_perp) settings of one space: s_par at s_perp = 1, then s_perp at s_par = 1."""
    s_perp = s.residual_s_perp if s.residual_s_perp is not None and not SPACES[space].value else s.s_perp
    return [("s_par", v, 1.0) for v in s.s_par] + [("s_perp", 1.0, v) for v in s_perp]


def _site(s: ScaleSettings, space: Space) -> ValueSite:
    """``site`` for the value spaces (the residual spaces have no gate site: pre-gate, the default)."""
    return s.site if SPACES[space].value else "pre-gate"


def _jobs(
    s: ScaleSettings, space_layers: dict[str, tuple[int, ...]]
) -> tuple[dict[Space, EditJob], dict[str, tuple[EditJob, tuple[Space, str, float, float, int | None]]]]:
    """One matched no-op per space (all its layers, from the tokens) and one job per (space, setting[, layer]);
    per-layer jobs start at their layer (the unedited prefix is reused). Returns the no-op jobs by space and every
    edited job with its (space, vary, s_par, s_perp, layer) point."""
    scale = partial(ComponentScale, heads=s.heads, positions=s.positions, eps=s.eps, guard=s.guard)
    noops = {sp: EditJob(f"{sp}|noop", (scale(sp, layers=space_layers[sp], site=_site(s, sp)),)) for sp in s.space}
    points = {}
    for sp in s.space:
        for vary, a, b in _grid(s, sp):
            for layer in space_layers[sp] if s.per_layer else [None]:
                edited = space_layers[sp] if layer is None else (layer,)
                key = f"{sp}|{vary}|s_par={a}|s_perp={b}|layer={layer}"
                job = EditJob(key, (scale(sp, a, b, layers=edited, site=_site(s, sp)),), start_layer=layer or 0)
                points[key] = (job, (sp, vary, a, b, layer))
    return noops, points


UNEDITED_TOLERANCE = 1e-9
"""The canary's floor: |matched no-op - unedited| loss per document (nats) always accepted."""
UNEDITED_ULPS = 16
"""Beyond the floor, the canary accepts the rounding of the model's own precision: 16 eps |the document's loss| (eps
of the model's dtype). Two forwards of the same function may round differently (the edit's hooks take another
kernel; MKL on AVX2 rather than AVX-512 blocks its products otherwise: 3.8e-6 nats on a whole text there, where
16 eps of its loss allows about 1e-3); an edit that is not a no-op moves a document's loss far more."""


def _check_unedited(
    run: SweepRun | Mapping[EditJob, DocLosses], noops: dict[Space, EditJob], unedited: EditJob, *, eps: float
) -> None:
    """The paper's scale-1 canary: each space's matched no-op gives the unedited model's loss on every document, to
    the rounding of the model's precision ``eps`` (:data:`UNEDITED_ULPS`)."""
    base = run[unedited].loss_sum
    allowed = np.maximum(UNEDITED_TOLERANCE, UNEDITED_ULPS * eps * np.abs(base))
    for sp, job in noops.items():
        over = np.abs(run[job].loss_sum - base) - allowed
        if over.max() > 0:
            doc = int(over.argmax())
            worst = float(abs(run[job].loss_sum[doc] - base[doc]))
            raise LibraryError(
                f"the matched no-op of {sp!r} differs from the unedited model by {worst:.3g} nats on document {doc} "
                f"(more than the {float(allowed[doc]):.3g} its rounding allows): a scale-1 edit must not change the "
                "forward"
            )


def _losses(run: SweepRun, texts: TextWindows | None, job: EditJob) -> DocLosses:
    """A job's losses per document, or with ``texts`` per text: NLL summed over its windows, over its words."""
    if texts is None:
        return run[job]
    return DocLosses(texts.per_text(run[job].loss_sum), texts.n_words)


@long_call
def scale_sweep(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: ScaleSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> ScalingResult:
    """Loss/perplexity of ``ComponentScale`` settings, minus the matched no-op, with paired bootstrap CIs
    (:class:`ScaleSettings`; run options :class:`~lens_parallel.options.RunOptions`; both as keyword shortcuts).

    Runs on the sweep engine: the settings of one space stack into shared forwards with one scale per row, and the
    edits compute their references inside the forward; per-layer settings resume at the edited layer. The matched
    no-op (the same hooks, scales 1) is exact, so one no-op per space serves every setting and layer.

    ``metric="word_perplexity"`` (the directional-decomposition paper's): ``documents`` are
    :class:`~lens_parallel.documents.TextWindows` (:func:`lens_parallel.downstream.perplexity.text_windows`: lm-eval's
    rolling windows of whole texts); each text's NLL is summed over its windows and divided by its words, so the
    loss is nats per word, the perplexity lm-eval's ``word_perplexity`` and the bootstrap resamples texts.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> sweep = lp.scale_sweep(model, docs, space="value", s_par=[0.0, 1.0], layers=[0], progress=False)
        >>> type(sweep).__name__
        'ScalingResult'
    """
    info = check_model(model)
    s, opts = resolve(ScaleSettings, settings, options, protocol, changes)
    if s.metric == "word_perplexity" and not isinstance(documents, TextWindows):
        raise LensParallelError(
            "metric='word_perplexity' scores whole texts in lm-eval's rolling windows: pass "
            "lens_parallel.downstream.perplexity.text_windows(model, texts, window=...), "
            f"not {type(documents).__name__}"
        )
    docs = Documents.of(documents, model)
    s = dataclasses.replace(  # indices counted from the end (-1) read on this model: the edits count from 0
        s,
        layers=None if s.layers is None else check_indices("layers", s.layers, info.n_layers),
        heads=check_indices("heads", s.heads, info.n_heads) if isinstance(s.heads, tuple) else s.heads,
    )
    space_layers = _space_layers(s, info)
    noops, points = _jobs(s, space_layers)
    unedited = EditJob("unedited", ())
    jobs = [*noops.values(), *(job for job, _ in points.values()), *([unedited] if s.unedited_check else [])]
    run = run_sweep(model, docs, jobs, options=opts, desc="scale sweep")
    if s.unedited_check:
        _check_unedited(run, noops, unedited, eps=torch.finfo(next(model.parameters()).dtype).eps)
    texts = documents if s.metric == "word_perplexity" and isinstance(documents, TextWindows) else None
    losses = partial(_losses, run, texts)
    sweep_points = tuple(
        SweepPoint(
            sp, vary, a, b, layer, edit_effect(losses(noops[sp]), losses(job), n_resamples=s.n_resamples, seed=s.seed)
        )
        for job, (sp, vary, a, b, layer) in points.values()
    )
    layers = sorted({layer for kept in space_layers.values() for layer in kept})
    return ScalingResult(
        points=sweep_points, provenance=Provenance.of(info, docs, "scale_sweep", s, run, layers=layers)
    )


def _printed(result: ScalingResult, s: ScaleSettings, display: None) -> tuple[str, pd.DataFrame]:
    df = result.to_dataframe()
    title = f"{result.info.name}: edited minus no-op (nats/{result.unit}), no-op loss {df['loss_noop'].iloc[0]:.4f}"
    cols = ["space", "layer", "s_par", "s_perp", "delta_loss", "delta_loss_lo", "delta_loss_hi"]
    return title, df[cols].round(4).set_index("space")


ANALYSIS = Analysis(
    "scale",
    "loss when parallel / perpendicular parts are rescaled",
    scale_sweep,
    ScaleSettings,
    ScalingResult,
    _printed,
    sweep=True,
    store="scale_store.jsonl",
    whole_texts=lambda s: s.metric == "word_perplexity",
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
