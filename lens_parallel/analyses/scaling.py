"""Component-scaling sweeps: how loss and perplexity move when every head keeps s_par of its parallel part.

For each space, two one-dimensional sweeps through the matched no-op (s_par = s_perp = 1): vary s_par at
s_perp = 1, and vary s_perp at s_par = 1. Each setting is one forward of the edited model per batch (the edits
compute their references inside that forward; nothing is re-captured per setting). With ``per_layer=True`` each
layer is edited alone, and the unedited prefix is computed once per batch: the forward resumes at the edited
layer from the cached ``resid_pre``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from jaxtyping import Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.data import TokenBlocks
from lens_parallel.edits import HEAD_SPACES, SCALE_SPACES, ComponentScale, compile_hooks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import check_indices, softmax_layers
from lens_parallel.losses import EditEffect, edit_effect
from lens_parallel.models import model_info
from lens_parallel.plots.scaling import scaling_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.sweep import EditJob, run_sweep

DEFAULT_S_PAR = (-1.0, -0.5, 0.0, 0.5, 1.5, 2.0, 3.0)
DEFAULT_S_PERP = (0.0, 0.25, 0.5, 0.75, 1.5)


@serializable
@dataclass(frozen=True)
class SweepPoint:
    """One setting: ``vary`` is "s_par" or "s_perp" (the other scale is 1); ``layer`` is None for all layers."""

    space: str
    vary: str
    s_par: float
    s_perp: float
    layer: int | None
    effect: EditEffect


@serializable
@dataclass(frozen=True)
class ScalingResult(ResultMixin):
    """Edited-minus-no-op loss and perplexity for every (space, setting[, layer])."""

    points: tuple[SweepPoint, ...]
    provenance: Provenance

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
                    "n_tokens": e.n_tokens,
                }
            )
        return pd.DataFrame(rows).astype({"layer": "Int64"})

    def summary(self) -> pd.DataFrame:
        """One row: the no-op loss and the delta loss (nats/token) of every setting, as
        ``delta_loss[<space>,s_par=<v>]`` / ``delta_loss[<space>,s_perp=<v>]`` (per-layer sweeps: mean over layers)."""
        df = self.to_dataframe()
        row = {"model": self.info.name, "loss_noop": float(df["loss_noop"].iloc[0])}
        for (space, vary, s_par, s_perp), g in df.groupby(["space", "vary", "s_par", "s_perp"], sort=False):
            value = s_par if vary == "s_par" else s_perp
            row[f"delta_loss[{space},{vary}={value:g}]"] = float(g["delta_loss"].mean())
        return pd.DataFrame([row])

    def figure(self):
        return scaling_figure(self)


def _check_scales(name: str, values: Sequence[float]) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if not all(np.isfinite(values)):
        raise LensParallelError(f"{name} values must be finite numbers, got {list(values)}")
    return values


def _space_layers(info, spaces: tuple[str, ...], layers) -> dict[str, tuple[int, ...]]:
    """The layers each space edits: head-level spaces act on softmax-attention layers only (Qwen3.5's linear blocks
    are skipped when ``layers=None``; naming one raises)."""
    layer_idx = check_indices("layers", layers, info.n_layers)
    return {
        sp: softmax_layers(info, layers, what=f"space {sp!r}")[0] if sp in HEAD_SPACES else layer_idx for sp in spaces
    }


def _jobs(
    spaces: tuple[str, ...],
    settings: list[tuple[str, float, float]],
    space_layers: dict,
    per_layer: bool,
    heads,
    positions: str,
) -> tuple[dict[str, EditJob], dict[str, tuple]]:
    """One matched no-op per space (all its layers, from the tokens) and one job per (space, setting[, layer]);
    per-layer jobs start at their layer (the unedited prefix is reused). Returns the no-op jobs by space and every
    edited job with its (space, vary, s_par, s_perp, layer) point."""
    noops = {
        sp: EditJob(f"{sp}|noop", (ComponentScale(sp, layers=space_layers[sp], heads=heads, positions=positions),))
        for sp in spaces
    }
    points = {}
    for sp in spaces:
        for vary, a, b in settings:
            for layer in space_layers[sp] if per_layer else [None]:
                edited = space_layers[sp] if layer is None else (layer,)
                key = f"{sp}|{vary}|s_par={a}|s_perp={b}|layer={layer}"
                scale = ComponentScale(sp, a, b, layers=edited, heads=heads, positions=positions)
                job = EditJob(key, (scale,), start_layer=layer or 0)
                points[key] = (job, (sp, vary, a, b, layer))
    return noops, points


def scale_sweep(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    space: str | Sequence[str] = "value",
    s_par: Sequence[float] = DEFAULT_S_PAR,
    s_perp: Sequence[float] = DEFAULT_S_PERP,
    layers: int | Sequence[int] | None = None,
    per_layer: bool = False,
    heads: Sequence[int] | None = None,
    positions: str = "all",
    batch_size: int = 8,
    n_resamples: int = 2000,
    seed: int = 0,
    store: str | Path | None = None,
    progress: bool = True,
    workers: int = 1,
    ray_address: str | None = None,
) -> ScalingResult:
    """Loss/perplexity of ``ComponentScale`` settings, minus the matched no-op, with paired bootstrap CIs.

    Args:
        space: one or more of ``value``, ``value-exclude-self``, ``residual-attn``, ``residual-mlp``,
            ``residual-block``.
        s_par: values of s_par tried at s_perp = 1. s_perp: values of s_perp tried at s_par = 1.
        layers: the layers edited (default all), all together; with ``per_layer=True`` one at a time.
        heads: query heads edited (value spaces and residual-attn only; default all / the whole sublayer).
        positions: ``all`` (default) or ``after-first``: position 0 (the boundary token, where o_0 = v_0) untouched.
        batch_size, n_resamples, seed: documents per forward; bootstrap resamples and seed (CIs over documents).
        store: a JSON-lines file that makes the sweep resumable (see :func:`lens_parallel.sweep.run_sweep`).
        workers, ray_address: run the settings on Ray workers (:mod:`lens_parallel.distributed`; same numbers).

    Runs on the sweep engine: one forward per setting and batch (the edits compute their references inside that
    forward); per-layer settings resume at the edited layer. The matched no-op (the same hooks, scales 1) is exact,
    so one no-op per space serves every setting and layer.
    """
    info = model_info(model)
    spaces = (space,) if isinstance(space, str) else tuple(space)
    bad = [sp for sp in spaces if sp not in SCALE_SPACES]
    if bad or not spaces:
        raise LensParallelError(f"unknown space {(bad or [spaces])[0]!r}; accepted: {', '.join(SCALE_SPACES)}")
    space_layers = _space_layers(info, spaces, layers)
    settings = [("s_par", v, 1.0) for v in _check_scales("s_par", s_par)]
    settings += [("s_perp", 1.0, v) for v in _check_scales("s_perp", s_perp)]
    noops, points = _jobs(spaces, settings, space_layers, per_layer, heads, positions)
    for job in [*noops.values(), *(job for job, _ in points.values())]:
        compile_hooks(model, job.edits)  # validate every intervention before the first forward
    toks = as_tokens(tokens)
    jobs = [*noops.values(), *(job for job, _ in points.values())]
    run = run_sweep(
        model,
        toks,
        jobs,
        batch_size=batch_size,
        store=store,
        progress=progress,
        desc="scale sweep",
        workers=workers,
        ray_address=ray_address,
    )
    sweep_points = tuple(
        SweepPoint(sp, vary, a, b, layer, edit_effect(run[noops[sp]], run[job], n_resamples=n_resamples, seed=seed))
        for job, (sp, vary, a, b, layer) in points.values()
    )
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="scale_sweep",
        spaces=list(spaces),
        s_par=list(s_par),
        s_perp=list(s_perp),
        layers=list(check_indices("layers", layers, info.n_layers)),
        per_layer=per_layer,
        heads=None if heads is None else list(heads),
        positions=positions,
        batch_size=batch_size,
        n_resamples=n_resamples,
        seed=seed,
    )
    return ScalingResult(points=sweep_points, provenance=provenance)
