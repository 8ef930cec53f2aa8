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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Float, Int
from scipy import stats as sps
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.compression import Compression, MethodLike, compress, method_name
from lens_parallel.data import TokenBlocks, document_batches
from lens_parallel.distributed import TaskContext, check_workers, run_tasks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import LayerStream, softmax_layers
from lens_parallel.losses import DocLosses, EditEffect, document_losses, edit_effect
from lens_parallel.models import model_info
from lens_parallel.plots.compression import compression_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.sweep import capture

SUBLAYERS = ("attn", "mlp")
POSITIONS = ("last", "all")


@serializable
@dataclass(frozen=True)
class CompressionResult(ResultMixin):
    """Per method, sublayer, layer and prompt: ``par`` = |e_par|/|delta|, ``perp`` = |e_perp|/|delta|, ``coef`` =
    e.delta/|delta|^2 (arrays ``[method, sublayer, layer, prompt]``, NaN where |delta| ~ 0), and per method the
    end-to-end delta loss (nats/token, compressed - dense) with its paired bootstrap CI over prompts."""

    sublayers: ClassVar[tuple[str, ...]] = SUBLAYERS

    methods: tuple[str, ...]
    layers: tuple[int, ...]
    positions: str
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


def _updates(
    tensors: dict[str, Tensor], positions: str
) -> tuple[Float[Tensor, "sublayer batch scored d_model"], Float[Tensor, "batch pos d_model"]]:
    pos = slice(-1, None) if positions == "last" else slice(1, None)
    return torch.stack([tensors["attn_out"][:, pos], tensors["mlp_out"][:, pos]]).double(), tensors["resid_pre"]


def _block_updates(model, info, layer: int, tokens, resid, positions: str) -> Tensor:
    """Block ``layer``'s attention and MLP updates when it is fed ``resid`` (the dense model's input)."""
    got: dict[str, Tensor] = {}
    stream = LayerStream(info, [layer], ["attn_out", "mlp_out"], lambda _, t: got.update(t), dtype=torch.float32)
    stream.run(model, tokens, resid=resid, start_at_layer=layer)
    return _updates({**got, "resid_pre": resid}, positions)[0]


def _relative_errors(
    comp: Float[Tensor, "sublayer batch scored d_model"],
    base: Float[Tensor, "sublayer batch scored d_model"],
    eps: float,
) -> Float[Tensor, "3 sublayer batch"]:
    """|e_par|/|delta|, |e_perp|/|delta| and e.delta/|delta|^2 of e = comp - base, averaged over the scored
    positions of each document (NaN where |delta| ~ 0)."""
    proj = geometry.project(comp - base, base, eps=eps)
    norm, ok = base.norm(dim=-1), proj.valid
    safe = torch.where(ok, norm, 1.0)
    ratios = (proj.par.norm(dim=-1) / safe, proj.perp.norm(dim=-1) / safe, proj.coef)
    return torch.stack([torch.where(ok, r, torch.nan).nanmean(-1) for r in ratios])


def _check_methods(method: MethodLike | Sequence[MethodLike], positions: str) -> list:
    methods = [method] if isinstance(method, (str, Compression)) or callable(method) else list(method)
    if not methods:
        raise LensParallelError("give at least one compression method")
    if positions not in POSITIONS:
        raise LensParallelError(f"positions must be one of {POSITIONS}, got {positions!r}")
    return [Compression.parse(m) if isinstance(m, str) else m for m in methods]


@dataclass(frozen=True)
class _CompressionInput:
    """What every method's unit of work needs; sent once to each worker."""

    tokens: Tensor
    calibration: Tensor
    methods: tuple
    layers: tuple[int, ...]
    positions: str
    eps: float
    batch_size: int


def _dense_pass(model: TransformerBridge, plan: _CompressionInput) -> tuple[dict[int, list], DocLosses]:
    """The dense model's per-layer inputs and updates, batch by batch, and its per-document losses."""
    dense: dict[int, list[tuple[Tensor, Tensor]]] = {layer: [] for layer in plan.layers}

    def keep_dense(rows: slice, layer: int, tensors: dict[str, Tensor]) -> None:
        dense[layer].append(_updates(tensors, plan.positions))

    roles = ["resid_pre", "attn_out", "mlp_out"]
    capture(model, plan.tokens, plan.layers, roles, keep_dense, batch_size=plan.batch_size, dtype=torch.float32)
    return dense, document_losses(model, plan.tokens, batch_size=plan.batch_size)


def _method_task(context: TaskContext, plan: _CompressionInput, i: int) -> tuple[np.ndarray, EditEffect]:
    """Method ``i``: its relative errors ``[3, sublayer, layer, document]`` and its loss change."""
    dense, base_losses = context.cached("dense", lambda: _dense_pass(context.model, plan))
    compressed = compress(context.model, plan.methods[i], calibration=plan.calibration)
    errors = np.full((3, len(SUBLAYERS), len(plan.layers), len(plan.tokens)), np.nan)
    for j, (rows, batch) in enumerate(document_batches(plan.tokens, plan.batch_size)):
        for k, layer in enumerate(plan.layers):
            base, resid = dense[layer][j]
            comp = _block_updates(compressed, context.info, layer, batch, resid, plan.positions)
            errors[:, :, k, rows] = _relative_errors(comp, base, plan.eps).numpy()
    compressed_losses = document_losses(compressed, plan.tokens, batch_size=plan.batch_size)
    return errors, edit_effect(base_losses, compressed_losses)


def compression_error(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    method: MethodLike | Sequence[MethodLike],
    positions: str = "last",
    calibration: TokenBlocks | Int[Tensor, "batch pos"] | None = None,
    eps: float = geometry.EPS,
    batch_size: int = 8,
    workers: int = 1,
    ray_address: str | None = None,
) -> CompressionResult:
    """Decompose every method's per-layer update error into parts along and across the dense update.

    ``method``: one or several specs (``int8``, ``int4-g128``, ``wanda-50%``, ``magnitude-2:4``, ... see
    :mod:`lens_parallel.compression`), :class:`Compression` objects, or functions editing a Hugging Face model in
    place. ``calibration``: tokens for Wanda's input norms (default: ``tokens``). Each method compresses a copy (one
    at a time); ``model`` is never changed. Prompts run ``batch_size`` at a time: one dense pass keeps each layer's
    input and updates, then each compressed block is fed the dense input, batch by batch. ``workers`` /
    ``ray_address``: one method per Ray worker at a time (:mod:`lens_parallel.distributed`; same numbers; a
    function given as a method must be importable or picklable by cloudpickle).
    """
    methods = _check_methods(method, positions)
    distributed = check_workers(workers, ray_address, model)
    toks = as_tokens(tokens)
    calib = toks if calibration is None else as_tokens(calibration)
    info = model_info(model)
    layers, _ = softmax_layers(info, None, what="compression_error")
    plan = _CompressionInput(toks, calib, tuple(methods), tuple(layers), positions, eps, batch_size)
    memo = {} if distributed else {"dense": _dense_pass(model, plan)}  # workers make their own dense pass
    base_losses = document_losses(model, toks, batch_size=batch_size) if distributed else memo["dense"][1]
    errors = np.full((3, len(methods), len(SUBLAYERS), len(layers), len(toks)), np.nan)  # par, perp, coef
    delta_loss, delta_ci = np.zeros(len(methods)), np.zeros((len(methods), 2))
    finished = run_tasks(
        model, _method_task, plan, range(len(methods)), workers=workers, ray_address=ray_address, memo=memo
    )
    for i, (err, effect) in finished:
        errors[:, i] = err
        delta_loss[i], delta_ci[i] = effect.delta_loss, effect.delta_loss_ci
    return CompressionResult(
        methods=tuple(method_name(m) for m in methods),
        layers=tuple(layers),
        positions=positions,
        par=errors[0],
        perp=errors[1],
        coef=errors[2],
        loss_dense=base_losses.loss,
        delta_loss=delta_loss,
        delta_loss_ci=delta_ci,
        provenance=Provenance.collect(
            info,
            tokens,
            methods=[method_name(m) for m in methods],
            positions=positions,
            calibration="tokens" if calibration is None else "separate",
            eps=eps,
            batch_size=batch_size,
        ),
    )
