"""Next-layer head dominance: how many upstream heads shape each head of the next layer.

For each adjacent layer pair (l, l+1) and each upstream head u of layer l, remove u's output (its hook_z, whole
sequence, zeroed) and recompute only up to layer l+1's effective queries, keys and values (after norms, rotary
and Qwen3's q/k norms; keys and values per kv head, GQA slots not counted twice). Per receiving query head g and
query token t:

    rel_q = |q'_g - q_g| / |q_g|,  rel_k, rel_v likewise for g's kv head,
    combined = sqrt(|dq_g|^2 + |dk|^2 + |dv|^2) / sqrt(|q_g|^2 + |k|^2 + |v|^2),
    js = Jensen-Shannon divergence of g's attention row at t (sqrt(js) is a distance).

Concentration per (text, receiving head, pair) is computed from the token-averaged combined effect of each upstream
head (``stats.concentration``: effective number exp(H), effective fraction, normalised concentration, top/bottom
25% share, heads for 90%). Joint controls remove the weak half, the strong half and a random half (same size) of the
upstream heads, chosen per (text, receiving head) from the single-head effects, and measure the joint effect.
Every forward resumes at layer l from the cached residual (earlier blocks not computed) and stops after layer l+1's
attention pattern. The random half of each (text, receiving head) is drawn from ``default_rng([seed, l, text])``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import einops
import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.data import TokenBlocks, document_batches
from lens_parallel.edits import HeadEdit
from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import LayerStream, check_indices, effective_qk_roles, hook_name
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.plots.dominance import dominance_figure
from lens_parallel.results import Provenance, ResultMixin, as_tokens, serializable
from lens_parallel.stats import concentration

JOINT = ("weak", "strong", "random")


@serializable
@dataclass(frozen=True)
class DominanceResult(ResultMixin):
    """Raw per-head effects and joint controls.

    ``rel_q``, ``combined``, ``js``: ``[pair, text, upstream_head, query_pos, receiving_head]``; ``rel_k``, ``rel_v``:
    ``[..., key_head]`` / ``[..., value_head]``; ``joint``: ``[pair, text, receiving_head, 3]`` for the weak, strong
    and random half (token-averaged combined effect). ``query_positions`` are the token positions scored.
    Receiving heads are query heads of a softmax layer and value heads of a linear-attention layer
    (``receiving_types``); where pairs differ in head counts the arrays are NaN-padded.
    """

    joint_kinds: ClassVar[tuple[str, ...]] = JOINT

    layer_pairs: tuple[tuple[int, int], ...]
    query_positions: tuple[int, ...]
    receiving_types: tuple[str, ...]
    rel_q: np.ndarray
    rel_k: np.ndarray
    rel_v: np.ndarray
    combined: np.ndarray
    js: np.ndarray
    joint: np.ndarray
    provenance: Provenance

    def concentration(self) -> dict[str, np.ndarray]:
        """Concentration metrics ``[pair, text, receiving_head]`` of the token-averaged single-head effects."""
        effects = einops.rearrange(self.combined.mean(3), "pair text up recv -> pair text recv up")
        return concentration(effects)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (layer pair, text, receiving head): concentration metrics, joint controls, strong/weak."""
        metrics = self.concentration()
        rows = []
        for p, (up, recv) in enumerate(self.layer_pairs):
            for i in range(self.joint.shape[1]):
                for g in range(self.joint.shape[2]):
                    weak, strong, rand = self.joint[p, i, g]
                    if np.isnan(self.joint[p, i, g]).all():
                        continue  # padding: this receiving layer has fewer heads
                    rows.append(
                        {
                            "model": self.info.name,
                            "upstream_layer": up,
                            "receiving_layer": recv,
                            "receiving_type": self.receiving_types[p],
                            "text": i,
                            "receiving_head": g,
                            "label": f"L{recv}H{g}",
                            **{k: v[p, i, g] for k, v in metrics.items()},
                            "joint_weak": weak,
                            "joint_strong": strong,
                            "joint_random": rand,
                            "strong_weak_ratio": strong / weak if weak > 0 else np.nan,
                            "mean_js": self.js[p, i, :, :, g].mean(),  # NaN for linear attention (no softmax)
                            "mean_js_distance": np.sqrt(self.js[p, i, :, :, g]).mean(),
                        }
                    )
        return pd.DataFrame(rows)

    def summary(self) -> pd.DataFrame:
        """One row: means over every (pair, text, receiving head) of the concentration metrics and joint effects."""
        df = self.to_dataframe()
        columns = ["effective_fraction", "top25_share", "heads_for_90", "joint_weak", "joint_strong", "joint_random"]
        return pd.DataFrame([{"model": self.info.name, "n_pairs": len(self.layer_pairs), **df[columns].mean()}])

    def figure(self):
        return dominance_figure(self)


def _positions(query_positions: slice | Sequence[int], seq_len: int) -> tuple[int, ...]:
    if isinstance(query_positions, slice):
        positions = tuple(range(seq_len)[query_positions])
        if not positions:
            raise LensParallelError(
                f"query_positions {query_positions} selects no position of sequences of {seq_len} tokens"
            )
        return positions
    positions = tuple(int(t) for t in query_positions)
    bad = [t for t in positions if not 0 <= t < seq_len]
    if bad or not positions:
        raise LensParallelError(
            f"query_positions {list(bad or positions)} out of range: sequences have {seq_len} tokens"
        )
    return positions


class _Receiver:
    """Runs forwards from layer l's residual with upstream heads zeroed; returns layer l+1's effective q, k, v
    (and the attention pattern for softmax layers).

    Receiving heads: query heads of a softmax layer (k, v from their kv head); value heads of a linear-attention
    layer (q, k from their key head). ``index`` maps each receiving head to its q, k and v head.
    """

    def __init__(self, model: TransformerBridge, info: ModelInfo, up: int) -> None:
        self.model, self.info, self.up, self.recv = model, info, up, up + 1
        self.kind = info.layer_types[self.recv]
        if self.kind == "softmax":
            self.roles = (*effective_qk_roles(info), "v", "pattern_full")
        else:
            self.roles = ("lin_q", "lin_k", "lin_v")

    def __call__(self, tokens: Tensor, resid: Tensor, mask: Tensor | None) -> dict[str, Tensor | None]:
        out: dict[str, Tensor] = {}
        stream = LayerStream(self.info, [self.recv], self.roles, lambda _, t: out.update(t))
        edit = [] if mask is None else HeadEdit("zero", self.up, mask).hooks(self.model, self.info)
        stream.run(self.model, tokens, edit_hooks=edit, resid=resid, start_at_layer=self.up)
        q, k, v = (out[role] for role in self.roles[:3])
        return {"q": q, "k": k, "v": v, "pattern": out.get("pattern_full")}

    def index(self, base: dict[str, Tensor | None]) -> tuple[list[int], list[int], list[int]]:
        n_q, n_k, n_v = (base[key].shape[2] for key in ("q", "k", "v"))
        n_recv = n_q if self.kind == "softmax" else n_v
        return tuple([r * n // n_recv for r in range(n_recv)] for n in (n_q, n_k, n_v))


def _effects(base: dict, new: dict, index: tuple[list[int], list[int], list[int]], positions: list[int]) -> dict:
    """Per-row effects at the query positions: rel_q/combined/js ``[row, pos, receiving head]``, rel_k/rel_v per
    key / value head (each counted once, not once per GQA slot). js is NaN for linear attention (no softmax)."""
    qi, ki, vi = index
    q, k, v = (base[key][:, positions] for key in ("q", "k", "v"))
    q2, k2, v2 = (new[key][:, positions] for key in ("q", "k", "v"))
    num = sum((b[:, :, i] - a[:, :, i]).pow(2).sum(-1) for a, b, i in ((q, q2, qi), (k, k2, ki), (v, v2, vi)))
    den = sum(a[:, :, i].pow(2).sum(-1) for a, i in ((q, qi), (k, ki), (v, vi)))
    if base["pattern"] is not None:
        rows_base = einops.rearrange(base["pattern"][:, :, positions], "b h p k -> b p h k")
        rows_new = einops.rearrange(new["pattern"][:, :, positions], "b h p k -> b p h k")
        js = geometry.js_divergence(rows_new, rows_base)
    else:
        js = torch.full(num.shape, float("nan"), dtype=num.dtype)
    return {
        "rel_q": geometry.relative_change(q2, q)[:, :, qi],
        "rel_k": geometry.relative_change(k2, k),
        "rel_v": geometry.relative_change(v2, v),
        "combined": torch.sqrt(num / den.clamp_min(1e-30)),
        "js": js,
    }


def _pad(arrays: list[np.ndarray]) -> np.ndarray:
    """Stack per-pair arrays whose last axis (receiving / key / value heads) differs, padding with NaN."""
    width = max(a.shape[-1] for a in arrays)
    return np.stack(
        [np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])], constant_values=np.nan) for a in arrays]
    )


def _tile(t: Tensor | None, r: int, pattern: str) -> Tensor | None:
    return None if t is None else einops.repeat(t, pattern, r=r)


def _single_effects(receive: _Receiver, tokens: Tensor, resid: Tensor, base: dict, index, positions) -> dict:
    """Every upstream head removed alone (row (u, b) removes head u in text b): effects ``[text, upstream, pos,
    receiving]`` (rel_k / rel_v per key / value head)."""
    h = receive.info.n_heads
    mask = einops.repeat(torch.eye(h, dtype=torch.bool), "u h -> (u b) h", b=len(tokens))
    tiled = {key: _tile(t, h, "b ... -> (r b) ...") for key, t in base.items()}
    ablated = receive(_tile(tokens, h, "b p -> (r b) p"), _tile(resid, h, "b p d -> (r b) p d"), mask)
    single = _effects(tiled, ablated, index, positions)
    return {k: einops.rearrange(v.double().cpu().numpy(), "(u b) j g -> b u j g", u=h) for k, v in single.items()}


def _joint_masks(combined: np.ndarray, texts: range, *, seed: int, up: int) -> Tensor:
    """Per (text, receiving head): the weak, strong and a random half of the upstream heads, ``[text, receiving,
    3, upstream]``; weak/strong from the token-averaged single-head effects ``combined [text, upstream, pos, recv]``,
    the random half drawn from ``default_rng([seed, up, text])`` (independent of how texts are batched)."""
    n, h, _, n_recv = combined.shape
    half = h // 2
    order = np.argsort(combined.mean(2), axis=1)  # [text, upstream (ascending), recv]
    masks = torch.zeros(n, n_recv, len(JOINT), h, dtype=torch.bool)
    for b, text in enumerate(texts):
        rng = np.random.default_rng([seed, up, text])
        for g in range(n_recv):
            masks[b, g, 0, order[b, :half, g]] = True
            masks[b, g, 1, order[b, h - half :, g]] = True
            masks[b, g, 2, rng.choice(h, size=half, replace=False)] = True
    return masks


def _joint_effects(
    receive: _Receiver, tokens: Tensor, resid: Tensor, base: dict, index, positions, masks
) -> np.ndarray:
    """The measured combined effect of removing each mask's heads together, token-averaged, read at each row's
    own receiving head: ``[text, receiving, 3]``."""
    n_recv, n_joint = masks.shape[1], masks.shape[2]
    r = n_recv * n_joint
    rows = einops.rearrange(masks, "b g c u -> (b g c) u")
    expand = {key: _tile(t, r, "b ... -> (b r) ...") for key, t in base.items()}
    joint_new = receive(_tile(tokens, r, "b p -> (b r) p"), _tile(resid, r, "b p d -> (b r) p d"), rows)
    combined = _effects(expand, joint_new, index, positions)["combined"].mean(1)  # [(b g c), recv]
    combined = einops.rearrange(combined.double().cpu().numpy(), "(b g c) r -> b g c r", g=n_recv, c=n_joint)
    return np.einsum("bgcg->bgc", combined)


def _upstream_layers(info: ModelInfo, upstream_layers) -> tuple[list[int], list[int]]:
    chosen = check_indices("upstream layers", upstream_layers, info.n_layers - 1)
    ups = [up for up in chosen if info.layer_types[up] == "softmax"]
    if not ups:
        raise LensParallelError(
            f"no layer pair with a softmax-attention upstream layer among upstream layers {list(chosen)}"
        )
    if info.n_heads < 2:
        raise LensParallelError("head dominance needs at least 2 heads per layer")
    return ups, [up for up in chosen if up not in ups]


def head_dominance(
    model: TransformerBridge,
    tokens: TokenBlocks | Int[Tensor, "batch pos"],
    *,
    query_positions: slice | Sequence[int] = slice(7, None),
    upstream_layers: int | Sequence[int] | None = None,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
) -> DominanceResult:
    """Dominance of upstream heads over the next layer's heads, for every pair (l, l+1) with l in
    ``upstream_layers`` (default: all but the last layer). ``query_positions``: the receiving tokens scored.

    The upstream layer must have softmax attention (a head's hook_z is what is removed): pairs whose upstream
    layer is a linear-attention block (Qwen3.5) are skipped, and the result's provenance lists them. Receiving
    layers of either type are handled (``receiving_types``); arrays are NaN-padded where head counts differ.
    Texts are processed ``batch_size`` at a time (each text is tiled once per upstream head in a forward); one
    unedited forward per batch gives every pair's resid_pre.
    """
    info = model_info(model)
    toks = as_tokens(tokens)
    positions = list(_positions(query_positions, toks.shape[1]))
    ups, skipped = _upstream_layers(info, upstream_layers)
    receivers = {up: _Receiver(model, info, up) for up in ups}
    names = [hook_name(up, "resid_pre") for up in ups]
    per_pair = {up: {key: [] for key in ("rel_q", "rel_k", "rel_v", "combined", "js", "joint")} for up in ups}
    batches = document_batches(toks, batch_size)
    bar = tqdm(total=len(ups) * -(-len(toks) // batch_size), desc="dominance", unit="pair", disable=not progress)
    for rows, batch in batches:
        with torch.inference_mode():
            _, cache = model.run_with_cache(batch, names_filter=names, stop_at_layer=max(ups) + 1)
        for up, receive in receivers.items():
            resid = cache[hook_name(up, "resid_pre")]
            base = receive(batch, resid, None)
            index = receive.index(base)
            single = _single_effects(receive, batch, resid, base, index, positions)
            masks = _joint_masks(single["combined"], range(rows.start, rows.stop), seed=seed, up=up)
            single["joint"] = _joint_effects(receive, batch, resid, base, index, positions, masks)
            for key, value in single.items():
                per_pair[up][key].append(value)
            bar.update(1)
    bar.close()
    note = f"skipped upstream linear-attention layers {skipped}: a head's hook_z is what is removed" if skipped else ""
    if note:
        warnings.warn(note, stacklevel=2)
    provenance = Provenance.collect(
        info,
        tokens,
        analysis="head_dominance",
        upstream_layers=list(ups),
        query_positions=positions,
        seed=seed,
        batch_size=batch_size,
        ablation="zero hook_z of one upstream head over the whole sequence",
        skipped=note,
    )
    arrays = {key: [np.concatenate(per_pair[up][key]) for up in ups] for key in per_pair[ups[0]]}
    joint = arrays.pop("joint")
    return DominanceResult(
        layer_pairs=tuple((up, up + 1) for up in ups),
        query_positions=tuple(positions),
        receiving_types=tuple(receivers[up].kind for up in ups),
        joint=_pad([np.moveaxis(j, 1, -1) for j in joint]).transpose(0, 1, 3, 2),
        provenance=provenance,
        **{key: _pad(v) for key, v in arrays.items()},
    )
