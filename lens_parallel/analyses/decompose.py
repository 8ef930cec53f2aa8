"""Parallel/perpendicular decomposition of head outputs and residual updates, streamed layer by layer.

Spaces (m = message, r = reference; formulas in ``geometry.py`` and docs/design.md):

==================== ============================================= =========================== ===============
space                m                                             r                           level
==================== ============================================= =========================== ===============
value                o_t = hook_z (sum_s A_ts v_s)                 v_t (GQA-expanded hook_v)   head
value-exclude-self   c_t = o_t - A_tt v_t                          v_t                         head
residual-attn        hook_attn_out; per head z_h W_O[h]            x_t = resid_pre             sublayer + head
residual-mlp         hook_mlp_out                                  resid_mid (resid_pre if     sublayer
                                                                   attn/MLP run in parallel)
residual-block       resid_post - resid_pre                        resid_pre                   sublayer
==================== ============================================= =========================== ===============

Gated attention (Qwen3.5): hook_z is sigmoid(gate) * (A v); the value spaces decompose the pre-gate aggregate A v
(rebuilt from hook_pattern and hook_v), residual-attn per head uses the gated write z_h W_O[h]. Linear-attention
layers have no hook_z / hook_pattern: the head-level spaces skip them (with a warning, and said in the result's
provenance); residual-mlp and residual-block cover every layer. Post-attention norms (Gemma 3): hook_attn_out and
hook_mlp_out are the normalised updates actually added to the residual; the per-head level of residual-attn is
undefined there (the norm acts on all heads together) and is skipped with a note.

Statistics are means over all documents and positions t >= 1 (position 0 is excluded: there o_0 = v_0, so its
value-space cosine is 1 by construction), accumulated in float64 inside the forward hooks: memory does not grow
with the number of layers, and the forward stops after the last requested layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.data import TokenBlocks
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import (
    LayerStream,
    check_indices,
    expand_kv,
    head_writes_note,
    output_weights,
    residual_reference_role,
    softmax_layers,
)
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.plots.decompose import decomposition_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable

SPACES = ("value", "value-exclude-self", "residual-attn", "residual-mlp", "residual-block")
HEAD_SPACES = ("value", "value-exclude-self", "residual-attn")


def _roles(space: str, info: ModelInfo) -> tuple[str, ...]:
    """The activations a space needs at a layer (gated attention: the full pattern, to rebuild the pre-gate A v)."""
    if space in ("value", "value-exclude-self"):
        if info.gated_attention:
            return ("v", "pattern_full")
        return ("v", "z") if space == "value" else ("v", "pattern", "z")
    if space == "residual-attn":
        return ("resid_pre", "z", "attn_out")
    if space == "residual-mlp":
        return (residual_reference_role(info, "mlp"), "mlp_out")
    return ("resid_pre", "resid_post")


_SUMS = ("n", "n_degenerate", "cos", "cos_sq", "par_frac", "perp_frac", "coef")


@serializable
@dataclass(frozen=True)
class AlignmentTable:
    """Per-layer, per-unit means over positions t >= 1 for one space at one level.

    Arrays are ``[layer, unit]``: units are query heads (``level="head"``) or the one sublayer update
    (``level="sublayer"``). ``n_degenerate`` counts positions excluded by the eps guard on |m| and |r|.
    ``par_perp_ratio`` (in the data frame) is mean(|m_par|/|m|) / mean(|m_perp|/|m|), a ratio of means.
    """

    space: str
    level: str
    layers: tuple[int, ...]
    n_positions: np.ndarray
    n_degenerate: np.ndarray
    self_cos: np.ndarray
    self_cos_std: np.ndarray
    par_frac: np.ndarray
    perp_frac: np.ndarray
    par_coef: np.ndarray

    def to_dataframe(self, info: ModelInfo) -> pd.DataFrame:
        rows = []
        for i, layer in enumerate(self.layers):
            for unit in range(self.self_cos.shape[1]):
                head = unit if self.level == "head" else None
                rows.append(
                    {
                        "model": info.name,
                        "space": self.space,
                        "level": self.level,
                        "layer": layer,
                        "head": head,
                        "kv_head": None if head is None else head // info.group_size,
                        "label": f"L{layer}H{head}" if head is not None else f"L{layer}",
                        "n_positions": int(self.n_positions[i, unit]),
                        "n_degenerate": int(self.n_degenerate[i, unit]),
                        "self_cos": self.self_cos[i, unit],
                        "self_cos_std": self.self_cos_std[i, unit],
                        "par_frac": self.par_frac[i, unit],
                        "perp_frac": self.perp_frac[i, unit],
                        "par_coef": self.par_coef[i, unit],
                        "par_perp_ratio": self.par_frac[i, unit] / self.perp_frac[i, unit],
                    }
                )
        df = pd.DataFrame(rows)
        return df.astype({"head": "Int64", "kv_head": "Int64"})


@serializable
@dataclass(frozen=True)
class DecompositionResult(ResultMixin):
    """Self-alignment statistics of every requested space; see :func:`decompose`."""

    tables: tuple[AlignmentTable, ...]
    provenance: Provenance

    def table(self, space: str, level: str = "head") -> AlignmentTable:
        for t in self.tables:
            if t.space == space and t.level == level:
                return t
        have = ", ".join(f"{t.space}/{t.level}" for t in self.tables)
        raise KeyError(f"no table for space {space!r} at level {level!r}; this result has: {have}")

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy rows: one per (space, level, layer, head); head is <NA> for whole-sublayer rows."""
        return pd.concat([t.to_dataframe(self.info) for t in self.tables], ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """One row: the mean over layers and units of the self-cosine and parallel fraction of every space and
        level, as ``self_cos[<space>,<level>]`` and ``par_frac[<space>,<level>]``."""
        row = {"model": self.info.name}
        for t in self.tables:
            row[f"self_cos[{t.space},{t.level}]"] = float(np.nanmean(t.self_cos))
            row[f"par_frac[{t.space},{t.level}]"] = float(np.nanmean(t.par_frac))
        return pd.DataFrame([row])

    def figure(self):
        return decomposition_figure(self)


def _normalise_spaces(space: str | Sequence[str]) -> tuple[str, ...]:
    spaces = SPACES if space == "all" else (space,) if isinstance(space, str) else tuple(space)
    bad = [s for s in spaces if s not in SPACES]
    if bad or not spaces:
        raise LensParallelError(f"unknown space(s) {bad or spaces!r}; accepted: {', '.join(SPACES)} or 'all'")
    return tuple(dict.fromkeys(spaces))


class _Accumulator:
    """Running float64 sums of the alignment statistics, per (space, level), per layer and unit."""

    def __init__(self, info: ModelInfo, layers: dict[str, tuple[int, ...]], eps: float) -> None:
        self.info, self.eps = info, eps
        self.layers: dict[tuple[str, str], tuple[int, ...]] = {}
        for space, space_layers in layers.items():
            if space in HEAD_SPACES and not (space == "residual-attn" and head_writes_note(info, space)):
                self.layers[space, "head"] = space_layers
            if space.startswith("residual"):
                self.layers[space, "sublayer"] = space_layers
        self.sums = {
            key: torch.zeros(len(ls), info.n_heads if key[1] == "head" else 1, len(_SUMS), dtype=torch.float64)
            for key, ls in self.layers.items()
        }

    def active(self, key: tuple[str, str], layer: int) -> bool:
        return key in self.layers and layer in self.layers[key]

    def add(self, key: tuple[str, str], layer: int, a: geometry.Alignment) -> None:
        """Add the positions t >= 1 of ``a`` (fields ``[batch, pos, unit]``)."""
        valid = a.valid[:, 1:]
        w = valid.to(torch.float64)
        sums = torch.stack(
            [
                w.sum((0, 1)),
                (~valid).to(torch.float64).sum((0, 1)),
                (w * a.cos[:, 1:]).sum((0, 1)),
                (w * a.cos[:, 1:] ** 2).sum((0, 1)),
                (w * a.par_frac[:, 1:]).sum((0, 1)),
                (w * a.perp_frac[:, 1:]).sum((0, 1)),
                (w * a.coef[:, 1:]).sum((0, 1)),
            ],
            dim=-1,
        )
        self.sums[key][self.layers[key].index(layer)] += sums

    def tables(self) -> tuple[AlignmentTable, ...]:
        out = []
        for (space, level), s in self.sums.items():
            s = s.numpy()
            n = s[..., 0]
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = {name: s[..., i] / n for i, name in enumerate(_SUMS) if i >= 2}
            var = np.clip(mean["cos_sq"] - mean["cos"] ** 2, 0.0, None)
            out.append(
                AlignmentTable(
                    space=space,
                    level=level,
                    layers=self.layers[space, level],
                    n_positions=(n + s[..., 1]).astype(np.int64),
                    n_degenerate=s[..., 1].astype(np.int64),
                    self_cos=mean["cos"],
                    self_cos_std=np.sqrt(var),
                    par_frac=mean["par_frac"],
                    perp_frac=mean["perp_frac"],
                    par_coef=mean["coef"],
                )
            )
        return tuple(out)


def _residual_message(space: str, t: dict[str, Tensor], info: ModelInfo) -> tuple[Tensor, Tensor]:
    """(m, x) of a residual space: the sublayer's update and the residual state it is added to."""
    if space == "residual-attn":
        return t["attn_out"], t["resid_pre"]
    if space == "residual-mlp":
        return t["mlp_out"], t[residual_reference_role(info, "mlp")]
    return t["resid_post"] - t["resid_pre"], t["resid_pre"]


def _reducer(acc: _Accumulator, spaces: tuple[str, ...], W_O: dict[int, Tensor]):
    info, eps = acc.info, acc.eps

    def reduce(layer: int, t: dict[str, Tensor]) -> None:
        v = expand_kv(t["v"], info.n_heads) if "v" in t else None
        if "pattern_full" in t:  # gated attention: hook_z is sigmoid(gate) * (A v); decompose the pre-gate A v
            o = geometry.value_aggregate(t["pattern_full"], v)
            diag = torch.diagonal(t["pattern_full"], dim1=-2, dim2=-1)
        else:
            o, diag = t.get("z"), t.get("pattern")
        for space in spaces:
            if not acc.active((space, "sublayer" if space.startswith("residual") else "head"), layer):
                continue
            if space == "value":
                acc.add((space, "head"), layer, geometry.alignment(o, v, eps=eps))
            elif space == "value-exclude-self":
                _, c = geometry.split_self(o, v, diag)
                acc.add((space, "head"), layer, geometry.alignment(c, v, eps=eps))
            else:
                m, x = _residual_message(space, t, info)
                a = geometry.alignment(m.unsqueeze(2), x.unsqueeze(2), eps=eps)
                acc.add((space, "sublayer"), layer, a)
                if acc.active((space, "head"), layer):
                    dot, mm = geometry.head_residual_products(t["z"], W_O[layer], x)
                    rr = (x * x).sum(-1, keepdim=True).expand_as(dot)
                    acc.add((space, "head"), layer, geometry.alignment_from_products(dot, mm, rr, eps=eps))

    return reduce


def decompose(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    space: str | Sequence[str] = "value",
    layers: int | Sequence[int] | None = None,
    batch_size: int = 8,
    eps: float = geometry.EPS,
    progress: bool = True,
) -> DecompositionResult:
    """Self-alignment of head outputs / residual updates in one or more spaces, in a single streamed pass.

    Args:
        model: a ``TransformerBridge`` from :func:`lens_parallel.load_model` (unprocessed weights).
        tokens: :class:`TokenBlocks` or an integer tensor ``[batch, pos]``.
        space: one of ``value``, ``value-exclude-self``, ``residual-attn``, ``residual-mlp``, ``residual-block``,
            a list of them, or ``"all"``; every space is computed from the same forward.
        layers: layer indices (default: all).
        batch_size: documents per forward.
        eps: guard on |m| and |r| (positions below it are excluded and counted).

    Returns:
        :class:`DecompositionResult`: per (space, level) an :class:`AlignmentTable` with, per layer and head,
        the mean self-cosine cos(m, r), its std, mean |m_par|/|m|, mean |m_perp|/|m| and the mean signed
        parallel coefficient m.r/|r|^2, over positions t >= 1.
    """
    info = model_info(model)
    spaces = _normalise_spaces(space)
    layer_idx = check_indices("layers", layers, info.n_layers)
    toks = as_tokens(tokens)
    if batch_size < 1:
        raise LensParallelError(f"batch_size must be >= 1, got {batch_size}")
    if toks.shape[1] < 2:
        raise LensParallelError(f"need at least 2 positions per document (position 0 is excluded), got {toks.shape[1]}")
    space_layers, skipped = {}, []
    for space in spaces:
        if space in HEAD_SPACES:
            space_layers[space], note = softmax_layers(info, layers, what=f"space {space!r}")
            skipped += [note] if note else []
        else:
            space_layers[space] = layer_idx
    if "residual-attn" in spaces and (note := head_writes_note(info, "the per-head level of residual-attn")):
        skipped.append(note)
    for note in skipped:
        warnings.warn(note, stacklevel=2)
    roles = {layer: [r for s in spaces if layer in space_layers[s] for r in _roles(s, info)] for layer in layer_idx}
    roles = {layer: r for layer, r in roles.items() if r}
    W_O = {}
    if "residual-attn" in spaces:
        W_O = {layer: output_weights(model, layer, dtype=torch.float64) for layer in space_layers["residual-attn"]}
    acc = _Accumulator(info, space_layers, eps)
    stream = LayerStream(info, list(roles), roles, _reducer(acc, spaces, W_O))
    for start in tqdm(range(0, toks.shape[0], batch_size), desc="decompose", unit="batch", disable=not progress):
        stream.run(model, toks[start : start + batch_size])
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="decompose",
        spaces=list(spaces),
        layers=list(layer_idx),
        eps=eps,
        positions="t >= 1 (position 0 excluded)",
        batch_size=batch_size,
        skipped=skipped,
    )
    return DecompositionResult(tables=acc.tables(), provenance=provenance)
