"""Next-layer head dominance, as the Qwen3.5 study measured it: how many upstream heads shape each receiving head.

For every adjacent layer pair (l, l+1), whatever the two layer types, and every upstream head u of layer l, remove
u's projected output over the whole sequence (``HeadEdit("zero")``: a softmax head's hook_z; a linear-attention
head's gate input, which zeroes its gated-norm output, its slice of the output projection's input) and recompute
only up to layer l+1's *effective* queries, keys and values, read where the receiving layer uses them:

- softmax receiver: queries and keys after q/k norms and rotary (hook_rot_q / hook_rot_k; Pythia: hook_q / hook_k,
  which differ by a per-position rotation that preserves the norms and distances used here), values hook_v; keys
  and values per kv head. Receiving heads are its query heads.
- linear-attention receiver (gated delta rule): queries and keys after the causal convolution (hook_q / hook_k of
  ``linear_attn``), L2-normalised as the kernel does (x / sqrt(|x|^2 + 1e-6)), queries then scaled by
  d_head^-1/2 as the kernel does; values hook_v, as the kernel reads them. Receiving heads are its value heads;
  queries and keys per key head.

The unit of observation is (pair, text, query token t, receiving head g). Per observation and upstream head:

    rel_q, rel_k, rel_v = |x' - x| / |x| once per query, key and value head (a key or value head shared by a
    group of query heads, or a query/key head shared by a group of linear value heads, is counted once);
    qkv = sqrt(|dq_g|^2 + |dk_g|^2 + |dv_g|^2) / sqrt(|q_g|^2 + |k_g|^2 + |v_g|^2), with k_g, v_g the key and value
    head g reads (the combined change of what g uses);
    js = JS(A'_g[t, :], A_g[t, :]) of g's attention row (softmax receivers), and js_distance = sqrt(js).

Concentration (``stats.concentration``) is computed per observation over the upstream heads, on each scale
(``qkv``, ``js``, ``js_distance``), then summarised (median, quartiles) per pair, per receiving-layer type and
overall. Joint controls, per observation: remove the weak half, the strong half (ranked by that observation's
single-head effects on the mask scale, ``qkv`` by default as in the study, optionally ``js``), a random half of the
same size (``default_rng([seed, l, text])``, one draw per query token and receiving head in that order) and all
upstream heads, and *measure* the joint effect on every scale.

Cost. Single-head removals are constant over positions: one row per (text, upstream head), full length, gives
every query token. A token-adaptive mask for token t must hold at every position t reads (the attention row, and a
linear receiver's causal convolution), so each (text, receiving head, half) of token t needs a row truncated to
t + 1 tokens (causal: the same numbers as the full sequence, to float rounding). No row is computed twice: a mask
that recurs for one text (across receiving heads, halves or tokens) is one row, run at least to the last token that
reads it (a row run to t' gives every earlier token's numbers too); rows are packed longest first, each forward at
its longest row's length. Captures stay in the model's precision (at least
float32) and only the positions read are taken to float64. Every row resumes at layer l from
the cached residual (earlier blocks not computed) and stops at layer l+1's attention pattern; each forward carries
the unedited rows of its texts, so an effect compares two rows of one forward (removing no head gives 0, exactly where
the CPU's kernels treat every row of a batch alike, else to float32 rounding: 2e-7 seen on one machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import einops
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from jaxtyping import Bool, Int
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import DominanceScale, MaskScale
from lens_parallel.data import TokenBlocks, token_blocks
from lens_parallel.distributed import TaskContext, check_workers
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import HeadEdit
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import check_indices, effective_qk_roles
from lens_parallel.layers import LAYER_KINDS
from lens_parallel.models import ModelInfo, head_label, layer_label
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.dominance import dominance_figure
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.stats import concentration
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import (
    as_indices,
    as_tuple,
    check_choice,
    check_choices,
    check_non_negative_int,
    literal_values,
)

SCALES = literal_values(DominanceScale)
"""Effect scales: combined relative Q/K/V change; JS divergence of the attention row; its square root."""
MASK_SCALES = literal_values(MaskScale)
"""Scales the weak/strong halves can be ranked on (``js`` and ``js_distance`` rank heads identically)."""
JOINT = ("weak", "strong", "random", "all")
METRICS = (
    "effective_n",
    "effective_fraction",
    "normalised_concentration",
    "top25_share",
    "bottom25_share",
    "heads_for_90",
)


def _has_pattern(layer_type: str) -> bool:
    """Whether layers of ``layer_type`` have a softmax pattern (where the JS scales of a receiving row exist)."""
    return LAYER_KINDS[layer_type].pattern


@dataclass(frozen=True, repr=False)
class DominanceResult(ResultMixin):
    """Raw per-observation effects of every upstream head, and the measured joint controls.

    ``qkv``, ``js``: ``[pair, text, upstream_head, query_pos, receiving_head]``; ``rel_q`` / ``rel_k`` / ``rel_v``:
    ``[..., query_head]`` / ``[..., key_head]`` / ``[..., value_head]``; ``joint_qkv`` / ``joint_js``:
    ``[pair, text, query_pos, receiving_head, mask_scale, kind]`` with kinds ``weak, strong, random, all``
    (``random`` and ``all`` do not depend on the mask scale). Head axes are NaN-padded where pairs differ in head
    counts (``upstream_heads``, ``receiving_heads``, ``query_heads``, ``key_heads``, ``value_heads``); ``js`` is NaN for
    linear-attention receivers.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> dom = lp.head_dominance(model, docs, upstream_layers=(0,), progress=False)
        >>> fig = dom.figure()
    """

    columns: ClassVar[str] = (
        "model upstream_layer receiving_layer upstream_type receiving_type text position receiving_head "
        "label effective_n effective_fraction normalised_concentration top25_share bottom25_share "
        "heads_for_90 scale n_pairs qkv_observations qkv_effective_fraction qkv_top25_share "
        "qkv_bottom25_share qkv_heads_for_90 qkv_joint_weak qkv_joint_strong qkv_joint_random qkv_joint_all "
        "qkv_strong_weak_ratio qkv_weak_smaller js_distance_observations js_distance_effective_fraction "
        "js_distance_top25_share js_distance_bottom25_share js_distance_heads_for_90 js_distance_joint_weak "
        "js_distance_joint_strong js_distance_joint_random js_distance_joint_all "
        "js_distance_strong_weak_ratio js_distance_weak_smaller"
    )

    joint_kinds: ClassVar[tuple[str, ...]] = JOINT
    scales: ClassVar[tuple[str, ...]] = SCALES

    layer_pairs: tuple[tuple[int, int], ...]
    layer_types: tuple[tuple[str, str], ...]
    upstream_heads: tuple[int, ...]
    receiving_heads: tuple[int, ...]
    query_heads: tuple[int, ...]
    key_heads: tuple[int, ...]
    value_heads: tuple[int, ...]
    query_positions: tuple[int, ...]
    mask_scales: tuple[str, ...]
    rel_q: np.ndarray
    rel_k: np.ndarray
    rel_v: np.ndarray
    qkv: np.ndarray
    js: np.ndarray
    joint_qkv: np.ndarray
    joint_js: np.ndarray
    provenance: Provenance

    @property
    def receiving_types(self) -> tuple[str, ...]:
        return tuple(recv for _, recv in self.layer_types)

    def effects(self, pair: int, scale: str = "qkv") -> np.ndarray:
        """Single-head effects of pair ``pair`` on ``scale``, ``[text, query_pos, receiving_head, upstream_head]``
        (padding removed)."""
        _check_scale(scale, DominanceScale)
        raw = self.qkv if scale == "qkv" else self.js
        e = raw[pair, :, : self.upstream_heads[pair], :, : self.receiving_heads[pair]]
        return einops.rearrange(np.sqrt(e) if scale == "js_distance" else e, "text up pos recv -> text pos recv up")

    def concentration(self, scale: str = "qkv") -> dict[str, np.ndarray]:
        """Per-observation concentration over upstream heads, ``[pair, text, query_pos, receiving_head]`` per
        metric (NaN for padding and, on the JS scales, for linear receivers)."""
        shape = (len(self.layer_pairs), self.qkv.shape[1], self.qkv.shape[3], self.qkv.shape[4])
        out = {metric: np.full(shape, np.nan) for metric in METRICS}
        for p in range(len(self.layer_pairs)):
            if scale != "qkv" and not LAYER_KINDS[self.receiving_types[p]].pattern:
                continue
            for metric, values in concentration(self.effects(p, scale)).items():
                out[metric][p, :, :, : values.shape[-1]] = values
        return out

    def _frame(self, columns: dict[str, np.ndarray], *, heads: str = "receiving_head") -> pd.DataFrame:
        """Tidy rows of ``[pair, text, query_pos, head]`` arrays (or ``[pair, text, query_pos, head, upstream]``),
        padding dropped. ``heads`` names the head axis: ``receiving_head``, ``query_head``, ``key_head`` or
        ``value_head``."""
        shape = next(iter(columns.values())).shape
        index = np.indices(shape).reshape(len(shape), -1)
        p, text, j, g = index[:4]
        counts = {
            "receiving_head": self.receiving_heads,
            "query_head": self.query_heads,
            "key_head": self.key_heads,
            "value_head": self.value_heads,
        }
        keep = g < np.asarray(counts[heads])[p]
        pairs = np.asarray(self.layer_pairs)[p]
        rows = {
            "model": self.info.name,
            "upstream_layer": pairs[:, 0],
            "receiving_layer": pairs[:, 1],
            "upstream_type": np.asarray(self.layer_types)[p, 0],
            "receiving_type": np.asarray(self.receiving_types)[p],
            "text": text,
            "position": np.asarray(self.query_positions)[j],
            heads: g,
        }
        if heads == "receiving_head":
            rows["label"] = [head_label(int(r), int(h)) for r, h in zip(pairs[:, 1], g, strict=True)]
        if len(shape) == 5:
            u = index[4]
            keep &= u < np.asarray(self.upstream_heads)[p]
            rows["upstream_head"] = u
            rows["upstream_label"] = [head_label(int(layer), int(h)) for layer, h in zip(pairs[:, 0], u, strict=True)]
        df = pd.DataFrame({**rows, **{name: values.reshape(-1) for name, values in columns.items()}})
        return df[keep].reset_index(drop=True)

    def effects_table(self) -> pd.DataFrame:
        """Full resolution: one row per observation and upstream head, with qkv, js and js_distance."""
        axes = "pair text up pos recv -> pair text pos recv up"
        columns = {name: einops.rearrange(getattr(self, name), axes) for name in ("qkv", "js")}
        return self._frame({**columns, "js_distance": np.sqrt(columns["js"])})

    def projection_table(self) -> pd.DataFrame:
        """rel_q per query head, rel_k per key head, rel_v per value head, each head counted once (not once per head
        sharing it): one row per (pair, text, query token, ``role`` q/k/v, ``head``, upstream head)."""
        axes = "pair text up pos head -> pair text pos head up"
        frames = [
            self._frame({"rel": einops.rearrange(values, axes)}, heads=f"{name}_head")
            .rename(columns={f"{name}_head": "head"})
            .assign(role=name[0])
            for name, values in (("query", self.rel_q), ("key", self.rel_k), ("value", self.rel_v))
        ]
        return pd.concat(frames, ignore_index=True)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per observation (pair, text, query token, receiving head) and scale: the concentration of that
        observation's single-head effects over the upstream heads (JS scales for softmax receivers only)."""
        frames = []
        for scale in SCALES:
            df = self._frame(self.concentration(scale)).assign(scale=scale)
            frames.append(df if scale == "qkv" else df[df.receiving_type.map(_has_pattern)])
        return pd.concat(frames, ignore_index=True)

    def joint_table(self) -> pd.DataFrame:
        """One row per observation, scale and mask scale: the measured effect of removing the weak half, the strong
        half, a random half and all upstream heads together; strong/weak ratio; whether weak < strong."""
        frames = []
        for scale in SCALES:
            joint = self.joint_qkv if scale == "qkv" else self.joint_js
            joint = np.sqrt(joint) if scale == "js_distance" else joint
            for m, mask_scale in enumerate(self.mask_scales):
                values = {f"joint_{kind}": joint[..., m, k] for k, kind in enumerate(JOINT)}
                df = self._frame(values).assign(scale=scale, mask_scale=mask_scale)
                if scale != "qkv" or mask_scale != "qkv":
                    df = df[df.receiving_type.map(_has_pattern)]
                frames.append(df)
        df = pd.concat(frames, ignore_index=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            df["strong_weak_ratio"] = np.where(df.joint_weak > 0, df.joint_strong / df.joint_weak, np.nan)
        df["weak_smaller"] = df.joint_weak < df.joint_strong
        return df

    def group_table(self) -> pd.DataFrame:
        """Median and quartiles of every per-observation quantity, per layer pair, per receiving-layer type and over
        all observations (``level`` / ``group``), on each scale; joint rows carry their ``mask_scale`` (concentration
        rows ``mask_scale == ""``). ``weak_smaller``'s mean is the share of observations where weak < strong."""
        conc = self.to_dataframe().assign(mask_scale="")
        joint = self.joint_table()
        long = pd.concat(
            [
                conc.melt(id_vars=_ID_COLUMNS, value_vars=list(METRICS), var_name="metric"),
                joint.assign(weak_smaller=joint.weak_smaller.astype(float)).melt(
                    id_vars=_ID_COLUMNS, value_vars=_JOINT_COLUMNS, var_name="metric"
                ),
            ],
            ignore_index=True,
        )
        long["pair"] = "L" + long.upstream_layer.astype(str) + "→L" + long.receiving_layer.astype(str)
        frames = []
        for level, key in (("pair", "pair"), ("receiving_type", "receiving_type"), ("all", None)):
            group = long.assign(group="all") if key is None else long.assign(group=long[key])
            stats = group.groupby(["group", "scale", "mask_scale", "metric"], sort=False)["value"]
            table = stats.describe()[["count", "mean", "25%", "50%", "75%"]]
            frames.append(table.rename(columns={"25%": "q1", "50%": "median", "75%": "q3"}).assign(level=level))
        out = pd.concat(frames).reset_index()
        return out.assign(model=self.info.name)[["model", "level", *out.columns.drop(["level"])]]

    def summary(self) -> pd.DataFrame:
        """One row: the study's headline numbers (medians over all observations; joint effects as means, ratio
        as median, weak-smaller as a share), on the Q/K/V scale and on sqrt(JS), masks ranked on Q/K/V."""
        table = self.group_table()
        overall = table[(table.level == "all") & (table.mask_scale.isin(["", "qkv"]))]
        row: dict[str, Any] = {"model": self.info.name, "n_pairs": len(self.layer_pairs)}
        for scale in ("qkv", "js_distance"):
            at = overall[overall.scale == scale].set_index("metric")
            row[f"{scale}_observations"] = at.loc["effective_fraction", "count"] if len(at) else 0
            for metric, stat in _HEADLINE:
                row[f"{scale}_{metric}"] = at.loc[metric, stat] if metric in at.index else np.nan
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return dominance_figure(self)


_ID_COLUMNS = ["upstream_layer", "receiving_layer", "receiving_type", "scale", "mask_scale"]
_JOINT_COLUMNS = [*(f"joint_{kind}" for kind in JOINT), "strong_weak_ratio", "weak_smaller"]
_HEADLINE = (
    ("effective_fraction", "median"),
    ("top25_share", "median"),
    ("bottom25_share", "median"),
    ("heads_for_90", "median"),
    ("joint_weak", "mean"),
    ("joint_strong", "mean"),
    ("joint_random", "mean"),
    ("joint_all", "mean"),
    ("strong_weak_ratio", "median"),
    ("weak_smaller", "mean"),
)


def _check_scale(scale: str, accepted: Any) -> None:
    check_choice("scale", scale, accepted)


STUDY_WINDOW = (7, 32)
"""The study's receiving query tokens, 7..31 (``query_positions=None``: this window, within the sequences)."""


def _positions(query_positions: slice | Sequence[int] | None, seq_len: int) -> tuple[int, ...]:
    """The receiving query tokens: ``None`` for the study's window (:data:`STUDY_WINDOW`, cut to the sequences'
    length), a slice ``start:stop`` with 0 <= start < stop <= seq_len (open ends allowed; no negative index counting
    from the end, no step), or positions in [0, seq_len)."""
    if query_positions is None:
        start, stop = STUDY_WINDOW
        if seq_len <= start:
            raise LensParallelError(
                f"the study's query window starts at token {start}, but the sequences have {seq_len} tokens: give "
                "longer texts or query_positions"
            )
        return tuple(range(start, min(stop, seq_len)))
    if isinstance(query_positions, slice):
        start = 0 if query_positions.start is None else query_positions.start
        stop = seq_len if query_positions.stop is None else query_positions.stop
        if query_positions.step not in (None, 1) or not 0 <= start < stop <= seq_len:
            raise LensParallelError(
                f"query positions {start}:{stop} must satisfy 0 <= start < stop <= {seq_len} (the sequences' length; "
                "no negative positions, no step)"
            )
        return tuple(range(start, stop))
    positions = tuple(int(t) for t in query_positions)
    bad = [t for t in positions if not 0 <= t < seq_len]
    if bad or not positions:
        raise LensParallelError(
            f"query_positions {list(bad or positions)} out of range: sequences have {seq_len} tokens"
        )
    return positions


def _receiver_heads(info: ModelInfo, up: int) -> tuple[int, int, int, int, int]:
    """(upstream heads, receiving heads, query heads, key heads, value heads) of the pair (up, up + 1)."""
    n_q, n_k, n_v = info.kind(up + 1).head_counts(info)
    return info.output_heads(up), info.output_heads(up + 1), n_q, n_k, n_v


class _Receiver:
    """Rows of a batch resumed at layer l from the reference pass's residual, upstream heads removed, run up to
    layer l+1's effective q, k, v (and its attention pattern for a softmax layer). ``index[r]`` gives receiving
    head r's query, key and value head."""

    def __init__(self, model: TransformerBridge, info: ModelInfo, up: int) -> None:
        self.model, self.info, self.up, self.recv = model, info, up, up + 1
        self.softmax = info.kind(self.recv).pattern
        self.n_up, self.n_recv, self.n_q, self.n_k, self.n_v = _receiver_heads(info, up)
        self.roles = info.kind(self.recv).receiver_roles(effective_qk_roles(info))
        self.index = tuple([r * n // self.n_recv for r in range(self.n_recv)] for n in (self.n_q, self.n_k, self.n_v))
        # captured in (at least) float32, exactly the model's values; only the positions read go to float64
        self.dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)

    def __call__(
        self, batch: Batch, rows: Int[Tensor, " row"], mask: Bool[Tensor, "row head_index"], length: int
    ) -> dict[str, Tensor | None]:
        hooks = HeadEdit("zero", self.up, mask).hooks(self.model, self.info)
        capture = {self.recv: self.roles}
        out = run_rows(
            self.model,
            self.info,
            batch,
            rows=rows,
            hooks=hooks,
            start_layer=self.up,
            capture=capture,
            length=length,
            dtype=self.dtype,
        ).captured[self.recv]
        q, k, v = (out[role] for role in self.roles[:3])
        if not self.softmax:  # what the gated delta rule kernel multiplies: L2-normalised, q scaled
            q, k = geometry.l2_normalize(q.double()) * q.shape[-1] ** -0.5, geometry.l2_normalize(k.double())
        return {"q": q, "k": k, "v": v, "pattern": out.get("pattern_full")}


def _effects(
    base: dict[str, Any], new: dict[str, Any], index: tuple[list[int], ...], at: list[int]
) -> dict[str, Tensor]:
    """Per-row effects at positions ``at``: qkv / js ``[row, pos, receiving_head]``, rel_q / rel_k / rel_v per query /
    key / value head. js is NaN for linear attention (no softmax)."""
    qi, ki, vi = index
    q, k, v = (base[key][:, at].double() for key in ("q", "k", "v"))
    q2, k2, v2 = (new[key][:, at].double() for key in ("q", "k", "v"))
    num = sum((b[:, :, i] - a[:, :, i]).pow(2).sum(-1) for a, b, i in ((q, q2, qi), (k, k2, ki), (v, v2, vi)))
    den = sum(a[:, :, i].pow(2).sum(-1) for a, i in ((q, qi), (k, ki), (v, vi)))
    if base["pattern"] is not None:
        rows_base = einops.rearrange(base["pattern"][:, :, at].double(), "row head pos key -> row pos head key")
        rows_new = einops.rearrange(new["pattern"][:, :, at].double(), "row head pos key -> row pos head key")
        js = geometry.js_divergence(rows_new, rows_base)
    else:
        js = num.new_full(num.shape, float("nan"))
    return {
        "rel_q": geometry.relative_change(q2, q),
        "rel_k": geometry.relative_change(k2, k),
        "rel_v": geometry.relative_change(v2, v),
        "qkv": torch.sqrt(num / den.clamp_min(1e-30)),
        "js": js,
    }


def _measure(
    receive: _Receiver,
    batch: Batch,
    owners: Int[Tensor, " row"],
    masks: Bool[Tensor, "row head_index"],
    *,
    length: int,
    at: list[int],
    tokens_per_forward: int,
) -> dict[str, np.ndarray]:
    """Effects of removing ``masks[r]``'s upstream heads in text ``owners[r]`` of the batch (sequences cut to
    ``length``), ``[row, pos, ...]``. Each forward holds at most ``tokens_per_forward`` tokens, its texts' unedited
    rows included."""
    step = max(1, tokens_per_forward // length - len(batch.docs.lengths))
    parts = []
    for start in range(0, len(owners), step):
        own = owners[start : start + step]
        texts, inverse = torch.unique(own, return_inverse=True)
        n = len(texts)
        mask = torch.cat([masks.new_zeros(n, masks.shape[1]), masks[start : start + step]])
        rows = torch.cat([texts, own]).to(batch.docs.tokens.device)
        out = receive(batch, rows, mask.to(rows.device), length)
        base = {k: None if t is None else t[:n][inverse] for k, t in out.items()}
        new = {k: None if t is None else t[n:] for k, t in out.items()}
        parts.append(_effects(base, new, receive.index, at))
    return {k: torch.cat([p[k] for p in parts]).cpu().numpy() for k in parts[0]}


def _single_effects(
    receive: _Receiver, batch: Batch, positions: list[int], tokens_per_forward: int
) -> dict[str, np.ndarray]:
    """Every upstream head removed alone, and all of them together (the last row of each text): effects
    ``[text, upstream (+ all), pos, head]``."""
    n, h = len(batch.docs.lengths), receive.n_up
    owners = einops.repeat(torch.arange(n, device="cpu"), "text -> (text u)", u=h + 1)  # host bookkeeping
    masks = einops.repeat(
        torch.cat([torch.eye(h, device="cpu"), torch.ones(1, h, device="cpu")]).bool(), "u h -> (text u) h", text=n
    )
    length = batch.docs.tokens.shape[1]
    eff = _measure(receive, batch, owners, masks, length=length, at=positions, tokens_per_forward=tokens_per_forward)
    return {k: einops.rearrange(v, "(text u) pos head -> text u pos head", text=n) for k, v in eff.items()}


def _half_masks(
    single: dict[str, np.ndarray], texts: range, *, up: int, seed: int, mask_scales: tuple[str, ...]
) -> Bool[Tensor, "text pos recv half upstream"]:
    """Per observation: the random half, then the weak and strong half ranked on each mask scale.

    ``single[scale]``: ``[text, upstream, pos, recv]``. The random half of text i is drawn from
    ``default_rng([seed, up, i])``, one draw per (query token, receiving head) in that order."""
    n, h, n_pos, n_recv = single["qkv"].shape
    half = h // 2
    masks = torch.zeros(n, n_pos, n_recv, 1 + 2 * len(mask_scales), h, dtype=torch.bool, device="cpu")
    for b, text in enumerate(texts):
        rng = np.random.default_rng([seed, up, text])
        for j in range(n_pos):
            for g in range(n_recv):
                masks[b, j, g, 0, rng.choice(h, size=half, replace=False)] = True
    for m, scale in enumerate(mask_scales):
        order = torch.from_numpy(np.argsort(single[scale], axis=1, kind="stable"))  # ascending over upstream heads
        order = einops.rearrange(order, "text up pos recv -> text pos recv up")
        masks[:, :, :, 1 + 2 * m].scatter_(-1, order[..., :half], True)
        masks[:, :, :, 2 + 2 * m].scatter_(-1, order[..., h - half :], True)
    return masks


def _joint_effects(
    receive: _Receiver,
    batch: Batch,
    positions: list[int],
    masks: Bool[Tensor, "text pos recv half upstream"],
    tokens_per_forward: int,
) -> dict[str, np.ndarray]:
    """Token-adaptive joint removals: token t's mask at every position up to t, read at token t and its own
    receiving head. Returns qkv / js ``[text, pos, recv, half]``.

    Each distinct (text, mask) is run once, cut to ``t + 1`` tokens for the last token t that reads it: causal
    attention makes a row cut there give every earlier token's numbers too (to float rounding), so masks that
    coincide across receiving heads, halves or tokens share one row. Rows are packed longest first into forwards of
    ``tokens_per_forward`` tokens, each run at its longest row's length."""
    n, n_pos, n_recv, n_half, _ = masks.shape
    requests = einops.rearrange(masks, "text pos recv half up -> text (pos recv half) up")
    token = einops.repeat(torch.tensor(positions, device="cpu"), "pos -> (pos recv half)", recv=n_recv, half=n_half)
    at_pos = einops.repeat(torch.arange(n_pos, device="cpu"), "pos -> (pos recv half)", recv=n_recv, half=n_half)
    head = einops.repeat(torch.arange(n_recv, device="cpu"), "recv -> (pos recv half)", pos=n_pos, half=n_half)
    owners, rows, last, which, offset = [], [], [], [], 0
    for text in range(n):
        unique, inverse = torch.unique(requests[text], dim=0, return_inverse=True)
        owners.append(torch.full((len(unique),), text, device="cpu"))
        rows.append(unique)
        last.append(token.new_full((len(unique),), -1).scatter_reduce(0, inverse, token, "amax"))
        which.append(inverse + offset)
        offset += len(unique)
    owner, row_mask, length = torch.cat(owners), torch.cat(rows), torch.cat(last) + 1
    per_row = {key: np.full((len(owner), n_pos, n_recv), np.nan) for key in ("qkv", "js")}
    for idx in _length_chunks(length, tokens_per_forward, n):
        size = int(length[idx[0]])  # the chunk's longest row: shorter ones run longer (causal: the same numbers)
        read = [j for j, t in enumerate(positions) if t < size]
        at = [positions[j] for j in read]
        eff = _measure(
            receive, batch, owner[idx], row_mask[idx], length=size, at=at, tokens_per_forward=tokens_per_forward
        )
        for key in per_row:
            per_row[key][idx.numpy()[:, None], np.asarray(read)[None, :]] = eff[key]
    gather = (torch.stack(which).numpy(), at_pos.numpy()[None], head.numpy()[None])
    return {
        key: einops.rearrange(v[gather], "text (pos recv half) -> text pos recv half", pos=n_pos, recv=n_recv)
        for key, v in per_row.items()
    }


def _length_chunks(length: Int[Tensor, " row"], tokens_per_forward: int, n_texts: int) -> list[Int[Tensor, " chunk"]]:
    """Rows in forwards of at most ``tokens_per_forward`` tokens (their texts' unedited rows included), longest
    first, each forward run at the length of its longest row."""
    order = torch.argsort(length, descending=True, stable=True)
    chunks, start = [], 0
    while start < len(order):
        step = max(1, tokens_per_forward // int(length[order[start]]) - n_texts)
        chunks.append(order[start : start + step])
        start += step
    return chunks


def _pair_batch(
    receive: _Receiver,
    batch: Batch,
    positions: list[int],
    *,
    seed: int,
    mask_scales: tuple[MaskScale, ...],
    tokens_per_forward: int,
) -> dict[str, np.ndarray]:
    """Everything one layer pair yields for one batch of texts."""
    texts = range(batch.docs.rows.start, batch.docs.rows.stop)
    single = _single_effects(receive, batch, positions, tokens_per_forward)
    everything = {key: single[key][:, -1] for key in ("qkv", "js")}  # [text, pos, head]: all upstream heads removed
    single = {key: v[:, :-1] for key, v in single.items()}
    scales = mask_scales if receive.softmax else ("qkv",)
    masks = _half_masks(single, texts, up=receive.up, seed=seed, mask_scales=scales)
    joint = _joint_effects(receive, batch, positions, masks, tokens_per_forward)
    for key in ("qkv", "js"):  # -> [text, pos, recv, mask_scale, kind]
        halves = joint[key]
        per_scale = []
        for m in range(len(mask_scales)):
            if m < len(scales):
                weak, strong = halves[..., 1 + 2 * m], halves[..., 2 + 2 * m]
            else:  # js masks are undefined for a linear receiver
                weak = strong = np.full(halves.shape[:-1], np.nan)
            per_scale.append(np.stack([weak, strong, halves[..., 0], everything[key]], axis=-1))
        single[f"joint_{key}"] = np.stack(per_scale, axis=-2)
    return single


def _pad(arrays: list[np.ndarray], axes: Sequence[int]) -> np.ndarray:
    """Stack per-pair arrays whose head axes differ in size, padding with NaN."""
    widths = {axis: max(a.shape[axis] for a in arrays) for axis in axes}
    padded = []
    for a in arrays:
        pad = [(0, widths[axis] - a.shape[axis]) if axis in widths else (0, 0) for axis in range(a.ndim)]
        padded.append(np.pad(a.astype(np.float64), pad, constant_values=np.nan))
    return np.stack(padded)


@dataclass(frozen=True)
class PairJob:
    """One adjacent layer pair (``up``, ``up + 1``): every removal of upstream heads of layer ``up``, measured at
    layer ``up + 1``."""

    up: int

    @property
    def key(self) -> str:
        return f"{layer_label(self.up)}->{layer_label(self.up + 1)}"

    @property
    def start_layer(self) -> int:
        return self.up


class _DominanceMetric(Metric[PairJob]):
    """Per layer pair and text: the single-head effects (``rel_q``, ``rel_k``, ``rel_v``, ``qkv``, ``js``) and the
    joint controls (``joint_qkv``, ``joint_js``) of the study's protocol (module docstring)."""

    name = "head-dominance"

    def __init__(self, info: ModelInfo, positions: tuple[int, ...], seed: int, mask_scales: tuple[MaskScale, ...]):
        self.info, self.positions, self.seed, self.mask_scales = info, positions, seed, mask_scales

    def fingerprint(self) -> dict[str, Any]:
        return {
            "metric": self.name,
            "positions": list(self.positions),
            "seed": self.seed,
            "masks": list(self.mask_scales),
        }

    def spec(self, job: PairJob) -> dict[str, ValueSpec]:
        n_up, n_recv, n_q, n_k, n_v = _receiver_heads(self.info, job.up)
        pos = len(self.positions)
        joint = ValueSpec(("docs", pos, n_recv, len(self.mask_scales), len(JOINT)), allow_nan=True)
        return {
            "rel_q": ValueSpec(("docs", n_up, pos, n_q)),
            "rel_k": ValueSpec(("docs", n_up, pos, n_k)),
            "rel_v": ValueSpec(("docs", n_up, pos, n_v)),
            "qkv": ValueSpec(("docs", n_up, pos, n_recv)),
            "js": ValueSpec(("docs", n_up, pos, n_recv), allow_nan=True),
            "joint_qkv": joint,
            "joint_js": joint,
        }

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[PairJob], batch: Batch) -> list[Values]:
        (job,) = jobs
        receive = context.cached(("receiver", job.up), lambda: _Receiver(context.model, context.info, job.up))
        out = _pair_batch(
            receive,
            batch,
            list(self.positions),
            seed=self.seed,
            mask_scales=self.mask_scales,
            tokens_per_forward=plan.tokens_per_forward,
        )
        return [out]


def study_texts(model: TransformerBridge, *, seq_len: int = 32, seed: int = 0) -> TokenBlocks:
    """The study's inputs: four texts of ``seq_len`` tokens, two English (``wikipedia-en``) and two Chinese
    (``lunyu``), each block starting with the document-boundary token at position 0.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> blocks = lp.study_texts(model, seq_len=16)
        >>> blocks.tokens.shape[1]
        16
    """
    english = token_blocks(model, "wikipedia-en", n_docs=2, seq_len=seq_len, seed=seed)
    chinese = token_blocks(model, "lunyu", n_docs=2, seq_len=seq_len, seed=seed)
    return replace(
        english,
        tokens=torch.cat([english.tokens, chinese.tokens]),
        corpus="wikipedia-en (texts 0-1) + lunyu (texts 2-3)",
        doc_indices=english.doc_indices + chinese.doc_indices,
    )


@dataclass(frozen=True, kw_only=True)
class DominanceSettings:
    """What head dominance computes: for every pair (l, l+1) with l in ``upstream_layers`` (None: all but the last),
    the receiving query tokens ``query_positions`` (explicit positions), or the window ``query_start`` ..
    ``query_stop`` (exclusive; both None: the study's 7..31, cut to the texts' length), the weak/strong halves ranked
    on ``mask_scales`` (``("qkv",)``, the study's, or ``("qkv", "js")``), the random halves seeded by ``seed``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.DominanceSettings(upstream_layers=(0,)).upstream_layers
        (0,)
    """

    upstream_layers: tuple[int, ...] | None = field(
        default=None, metadata={"help": "upstream layers", "none": "all but the last"}
    )
    query_positions: tuple[int, ...] | None = field(
        default=None, metadata={"help": "receiving query tokens scored", "none": "the window below"}
    )
    query_start: int | None = field(
        default=None, metadata={"help": "first query token scored", "none": "the study's 7"}
    )
    query_stop: int | None = field(
        default=None, metadata={"help": "score tokens before this one", "none": "the study's 32, or the texts' end"}
    )
    mask_scales: tuple[MaskScale, ...] = field(default=("qkv",), metadata={"help": "what ranks the weak/strong halves"})
    seed: int = field(default=0, metadata={"help": "seed of the random halves"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "upstream_layers", as_indices(self.upstream_layers, what="upstream_layers"))
        object.__setattr__(self, "query_positions", as_indices(self.query_positions, what="query_positions"))
        if self.query_positions is not None and (self.query_start is not None or self.query_stop is not None):
            raise LensParallelError("give query_positions or a query_start / query_stop window, not both")
        scales = check_choices("mask scale", as_tuple(self.mask_scales), MaskScale)
        if scales[0] != "qkv":
            raise LensParallelError(f"mask_scales must be ('qkv',) or ('qkv', 'js'), got {scales}")
        object.__setattr__(self, "mask_scales", scales)
        check_non_negative_int("seed", self.seed)

    def window(self) -> slice | tuple[int, ...] | None:
        """The receiving query tokens as :func:`_positions` reads them."""
        if self.query_positions is not None:
            return self.query_positions
        if self.query_start is None and self.query_stop is None:
            return None
        return slice(STUDY_WINDOW[0] if self.query_start is None else self.query_start, self.query_stop)


@long_call
def head_dominance(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: DominanceSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> DominanceResult:
    """Dominance of upstream heads over the next layer's heads, for every pair (l, l+1) of any layer types (module
    docstring for the formulas; :class:`DominanceSettings`, e.g. ``query_positions=slice(7, 32)`` or a list; run
    options :class:`~lens_parallel.options.RunOptions`; both as keyword shortcuts).

    ``documents``: the study used four 32-token texts (:func:`study_texts`: two English, two Chinese; the
    ``dominance-study`` protocol). Blocks start with the document-boundary token at position 0, so position 7 is the
    7th text token and sees 7 earlier text tokens; a caller whose texts carry no boundary token shifts the window by
    one (``slice(8, 33)`` on 33 tokens). Runs on the engine: one job per layer pair, each batch's residual entering
    layer l from the reference pass, every removal a row of a stacked forward (``tokens_per_forward`` tokens at
    most); ``store`` makes the run resumable pair by pair, ``workers`` runs pairs on Ray (same numbers).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> dom = lp.head_dominance(model, docs, upstream_layers=(0,), progress=False)
        >>> type(dom).__name__
        'DominanceResult'
    """
    info = check_model(model)
    window = changes.pop("query_positions", None)
    if isinstance(window, slice):
        if window.step not in (None, 1):
            raise LensParallelError(f"query positions {window} must have no step")
        changes |= {"query_start": window.start, "query_stop": window.stop}
    elif window is not None:
        changes["query_positions"] = window
    s, opts = resolve(DominanceSettings, settings, options, protocol, changes)
    check_workers(opts.workers, opts.ray_address, model)
    docs = Documents.of(documents, model)
    positions = _positions(s.window(), int(docs.lengths.min()))
    chosen = check_indices("upstream layers", s.upstream_layers, info.n_layers - 1)
    pairs = [up for up in range(info.n_layers - 1) if min(info.output_heads(up), info.output_heads(up + 1)) >= 2]
    if s.upstream_layers is None:
        ups = tuple(pairs)
    elif few := sorted(up for up in s.upstream_layers if up not in pairs):
        raise LensParallelError(
            f"head dominance needs at least 2 heads in both layers of a pair; upstream layers {few} of {info.name} "
            f"start pairs with fewer (upstream layers with 2 or more heads on both sides: {pairs})"
        )
    else:
        ups = chosen
    if not ups:
        raise LensParallelError(f"{info.name} has no adjacent layers with 2 or more heads each: no head dominance")
    metric = _DominanceMetric(info, positions, s.seed, s.mask_scales)
    jobs = [PairJob(up) for up in ups]
    run = run_sweep(model, docs, jobs, metric=metric, options=opts, desc="dominance")
    heads = [_receiver_heads(info, up) for up in ups]
    arrays = {key: [run.value(job)[key] for job in jobs] for key in metric.spec(jobs[0])}
    provenance = Provenance.of(
        info,
        docs,
        "head_dominance",
        s,
        run,
        upstream_layers=list(ups),
        query_positions=list(positions),
        removal="upstream head's projected output zeroed over the whole sequence (softmax: hook_z; linear "
        "attention: gate input, so its gated-norm output is 0)",
    )
    return DominanceResult(
        layer_pairs=tuple((up, up + 1) for up in ups),
        layer_types=tuple((info.layer_types[up], info.layer_types[up + 1]) for up in ups),
        upstream_heads=tuple(h[0] for h in heads),
        receiving_heads=tuple(h[1] for h in heads),
        query_heads=tuple(h[2] for h in heads),
        key_heads=tuple(h[3] for h in heads),
        value_heads=tuple(h[4] for h in heads),
        query_positions=positions,
        mask_scales=s.mask_scales,
        joint_qkv=_pad(arrays.pop("joint_qkv"), axes=(2,)),
        joint_js=_pad(arrays.pop("joint_js"), axes=(2,)),
        provenance=provenance,
        **{key: _pad(v, axes=(1, 3)) for key, v in arrays.items()},
    )


@dataclass(frozen=True, kw_only=True)
class DominanceDisplay:
    """Which scale the ``dominance`` subcommand prints its table on (every scale is in the files)."""

    scale: DominanceScale = field(default="qkv", metadata={"help": "scale of the printed table"})


_PRINTED_COLUMNS = [
    "effective_fraction",
    "top25_share",
    "bottom25_share",
    "heads_for_90",
    "joint_weak",
    "joint_strong",
    "joint_all",
    "strong_weak_ratio",
    "weak_smaller",
]


def _printed(result: DominanceResult, s: DominanceSettings, display: DominanceDisplay) -> tuple[str, pd.DataFrame]:
    scale = display.scale
    table = result.group_table()
    table = table[(table.level == "pair") & (table.scale == scale) & table.mask_scale.isin(["", "qkv"])]
    shown = table.pivot(index="group", columns="metric", values="median")
    shown = shown.reindex(index=list(dict.fromkeys(table.group)), columns=_PRINTED_COLUMNS)
    shown["weak_smaller"] = table[table.metric == "weak_smaller"].set_index("group")["mean"]
    title = (
        f"{result.info.name}: dominance of upstream heads over the next layer, {scale} scale: medians over "
        "observations (text, query token, receiving head); weak_smaller = share of observations"
    )
    return title, shown.round(4)


ANALYSIS = Analysis(
    "dominance",
    "how strongly each upstream head drives the next layer's q/k/v",
    head_dominance,
    DominanceSettings,
    DominanceResult,
    _printed,
    data={"texts": "study", "seq_len": 32, "n_docs": 4},
    sweep=True,
    store="dominance_store.jsonl",
    display=DominanceDisplay,
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
