"""A TransformerLens user's own forward hooks as an edit: ``[(hook name or filter, fn), ...]``, the list
``run_with_hooks(fwd_hooks=...)`` takes, passed wherever an edit is.

:class:`FwdHooks` follows the :class:`~lens_parallel.edits.Edit` protocol as a user's own edit does (no footprint:
the engine serves its attention rows as it serves any undeclared edit's). Its hooks run through TransformerLens's
hook points as ``run_with_hooks`` runs them, a name filter matching every hook point whose name it accepts. It is
recorded by what it is, never by where it lives in memory: each hook by its hook point (or its filter's name), its
function's qualified name, and a digest of the function's source with what it closes over (defaults, closure cells,
a ``functools.partial``'s arguments; a tensor by its values). Two runs of the same code digest alike, so a
resumable store keys on it; a function whose code or captured values changed gets another digest.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.errors import LensParallelError
from lens_parallel.hooks import Hook, block_of
from lens_parallel.models import ModelInfo
from lens_parallel.validate import did_you_mean

HookPointName = str | Callable[[str], bool]
"""A hook point's name (``blocks.0.attn.hook_z``) or a filter of names, as ``run_with_hooks`` takes them."""
FwdHook = tuple[HookPointName, Callable[..., Any]]
"""One entry of a ``fwd_hooks`` list."""


def is_fwd_hook(item: object) -> bool:
    """Whether ``item`` is one entry of a ``fwd_hooks`` list: a (hook point name or filter, function) pair."""
    return (
        isinstance(item, tuple)
        and len(item) == 2
        and (isinstance(item[0], str) or callable(item[0]))
        and callable(item[1])
    )


def _qualified(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (a ``functools.partial`` as ``partial(<its function>)``)."""
    if isinstance(fn, functools.partial):
        return f"partial({_qualified(fn.func)})"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _plain(value: Any) -> str:
    """A stable text of a captured value: a tensor or array by dtype, shape and the digest of its values, containers
    item by item, a function by its qualified name, anything else by its repr."""
    if isinstance(value, Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return f"array {value.dtype} {value.shape} {hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(_plain(v) for v in value)}]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{k!r}: {_plain(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
        )
    if callable(value):
        return _qualified(value)
    return repr(value)


def source_digest(fn: Callable[..., Any]) -> str:
    """The first 16 hex digits of the sha256 of ``fn``'s source (its bytecode where the source cannot be read), its
    defaults, what it closes over and the module globals it reads that are data, not code (:func:`_plain`); a
    ``functools.partial`` adds its arguments."""
    if isinstance(fn, functools.partial):
        parts = [source_digest(fn.func), _plain(fn.args), _plain(fn.keywords)]
    else:
        try:
            parts = [inspect.getsource(fn)]
        except (OSError, TypeError):
            code = getattr(fn, "__code__", None)
            parts = [code.co_code.hex() if code is not None else repr(type(fn))]
        cells = getattr(fn, "__closure__", None) or ()
        parts += [_plain(getattr(fn, "__defaults__", None)), *(_plain(cell.cell_contents) for cell in cells)]
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
        read = [scope[name] for name in (code.co_names if code is not None else ()) if name in scope]
        parts += [_plain(value) for value in read if not (callable(value) or inspect.ismodule(value))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FwdHooks:
    """Your TransformerLens forward hooks as one edit (module docstring): ``fwd_hooks`` as ``run_with_hooks`` takes
    them, each ``fn(activation, hook)`` returning the new activation or None (an observer). A list of such pairs is
    taken wherever an edit is (:func:`~lens_parallel.edits.as_edits` wraps it in this class).

    Attributes:
        recorded: per hook, ``(hook point or "filter <name>", the function's qualified name, its source digest)``,
            what provenance and a store's key read.

    Args:
        fwd_hooks: the (hook point name or filter, function) pairs, in order.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> def halve(z, hook):
        ...     return z * 0.5
        >>> effect = lp.evaluate(model, ["The cat sat on the mat."], [("blocks.1.attn.hook_z", halve)], n_resamples=10)
        >>> point, function, digest = effect.provenance.settings["edits"][0]["recorded"][0]
        >>> point, function.endswith("halve"), len(digest)
        ('blocks.1.attn.hook_z', True, 16)
    """

    fwd_hooks: tuple[FwdHook, ...] = dataclasses.field(compare=False, repr=False, metadata={"provenance": False})
    recorded: tuple[tuple[str, str, str], ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        pairs = tuple(self.fwd_hooks)
        if not pairs or not all(is_fwd_hook(pair) for pair in pairs):
            raise LensParallelError(
                "fwd_hooks must be (hook point name or filter, fn) pairs, as run_with_hooks takes them, e.g. "
                "[('blocks.0.attn.hook_z', fn)]"
            )
        object.__setattr__(self, "fwd_hooks", pairs)
        recorded = tuple(
            (
                point if isinstance(point, str) else f"filter {_qualified(point)} {source_digest(point)}",
                _qualified(fn),
                source_digest(fn),
            )
            for point, fn in pairs
        )
        object.__setattr__(self, "recorded", recorded)

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The blocks its named hook points sit in (None: a filter, or a hook point outside the blocks, such as
        hook_embed: every layer, so a sweep runs it from layer 0)."""
        found = [block_of(point) if isinstance(point, str) else None for point, _ in self.fwd_hooks]
        if any(block is None for block in found):
            return None
        return tuple(sorted({block for block in found if block is not None}))

    def hooks(self, model: TransformerBridge, info: ModelInfo) -> list[Hook]:
        """Each pair on the hook points it names (a filter: every hook point one of whose names it accepts, once, as
        ``run_with_hooks`` adds it); a name the model has not is refused, with the closest it has."""
        out: list[Hook] = []
        for point, fn in self.fwd_hooks:
            if isinstance(point, str):
                if point not in model.hook_dict:
                    raise LensParallelError(
                        f"{point!r} is not a hook point of {info.name}{did_you_mean(point, model.hook_dict)}; "
                        "model.hook_dict lists them"
                    )
                names: Sequence[str] = [point]
            else:  # each hook point once, by its own name, however many of its aliases the filter accepts
                matched = {id(hp): hp.name or name for name, hp in model.hook_dict.items() if point(name)}
                names = list(matched.values())
                if not names:
                    raise LensParallelError(f"the hook filter {_qualified(point)} accepts no hook point of {info.name}")
            out += [(name, fn) for name in names]
        return out
