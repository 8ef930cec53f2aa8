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
from lens_parallel.data import TokenBlocks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import LayerStream, softmax_layers
from lens_parallel.losses import document_losses, edit_effect
from lens_parallel.models import model_info
from lens_parallel.plots.compression import compression_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable

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


def compression_error(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    method: MethodLike | Sequence[MethodLike],
    positions: str = "last",
    calibration: TokenBlocks | Int[Tensor, "batch pos"] | None = None,
    eps: float = geometry.EPS,
) -> CompressionResult:
    """Decompose every method's per-layer update error into parts along and across the dense update.

    ``method``: one or several specs (``int8``, ``int4-g128``, ``wanda-50%``, ``magnitude-2:4``, ... see
    :mod:`lens_parallel.compression`), :class:`Compression` objects, or functions editing a Hugging Face model in
    place. ``calibration``: tokens for Wanda's input norms (default: ``tokens``). Each method compresses a copy;
    ``model`` is never changed.
    """
    methods = [method] if isinstance(method, (str, Compression)) or callable(method) else list(method)
    if not methods:
        raise LensParallelError("give at least one compression method")
    methods = [Compression.parse(m) if isinstance(m, str) else m for m in methods]
    if positions not in POSITIONS:
        raise LensParallelError(f"positions must be one of {POSITIONS}, got {positions!r}")
    toks = as_tokens(tokens)
    calib = toks if calibration is None else as_tokens(calibration)
    info = model_info(model)
    layers, _ = softmax_layers(info, None, what="compression_error")
    dense: dict[int, tuple[Tensor, Tensor]] = {}

    def keep_dense(layer: int, tensors: dict[str, Tensor]) -> None:
        dense[layer] = _updates(tensors, positions)

    LayerStream(info, layers, ["resid_pre", "attn_out", "mlp_out"], keep_dense, dtype=torch.float32).run(model, toks)
    base_losses = document_losses(model, toks)
    shape = (len(methods), len(SUBLAYERS), len(layers), len(toks))
    par, perp, coef = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
    delta_loss, delta_ci = np.zeros(len(methods)), np.zeros((len(methods), 2))
    for i, m in enumerate(methods):
        compressed = compress(model, m, calibration=calib)
        for k, layer in enumerate(layers):
            base, resid = dense[layer]
            comp = _block_updates(compressed, info, layer, toks, resid, positions)
            proj = geometry.project(comp - base, base, eps=eps)
            norm = base.norm(dim=-1)
            ok = proj.valid
            ratio_par = torch.where(ok, proj.par.norm(dim=-1) / torch.where(ok, norm, 1.0), torch.nan)
            ratio_perp = torch.where(ok, proj.perp.norm(dim=-1) / torch.where(ok, norm, 1.0), torch.nan)
            coefs = torch.where(ok, proj.coef, torch.nan)
            par[i, :, k] = ratio_par.nanmean(-1).numpy()
            perp[i, :, k] = ratio_perp.nanmean(-1).numpy()
            coef[i, :, k] = coefs.nanmean(-1).numpy()
        effect = edit_effect(base_losses, document_losses(compressed, toks))
        delta_loss[i], delta_ci[i] = effect.delta_loss, effect.delta_loss_ci
    return CompressionResult(
        methods=tuple(method_name(m) for m in methods),
        layers=tuple(layers),
        positions=positions,
        par=par,
        perp=perp,
        coef=coef,
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
        ),
    )
