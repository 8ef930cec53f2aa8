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
(hook_z / sigmoid(gate)), residual-attn per head uses the gated write z_h W_O[h]. Linear-attention
layers (Qwen3.5's gated delta rule) are decomposed in every space, per value head: m = o_t (hook_recurrence_out),
r = v_t, exclude-self removes a_tt v_t with a_tt = beta_t (k_t . q_t) (:mod:`lens_parallel.spaces`); residual-attn
reads their block's linear-attention output, per head u_h W_out[h] (u_h the gated RMSNorm of o_h and the gate z_h:
the heads' writes sum to the output). On a hybrid model the tables say each row's ``layer_type``.

Post-attention norms (Gemma 3): hook_attn_out and
hook_mlp_out are the normalised updates actually added to the residual; the per-head level of residual-attn is
undefined there (the norm acts on all heads together) and is skipped with a note.

Statistics are means over all documents and positions t >= 1 (position 0 is excluded: there o_0 = v_0, so its
value-space cosine is 1 by construction), accumulated in float64 inside the forward hooks: memory does not grow
with the number of layers, and the forward stops after the last requested layer.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.registry import Analysis
from lens_parallel.bridges import check_model
from lens_parallel.choices import Space
from lens_parallel.distributed import TaskContext
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.hooks import (
    Reducer,
    check_indices,
    head_write_inputs,
    head_writes_note,
    output_weights,
)
from lens_parallel.models import ModelInfo, layer_label
from lens_parallel.options import RunOptions, resolve
from lens_parallel.plots.decompose import decomposition_figure
from lens_parallel.results import Provenance, ResultMixin, head_frame, layer_frame
from lens_parallel.spaces import SPACE_NAMES, SPACES, check_spaces, residual_space, value_parts, value_space
from lens_parallel.store import Values, ValueSpec
from lens_parallel.sweep import Batch, EditJob, Metric, SweepPlan, run_rows, run_sweep
from lens_parallel.validate import as_indices, as_tuple, check_eps

_SUMS = ("n", "n_degenerate", "cos", "cos_sq", "par_frac", "perp_frac", "coef")


@dataclass(frozen=True)
class AlignmentTable:
    """Per-layer, per-unit means over positions t >= 1 for one space at one level.

    Arrays are ``[layer, unit]``: units are query heads (``level="head"``) or the one sublayer update
    (``level="sublayer"``); on a hybrid model the head axis is as wide as the widest layer's heads (a linear layer's
    value heads), a narrower layer's extra units are NaN and have no row in the data frame. ``n_degenerate``
    counts positions excluded by the eps guard on |m| and |r|.
    ``par_perp_ratio`` (in the data frame) is mean(|m_par|/|m|) / mean(|m_perp|/|m|), a ratio of means.
    :meth:`DecompositionResult.table` hands it out with its model (``info``), so that :meth:`to_dataframe` gives its
    tidy rows (every column defined in :mod:`lens_parallel.glossary`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> table = lp.decompose(model, docs, progress=False).table("value", "head")
        >>> table.self_cos.shape  # layers x heads
        (3, 4)
        >>> list(table.to_dataframe().columns[:4])
        ['model', 'space', 'level', 'layer']
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
    info: ModelInfo | None = field(
        default=None, compare=False, repr=False, metadata={"help": "the model the rows are of (set by table())"}
    )

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy rows, one per (layer, head), or per layer for a whole-sublayer update (head <NA>)."""
        if self.info is None:
            raise LensParallelError("this AlignmentTable holds no model: take it from DecompositionResult.table()")
        info = self.info
        values = {
            "n_positions": self.n_positions.astype(np.int64),
            "n_degenerate": self.n_degenerate.astype(np.int64),
            "self_cos": self.self_cos,
            "self_cos_std": self.self_cos_std,
            "par_frac": self.par_frac,
            "perp_frac": self.perp_frac,
            "par_coef": self.par_coef,
            "par_perp_ratio": self.par_frac / self.perp_frac,
        }
        front = {"space": self.space, "level": self.level}
        if self.level == "head":
            df = head_frame(info, self.layers, values, front=front)
        else:  # the whole sublayer update: one row per layer, labelled L{layer}
            df = layer_frame(info, self.layers, {k: v[:, 0] for k, v in values.items()}, front=front)
            df["label"] = [layer_label(layer) for layer in self.layers]
        return df.astype({"head": "Int64", "kv_head": "Int64"})


@dataclass(frozen=True, repr=False)
class DecompositionResult(ResultMixin):
    """Self-alignment statistics of every requested space; see :func:`decompose`.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> result = lp.decompose(model, docs, progress=False)
        >>> list(result.to_dataframe().columns[:3])
        ['model', 'space', 'level']
    """

    columns: ClassVar[str] = (
        "model layer head kv_head label layer_type space level n_positions n_degenerate self_cos "
        "self_cos_std par_frac perp_frac par_coef par_perp_ratio self_cos[<space>,<level>] "
        "par_frac[<space>,<level>]"
    )

    tables: tuple[AlignmentTable, ...]
    provenance: Provenance

    def table(self, space: str, level: str = "head") -> AlignmentTable:
        """The :class:`AlignmentTable` of ``space`` at ``level`` (arrays ``[layer, unit]``; ``.to_dataframe()`` its
        rows)."""
        for t in self.tables:
            if t.space == space and t.level == level:
                return dataclasses.replace(t, info=self.info)
        have = ", ".join(f"{t.space}/{t.level}" for t in self.tables)
        raise KeyError(f"no table for space {space!r} at level {level!r}; this result has: {have}")

    def to_dataframe(self) -> pd.DataFrame:
        """Tidy rows: one per (space, level, layer, head); head is <NA> for whole-sublayer rows."""
        return pd.concat([self.table(t.space, t.level).to_dataframe() for t in self.tables], ignore_index=True)

    def summary(self) -> pd.DataFrame:
        """One row: the mean over layers and units of the self-cosine and parallel fraction of every space and
        level, as ``self_cos[<space>,<level>]`` and ``par_frac[<space>,<level>]``."""
        row: dict[str, Any] = {"model": self.info.name}
        for t in self.tables:
            row[f"self_cos[{t.space},{t.level}]"] = float(np.nanmean(t.self_cos))
            row[f"par_frac[{t.space},{t.level}]"] = float(np.nanmean(t.par_frac))
        return pd.DataFrame([row])

    def figure(self) -> go.Figure:
        return decomposition_figure(self)


def _normalise_spaces(space: object) -> tuple[Space, ...]:
    """A space, a list of them, or ``"all"`` (every space; also inside a list) as a tuple of spaces."""
    spaces = as_tuple(space)
    if "all" in spaces:
        return SPACE_NAMES
    return check_spaces(spaces)


class _Accumulator:
    """Running float64 sums of the alignment statistics, per (space, level), per layer and unit, on ``device`` (the
    tokens': nothing is read on the host until the forward has ended)."""

    def __init__(
        self, info: ModelInfo, layers: dict[str, tuple[int, ...]], eps: float, device: torch.device | str = "cpu"
    ) -> None:
        self.info, self.eps = info, eps
        self.layers: dict[tuple[str, str], tuple[int, ...]] = {}
        for space, space_layers in layers.items():
            spec = SPACES[space]
            with_heads = tuple(layer for layer in space_layers if info.kind(layer).heads)
            if spec.per_head and with_heads and not (spec.head_writes and head_writes_note(info, space)):
                self.layers[space, "head"] = with_heads
            if spec.level == "sublayer":
                self.layers[space, "sublayer"] = space_layers
        self.sums = {
            key: torch.zeros(len(ls), self.units(key), len(_SUMS), dtype=torch.float64, device=device)
            for key, ls in self.layers.items()
        }

    def units(self, key: tuple[str, str]) -> int:
        """The unit axis of ``key``'s sums: 1 for a sublayer, else the most heads of its layers."""
        return 1 if key[1] == "sublayer" else max((self.info.output_heads(i) for i in self.layers[key]), default=0)

    def active(self, key: tuple[str, str], layer: int) -> bool:
        return key in self.layers and layer in self.layers[key]

    def add(self, key: tuple[str, str], layer: int, a: geometry.Alignment, real: Tensor) -> None:
        """Add the real positions t >= 1 of ``a`` (fields ``[batch, pos, unit]``; ``real [batch, pos]``)."""
        real = real[:, 1:, None].to(a.valid.device)
        valid = a.valid[:, 1:] & real
        w = valid.to(torch.float64)
        cos = a.cos[:, 1:]
        per_position = torch.stack([cos, cos * cos, a.par_frac[:, 1:], a.perp_frac[:, 1:], a.coef[:, 1:]], dim=-1)
        counts = torch.stack([valid, ~a.valid[:, 1:] & real], dim=-1).to(torch.float64)
        sums = torch.cat([counts.sum((0, 1)), (w[..., None] * per_position).sum((0, 1))], dim=-1)
        into = self.sums[key]
        into[self.layers[key].index(layer), : sums.shape[0]] += sums.to(into.device, non_blocking=True)

    def tables(self, sums: dict[tuple[str, str], np.ndarray]) -> tuple[AlignmentTable, ...]:
        out = []
        for (space, level), s in sums.items():
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


class _HeadWrites(NamedTuple):
    """What a layer's per-head residual writes m_h = u_h W_O[h] are measured from: W_O (float64), its Gram matrix
    (:func:`~lens_parallel.geometry.write_gram`, once per layer) and the heads' inputs u from the layer's captures
    (:func:`~lens_parallel.hooks.head_write_inputs`)."""

    W_O: Tensor
    gram: Tensor
    inputs: Callable[[Mapping[str, Tensor]], Tensor]

    @classmethod
    def of(cls, model: TransformerBridge, info: ModelInfo, layer: int) -> _HeadWrites:
        W_O = output_weights(model, info, layer, dtype=torch.float64)
        return cls(W_O, geometry.write_gram(W_O), head_write_inputs(model, info, layer))


def _reducer(acc: _Accumulator, spaces: tuple[Space, ...], writes: dict[int, _HeadWrites], real: Tensor) -> Reducer:
    """The reduction of one batch's captures into ``acc`` (``real``: the batch's real positions; ``writes``: per
    layer whose head writes are split, what they are measured from)."""
    info, eps = acc.info, acc.eps

    def reduce(layer: int, t: dict[str, Tensor]) -> None:
        parts = value_parts(t, info) if "v" in t or "lin_v" in t else None
        for space in spaces:
            spec = SPACES[space]
            if not acc.active((space, spec.level), layer):
                continue
            if spec.value:
                assert parts is not None  # v is captured for every value space (SpaceSpec.roles)
                acc.add((space, spec.level), layer, value_space(space).alignment(parts, eps=eps), real)
            else:
                m, x = residual_space(space).residual_message(t, info)
                a = geometry.alignment(m.unsqueeze(2), x.unsqueeze(2), eps=eps)
                acc.add((space, "sublayer"), layer, a, real)
                if acc.active((space, "head"), layer):
                    w = writes[layer]
                    z = w.inputs(t)
                    dot, mm = geometry.head_residual_dots(z, w.W_O, x), geometry.head_write_norms(z, w.gram)
                    rr = (x * x).sum(-1, keepdim=True).expand_as(dot)
                    acc.add((space, "head"), layer, geometry.alignment_from_products(dot, mm, rr, eps=eps), real)

    return reduce


class _AlignmentMetric(Metric[EditJob]):
    """The running sums of the alignment statistics of every (space, level), per layer and unit, over every
    document's real positions t >= 1 (summed over batches)."""

    name = "alignment"

    def __init__(
        self,
        info: ModelInfo,
        spaces: tuple[Space, ...],
        space_layers: dict[str, tuple[int, ...]],
        roles: dict[int, list[str]],
        writes: dict[int, _HeadWrites],
        eps: float,
    ) -> None:
        self.info, self.spaces, self.space_layers, self.roles, self.eps = info, spaces, space_layers, roles, eps
        self.writes = writes
        self.keys = list(_Accumulator(info, space_layers, eps).layers)

    def fingerprint(self) -> dict[str, Any]:
        return {"metric": self.name, "spaces": list(self.spaces), "eps": self.eps}

    def spec(self, job: EditJob) -> dict[str, ValueSpec]:
        acc = _Accumulator(self.info, self.space_layers, self.eps)
        return {f"{sp}|{level}": ValueSpec(tuple(acc.sums[sp, level].shape)) for sp, level in self.keys}

    def measure(self, context: TaskContext, plan: SweepPlan, jobs: Sequence[EditJob], batch: Batch) -> list[Values]:
        acc = _Accumulator(self.info, self.space_layers, self.eps, device=batch.docs.tokens.device)
        reduce = _reducer(acc, self.spaces, self.writes, batch.docs.real)
        run_rows(context.model, self.info, batch, capture=self.roles, reduce=reduce)
        return [{f"{sp}|{level}": sums.cpu().numpy() for (sp, level), sums in acc.sums.items()}]


@dataclass(frozen=True, kw_only=True)
class DecomposeSettings:
    """What a decomposition computes: the self-alignment statistics of every ``space`` (a list, or ``"all"``) on
    ``layers`` (None: all), guarding |m| and |r| by ``eps``.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.DecomposeSettings(space=("all",)).space[:2]
        ('value', 'value-exclude-self')
    """

    space: tuple[Space, ...] = field(default=("value",), metadata={"help": "spaces (or all)", "also": ("all",)})
    layers: tuple[int, ...] | None = field(default=None, metadata={"help": "layers", "none": "all"})
    eps: float = field(default=geometry.EPS, metadata={"help": "guard on |m| and |r|"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "space", _normalise_spaces(self.space))
        object.__setattr__(self, "layers", as_indices(self.layers))
        check_eps(self.eps)


@long_call
def decompose(
    model: TransformerBridge,
    documents: DocumentsLike,
    *,
    settings: DecomposeSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> DecompositionResult:
    """Self-alignment of head outputs / residual updates in one or more spaces, in a single streamed pass of the
    engine (:class:`DecomposeSettings`: ``space`` one of ``value``, ``value-exclude-self``, ``value-merged``,
    ``residual-attn``, ``residual-mlp``, ``residual-block``, a list of them, or ``"all"``, every space from the same
    forward; ``layers``; ``eps``. Run options :class:`~lens_parallel.options.RunOptions`; both as keyword shortcuts).

    Returns :class:`DecompositionResult`: per (space, level) an :class:`AlignmentTable` with, per layer and head,
    the mean self-cosine cos(m, r), its std, mean |m_par|/|m|, mean |m_perp|/|m| and the mean signed parallel
    coefficient m.r/|r|^2, over every document's real positions t >= 1 (documents of different lengths included).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> result = lp.decompose(model, docs, space=["value", "residual-attn"], progress=False)
        >>> result.table("value", "head").self_cos.shape  # layers x heads
        (3, 4)
        >>> text = lp.decompose(model, ["The cat sat on the mat.", "A dog ran."], progress=False)  # text works too
    """
    info = check_model(model)
    s, opts = resolve(DecomposeSettings, settings, options, protocol, changes)
    docs = Documents.of(documents, model)
    layer_idx = check_indices("layers", s.layers, info.n_layers)
    space_layers: dict[str, tuple[int, ...]] = {}
    skipped: list[str] = []
    for space in s.space:
        defined = tuple(layer for layer in layer_idx if SPACES[space].defined_at(info, layer))
        if missing := [layer for layer in layer_idx if layer not in defined]:
            skipped.append(f"{space} skipped at layers {missing}: {SPACES[space].undefined_reason(info, missing)}")
        if defined:
            space_layers[space] = defined
    if not space_layers:
        raise LensParallelError(f"{info.name}: no space asked for is defined on layers {list(layer_idx)}: {skipped}")
    writes = any(SPACES[sp].head_writes for sp in s.space)
    if writes and (note := head_writes_note(info, "the per-head level of residual-attn")):
        skipped.append(note)
    for note in skipped:
        warnings.warn(note, stacklevel=2)
    acc = _Accumulator(info, space_layers, s.eps)
    roles = {
        layer: [
            r
            for sp in s.space
            if layer in space_layers.get(sp, ())
            for r in SPACES[sp].roles(info, layer, heads=acc.active((sp, "head"), layer))
        ]
        for layer in layer_idx
    }
    roles = {layer: list(dict.fromkeys(r)) for layer, r in roles.items() if r}
    written = (ls for (sp, level), ls in acc.layers.items() if level == "head" and SPACES[sp].head_writes)
    heads = sorted({layer for ls in written for layer in ls})  # the layers whose heads' residual writes are split
    head_writes = {layer: _HeadWrites.of(model, info, layer) for layer in heads}
    spaces = tuple(sp for sp in s.space if sp in space_layers)
    metric = _AlignmentMetric(info, spaces, space_layers, roles, head_writes, s.eps)
    job = EditJob("unedited", ())
    run = run_sweep(model, docs, [job], metric=metric, options=opts, desc="decompose")
    values = run.value(job)
    tables = acc.tables({key: values[f"{key[0]}|{key[1]}"] for key in acc.sums})
    provenance = Provenance.of(
        info,
        docs,
        "decompose",
        s,
        run,
        layers=list(layer_idx),
        positions="1 <= t < length (position 0 excluded)",
        skipped=skipped,
    )
    return DecompositionResult(tables=tables, provenance=provenance)


def _printed(result: DecompositionResult, s: DecomposeSettings, display: None) -> tuple[str, pd.DataFrame]:
    shown = result.to_dataframe().groupby(["space", "level"])[["self_cos", "par_frac", "perp_frac", "par_coef"]]
    return f"{result.info.name}: means over layers and heads, positions t >= 1", shown.mean().round(4)


ANALYSIS = Analysis(
    "decompose",
    "self-alignment of head outputs and residual updates",
    decompose,
    DecomposeSettings,
    DecompositionResult,
    _printed,
)
"""This analysis, as :data:`~lens_parallel.analyses.registry.MODULES` finds it."""
