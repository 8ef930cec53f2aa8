"""Hook names and shapes: the role each hook point plays (:data:`ROLE_HOOKS`), the checks of what a hook
hands over, the layers and heads an analysis may ask for, and the weights and inputs a head writes through."""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, cast

import torch
import torch.utils.checkpoint
from jaxtyping import Float
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat, geometry
from lens_parallel.attention import GATES
from lens_parallel.errors import LensParallelError, LibraryError
from lens_parallel.geometry import expand_kv as expand_kv  # where the analyses and edits import it from
from lens_parallel.layers import BLOCK_HOOKS
from lens_parallel.models import ModelInfo

Hook = tuple[str, Callable[..., Tensor | None]]
"""A TransformerLens forward hook: the full hook name and ``fn(tensor, hook)`` returning a replacement or None."""

ROLE_HOOKS: dict[str, str] = {
    **{role: "blocks.{layer}." + name for role, name in BLOCK_HOOKS.items()},
    "q": "blocks.{layer}.attn.hook_q",
    "k": "blocks.{layer}.attn.hook_k",
    "rot_q": "blocks.{layer}.attn.hook_rot_q",
    "rot_k": "blocks.{layer}.attn.hook_rot_k",
    "v": "blocks.{layer}.attn.hook_v",
    "pattern_diag": "blocks.{layer}.attn.hook_pattern",
    "pattern_full": "blocks.{layer}.attn.hook_pattern",
    "z": "blocks.{layer}.attn.hook_z",
    **{role: "blocks.{layer}." + gate.hook for role, gate in GATES.items()},
    "lin_q": "blocks.{layer}.linear_attn.hook_q",
    "lin_k": "blocks.{layer}.linear_attn.hook_k",
    "lin_v": "blocks.{layer}.linear_attn.hook_v",
    "lin_beta": "blocks.{layer}.linear_attn.hook_beta",
    "lin_decay": "blocks.{layer}.linear_attn.hook_log_decay",
    "lin_o": "blocks.{layer}.linear_attn.hook_recurrence_out",
    "lin_gate": "blocks.{layer}.linear_attn.hook_gate_input",
    "lin_out": "blocks.{layer}.linear_attn.hook_out",
}
"""Activation roles and their TransformerLens hook names. ``pattern_diag`` is kept as its diagonal A_tt only,
``pattern_full`` as the whole map (both read hook_pattern); ``rot_q``/``rot_k`` are queries/keys after rotary (and after
Qwen3's q/k norms). ``lin_q``/``lin_k``/``lin_v``: a linear-attention block's queries, keys (per key head) and values
(per value head) after its causal convolution, before the kernel's L2 normalisation; ``lin_beta``: its write strength
beta_t per value head; ``lin_decay``: its log decay g_t (negative) per value head; ``lin_o``: the delta rule's output
o_t per value head (before the gated RMSNorm); ``lin_gate``: the gate z of its gated RMSNorm, ``norm(o) * silu(z)``, per
value head; ``lin_out``: the block's linear-attention output, added to the residual (a linear layer's counterpart of
``attn_out``)."""


def effective_qk_roles(info: ModelInfo) -> tuple[str, str]:
    """The roles holding the queries and keys attention uses: after rotary (and Qwen3's q/k norms) where the bridge
    fires them (:attr:`ModelInfo.rotary_hooks`). GPT-NeoX's, Falcon's and GPT-J's bridges do not fire
    hook_rot_q/k, so they use hook_q/hook_k, which differ from the rotated vectors by a per-position rotation: norms
    and distances (all that relative changes use) agree."""
    return ("rot_q", "rot_k") if info.rotary_hooks else ("q", "k")


RENAMED_ROLES = {"pattern": "pattern_diag (its diagonal A_tt) or pattern_full (the whole map)"}
"""Roles renamed, with their new names (an old one is refused in one line)."""


BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.")
"""The start of a hook name inside a block (``blocks.3.``): its group 1 is the block's index."""


def block_of(name: str) -> int | None:
    """The block a full hook name sits in (``blocks.3.attn.hook_z`` -> 3), None outside the blocks (hook_embed)."""
    found = BLOCK_NAME.match(name)
    return None if found is None else int(found.group(1))


def hook_name(layer: int, role: str) -> str:
    """The full hook name of ``role`` at ``layer``."""
    if role not in ROLE_HOOKS:
        if role in RENAMED_ROLES:
            raise LensParallelError(f"the role {role!r} is now {RENAMED_ROLES[role]}")
        raise LensParallelError(f"unknown role {role!r}; roles: {', '.join(ROLE_HOOKS)}")
    return ROLE_HOOKS[role].format(layer=layer)


class HookShapeError(LibraryError):
    """A captured activation does not have the shape the analysis expects (a TransformerLens incompatibility)."""


def expected_shape(role: str, info: ModelInfo) -> tuple[tuple[str, int | None], ...]:
    """Named expected shape of a role's activation (None: any size)."""
    batch, pos = ("batch", None), ("pos", None)
    if role in ("v", "k", "rot_k"):
        return batch, pos, ("n_kv_heads", info.n_kv_heads), ("d_head", info.d_head)
    if role in ("z", "q", "rot_q"):
        return batch, pos, ("n_heads", info.n_heads), ("d_head", info.d_head)
    if role in ("pattern_diag", "pattern_full"):
        return batch, ("n_heads", info.n_heads), ("query_pos", None), ("key_pos", None)
    if role in ("lin_q", "lin_k", "lin_v", "lin_o", "lin_gate"):
        return batch, pos, ("heads", None), ("d_head", None)
    if role in ("lin_beta", "lin_decay"):
        return batch, pos, ("n_linear_heads", info.n_linear_heads)
    if role in GATES:
        return batch, pos, *GATES[role].dims(info.n_heads, info.d_head)
    return batch, pos, ("d_model", info.d_model)


def check_shape(name: str, tensor: Tensor, expected: Sequence[tuple[str, int | None]]) -> None:
    """Raise :class:`HookShapeError` naming the hook, the expected and the actual shape."""
    ok = tensor.ndim == len(expected) and all(
        size is None or tensor.shape[i] == size for i, (_, size) in enumerate(expected)
    )
    if not ok:
        want = ", ".join(dim if size is None else f"{dim}={size}" for dim, size in expected)
        raise HookShapeError(f"hook {name}: expected shape [{want}], got {tuple(tensor.shape)}")


def check_indices(kind: str, given: int | Sequence[int] | None, n: int) -> tuple[int, ...]:
    """Validate layer or head indices against a model with ``n`` of them: None means all (0..n-1); an int or a
    sequence gives a sorted tuple without repeats, a negative index counting from the end as TransformerLens and
    Python read it (-1 is the last). Raises ``ValueError`` naming the bad indices and the range."""
    if given is None:
        return tuple(range(n))
    items: list[Any] = [given] if isinstance(given, numbers.Integral) else list(cast(Iterable[Any], given))
    bad = [i for i in items if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not -n <= int(i) < n]
    if bad or not items:
        raise LensParallelError(
            f"{kind} {bad or items} out of range: this model has {kind} 0..{n - 1} (or -{n}..-1 from the end)"
        )
    return tuple(sorted({int(i) % n for i in items}))


def check_heads(info: ModelInfo, layer: int, heads: int | Sequence[int] | None) -> tuple[int, ...]:
    """:func:`check_indices` of ``heads`` against ``layer``'s own heads (:meth:`ModelInfo.output_heads`): query heads,
    or on a linear-attention layer its value heads, which the error then says; a layer without heads raises."""
    kind = info.kind(layer)
    if not kind.heads:
        raise LensParallelError(f"layer {layer} of {info.name} is a {kind.title} layer: it has no heads")
    try:
        return check_indices("heads", heads, kind.output_heads(info))
    except LensParallelError as error:
        if kind.pattern:
            raise
        raise LensParallelError(
            f"{error} at layer {layer}, a {kind.title} layer (its heads are {kind.unit}s)"
        ) from None


def layers_where(
    info: ModelInfo,
    layers: int | Sequence[int] | None,
    has: Callable[[int], bool],
    *,
    needs: str,
    what: str,
) -> tuple[tuple[int, ...], str]:
    """The layers among ``layers`` for which ``has(layer)`` (what ``what`` ``needs``, in words), and a note on what
    it skips.

    ``layers=None``: every such layer; the others are skipped and the note says which, of which kinds, and why
    (empty when nothing is skipped). Named layers without it raise ``ValueError`` naming their kinds and the layers
    that have it; so does a model none of whose layers has it."""
    chosen = check_indices("layers", layers, info.n_layers)
    without = [layer for layer in chosen if not has(layer)]
    kinds = ", ".join(sorted({info.kind(layer).title for layer in without}))
    if without and layers is not None:
        able = [layer for layer in range(info.n_layers) if has(layer)]
        raise LensParallelError(
            f"{what} needs {needs}, but layers {without} of {info.name} ({kinds}) have none; layers that have it: "
            f"{able}"
        )
    if len(without) == len(chosen):
        raise LensParallelError(f"{what} needs {needs}, but no layer of {info.name} has it (its layers: {kinds})")
    note = f"skipped layers {without} ({kinds}): {what} needs {needs}" if without else ""
    return tuple(layer for layer in chosen if has(layer)), note


def softmax_layers(info: ModelInfo, layers: int | Sequence[int] | None, *, what: str) -> tuple[tuple[int, ...], str]:
    """:func:`layers_where` a layer has softmax attention: the layers an analysis needing hook_z and hook_pattern runs
    on."""
    needs = "softmax attention (hook_z, hook_pattern)"
    return layers_where(info, layers, lambda layer: info.kind(layer).pattern, needs=needs, what=what)


def head_layers(info: ModelInfo, layers: int | Sequence[int] | None, *, what: str) -> tuple[tuple[int, ...], str]:
    """:func:`layers_where` a layer has heads: the layers a per-head analysis (the value spaces, head ablations) runs
    on."""
    needs = "heads (softmax or linear attention)"
    return layers_where(info, layers, lambda layer: info.kind(layer).heads, needs=needs, what=what)


def output_weights(
    model: TransformerBridge, info: ModelInfo, layer: int, *, dtype: torch.dtype | None = None
) -> Float[Tensor, "head_index d_head d_model"]:
    """W_O of ``layer`` (a detached copy, in ``dtype`` when given), also when accelerate has offloaded that layer's
    weights to CPU or disk (``load_model(..., device_map=...)``): they are materialised for the read. On a
    linear-attention layer its output projection per value head, ``out_proj.weight`` as ``[head, d_v, d_model]``."""
    weights = info.kind(layer).output_weights(model, info, layer)
    return weights if dtype is None else weights.to(dtype)


def linear_head_inputs(model: TransformerBridge, layer: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``(o, z) -> u``: a linear-attention layer's per-head input to its output projection from its delta-rule
    output o (hook_recurrence_out) and gate z (hook_gate_input), the layer's own gated RMSNorm
    (:func:`lens_parallel.geometry.gated_rms_norm` with its weight and eps); u_h W_O[h] (:func:`output_weights`) is
    head h's write to the residual."""
    norm: Any = compat.hf_module(model.blocks[layer].linear_attn).norm
    weight, eps = norm.weight.detach().clone(), float(norm.variance_epsilon)
    return partial(geometry.gated_rms_norm, weight=weight, eps=eps)


def head_write_inputs(
    model: TransformerBridge, info: ModelInfo, layer: int
) -> Callable[[Mapping[str, Tensor]], Tensor]:
    """``captured -> u``: each head's input to ``layer``'s output projection ``[batch, pos, head, d_head]`` from the
    roles its kind's head writes are formed from (:attr:`~lens_parallel.layers.LayerKind.head_roles`): hook_z on
    softmax attention; on linear attention the gated RMSNorm of o and the gate (:func:`linear_head_inputs`). u_h
    W_O[h] (:func:`output_weights`) is head h's write to the residual."""
    roles = info.kind(layer).head_roles
    if roles == ("z",):
        return lambda captured: captured["z"]
    norm = linear_head_inputs(model, layer)
    return lambda captured: norm(*(captured[role] for role in roles))


def head_writes_note(info: ModelInfo, what: str) -> str:
    """Why ``what`` (anything built on one head's write z_h W_O[h] to the residual) is undefined on this model, or
    "" when it is defined. With a post-attention norm (Gemma 3) the attention output of all heads together is
    RMS-normalised before the residual add, so a single head's write is not a term of the residual update."""
    if not info.post_norm:
        return ""
    return (
        f"{what} is undefined on {info.name}: its attention output is RMS-normalised over all heads together before "
        "the residual add (post-attention norm), so one head's write z_h W_O[h] is not a term of the residual update; "
        "the value spaces and the whole residual-attn sublayer (no heads) are defined"
    )


def check_head_writes(info: ModelInfo, what: str) -> None:
    """Raise :class:`LensParallelError` with :func:`head_writes_note` when per-head residual writes are undefined."""
    if note := head_writes_note(info, what):
        raise LensParallelError(note)


def check_not_gated(info: ModelInfo, what: str, *, alternative: str = "") -> None:
    """Raise :class:`LensParallelError` for ``what`` on gated attention (Qwen3.5), where hook_z is
    sigmoid(gate) * (A v): a head's write is not A v, so edits defined on it are undefined there."""
    if info.gated_attention:
        tail = f"; {alternative}" if alternative else ""
        raise LensParallelError(f"{what} is not defined for gated attention (hook_z is sigmoid(gate) * A v){tail}")


def residual_reference_role(info: ModelInfo, sublayer: str) -> str:
    """The residual state a sublayer's update is added to: resid_pre for attention, for parallel attn/MLP blocks
    and for the whole block; resid_mid for a sequential MLP."""
    return "resid_mid" if sublayer == "mlp" and not info.parallel_attn_mlp else "resid_pre"
