"""Directional decomposition of compression error, layer by layer.

For each layer l and sublayer (attention, MLP), the compressed block is fed the *dense* model's input resid_pre[l]
(errors do not compound across blocks; inside a sequential block the MLP sees the compressed attention's output),
and its update is compared with the dense one:

    e = delta_compressed - delta_base,   e_par = (e . delta_base / |delta_base|^2) delta_base,   e_perp = e - e_par

reported as |e_par| / |delta_base| and |e_perp| / |delta_base| (mean and std over prompts), with the signed
coefficient e . delta_base / |delta_base|^2 (< 0: the compressed update is shorter along its own direction).
``positions="last"`` scores each prompt's last position; ``"all"`` averages positions 1.. of each prompt (position 0,
the boundary token, is excluded). Also the end-to-end change in next-token loss of the compressed model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float
from scipy import stats as sps
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.choices import ScoredPositions, Sublayer
from lens_parallel.compression import SPEC_HELP, Compression, MethodLike, compress, method_name
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import DocBatch, Documents
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import softmax_layers
from lens_parallel.losses import DocLosses, edit_effect
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.compression import compression_figure
from lens_parallel.results import Provenance, ResultMixin, serializable
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, Job, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import check_choice, check_finite, options

SUBLAYERS = options(Sublayer)
SUBLAYER_ROLES = ("attn_out", "mlp_out")
"""The hooks of each sublayer's update, in :data:`SUBLAYERS` order."""


@serializable
@dataclass(frozen=True)
class CompressionResult(ResultMixin):
    """Per method, sublayer, layer and prompt: ``par`` = |e_par|/|delta|, ``perp`` = |e_perp|/|delta|, ``coef`` =
    e.delta/|delta|^2 (arrays ``[method, sublayer, layer, prompt]``, NaN where |delta| ~ 0), and per method the
    end-to-end delta loss (nats/token, compressed - dense) with its paired bootstrap CI over prompts."""

    sublayers: ClassVar[tuple[str, ...]] = SUBLAYERS

    methods: tuple[str, ...]
    layers: tuple[int, ...]
    positions: ScoredPositions
    par: np.ndarray
    perp: np.ndarray
    coef: np.ndarray
    loss_dense: float
    delta_loss: np.ndarray
    delta_loss_ci: np.ndarray
    provenance: Provenance

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (method, sublayer, layer, prompt) with |e_par|/|delta|, |e_perp|/|delta| and
        the signed coefficient (NaN where |delta| ~ 0)."""
        m, j, k, d = np.meshgrid(*(np.arange(n) for n in self.par.shape), indexing="ij")
        return pd.DataFrame(
            {
                "model": self.info.name,
                "method": np.asarray(self.methods)[m.ravel()],
                "sublayer": np.asarray(SUBLAYERS)[j.ravel()],
                "layer": np.asarray(self.layers)[k.ravel()],
                "prompt": d.ravel(),
                "par": self.par.ravel(),
                "perp": self.perp.ravel(),
                "coef": self.coef.ravel(),
            }
        )

    def layer_table(self) -> pd.DataFrame:
        """One row per method, sublayer and layer: mean and std over prompts."""
        rows = []
        for i, method in enumerate(self.methods):
            for j, sub in enumerate(SUBLAYERS):
                for k, layer in enumerate(self.layers):
                    par, perp = self.par[i, j, k], self.perp[i, j, k]
                    rows.append(
                        {
                            "method": method,
                            "sublayer": sub,
                            "layer": layer,
                            "par_mean": np.nanmean(par),
                            "par_std": np.nanstd(par),
                            "perp_mean": np.nanmean(perp),
                            "perp_std": np.nanstd(perp),
                            "err_mean": np.nanmean(np.hypot(par, perp)),
                            "coef_mean": np.nanmean(self.coef[i, j, k]),
                        }
                    )
        return pd.DataFrame(rows)

    def method_table(self) -> pd.DataFrame:
        """One row per method and sublayer: errors and the signed coefficient averaged over layers, the share of
        squared error that is perpendicular, the Pearson correlation across layers of mean |e|/|delta| with mean
        |e_perp|/|delta|, and the end-to-end delta loss."""
        df = self.layer_table()
        rows = []
        for (method, sub), g in df.groupby(["method", "sublayer"], sort=False):
            i = self.methods.index(method)
            ok = g["err_mean"].std() > 0 and g["perp_mean"].std() > 0
            rows.append(
                {
                    "method": method,
                    "sublayer": sub,
                    "perp_mean": g["perp_mean"].mean(),
                    "par_mean": g["par_mean"].mean(),
                    "coef_mean": g["coef_mean"].mean(),
                    "perp_share": (g["perp_mean"] ** 2).sum() / (g["err_mean"] ** 2).sum() if ok else np.nan,
                    "corr_err_perp": sps.pearsonr(g["err_mean"], g["perp_mean"]).statistic if ok else np.nan,
                    "delta_loss": float(self.delta_loss[i]),
                    "delta_loss_lo": float(self.delta_loss_ci[i, 0]),
                    "delta_loss_hi": float(self.delta_loss_ci[i, 1]),
                }
            )
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """One row: :meth:`method_table`'s perpendicular and parallel error, perpendicular share and delta loss of
        every method and sublayer, as ``<column>[<method>,<sublayer>]``."""
        row = {"model": self.info.name, "loss_dense": self.loss_dense}
        for r in self.method_table().itertuples():
            for column in ("perp_mean", "par_mean", "perp_share", "delta_loss"):
                row[f"{column}[{r.method},{r.sublayer}]"] = getattr(r, column)
        return pd.DataFrame([row])

    def figures(self) -> dict[str, go.Figure]:
        return {sub: self.figure(sublayer=sub) for sub in SUBLAYERS}

    def figure(self, *, sublayer: str = "attn") -> go.Figure:
        return compression_figure(self, sublayer=sublayer)


@serializable
@dataclass(frozen=True, kw_only=True)
class CompressionSettings:
    """What compression error computes: each of ``method`` (specs such as ``int8``, ``int4-g128``, ``wanda-50%``,
    :class:`~lens_parallel.compression.Compression` objects, or functions editing a Hugging Face model in place),
    scored at ``scored`` positions (each prompt's ``last``, or ``all`` positions after the first), projections
    guarded by ``eps``."""

    method: tuple[MethodLike, ...] = field(
        default=("int8", "int4-g128", "wanda-50%", "wanda-2:4"), metadata={"help": f"compressions: {SPEC_HELP}"}
    )
    scored: ScoredPositions = field(default="last", metadata={"help": "positions scored: each prompt's last, or all"})
    eps: float = field(default=geometry.EPS, metadata={"help": "guard on the norm of the dense update"})

    def __post_init__(self) -> None:
        methods = (
            (self.method,) if isinstance(self.method, (str, Compression)) or callable(self.method) else self.method
        )
        if not methods:
            raise LensParallelError("give at least one compression method")
        for m in methods:
            if isinstance(m, str):
                Compression.parse(m)  # a spec is checked here, kept as given
            elif not isinstance(m, Compression) and not callable(m):
                raise LensParallelError(f"a compression method is a spec, a Compression or a function, got {m!r}")
        object.__setattr__(self, "method", tuple(methods))
        check_choice("scored positions", self.scored, ScoredPositions)
        check_finite("eps", self.eps)

    def record(self) -> dict[str, Any]:
        """Plain data for provenance (each method by its name)."""
        return {"method": [method_name(m) for m in self.method], "scored": self.scored, "eps": self.eps}


@dataclass(frozen=True)
class MethodJob:
    """One compression method: a compressed copy of the model, its every block fed the dense input."""

    method: MethodLike

    @property
    def key(self) -> str:
        return method_name(self.method)

    @property
    def start_layer(self) -> int:
        return 0

    def __repr__(self) -> str:  # the store's digest: a function's repr would hold its address
        if isinstance(self.method, (str, Compression)):
            return f"MethodJob({Compression.parse(self.method) if isinstance(self.method, str) else self.method!r})"
        return f"MethodJob({getattr(self.method, '__module__', '')}.{getattr(self.method, '__qualname__', self.key)})"


def _scored_weight(docs: DocBatch, scored: ScoredPositions) -> Float[Tensor, "batch pos"]:
    """Per document, the positions scored: its last real one, or every real one after the first."""
    if scored == "last":
        return torch.nn.functional.one_hot(docs.lengths - 1, docs.tokens.shape[1]).double()
    weight = docs.real.double()
    weight[:, 0] = 0.0
    return weight


def _relative_errors(
    comp: Float[Tensor, "sublayer batch pos d_model"],
    base: Float[Tensor, "sublayer batch pos d_model"],
    weight: Float[Tensor, "batch pos"],
    eps: float,
) -> Float[Tensor, "3 sublayer batch"]:
    """|e_par|/|delta|, |e_perp|/|delta| and e.delta/|delta|^2 of e = comp - base, averaged over each document's
    scored positions (``weight``), NaN where |delta| ~ 0 at every scored position."""
    comp, base = comp.double(), base.double()
    proj = geometry.project(comp - base, base, eps=eps)
    norm, ok = base.norm(dim=-1), proj.valid
    safe = torch.where(ok, norm, 1.0)
    w = weight.to(comp.device) * ok
    ratios = (proj.par.norm(dim=-1) / safe, proj.perp.norm(dim=-1) / safe, proj.coef)
    return torch.stack([(r * w).sum(-1) / w.sum(-1) for r in ratios]).cpu()  # 0/0 -> NaN


class _CompressionMetric(Metric):
    """Per method: every layer's update errors against the dense update, each block fed the dense input (``errors
    [3, sublayer, layer, docs]``: par, perp, coef), and the compressed model's per-document losses."""

    name = "compression-error"
    base = True

    def __init__(self, info: ModelInfo, layers: tuple[int, ...], s: CompressionSettings, calibration: Tensor) -> None:
        self.info, self.layers, self.s, self.calibration = info, layers, s, calibration

    def fingerprint(self) -> dict[str, Any]:
        calib = hashlib.sha256(self.calibration.cpu().numpy().tobytes()).hexdigest()[:16]
        return {"metric": self.name, "scored": self.s.scored, "eps": self.s.eps, "calibration": calib}

    def reference_roles(self, info: ModelInfo) -> dict[int, tuple[str, ...]]:
        return dict.fromkeys(self.layers, ("resid_pre", "attn_out", "mlp_out"))

    def spec(self, job: Job) -> dict[str, ValueSpec]:
        return {
            "errors": ValueSpec((3, len(SUBLAYERS), len(self.layers), "docs"), allow_nan=True),
            "loss_sum": ValueSpec(("docs",)),
        }

    def evaluate(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[Job], batch: Batch) -> list[Values]:
        (job,) = jobs
        assert isinstance(job, MethodJob)
        if context.memo.get("compressed", (None,))[0] != job.key:  # one compressed copy at a time, kept per method
            context.memo["compressed"] = (job.key, compress(context.model, job.method, calibration=self.calibration))
        model = context.memo["compressed"][1]
        weight = _scored_weight(batch.docs, self.s.scored)
        errors = np.full((3, len(SUBLAYERS), len(self.layers), len(batch.docs.lengths)), np.nan)
        for k, layer in enumerate(self.layers):
            dense = batch.reference[layer]
            fed = Batch(batch.docs, prefix={layer: dense["resid_pre"]})
            got = run_rows(
                model, self.info, fed, start_layer=layer, capture={layer: SUBLAYER_ROLES}, dtype=torch.float32
            )
            comp = torch.stack([got.captured[layer][r] for r in SUBLAYER_ROLES])
            base = torch.stack([dense[r] for r in SUBLAYER_ROLES])
            errors[:, :, k] = _relative_errors(comp, base, weight, self.s.eps).numpy()
        loss = run_rows(model, self.info, Batch(batch.docs), loss="document").nll
        assert loss is not None
        return [{"errors": errors, "loss_sum": loss.double().cpu().numpy()}]


def compression_error(
    model: TransformerBridge,
    documents: object,
    *,
    calibration: object | None = None,
    settings: CompressionSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> CompressionResult:
    """Decompose every method's per-layer update error into parts along and across the dense update
    (:class:`CompressionSettings`; run options :class:`~lens_parallel.options.RunOptions`: ``store`` makes the run
    resumable method by method, ``workers`` runs one method per Ray worker; both as keyword shortcuts).

    ``calibration``: tokens for Wanda's input norms (default: the documents). Each method compresses a copy (one at
    a time); ``model`` is never changed. One dense reference pass per batch keeps each layer's input and updates
    (and the dense losses), then each compressed block is fed the dense input. A function given as a method must be
    importable or picklable by cloudpickle for Ray workers.
    """
    s, opts = resolve(CompressionSettings, settings, options, protocol, changes)
    docs = Documents.of(documents)
    calib = docs.tokens if calibration is None else Documents.of(calibration).tokens
    info = model_info(model)
    layers, _ = softmax_layers(info, None, what="compression_error")
    metric = _CompressionMetric(info, layers, s, calib)
    jobs = [MethodJob(m) for m in s.method]
    if len({job.key for job in jobs}) != len(jobs):
        raise LensParallelError(f"two methods share a name: {[job.key for job in jobs]}")
    run = run_sweep(model, docs, jobs, metric=metric, options=opts, desc="compression")
    assert run.base is not None
    errors = np.stack([run.value(job)["errors"] for job in jobs], axis=1)  # [3, method, sublayer, layer, doc]
    effects = [edit_effect(run.base, DocLosses(run.value(job)["loss_sum"], run.n_tokens)) for job in jobs]
    return CompressionResult(
        methods=tuple(job.key for job in jobs),
        layers=tuple(layers),
        positions=s.scored,
        par=errors[0],
        perp=errors[1],
        coef=errors[2],
        loss_dense=run.base.loss,
        delta_loss=np.array([e.delta_loss for e in effects]),
        delta_loss_ci=np.array([e.delta_loss_ci for e in effects]),
        provenance=Provenance.of(
            info,
            docs,
            "compression_error",
            s,
            run,
            methods=[job.key for job in jobs],
            calibration="the documents" if calibration is None else "separate",
        ),
    )
