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

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import plots
from lens_parallel.data import TokenBlocks
from lens_parallel.edits import HEAD_SPACES, SCALE_SPACES, ComponentScale, compile_hooks
from lens_parallel.evaluate import DocLosses, EditEffect, batch_nll, edit_effect
from lens_parallel.hooks import check_indices, hook_name, softmax_layers
from lens_parallel.models import model_info
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable

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
            rows.append({
                "model": self.info.name, "space": p.space, "vary": p.vary, "s_par": p.s_par, "s_perp": p.s_perp,
                "layer": p.layer, "loss_noop": e.loss_noop, "loss_edited": e.loss_edited,
                "delta_loss": e.delta_loss, "delta_loss_lo": e.delta_loss_ci[0], "delta_loss_hi": e.delta_loss_ci[1],
                "ppl_noop": e.ppl_noop, "ppl_edited": e.ppl_edited, "delta_ppl": e.delta_ppl,
                "delta_ppl_lo": e.delta_ppl_ci[0], "delta_ppl_hi": e.delta_ppl_ci[1], "n_docs": e.n_docs,
                "n_tokens": e.n_tokens,
            })  # fmt: skip
        return pd.DataFrame(rows).astype({"layer": "Int64"})

    def figure(self):
        return plots.scaling_figure(self)


def _check_scales(name: str, values: Sequence[float]) -> tuple[float, ...]:
    values = tuple(float(v) for v in values)
    if not all(np.isfinite(values)):
        raise ValueError(f"{name} values must be finite numbers, got {list(values)}")
    return values


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
    batch_size: int = 8,
    n_resamples: int = 2000,
    seed: int = 0,
    progress: bool = True,
) -> ScalingResult:
    """Loss/perplexity of ``ComponentScale`` settings, minus the matched no-op, with paired bootstrap CIs.

    Args:
        space: one or more of ``value``, ``value-exclude-self``, ``residual-attn``, ``residual-mlp``,
            ``residual-block``.
        s_par: values of s_par tried at s_perp = 1. s_perp: values of s_perp tried at s_par = 1.
        layers: the layers edited (default all), all together; with ``per_layer=True`` one at a time.
        heads: query heads edited (value spaces and residual-attn only; default all / the whole sublayer).
        batch_size, n_resamples, seed: documents per forward; bootstrap resamples and seed (CIs over documents).

    The matched no-op (the same hooks, scales 1) is run for every space; it is exact, so one no-op forward
    per space and batch serves every setting and layer.
    """
    info = model_info(model)
    spaces = (space,) if isinstance(space, str) else tuple(space)
    layer_idx = check_indices("layers", layers, info.n_layers)
    bad = [sp for sp in spaces if sp not in SCALE_SPACES]
    if bad or not spaces:
        raise ValueError(f"unknown space {(bad or [spaces])[0]!r}; accepted: {', '.join(SCALE_SPACES)}")
    # head-level spaces act on softmax-attention layers only (Qwen3.5's linear blocks are skipped when layers=None)
    space_layers = {
        sp: softmax_layers(info, layers, what=f"space {sp!r}")[0] if sp in HEAD_SPACES else layer_idx for sp in spaces
    }
    settings = [("s_par", v, 1.0) for v in _check_scales("s_par", s_par)]
    settings += [("s_perp", 1.0, v) for v in _check_scales("s_perp", s_perp)]
    toks = as_tokens(tokens)
    # compile (and so validate) every intervention before the first forward
    hooks = {
        (sp, vary, a, b, ls): compile_hooks(model, ComponentScale(sp, a, b, layers=ls, heads=heads))
        for sp in spaces
        for (vary, a, b) in [*settings, ("noop", 1.0, 1.0)]
        for ls in ([(x,) for x in space_layers[sp]] if per_layer and vary != "noop" else [space_layers[sp]])
    }
    sums: dict[tuple, list[Tensor]] = {key: [] for key in hooks}
    prefix_names = [hook_name(layer, "resid_pre") for layer in layer_idx] if per_layer else []
    for start in tqdm(range(0, len(toks), batch_size), desc="scale sweep", unit="batch", disable=not progress):
        batch = toks[start : start + batch_size]
        prefix = {}
        if per_layer:
            with torch.inference_mode():
                _, prefix = model.run_with_cache(batch, names_filter=prefix_names, stop_at_layer=max(layer_idx) + 1)
        for key, hook_list in hooks.items():
            ls = key[-1]
            if per_layer and key[1] != "noop":
                resid = prefix[hook_name(ls[0], "resid_pre")]
                sums[key].append(batch_nll(model, batch, hook_list, resid=resid, start_at_layer=ls[0]))
            else:
                sums[key].append(batch_nll(model, batch, hook_list))
    n = np.full(len(toks), toks.shape[1] - 1, dtype=np.int64)
    losses = {key: DocLosses(torch.cat(v).double().cpu().numpy(), n) for key, v in sums.items()}
    points = []
    for (sp, vary, a, b, ls), doc_losses in losses.items():
        if vary == "noop":
            continue
        base = losses[sp, "noop", 1.0, 1.0, space_layers[sp]]
        effect = edit_effect(base, doc_losses, n_resamples=n_resamples, seed=seed)
        points.append(SweepPoint(sp, vary, a, b, ls[0] if per_layer else None, effect))
    provenance = Provenance.collect(
        info, tokens, analysis="scale_sweep", spaces=list(spaces), s_par=list(s_par), s_perp=list(s_perp),
        layers=list(layer_idx), per_layer=per_layer, heads=None if heads is None else list(heads),
        batch_size=batch_size, n_resamples=n_resamples, seed=seed,
    )  # fmt: skip
    return ScalingResult(points=tuple(points), provenance=provenance)
