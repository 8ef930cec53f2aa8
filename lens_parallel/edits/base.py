"""What every edit shares: the :class:`Edit` protocol, the :class:`EditBase` of the built-in edits, what an edit
declares about its forward (:class:`Footprint`) and the helpers that compile edits to hooks.

An edit is frozen data with ``hooks(model, info)``. A built-in edit derives from :class:`EditBase`, names its kind
(``kind``: what the command line's specs, the explorer's menu and the error messages call it) and has a row in
:data:`~lens_parallel.edits.kinds.EDITS`; a user-defined edit only needs ``hooks``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal, Protocol, cast, runtime_checkable

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.attention import QUERY_BLOCK, STEP_VALUES, Diagonal, RowsHook, rows_hook
from lens_parallel.choices import AttentionPath, EditPositions, HeadsAll
from lens_parallel.edits.hooked import FwdHook, FwdHooks, is_fwd_hook
from lens_parallel.errors import LensParallelError, LibraryError
from lens_parallel.hooks import BLOCK_NAME, ROLE_HOOKS, Hook, check_indices
from lens_parallel.models import ModelInfo, model_info
from lens_parallel.validate import as_indices, check_choice, literal_values

PatternUse = Literal["none", "diagonal", "rows"]
"""How an edit uses attention-pattern rows: not at all; only each row's diagonal A_tt and its row sum (what a
fused kernel can supply without the T x T pattern); or whole rows (it reads or rewrites A_ts for every key s)."""
PATTERN_USES: tuple[PatternUse, ...] = ("none", "diagonal", "rows")
"""The uses of the pattern, each needing more of it than the one before."""
PATTERN_PATHS: Mapping[PatternUse, AttentionPath | None] = {"none": None, "diagonal": "diagonal", "rows": "blocked"}
"""The attention path that serves every forward of a run whose edits' greatest use of the pattern is each
(:func:`lens_parallel.attention.attention_path`; None: each layer's own choice)."""


@dataclass(frozen=True)
class Footprint:
    """What an edit needs from a forward (read by the engine's hook selection; checked against what the edit's
    hooks touch by ``tests/test_edit_footprints.py``).

    Attributes:
        reads: activation roles (:data:`lens_parallel.hooks.ROLE_HOOKS`) its hooks read without changing.
        writes: roles whose activation it replaces.
        pattern: how it uses attention-pattern rows (:data:`PatternUse`).
        decode_safe: whether it is defined when a forward step sees one new query position against cached keys and
            values (every quantity it reads is the current position's own, the current attention row, or the
            values at every key position through :func:`all_values`). Every built-in edit is.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.ZeroDiagonal().footprint(lp.model_info(lp.load_model("toy-gpt2"))).decode_safe
        True
    """

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    pattern: PatternUse
    decode_safe: bool

    def __post_init__(self) -> None:
        unknown = sorted(set(self.reads + self.writes) - set(ROLE_HOOKS))
        if unknown:
            raise LibraryError(f"a footprint names unknown roles {unknown}; roles: {', '.join(ROLE_HOOKS)}")

    @property
    def roles(self) -> tuple[str, ...]:
        """Every role it reads or writes."""
        return tuple(dict.fromkeys(self.reads + self.writes))


@runtime_checkable
class Edit(Protocol):
    """An intervention, built-in or user-defined: frozen data (a frozen dataclass, so that it can be hashed into a
    store, sent to workers and described in provenance) with ``hooks(model, info)`` returning its forward hooks
    (checking its settings against the model first, before any forward). Optionally ``noop()``: its matched no-op
    (the same hooks with every scale at 1; None or absent: it is compared with the unedited model). Optionally
    ``layers``: the layers it edits (None: every layer), which lets the engine resume a job at the first of them;
    an edit that does not say runs from layer 0. :class:`EditBase` gives both typed defaults.

    Examples:
        >>> import lens_parallel as lp
        >>> isinstance(lp.ZeroDiagonal(), lp.Edit)
        True
    """

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]: ...


class EditBase:
    """The base of the built-in edits: the typed defaults of the optional parts of :class:`Edit` and the
    declarations the engine reads. A subclass is a frozen dataclass with its ``kind`` and a row in
    :data:`~lens_parallel.edits.kinds.EDITS`.

    Examples:
        >>> import lens_parallel as lp
        >>> issubclass(lp.ZeroDiagonal, lp.EditBase)
        True
    """

    kind: ClassVar[str] = ""
    """The edit's kind: its name in :data:`~lens_parallel.edits.kinds.EDITS` ("" for a user's own subclass)."""

    @property
    def layers(self) -> int | Sequence[int] | None:
        """The layers it edits (None, the default: every layer; an edit's ``layers`` field, a sorted tuple once
        the edit is built, overrides this)."""
        return None

    def declared_layers(self) -> tuple[int, ...] | Literal["undeclared"] | None:
        """:attr:`layers`, or ``"undeclared"`` where the edit cannot say (a wrapper of an edit that does not)."""
        return cast(tuple[int, ...] | None, self.layers)

    def noop(self) -> Edit | None:
        """Its matched no-op (the same hooks with every scale at 1), or None: compared with the unedited model."""
        return None

    def stack_signature(self) -> tuple[Any, ...] | None:
        """What the edit is but for per-row scales: edits of one signature can share a forward, one per batch row
        (:func:`~lens_parallel.edits.stacked_hooks`); None: it runs alone."""
        return None

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        raise NotImplementedError

    def resolved(self, info: ModelInfo) -> EditBase:
        """This edit as it meets ``info``'s model: its negative layer and head indices counted from the end (-1 the
        last), the one index rule of the analyses; the edit itself where none is negative. Every analysis and
        :func:`compile_hooks` run, and provenance records, the resolved edit (:func:`as_edits` with the model's
        info)."""
        return self

    def footprint(self, info: ModelInfo) -> Footprint | None:
        """What this edit, with these settings, needs from a forward of a model like ``info`` (None: it does not
        say, e.g. a wrapper of a user-defined edit)."""
        raise NotImplementedError


def _kinds_of(base: type[EditBase]) -> list[str]:
    """The names of ``base``'s subclasses that name a kind (the built-in edits), at any depth."""
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo += cls.__subclasses__()
        found += [cls.__name__] if cls.kind else []
    return found


POSITIONS = literal_values(EditPositions)
"""Which positions an edit acts on. ``all`` (the default); ``after-first`` leaves position 0, the boundary token,
untouched: there o_0 = v_0 (a causal head attends only to itself), so a value-space s_par = 0 removes its whole
output while exclude-self leaves it alone. The sanity-checks paper's frozen interventions exclude the first token;
its trained arms include every position."""

Heads = int | Sequence[int] | HeadsAll | None
"""The heads an edit acts on: a head, a list, ``"all"`` (every head, each on its own write) or None (the default:
every head in the value spaces, where a head is all there is; the whole sublayer update, b_O included, in
residual-attn)."""

HeadSet = tuple[int, ...] | Bool[Tensor, "batch head_index"]
"""The heads an edit acts on: the same query heads in every batch row, or one set per row (a bool mask)."""


def check_positions(positions: object) -> EditPositions:
    """``positions`` if it is one of :data:`POSITIONS`, else a :class:`LensParallelError`."""
    return cast(EditPositions, check_choice("positions", positions, EditPositions))


FIRST_INDEX: contextvars.ContextVar[Literal[0] | Tensor | None] = contextvars.ContextVar("first_index", default=0)
"""Where position 0 (the first token) lies on the position axis of the forward being run: 0 in every whole-sequence
forward; per row (``[batch]``) in a left-padded prompt's forward; None in a decoding step, which holds only later
positions. Set by the decoding loop (:mod:`lens_parallel.generation`) for the forwards it runs; read by
:func:`after_first`."""


def all_values(
    v: Float[Tensor, "batch pos head_index d_head"], layer: int, n_key: int
) -> Float[Tensor, "batch key_pos head_index d_head"]:
    """The values at the ``n_key`` key positions an attention pattern of ``layer`` holds in the current forward:
    ``v`` (hook_v) itself when it holds them all; on a decoding step (hook_v holds only the new positions) and on
    the blocked attention path (a block of queries sees the keys up to its last one) the first ``n_key`` of the
    layer's values over every key (:data:`lens_parallel.attention.STEP_VALUES`)."""
    if v.shape[1] == n_key:
        return v
    values = STEP_VALUES.get()
    if values is None or layer not in values:
        raise LibraryError(
            f"layer {layer}'s hook_v holds {v.shape[1]} positions against {n_key} keys and no cached values were "
            "handed over (run cached forwards through lens_parallel.generate)"
        )
    return values[layer][:, :n_key]


def at_first(first: int | Tensor, start: int, n: int, device: torch.device) -> Bool[Tensor, "row n"]:
    """Which of positions ``start .. start + n - 1`` is position 0 (:data:`FIRST_INDEX`: one index, ``[1, n]``,
    or one per row, ``[batch, n]``)."""
    return torch.arange(start, start + n, device=device) == torch.as_tensor(first, device=device).reshape(-1, 1)


def after_first(hooks: list[Hook]) -> list[Hook]:
    """The same hooks, each restoring position 0 of what it returns (the query axis of an attention pattern; where
    position 0 lies: :data:`FIRST_INDEX`); hooks that only read return None and stay as they are."""

    def keep_first(fn: Callable[..., Tensor | None], axis: int, tensor: Tensor, hook: HookPoint) -> Tensor | None:
        out = fn(tensor, hook)
        first = FIRST_INDEX.get()
        if out is None or first is None:
            return out
        block = QUERY_BLOCK.get() if axis == 2 else None  # a block of the queries (the blocked attention path)
        start = 0 if block is None else block.start
        at = at_first(first, start, out.shape[axis], out.device).expand(out.shape[0], -1)
        shape = [out.shape[0]] + [out.shape[axis] if d == axis else 1 for d in range(1, out.ndim)]
        return torch.where(at.reshape(shape), tensor.to(out.dtype), out)

    def keep_first_diagonal(
        fn: Callable[[Diagonal, HookPoint], Diagonal | None], rows: Diagonal, hook: HookPoint
    ) -> Diagonal | None:
        out = fn(rows, hook)
        first = FIRST_INDEX.get()
        if out is None or first is None:
            return out
        at = at_first(first, 0, rows.weight.shape[-1], rows.weight.device)
        return rows.where(at[:, None, :], out)  # position 0's row as it came

    def wrapped(name: str, fn: Callable[..., Tensor | None]) -> Callable[..., Tensor | None]:
        kept = partial(keep_first, fn, 2 if name.endswith("hook_pattern") else 1)
        if not isinstance(fn, RowsHook):
            return kept
        diagonal = None if fn.diagonal is None else partial(keep_first_diagonal, fn.diagonal)
        return rows_hook(kept, detached=fn.detached, diagonal=diagonal)

    return [(name, wrapped(name, fn)) for name, fn in hooks]


class _EveryPosition:
    """``positions="all"``: the edit's hooks as they are; every real position weighs in an estimate of it."""

    def hooks(self, hooks: list[Hook]) -> list[Hook]:
        return hooks

    def weights(self, weight: Float[Tensor, "batch pos"]) -> Float[Tensor, "batch pos"]:
        return weight


class _AfterFirst:
    """``positions="after-first"``: position 0 restored by every hook (:func:`after_first`), and left out of an
    estimate of the edit (its weight 0)."""

    def hooks(self, hooks: list[Hook]) -> list[Hook]:
        return after_first(hooks)

    def weights(self, weight: Float[Tensor, "batch pos"]) -> Float[Tensor, "batch pos"]:
        return torch.cat([torch.zeros_like(weight[:, :1]), weight[:, 1:]], dim=1)


EDIT_POSITIONS: Mapping[EditPositions, _EveryPosition | _AfterFirst] = {
    "all": _EveryPosition(),
    "after-first": _AfterFirst(),
}
"""What each choice of an edit's ``positions`` (:data:`POSITIONS`) does: to its hooks (``hooks``) and to the
per-position weights of a first-order estimate of it (``weights``)."""


def as_heads(heads: Heads) -> tuple[int, ...] | HeadsAll | None:
    """``heads`` checked: ``"all"``, None, or head indices (negative ones from the end)."""
    if heads == "all":
        return "all"
    if isinstance(heads, str):
        raise LensParallelError(f"heads must be head indices, 'all' or None, got {heads!r}")
    return as_indices(heads, what="heads")


def from_end(indices: Sequence[int], n: int, what: str) -> tuple[int, ...]:
    """``what`` (layers or heads) ``indices`` of ``n``, each of -n..-1 counted from the end (-1 -> n - 1), in their
    order; one out of range is refused as :func:`~lens_parallel.hooks.check_indices` refuses it."""
    check_indices(what, indices, n)
    return tuple(i % n for i in indices)


class LayerHeadEdit(EditBase):
    """The base of the built-in edits with ``layers`` and ``heads`` fields (checked by :func:`as_indices` and
    :func:`as_heads`): how they are :meth:`resolved` on a model."""

    heads: Heads  # a tuple of indices, "all" or None once the edit is built (as_heads)

    def resolved(self, info: ModelInfo) -> LayerHeadEdit:
        """Layers counted from the end of ``info``'s layers, heads from the end of the edited layers' heads, which
        must then all have the same number of heads (refused otherwise: -1 would be another head on each); an index
        out of range is refused here."""
        given = cast(tuple[int, ...] | None, self.layers)
        heads = cast(tuple[int, ...] | HeadsAll | None, self.heads)
        layers = None if given is None else from_end(given, info.n_layers, "layers")
        if isinstance(heads, tuple) and min(heads, default=0) < 0:
            edited = range(info.n_layers) if layers is None else layers
            counts = sorted({info.output_heads(i) for i in edited if info.kind(i).heads})
            if len(counts) > 1:
                raise LensParallelError(
                    f"heads {list(heads)} count from the end of a layer's heads, but the edited layers of {info.name} "
                    f"have {counts} heads: name the heads from 0, or edit layers of one head count"
                )
            heads = from_end(heads, counts[0], "heads") if counts else heads
        if (layers, heads) == (given, self.heads):
            return self
        resolved: LayerHeadEdit = dataclasses.replace(cast(Any, self), layers=layers, heads=heads)
        return resolved


def store(tensor: Tensor, hook: HookPoint, *, state: dict[str, Tensor], key: str) -> None:
    """A reading hook: keep ``tensor`` under ``key`` for a later hook of the same forward."""
    state[key] = tensor


def _store_diagonal(pattern: Tensor, hook: HookPoint, *, state: dict[str, Tensor]) -> None:
    diag = geometry.self_weights(pattern)
    block = QUERY_BLOCK.get()
    state["pattern_diag"] = diag if block is None or block.start == 0 else torch.cat([state["pattern_diag"], diag], -1)


def _store_self_weights(rows: Diagonal, hook: HookPoint, *, state: dict[str, Tensor]) -> None:
    state["pattern_diag"] = rows.weight.to(rows.dtype)


def store_diagonal(state: dict[str, Tensor]) -> RowsHook:
    """A reading hook on hook_pattern keeping only each query's own weight A_tt in ``state["pattern_diag"]`` (the
    role ``pattern_diag``; the last column of a decoding step's row: :func:`lens_parallel.geometry.self_weights`),
    the blocks of the blocked attention path joined in order; on the diagonal path, A_tt as it comes."""
    return rows_hook(partial(_store_diagonal, state=state), diagonal=partial(_store_self_weights, state=state))


def head_mask(
    heads: HeadSet | None, n_heads: int, batch: int, device: torch.device
) -> Bool[Tensor, "batch head_index"]:
    """The heads as a mask ``[batch, head_index]`` (None: every head)."""
    if heads is None:
        return torch.ones(batch, n_heads, dtype=torch.bool, device=device)
    if isinstance(heads, Tensor):
        if heads.shape != (batch, n_heads):
            raise LensParallelError(
                f"a per-row head mask must have shape ({batch}, {n_heads}), got {tuple(heads.shape)}"
            )
        return heads.to(device)
    mask = torch.zeros(batch, n_heads, dtype=torch.bool, device=device)
    mask[:, list(heads)] = True
    return mask


def as_edits(edits: object, info: ModelInfo | None = None) -> tuple[Edit, ...]:
    """One edit or a sequence of edits (one combined intervention, applied in order) as a tuple, each checked to
    follow the :class:`Edit` protocol; TransformerLens's ``fwd_hooks`` pairs (``(hook point or filter, fn)``) in the
    sequence, each run of them one :class:`~lens_parallel.edits.hooked.FwdHooks`. With ``info``, each built-in edit
    is :meth:`~EditBase.resolved` on its model (indices from the end counted)."""
    if isinstance(edits, Edit) or is_fwd_hook(edits):
        given: tuple[object, ...] = (edits,)
    elif isinstance(edits, (list, tuple)):
        given = tuple(edits)
    else:
        given = (edits,)
    found: list[object] = []
    for item in given:
        if is_fwd_hook(item) and found and isinstance(found[-1], list):
            found[-1].append(item)
        else:
            found.append([item] if is_fwd_hook(item) else item)
    found = [FwdHooks(tuple(item)) if isinstance(item, list) else item for item in found]
    bad = [e for e in found if not isinstance(e, Edit)]
    if bad:
        raise LensParallelError(
            "an edit has a hooks(model, info) method (the Edit protocol: the built-in "
            f"{', '.join(_kinds_of(EditBase))}, or your own frozen dataclass), or is a "
            f"TransformerLens fwd_hooks list [(hook point or filter, fn), ...]; got {type(bad[0]).__name__}"
        )
    checked = cast(tuple[Edit, ...], tuple(found))
    if info is None:
        return checked
    return tuple(e.resolved(info) if isinstance(e, EditBase) else e for e in checked)


UNEDITED = "unedited"
"""The name of the baseline setting in every table that compares settings."""

Intervention = Edit | FwdHook | Sequence[Edit | FwdHook]
"""One intervention: an edit, a TransformerLens ``fwd_hooks`` pair, or a sequence of them applied in order."""
Settings = Intervention | Mapping[str, Intervention]
"""One edit, one list of edits (one combined intervention), or several named settings."""


def named_edits(settings: object, info: ModelInfo | None = None) -> dict[str, tuple[Edit, ...]]:
    """``settings`` (:data:`Settings`) as named interventions, each a tuple of edits applied together (with
    ``info``, resolved on its model: :func:`as_edits`): a dict's names, else one setting named after its edits'
    types. The name :data:`UNEDITED` is the baseline's."""
    if isinstance(settings, Mapping):
        if not settings:
            raise LensParallelError("edits is an empty dict; give at least one name -> edit (or list of edits)")
        if UNEDITED in settings:
            raise LensParallelError(f"{UNEDITED!r} names the baseline every setting is compared with; rename it")
        return {str(name): as_edits(edits, info) for name, edits in settings.items()}
    edits = as_edits(settings, info)
    return {"+".join(type(e).__name__ for e in edits) or "no edit": edits}


UNDECLARED = "undeclared"
""":func:`edit_layers` of a user-defined edit without a ``layers`` attribute."""


def edit_layers(edit: Edit) -> tuple[int, ...] | Literal["undeclared"] | None:
    """The layers ``edit`` edits (None: every layer), or :data:`UNDECLARED` for a user-defined edit that does not
    say (the one place the optional attribute of the :class:`Edit` protocol is looked up)."""
    if isinstance(edit, EditBase):
        return edit.declared_layers()
    return cast(tuple[int, ...] | Literal["undeclared"] | None, getattr(edit, "layers", UNDECLARED))


def edit_noop(edit: Edit) -> Edit | None:
    """``edit``'s matched no-op, or None (the one place the optional ``noop`` of :class:`Edit` is looked up)."""
    if isinstance(edit, EditBase):
        return edit.noop()
    make = getattr(edit, "noop", None)
    return cast(Edit, make()) if callable(make) else None


def edit_footprint(edit: Edit, info: ModelInfo) -> Footprint | None:
    """``edit``'s :class:`Footprint` on a model like ``info``, or None where it does not declare one (the one place
    the optional ``footprint`` of a user-defined edit is looked up)."""
    if isinstance(edit, EditBase):
        return edit.footprint(info)
    declare = getattr(edit, "footprint", None)
    return cast(Footprint | None, declare(info)) if callable(declare) else None


def decode_safe(edits: Sequence[Edit], info: ModelInfo) -> bool:
    """Whether every edit says it is decode-safe (:attr:`Footprint.decode_safe`): decoding runs them against a
    key/value cache; any other edit (one that says not, or does not say) decodes by rerunning the whole sequence
    at each step (:mod:`lens_parallel.generation.decode`)."""
    return all((footprint := edit_footprint(edit, info)) is not None and footprint.decode_safe for edit in edits)


def describe_edit(edit: Edit) -> dict[str, Any]:
    """A plain-data description of an edit for provenance: its type and fields (a dataclass; otherwise its repr);
    a tensor field is given by its shape (``{"tensor": [...]}``), since its values live in the run that made it."""
    out: dict[str, Any] = {"type": f"{type(edit).__module__}.{type(edit).__qualname__}"}
    if not dataclasses.is_dataclass(edit):
        return out | {"repr": repr(edit)}
    for f in dataclasses.fields(edit):
        if not f.metadata.get("provenance", True):
            continue  # run state (a counter), not a setting
        value = getattr(edit, f.name)
        if isinstance(value, Tensor):
            value = {"tensor": list(value.shape)}
        elif isinstance(value, Edit):  # a wrapped edit (SkipFirstLayers)
            value = describe_edit(value)
        out[f.name] = value
    return out


def hook_roles(name: str) -> frozenset[str]:
    """The roles a full hook name serves (``blocks.3.attn.hook_z`` -> {``z``}; hook_pattern -> {``pattern``,
    ``pattern_full``}: the diagonal and the whole map are read at the same hook)."""
    generic = BLOCK_NAME.sub("blocks.{layer}.", name)
    return frozenset(role for role, template in ROLE_HOOKS.items() if template == generic)


def check_pattern_inline(info: ModelInfo, edit: Edit, names: Sequence[str]) -> None:
    """Refuse, in one line, an edit that hooks hook_pattern (to edit it, or to read A_tt before hook_z) at a layer
    whose bridge fires hook_pattern only after its attention has run (:attr:`~lens_parallel.ModelInfo.patterns_after`):
    there the edit would change nothing, or read a pattern not yet there."""
    layers = sorted({int(name.split(".")[1]) for name in names if name.endswith("attn.hook_pattern")})
    if bad := [layer for layer in layers if layer in info.patterns_after]:
        raise LensParallelError(
            f"{type(edit).__name__} needs the attention pattern inside the forward (it edits A, or reads A_tt before "
            f"hook_z), but at layers {bad} of {info.name} TransformerLens's generic attention bridge fires "
            "hook_pattern after the attention has run (read-only there); edits of hook_z, hook_v and the residual "
            "stream work on these layers"
        )


def compile_hooks(model: TransformerBridge, edits: Intervention) -> list[Hook]:
    """Validate every edit against the model (before any forward) and return their hooks, in order. A built-in
    edit's hooks are checked against its :class:`Footprint`: a hook on an undeclared role is a library bug."""
    info = model_info(model)
    out: list[Hook] = []
    for edit in as_edits(edits, info):
        hooks = edit.hooks(model, info)
        footprint = edit.footprint(info) if isinstance(edit, EditBase) else None  # a user's: not checked
        if footprint is not None:
            declared = set(footprint.roles)
            stray = sorted({name for name, _ in hooks if not hook_roles(name) & declared})
            if stray:
                raise LibraryError(f"{type(edit).__name__} hooks {stray} outside its declared footprint")
        check_pattern_inline(info, edit, [name for name, _ in hooks])
        out += hooks
    return out


def noop(edits: Edit | Sequence[Edit]) -> tuple[Edit, ...]:
    """The matched no-op: each edit's own no-op (the same hooks with every scale at 1: ``ComponentScale``,
    ``DiagonalEdit``, or a user-defined edit that defines one); edits without one (``HeadEdit``, ``GatedRemoval``,
    ``LearnedGate``, ...) have no single scale: their no-op is the unedited model, so they are dropped."""
    return tuple(n for e in as_edits(edits) if (n := edit_noop(e)) is not None)


@contextlib.contextmanager
def apply_edits(model: TransformerBridge, edits: Intervention) -> Iterator[TransformerBridge]:
    """``with apply_edits(model, edits): model(tokens)`` runs the edited model; hooks are removed on exit.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> with lp.apply_edits(model, lp.ZeroDiagonal(layers=[0])) as edited:
        ...     logits = edited(docs.tokens)
        >>> logits.shape[:2]
        torch.Size([4, 16])
    """
    hooks = compile_hooks(model, edits)
    with model.hooks(fwd_hooks=hooks):
        yield model
