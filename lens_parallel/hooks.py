"""Hook names, shape checks, GQA expansion and streaming (reduce-in-the-forward) capture.

Nothing here changes an activation: interventions live in ``edits.py``. A :class:`LayerStream` captures only the
hooks an analysis asks for, hands each layer's tensors to a reducer as soon as the layer is complete, drops them,
and stops the forward after the last layer it needs (nothing past it is computed). No forward here computes the
logits: each ends at the unembedding's input (:func:`run_to_final`).
"""

from __future__ import annotations

import contextlib
import numbers
import re
import threading
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, cast

import torch
import torch.utils.checkpoint
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat, geometry, observers
from lens_parallel.attention import GATES, QUERY_BLOCK, Diagonal, rows_hook
from lens_parallel.errors import LensParallelError, LibraryError, NonFiniteError
from lens_parallel.geometry import expand_kv as expand_kv  # where the analyses and edits import it from
from lens_parallel.kept import kept
from lens_parallel.layers import BLOCK_HOOKS
from lens_parallel.models import ModelInfo, model_info

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
    model: TransformerBridge, layer: int, *, dtype: torch.dtype | None = None
) -> Float[Tensor, "head_index d_head d_model"]:
    """W_O of ``layer`` (a detached copy, in ``dtype`` when given), also when accelerate has offloaded that layer's
    weights to CPU or disk (``load_model(..., device_map=...)``): they are materialised for the read. On a
    linear-attention layer its output projection per value head, ``out_proj.weight`` as ``[head, d_v, d_model]``."""
    info = model_info(model)
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


def head_write_inputs(model: TransformerBridge, layer: int) -> Callable[[Mapping[str, Tensor]], Tensor]:
    """``captured -> u``: each head's input to ``layer``'s output projection ``[batch, pos, head, d_head]`` from the
    roles its kind's head writes are formed from (:attr:`~lens_parallel.layers.LayerKind.head_roles`): hook_z on
    softmax attention; on linear attention the gated RMSNorm of o and the gate (:func:`linear_head_inputs`). u_h
    W_O[h] (:func:`output_weights`) is head h's write to the residual."""
    roles = model_info(model).kind(layer).head_roles
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


@contextlib.contextmanager
def model_lock(model: TransformerBridge) -> Iterator[None]:
    """The lock of one model's forwards (re-entrant, kept on the model): its hooks and patched blocks are that
    model's shared state, so forwards of one model from several threads take turns, while forwards of different
    models run at once. Inside, the forward is lens_parallel's (:func:`lens_parallel.observers.analysing`: hooks the
    user left on the bridge are watched)."""
    with kept(model, "lock", threading.RLock), observers.analysing(model):
        yield


def _passthrough(hidden_states: Any, *args: object, **kwargs: object) -> Any:
    return hidden_states


@contextlib.contextmanager
def _passing_through(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Each module's forward replaced by the identity on its first argument while inside (re-entrant: nested
    contexts count per module, :data:`_SKIP_DEPTH`)."""
    for module in modules:
        count = _SKIP_DEPTH.get(id(module), 0)
        if count == 0:
            module.forward = _passthrough
        _SKIP_DEPTH[id(module)] = count + 1
    try:
        yield
    finally:
        for module in modules:
            _SKIP_DEPTH[id(module)] -= 1
            if _SKIP_DEPTH[id(module)] == 0:
                del _SKIP_DEPTH[id(module)]
                del module.forward


_SKIP_DEPTH: dict[int, int] = {}
"""How many :func:`skip_blocks_before` contexts hold each skipped module (by id, while they hold it)."""


@contextlib.contextmanager
def skip_blocks_before(model: TransformerBridge, layer: int) -> Iterator[None]:
    """Make blocks ``0..layer-1`` return their input untouched, for a forward with ``start_at_layer=layer``.

    TransformerLens 4.3's ``start_at_layer`` still runs every earlier block and then swaps the caller's residual
    in at ``layer``, so reusing a cached prefix saves nothing by itself (there is no supported way to skip them).
    Inside this context the earlier blocks' Hugging Face layers (which in transformers 5 return the bare
    hidden-state tensor) are skipped; their output was discarded anyway, so the forward's result is unchanged
    (tested against the full forward on every toy family). Re-entrant (nested contexts count per block) and
    thread-safe (the model's lock, :func:`model_lock`, held for the context's duration: forwards of the same model
    in other threads wait); the installed TransformerLens is checked first (:data:`lens_parallel.compat.CHECKED`).
    """
    compat.check("transformer-lens")
    with model_lock(model), _passing_through([compat.hf_module(model.blocks[i]) for i in range(layer)]):
        yield


FINAL_HOOK = "unembed.hook_in"
"""Where the final normalised residual enters the unembedding: every forward here ends at this hook."""


def run_to_final(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[Hook] = (),
    *,
    resid: Float[Tensor, "batch pos d_model"] | None = None,
    start_at_layer: int | None = None,
) -> Float[Tensor, "batch pos d_model"] | None:
    """A forward over ``tokens`` (or from ``resid`` entering block ``start_at_layer``, the earlier blocks not
    computed: :func:`skip_blocks_before`) under ``hooks`` and the caller's grad mode, ended before the unembedding:
    returns the final normalised residual (the unembedding's input), or None when a hook ended the forward earlier
    by raising :class:`StopForward`. The logits are never computed (losses come from
    :func:`lens_parallel.losses.chunked_token_nll`): TransformerLens 4.3's ``stop_at_layer=n_layers`` still runs the
    unembedding. No key/value cache is built (``use_cache=False``): nothing here decodes, and a checkpointed block's
    recompute (:func:`checkpointed_blocks`) must not extend one. Thread-safe: forwards of the same model in other
    threads wait (:func:`model_lock`). A final residual holding NaN or infinity is
    refused by :func:`raise_non_finite` (where it first appears, and why); :meth:`LayerStream.run` does the same for
    its captures."""
    kept: list[Tensor] = []

    def stop_at_unembedding(tensor: Tensor, hook: HookPoint) -> None:
        kept.append(tensor)
        raise StopForward

    _run(model, tokens, [*hooks, (FINAL_HOOK, stop_at_unembedding)], resid, start_at_layer)
    if kept and not is_finite(kept[0]):
        raise_non_finite(model, tokens, hooks, resid=resid, start_at_layer=start_at_layer)
    return kept[0] if kept else None


def _run(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[tuple[str | Callable[[str], bool], Callable[..., Tensor | None]]],
    resid: Float[Tensor, "batch pos d_model"] | None,
    start_at_layer: int | None,
) -> None:
    """The bridge's forward over ``tokens``, or from ``resid`` entering block ``start_at_layer``, under ``hooks``
    (a hook name or a name filter each; no logits are returned, no key/value cache is built), ended quietly by
    :class:`StopForward`. One forward at a time: hooks are the model's shared state, and another thread's stop hook
    registered on the same model would end this forward first."""
    try:
        with model_lock(model), model.hooks(fwd_hooks=list(hooks)):
            if resid is None:
                model(tokens, return_type=None, use_cache=False)
            else:
                with skip_blocks_before(model, start_at_layer or 0):
                    model(resid, start_at_layer=start_at_layer, return_type=None, use_cache=False)
    except StopForward:
        pass


def is_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite (neither NaN nor infinite)."""
    return bool(torch.isfinite(tensor).all())


def raise_non_finite(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[Hook] = (),
    *,
    resid: Float[Tensor, "batch pos d_model"] | None = None,
    start_at_layer: int | None = None,
    output: str = "the final residual",
) -> typing.NoReturn:
    """Refuse a forward that produced NaN or infinity, naming where it first appears: the forward is rerun with
    ``hooks`` and a check after them at every hook point (attention scores excepted: masked scores are -inf by
    design; an overflow there reaches the pattern), and the model's parameters are searched for non-finite values.
    Raises :class:`~lens_parallel.errors.NonFiniteError`, whose message names the model, that hook point (else
    ``output``, where the caller found it: the final residual, or a decoding step's logits), any non-finite
    parameter and the likely cause."""
    found: list[str] = []

    def check(tensor: Tensor, hook: HookPoint) -> None:
        if not found and isinstance(tensor, Tensor) and tensor.is_floating_point() and not is_finite(tensor):
            found.append(str(hook.name))
            raise StopForward

    def checked(name: str) -> bool:
        return name != FINAL_HOOK and not name.endswith("hook_attn_scores")

    with warnings.catch_warnings():  # a name filter: hook points switched off (hook_mlp_in, ...) are skipped, warned
        warnings.simplefilter("ignore")
        _run(model, tokens, [*hooks, (checked, check)], resid, start_at_layer)
    params = model.original_model.named_parameters()
    param = next((compat.plain_name(n) for n, p in params if not is_finite(p.detach())), None)
    dtype = next(model.parameters()).dtype
    where = f"first at {found[0]}" if found else f"in {output}"
    dtype_name = str(dtype).removeprefix("torch.")
    if param is not None:
        cause = f"the parameter {param} holds NaN or infinity: check the weights"
    elif dtype in (torch.float16, torch.bfloat16):
        cause = f"likely a {dtype_name} overflow: load the model in float32"
        cause += " or bfloat16" if dtype == torch.float16 else ""
    else:
        cause = "likely an edit or a hook that divides by zero, or weights too large for the dtype"
    raise NonFiniteError(
        f"{model.cfg.model_name}: the forward produced non-finite activations {where} ({dtype_name}); {cause}"
    )


def forward(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    hooks: Sequence[Hook] = (),
    *,
    resid: Float[Tensor, "batch pos d_model"] | None = None,
    start_at_layer: int | None = None,
) -> Float[Tensor, "batch pos d_model"] | None:
    """The one forward every analysis runs: :func:`run_to_final` without gradients."""
    with torch.inference_mode():
        return run_to_final(model, tokens, hooks, resid=resid, start_at_layer=start_at_layer)


class StopForward(Exception):
    """Raised by the last needed hook to end a forward early (:func:`forward` ends quietly)."""


Reducer = Callable[[int, dict[str, Tensor]], None]


class LayerStream:
    """Capture ``roles`` at ``layers``; call ``reduce(layer, tensors)`` once all roles of a layer are in.

    ``roles`` is one list for every layer or a dict layer -> roles (layers of different kinds need different hooks).

    ``pattern_diag`` is stored as its diagonal ``[batch, head_index, pos]`` only (A_tt), never as the full map.
    Tensors are detached copies in ``dtype`` (float64 by default, so that streamed sums match a cache to 1e-6), on
    the device of the tokens: a model whose layers sit on several devices hands the reducer tensors on one device.
    """

    def __init__(
        self,
        info: ModelInfo,
        layers: Sequence[int],
        roles: Sequence[str] | dict[int, Sequence[str]],
        reduce: Reducer,
        *,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.layers = sorted(set(layers))
        self.roles = {
            layer: tuple(dict.fromkeys(roles[layer] if isinstance(roles, dict) else roles)) for layer in self.layers
        }
        used = {role for layer_roles in self.roles.values() for role in layer_roles}
        unknown = sorted(used - set(ROLE_HOOKS))
        if unknown:
            raise LensParallelError(f"unknown activation roles {unknown}; known: {', '.join(ROLE_HOOKS)}")
        if "resid_mid" in used and info.parallel_attn_mlp:
            raise LensParallelError(f"{info.name} runs attention and MLP in parallel: it has no resid_mid")
        self.info, self.reduce, self.dtype = info, reduce, dtype
        self.device: torch.device | None = None
        self.stop = True
        self._buffers: dict[int, dict[str, Tensor]] = {}
        self._partial: dict[int, Tensor] = {}  # a diagonal's first blocks (the blocked attention path)
        self._finite: list[Tensor] = []  # per capture: its float32 sum, finite iff its values are (read once)

    def fwd_hooks(self) -> list[Hook]:
        def capture(layer: int, role: str) -> Callable[..., Tensor | None]:
            fn = partial(self._capture, layer=layer, role=role)
            if role != "pattern_diag":
                return fn
            # the diagonal is row-wise (blocks are joined), kept detached, and on the diagonal path comes as A_tt
            return rows_hook(fn, detached=True, diagonal=partial(self._capture_self_weights, layer=layer))

        return [(hook_name(layer, role), capture(layer, role)) for layer in self.layers for role in self.roles[layer]]

    def _capture(self, tensor: Tensor, hook: HookPoint, *, layer: int, role: str) -> None:
        check_shape(hook_name(layer, role), tensor, expected_shape(role, self.info))
        kept = tensor.detach()
        if role == "pattern_diag":
            kept, block = geometry.self_weights(kept), QUERY_BLOCK.get()
            if block is not None and block.start > 0:
                kept = torch.cat([self._partial.pop(layer), kept.to(device=self.device, dtype=self.dtype)], -1)
            if block is not None and block.stop < block.total:
                self._partial[layer] = kept.to(device=self.device, dtype=self.dtype)
                return
        self._keep(kept, layer=layer, role=role)

    def _capture_self_weights(self, rows: Diagonal, hook: HookPoint, *, layer: int) -> None:
        self._keep(rows.weight.to(rows.dtype), layer=layer, role="pattern_diag")

    def _keep(self, kept: Tensor, *, layer: int, role: str) -> None:
        # a NaN or an infinity in a capture makes its float32 sum so (one pass, no mask formed); a sum of finite
        # activations overflows float32 only past ~3e38 / n per element. Kept on the device: read after the forward
        self._finite.append(kept.sum(dtype=torch.float32))
        buffer = self._buffers.setdefault(layer, {})
        buffer[role] = kept.to(device=self.device, dtype=self.dtype)
        if len(buffer) == len(self.roles[layer]):
            self.reduce(layer, self._buffers.pop(layer))
            if layer == self.layers[-1] and self.stop:
                raise StopForward

    def run(
        self,
        model: TransformerBridge,
        tokens: Int[Tensor, "batch pos"],
        *,
        edit_hooks: Sequence[Hook] = (),
        resid: Float[Tensor, "batch pos d_model"] | None = None,
        start_at_layer: int | None = None,
        final: bool = False,
    ) -> Float[Tensor, "batch pos d_model"] | None:
        """One :func:`forward` over ``tokens`` (or from ``resid`` entering block ``start_at_layer``, earlier blocks
        not computed), with ``edit_hooks`` (compiled edits) applied first. Stops after the last layer's reduction,
        or with ``final=True`` goes on and returns the final normalised residual."""
        self._buffers.clear()
        self._partial.clear()
        self._finite.clear()
        self.device, self.stop = tokens.device, not final
        hooks = [*edit_hooks, *self.fwd_hooks()]
        out = forward(model, tokens, hooks, resid=resid, start_at_layer=start_at_layer)
        if self._buffers:
            missing = {layer: sorted(set(self.roles[layer]) - set(b)) for layer, b in self._buffers.items()}
            raise LibraryError(f"hooks never fired for layer/roles {missing}")
        sums = [total.to(tokens.device) for total in self._finite]  # the layers' devices, when placed over several
        if sums and not bool(torch.isfinite(torch.stack(sums)).all()):  # one read, after the forward
            raise_non_finite(model, tokens, edit_hooks, resid=resid, start_at_layer=start_at_layer)
        return out


GradReducer = Callable[[int, dict[str, Tensor], dict[str, Tensor]], None]


@contextlib.contextmanager
def checkpointed_blocks(model: TransformerBridge, recomputing: list[bool]) -> Iterator[None]:
    """Activation checkpointing of every block, for a forward whose backward follows: each block keeps only its
    inputs and is recomputed (hooks and all) when the backward reaches it, so at most one block's graph exists at a
    time instead of every layer's attention maps and MLP activations. Hooks must stay attached until the backward
    has ended (the recompute runs them again). ``recomputing[0]`` is True while a block is being recomputed, so
    hooks can tell the recompute (same values, its graph never backpropagated) from the
    forward. Non-reentrant :func:`torch.utils.checkpoint.checkpoint` without early stop (every hook of a recomputed
    block fires). One gradient pass at a time per model (its blocks are patched meanwhile: :func:`model_lock`)."""

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        recomputing[0] = True
        try:
            yield
        finally:
            recomputing[0] = False

    def wrap(block: torch.nn.Module) -> Callable[..., Any]:
        plain = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(
                plain, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), recompute()), **kwargs
            )

        return forward

    blocks = list(model.blocks)
    forwards = [wrap(block) for block in blocks]
    with (
        model_lock(model),
        torch.utils.checkpoint.set_checkpoint_early_stop(False),
        compat.steps_replaced("forward", blocks, forwards),
    ):
        yield


def gradient_pass(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    info: ModelInfo,
    roles: dict[int, Sequence[str]],
    grad_roles: dict[int, Sequence[str]],
    objective: Callable[[Float[Tensor, "batch pos d_model"]], Float[Tensor, " batch"]],
    reduce: GradReducer,
) -> Float[Tensor, " batch"]:
    """One forward and one backward over ``tokens``: per layer, the activations of ``roles`` (detached float64
    copies; ``pattern_diag`` kept as its diagonal) and the gradients of ``objective(final).sum()`` (``final``: the final
    normalised residual) with respect to the activations of ``grad_roles`` (float64; both on the tokens' device),
    handed to ``reduce(layer, acts, grads)`` as soon as the backward has passed the layer. Documents are
    independent, so each document's gradient is that of its own objective.
    Every block is checkpointed (:func:`checkpointed_blocks`): the activations of ``roles`` are read when the
    backward recomputes their block, just before that block's gradients, so one layer's copies and one block's
    graph are held at a time (memory: the residual entering each block, plus one block). Returns
    ``objective(final)`` per document. Nothing in the forward changes: every hook returns its input."""
    acts: dict[int, dict[str, Tensor]] = {layer: {} for layer in roles}
    grads: dict[int, dict[str, Tensor]] = {layer: {} for layer in grad_roles}
    roots: list[Tensor] = []
    recomputing = [False]

    def grad_root(resid: Tensor, hook: HookPoint) -> Tensor:
        # the residual entering block 0, detached and made a leaf that requires grad: the backward starts its graph
        # here (same values; no parameter gradient is ever formed, whether or not the weights require grad)
        root = resid.detach().requires_grad_(True)
        if not recomputing[0]:
            roots.append(root)
        return root

    def on_grad(g: Tensor, *, layer: int, role: str) -> None:
        if not is_finite(g):
            raise NonFiniteError(
                f"{info.name}: the loss gradient at {hook_name(layer, role)} is not finite (the forward was; "
                f"{g.dtype} gradients overflow more easily): run in float32"
            )
        grads[layer][role] = g.detach().to(device=tokens.device, dtype=torch.float64)
        if len(grads[layer]) == len(grad_roles[layer]):
            reduce(layer, acts.pop(layer), grads.pop(layer))

    def capture(tensor: Tensor, hook: HookPoint, *, layer: int, role: str) -> Tensor:
        check_shape(hook_name(layer, role), tensor, expected_shape(role, info))
        if recomputing[0] and role in roles.get(layer, ()):
            kept = geometry.self_weights(tensor) if role == "pattern_diag" else tensor
            kept = kept.detach().to(device=tokens.device, dtype=torch.float64)
            block = QUERY_BLOCK.get() if role == "pattern_diag" else None
            if block is not None and block.start > 0:  # the blocked attention path: the diagonal's blocks in order
                kept = torch.cat([acts[layer][role], kept], -1)
            acts[layer][role] = kept
        if not recomputing[0] and role in grad_roles.get(layer, ()):
            tensor.register_hook(partial(on_grad, layer=layer, role=role))  # holds no reference to the tensor
        # returned unchanged: the bridge hands some hooks a reshaped view and, when a hook returns nothing, goes on
        # with the tensor it had, so only a returned tensor is sure to be the one the rest of the forward uses.
        return tensor

    names = {(layer, role) for layer, rs in [*roles.items(), *grad_roles.items()] for role in rs}
    hooks: list[Hook] = [(hook_name(0, "resid_pre"), grad_root)]

    def capture_self_weights(rows: Diagonal, hook: HookPoint, *, layer: int) -> None:
        if recomputing[0]:
            acts[layer]["pattern_diag"] = rows.weight.to(rows.dtype).to(device=tokens.device, dtype=torch.float64)

    def hook(layer: int, role: str) -> Callable[..., Tensor | None]:
        fn = partial(capture, layer=layer, role=role)
        if role != "pattern_diag" or role in grad_roles.get(layer, ()):
            return fn
        return rows_hook(fn, detached=True, diagonal=partial(capture_self_weights, layer=layer))

    hooks += [(hook_name(layer, role), hook(layer, role)) for layer, role in sorted(names)]
    # the hooks stay attached through the backward: the recomputed blocks run them again
    with torch.enable_grad(), checkpointed_blocks(model, recomputing), model.hooks(fwd_hooks=hooks):
        final = run_to_final(model, tokens)
        if final is None:
            raise LibraryError("the gradient pass ended before the unembedding")
        per_doc = objective(final)
        torch.autograd.grad(per_doc.sum(), roots)  # the hooks on the way down read the gradients
    if grads:
        raise LibraryError(f"no gradient reached layers {sorted(grads)}")
    return per_doc.detach()
