"""Directional decomposition of compression error, layer by layer.

For each layer l, the compressed model's update of each sublayer (attention, MLP) is compared with the dense one,
and the whole block's output with the dense block's:

    e = out_compressed - out_dense,   e_par = (e . delta / |delta|^2) delta,   e_perp = e - e_par

with delta the dense update (the sublayer's output; for ``block``, resid_post - resid_pre of the dense model), as
the directional-decomposition paper's code (Shwai-He/Transformer-Geometry, ``layerwise_para_perp_compare.py``)
computes it, reported as |e_par| / |delta| and |e_perp| / |delta| (mean and std over prompts), with the signed
coefficient e . delta / |delta|^2 (< 0: the compressed update is shorter along its own direction).

``mode="local"`` (the paper's one-layer swap): every compressed block is fed the dense model's input resid_pre[l]
(inside a sequential block the MLP sees the compressed attention's output), so errors do not compound and the block
error is its own update's. ``mode="global"``: the compressed model runs on its own, every layer compressed, and each
error includes what earlier layers passed on (the paper's ``effect_scope="global"``).
``positions="last"`` scores each prompt's last position; ``"all"`` averages positions 1.. of each prompt (position 0,
the boundary token, is excluded). Also the end-to-end change in next-token loss of the compressed model.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float
from scipy import stats as sps
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import CompressionMode, ScoredPositions, Sublayer
from lens_parallel.compression import SPEC_HELP, Compression, MethodLike, checked_compressed, compress, method_name
from lens_parallel.data import load_texts, token_blocks
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import DocBatch, Documents, DocumentsLike
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import softmax_layers
from lens_parallel.losses import DocLosses, edit_effect
from lens_parallel.models import ModelInfo
from lens_parallel.options import RunOptions, resolve
from lens_parallel.paths import write_table
from lens_parallel.plots.compression import compression_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, Job, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import check_choice, check_eps, check_positive_int, literal_values

DEFAULT_METHODS: tuple[MethodLike, ...] = ("int8", "int4-g128", "wanda-50%", "wanda-2:4")
SUBLAYERS = literal_values(Sublayer)
SUBLAYER_ROLES = ("attn_out", "mlp_out", "resid_post")
COLLECT_BYTES = 1 << 28
"""A compressed copy of at least this many bytes (256 MiB) is collected before the next method's copy is built."""
"""The hooks of each sublayer's output, in :data:`SUBLAYERS` order."""


@dataclass(frozen=True, repr=False)
class CompressionResult(ResultMixin):
    """Per method, sublayer, layer and prompt: ``par`` = |e_par|/|delta|, ``perp`` = |e_perp|/|delta|, ``coef`` =
    e.delta/|delta|^2 (arrays ``[method, sublayer, layer, prompt]``, NaN where |delta| ~ 0), and per method the
    end-to-end delta loss (nats/token, compressed - dense) with its paired bootstrap CI over prompts.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> err = lp.compression_error(model, docs, method=["int8"], progress=False)
        >>> fig = err.figure()
    """

    columns: ClassVar[str] = (
        "model method sublayer layer prompt par perp coef loss_dense perp_mean[<method>,<sublayer>] "
        "par_mean[<method>,<sublayer>] perp_share[<method>,<sublayer>] delta_loss[<method>,<sublayer>]"
    )

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
    sublayers: tuple[str, ...] = ("attn", "mlp")  # results saved before 0.12.0 have these two
    mode: CompressionMode = "local"
    input_drift: np.ndarray | None = None
    """``[method, layer, prompt]``: |x_c - x| / |x| of each block's input resid_pre, compressed against dense
    (0 in local mode, where every block is fed the dense input; None in results saved before 0.12.0)."""

    def to_dataframe(self) -> pd.DataFrame:
        """Full resolution: one row per (method, sublayer, layer, prompt) with |e_par|/|delta|, |e_perp|/|delta| and
        the signed coefficient (NaN where |delta| ~ 0)."""
        m, j, k, d = np.meshgrid(*(np.arange(n) for n in self.par.shape), indexing="ij")
        return pd.DataFrame(
            {
                "model": self.info.name,
                "method": np.asarray(self.methods)[m.ravel()],
                "sublayer": np.asarray(self.sublayers)[j.ravel()],
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
            for j, sub in enumerate(self.sublayers):
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
        return {sub: self.figure(sublayer=sub) for sub in self.sublayers}

    def figure(self, *, sublayer: str = "attn", drop_ends: bool = False) -> go.Figure:
        """One sublayer's errors by layer; ``drop_ends``: leave out the first and last layers, as the paper's
        Fig. 6 does (their updates dwarf or are dwarfed by the rest)."""
        return compression_figure(self, sublayer=sublayer, drop_ends=drop_ends)


@dataclass(frozen=True, kw_only=True)
class CompressionSettings:
    """What compression error computes: each of ``method`` (specs such as ``int8``, ``int4-g128``, ``wanda-50%``,
    ``wanda-seq-2:4``, :class:`~lens_parallel.compression.Compression` objects, or functions editing a Hugging Face
    model in place), in ``mode`` (``local``: each compressed block fed the dense input; ``global``: the compressed
    model on its own), scored at ``scored`` positions (each prompt's ``last``, or ``all`` positions after the
    first), projections guarded by ``eps``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.CompressionSettings(method=("int8",)).method
        ('int8',)
    """

    method: tuple[MethodLike, ...] = field(default=DEFAULT_METHODS, metadata={"help": f"compressions: {SPEC_HELP}"})
    mode: CompressionMode = field(
        default="local", metadata={"help": "local: every block fed the dense input; global: errors compound"}
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
        check_choice("mode", self.mode, CompressionMode)
        check_choice("scored positions", self.scored, ScoredPositions)
        check_eps(self.eps)

    def record(self) -> dict[str, Any]:
        """Plain data for provenance (each method by its name)."""
        return {
            "method": [method_name(m) for m in self.method],
            "mode": self.mode,
            "scored": self.scored,
            "eps": self.eps,
        }


@dataclass(frozen=True)
class MethodJob:
    """One compression method: a compressed copy of the model (:func:`~lens_parallel.compression.compress`)."""

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


@dataclass(frozen=True)
class CheckpointJob:
    """A separately loaded compressed model (``compressed=``): its name is its key."""

    name: str

    @property
    def key(self) -> str:
        return self.name

    @property
    def start_layer(self) -> int:
        return 0


def _nbytes(model: TransformerBridge) -> int:
    """The bytes of ``model``'s parameters and buffers (a quantized tensor counted at its logical size)."""
    return sum(t.numel() * t.element_size() for t in model.original_model.state_dict().values())


def _scored_weight(docs: DocBatch, scored: ScoredPositions) -> Float[Tensor, "batch pos"]:
    """Per document, the positions scored: its last real one, or every real one after the first."""
    if scored == "last":
        return torch.nn.functional.one_hot(docs.lengths - 1, docs.tokens.shape[1]).double()
    weight = docs.real.double()
    weight[:, 0] = 0.0
    return weight


def _relative_errors(
    error: Float[Tensor, "sublayer batch pos d_model"],
    ref: Float[Tensor, "sublayer batch pos d_model"],
    weight: Float[Tensor, "batch pos"],
    eps: float,
) -> Float[Tensor, "3 sublayer batch"]:
    """|e_par|/|delta|, |e_perp|/|delta| and e.delta/|delta|^2 of the error e along the dense update delta
    (``ref``), averaged over each document's scored positions (``weight``), NaN where |delta| ~ 0 at every scored
    position."""
    error, ref = error.double(), ref.double()
    proj = geometry.project(error, ref, eps=eps)
    norm, ok = ref.norm(dim=-1), proj.valid
    safe = torch.where(ok, norm, 1.0)
    w = weight.to(error.device) * ok
    ratios = (proj.par.norm(dim=-1) / safe, proj.perp.norm(dim=-1) / safe, proj.coef)
    return torch.stack([(r * w).sum(-1) / w.sum(-1) for r in ratios]).cpu()  # 0/0 -> NaN


def _layer_errors(
    got: dict[str, Tensor], dense: dict[str, Tensor], weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """One layer's relative errors ``[3, sublayer, batch]`` of the compressed outputs ``got`` (attn_out, mlp_out,
    resid_post and the block's input resid_pre) against the dense ones, and the input drift |x_c - x| / |x| of the
    block's input ``[batch]`` (0 in local mode), both averaged over the scored positions."""
    error = torch.stack([got[r].double() - dense[r].double() for r in SUBLAYER_ROLES])
    block = dense["resid_post"].double() - dense["resid_pre"].double()  # the dense block's update
    delta = torch.stack([dense["attn_out"].double(), dense["mlp_out"].double(), block])  # SUBLAYER_ROLES order
    errors = _relative_errors(error, delta, weight, eps)
    x_c, x = got["resid_pre"].double(), dense["resid_pre"].double()
    drift = (x_c - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(eps)
    w = weight.to(drift.device)
    return errors, ((drift * w).sum(-1) / w.sum(-1)).cpu()


class _CompressionMetric(Metric[MethodJob | CheckpointJob]):
    """Per method: every layer's update errors against the dense update (``errors [3, sublayer, layer, docs]``:
    par, perp, coef), the drift of each block's input, and the compressed model's per-document losses."""

    name = "compression-error"
    base = True

    def __init__(
        self,
        info: ModelInfo,
        layers: tuple[int, ...],
        s: CompressionSettings,
        calibration: Tensor,
        *,
        separate: Tensor | None = None,
        compressed: TransformerBridge | None = None,
    ) -> None:
        self.info, self.layers, self.s, self.calibration = info, layers, s, calibration
        self.separate, self.compressed = separate, compressed

    def fingerprint(self) -> dict[str, Any]:
        digest = {
            name: hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]
            for name, t in (("calibration", self.calibration), ("separate", self.separate))
            if t is not None
        }
        mode = {"mode": self.s.mode} if self.s.mode != "local" else {}  # local: the fingerprint of 0.11.0
        return {"metric": self.name, "scored": self.s.scored, "eps": self.s.eps, **mode, **digest}

    def reference_roles(self, info: ModelInfo) -> dict[int, tuple[str, ...]]:
        return dict.fromkeys(self.layers, ("resid_pre", "attn_out", "mlp_out", "resid_post"))

    def spec(self, job: MethodJob | CheckpointJob) -> dict[str, ValueSpec]:
        return {
            "errors": ValueSpec((3, len(SUBLAYERS), len(self.layers), "docs"), allow_nan=True),
            "drift": ValueSpec((len(self.layers), "docs")),
            "loss_sum": ValueSpec(("docs",)),
        }

    def _model(self, context: TaskContext, job: MethodJob | CheckpointJob) -> TransformerBridge:
        """The compressed model of ``job``: the given checkpoint, or a compressed copy (one at a time, kept)."""
        if isinstance(job, CheckpointJob):
            assert self.compressed is not None  # compression_error makes a CheckpointJob only with a model
            return self.compressed
        if context.memo.get("compressed", (None,))[0] != job.key:
            # the previous method's copy goes before this one is built (a bridge holds reference cycles, so only a
            # collection frees it): never two compressed copies beside the dense model, once a copy is big enough
            # to matter (a collection takes 0.1-0.4 s, most of a toy's method)
            _, previous = context.memo.pop("compressed", (None, None))
            if previous is not None and _nbytes(previous) >= COLLECT_BYTES:
                del previous
                gc.collect()
            apart = _calibrated_apart(job.method) and self.separate is not None
            calibration = self.separate if apart else self.calibration
            context.memo["compressed"] = (job.key, compress(context.model, job.method, calibration=calibration))
        return cast(TransformerBridge, context.memo["compressed"][1])

    def measure(
        self, context: TaskContext, plan: SweepPlan, jobs: Sequence[MethodJob | CheckpointJob], batch: Batch
    ) -> list[Values]:
        (job,) = jobs
        model = self._model(context, job)
        weight = _scored_weight(batch.docs, self.s.scored)
        n_docs = len(batch.docs.lengths)
        errors = np.full((3, len(SUBLAYERS), len(self.layers), n_docs), np.nan)
        drift = np.zeros((len(self.layers), n_docs))
        index = {layer: k for k, layer in enumerate(self.layers)}
        roles = ("resid_pre", *SUBLAYER_ROLES)

        def reduce(layer: int, got: dict[str, Tensor]) -> None:
            k = index[layer]
            layer_errors, layer_drift = _layer_errors(got, batch.reference[layer], weight, self.s.eps)
            errors[:, :, k], drift[k] = layer_errors.numpy(), layer_drift.numpy()

        capture = dict.fromkeys(self.layers, roles) if self.s.mode == "global" else None
        # the compressed model's own forward gives the losses and, in global mode, every layer's outputs (each
        # reduced as it completes): one forward for both
        loss = run_rows(
            model, self.info, Batch(batch.docs), capture=capture, loss="document", dtype=torch.float32, reduce=reduce
        ).nll
        assert loss is not None
        if self.s.mode == "local":  # each block fed the dense input
            for layer in self.layers:
                fed = Batch(batch.docs, prefix={layer: batch.reference[layer]["resid_pre"]})
                got = run_rows(model, self.info, fed, start_layer=layer, capture={layer: roles}, dtype=torch.float32)
                reduce(layer, got.captured[layer])
        return [{"errors": errors, "drift": drift, "loss_sum": loss.double().cpu().numpy()}]


AUTHORS_PROMPTS = (
    "John has twice as many books as Mary. Together they have 18 books. How many books does John have?",
    "Which animal is a mammal? Choose the correct answer: a) Snake b) Frog c) Dog d) Lizard",
)
"""The two default prompts of the authors' ``layerwise_para_perp_compare.py`` (its ``read_prompts``)."""


def compression_prompts(model: TransformerBridge, *, n: int = 12, max_tokens: int = 512) -> Documents:
    """The directional-decomposition paper's prompt protocol for compression error: ``n`` short prompts, each its
    own sequence of tokens with no boundary token, cut to ``max_tokens`` (ragged lengths; scored at the last token,
    ``scored="last"``). The paper's 12-prompt file is not public: these are the authors' two default prompts
    (:data:`AUTHORS_PROMPTS`) and the first sentence of the first ``n - 2`` bundled ``wikipedia-en`` articles."""
    check_positive_int("n", n)
    check_positive_int("max_tokens", max_tokens)
    sentences = [text.split(". ")[0].strip() + "." for text in load_texts("wikipedia-en", n_docs=max(n - 2, 1))]
    prompts = [*AUTHORS_PROMPTS, *sentences][:n]
    docs = Documents.of(prompts, model, bos="none")
    rows = [docs.tokens[i, : min(int(length), max_tokens)].tolist() for i, length in enumerate(docs.lengths)]
    return Documents.padded(rows, docs.source | {"protocol": "directional-decomposition compression prompts"})


def _calibrated_apart(method: MethodLike) -> bool:
    """Whether ``method`` is calibrated apart from the prompts by default (``wanda-seq-*``, ``torchao-awq-*``)."""
    spec = Compression.parse(method) if isinstance(method, str) else method
    return isinstance(spec, Compression) and spec.calibrated_apart


def _separate_calibration(model: TransformerBridge, docs: Documents) -> Tensor:
    """Calibration apart from the analysed prompts (``wanda-seq-*``, ``torchao-awq-*``): 16 blocks of up to 512
    tokens of a bundled English corpus that is not the prompts' (the Wanda paper: 128 x 2048 tokens of C4; AWQ's:
    128 x 512 tokens of the Pile; pass ``calibration=`` for those)."""
    corpus = "moby-dick" if docs.source.get("corpus") == "austen" else "austen"
    return token_blocks(model, corpus, n_docs=16, seq_len=min(512, model.cfg.n_ctx), seed=0).tokens


@long_call
def compression_error(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    compressed: TransformerBridge | str | None = None,
    calibration: DocumentsLike | None = None,
    settings: CompressionSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> CompressionResult:
    """Decompose every method's per-layer update error into parts along and across the dense update
    (:class:`CompressionSettings`; run options :class:`~lens_parallel.options.RunOptions`: ``store`` makes the run
    resumable method by method, ``workers`` runs one method per Ray worker; both as keyword shortcuts).

    ``compressed``: instead of ``method``, a separately loaded compressed model (a bridge, or a folder or spec for
    :func:`~lens_parallel.models.load_model`): an AWQ, GPTQ or bitsandbytes checkpoint, as the paper measured; it
    must have ``model``'s architecture (the same config up to quantization fields) and tokenizer. Giving both
    ``compressed`` and ``method`` is refused; giving neither runs :class:`CompressionSettings`' default methods.
    ``calibration``: tokens for Wanda's input norms and AWQ's activation magnitudes (default: the documents for
    ``wanda-*``, kept as before; a bundled corpus apart from the documents for ``wanda-seq-*`` and
    ``torchao-awq-*``). Each method compresses a copy (one at a time); ``model`` is never changed. One dense
    reference pass per batch keeps each layer's input, updates and output (and the dense losses). A function given
    as a method must be importable or picklable by cloudpickle for Ray workers.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> err = lp.compression_error(model, docs, method=["int8"], progress=False)
        >>> type(err).__name__
        'CompressionResult'
    """
    info = check_model(model)
    if compressed is not None and (
        "method" in changes or (settings is not None and settings.method != DEFAULT_METHODS)
    ):
        raise LensParallelError("give either method= (compress a copy) or compressed= (a compressed model), not both")
    s, opts = resolve(CompressionSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    other = None if compressed is None else checked_compressed(model, compressed)
    calib = docs.tokens if calibration is None else Documents.of(calibration, model).tokens
    apart = other is None and any(_calibrated_apart(m) for m in s.method)
    separate = _separate_calibration(model, docs) if apart and calibration is None else None
    layers, _ = softmax_layers(info, None, what="compression_error")
    metric = _CompressionMetric(info, layers, s, calib, separate=separate, compressed=other)
    jobs: list[Job] = [CheckpointJob(other.cfg.model_name)] if other is not None else [MethodJob(m) for m in s.method]
    if len({job.key for job in jobs}) != len(jobs):
        raise LensParallelError(f"two methods share a name: {[job.key for job in jobs]}")
    run = run_sweep(model, docs, jobs, metric=metric, options=opts, desc="compression")
    assert run.base is not None
    errors = np.stack([run.value(job)["errors"] for job in jobs], axis=1)  # [3, method, sublayer, layer, doc]
    effects = [edit_effect(run.base, DocLosses(run.value(job)["loss_sum"], run.n_tokens)) for job in jobs]
    if calibration is not None:
        calibration_note = "separate (given)"
    else:
        apart_note = " (wanda-*), a bundled corpus apart (wanda-seq-*, torchao-awq-*)"
        calibration_note = "the documents" + (apart_note if apart else "")
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
            method=[job.key for job in jobs],
            calibration=calibration_note,
            compressed=None if other is None else other.cfg.model_name,
        ),
        sublayers=SUBLAYERS,
        mode=s.mode,
        input_drift=np.stack([run.value(job)["drift"] for job in jobs]),
    )


def _printed(result: CompressionResult, s: CompressionSettings, display: None) -> tuple[str, pd.DataFrame]:
    title = f"{result.info.name}: error relative to the dense update, mean over layers; delta loss in nats/token"
    return title, result.method_table().round(4).set_index(["method", "sublayer"])


def _method_table(result: CompressionResult, folder: Path) -> tuple[Path, ...]:
    write_table(result.method_table(), folder / "compress_methods.csv")
    return (folder / "compress_methods.csv",)


ANALYSIS = Analysis(
    "compress",
    "compression error along / across each layer's update",
    compression_error,
    CompressionSettings,
    CompressionResult,
    _printed,
    data={"n_docs": 12},
    sweep=True,
    store="compress_store.jsonl",
    files=_method_table,
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
