"""Hooks a user left on a bridge (``hook.add_hook(f)``, ``model.add_hook(name, f)``, or a ``with model.hooks(...)``
block around the call): an *observer* (a hook that returns None and writes nothing) runs in lens_parallel's forwards
and is recorded in provenance (:attr:`~lens_parallel.models.ModelInfo.observer_hooks`); a hook that changes its
activation is refused the first time it does, in one line saying how to pass it as an edit (the ``fwd_hooks`` list
:class:`~lens_parallel.edits.FwdHooks` takes), which every analysis applies and records.

The watch (:func:`watch`): on each hook point holding such hooks, a forward hook placed before every other and one
after the user's (placed anew at each analysis, so that hooks added since are inside it, and before the hooks of
lens_parallel's own run) see whether the activation leaving the user's hooks is the tensor that entered them (else
refused at once) with the same values (a copy compared on the device, read once the forward has ended: no host
synchronisation inside it; an in-place write that changes nothing changes no number). It acts only inside
lens_parallel's own forwards (:func:`analysing`): the user's own TransformerLens calls run as they would without
lens_parallel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.errors import LensParallelError
from lens_parallel.kept import kept


def user_hooks(model: TransformerBridge) -> list[str]:
    """The hook points of ``model`` holding hooks that are not TransformerLens's permanent ones, each by the name
    TransformerLens documents (``blocks.0.attn.hook_z`` rather than the module path it aliases)."""
    named: dict[int, str] = {}
    for name, point in model.hook_dict.items():  # most points hold no hook at all: their lists are read first
        if (point.fwd_hooks or point.bwd_hooks) and point.has_hooks(including_permanent=False):
            named[id(point)] = min(named.get(id(point), name), name, key=_plainness)
    return sorted(named.values())


def _plainness(name: str) -> tuple[int, bool]:
    """How far a hook point's name is from the one TransformerLens documents: fewer dots, then not a module's own
    ``hook_in`` / ``hook_out`` (``blocks.1.hook_resid_pre`` over ``blocks.1.hook_in``)."""
    return name.count("."), name.endswith((".hook_in", ".hook_out"))


def _state(model: TransformerBridge) -> dict[str, Any]:
    """The watch's state, kept on the model: how many of lens_parallel's forwards are running (``depth``) and, per
    watched activation of them, whether its values changed (``written``: a device tensor each, read at the end)."""
    return kept(model, "watching", lambda: {"depth": 0, "written": []})


@contextlib.contextmanager
def analysing(model: TransformerBridge) -> Iterator[None]:
    """Inside: a forward of lens_parallel's, in which the watch acts (:func:`lens_parallel.hooks.model_lock` holds
    it around each); leaving the outermost, an activation a user's hook wrote in place is refused."""
    state = _state(model)
    if not state["depth"]:
        state["written"].clear()
    state["depth"] += 1
    try:
        yield
    finally:  # also when the forward ended early (lens_parallel stops once it has what it reads)
        state["depth"] -= 1
        written = state["written"] if not state["depth"] else []
        if bad := [name for name, changed in written if bool(changed)]:
            raise _refusal(model, bad[0])


def watch(model: TransformerBridge) -> tuple[str, ...]:
    """Place the watch (module docstring) on the hook points holding the user's hooks, anew (the last one removed);
    returns their names, what provenance records."""
    handles: list[Any] = kept(model, "watch", list)
    for handle in handles:
        handle.remove()
    handles.clear()
    names = user_hooks(model)
    for name in names:
        point, seen = model.hook_dict[name], dict[str, Any]()
        handles.append(point.register_forward_hook(partial(_entering, model, seen), prepend=True))
        handles.append(point.register_forward_hook(partial(_leaving, model, name, seen)))
    return tuple(names)


def _entering(model: TransformerBridge, seen: dict[str, Any], module: Any, inputs: Any, output: Any) -> None:
    if _state(model)["depth"] and isinstance(output, torch.Tensor):
        seen["tensor"], seen["values"] = output, output.clone()


def _leaving(model: TransformerBridge, name: str, seen: dict[str, Any], module: Any, inputs: Any, output: Any) -> None:
    if not (_state(model)["depth"] and "tensor" in seen):
        return
    tensor, values = seen.pop("tensor"), seen.pop("values")
    if output is not tensor:
        raise _refusal(model, name)
    _state(model)["written"].append((name, (output != values).any()))


def _refusal(model: TransformerBridge, name: str) -> LensParallelError:
    return LensParallelError(
        f"a hook left on {model.cfg.model_name} at {name} changes its activation, which would change every number "
        "unrecorded; remove it (model.reset_hooks(), or leave the `with model.hooks(...)` block) and pass it as an "
        f"edit, the fwd_hooks list run_with_hooks takes (lp.evaluate(model, docs, [({name!r}, fn)])); a hook that "
        "only reads (returns None, writes nothing) may stay"
    )
