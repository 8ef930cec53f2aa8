"""The model a caller passes: a ``TransformerBridge`` as lens_parallel analyses it, or one line saying what to do.

Every entry point (each analysis, the views, evaluation, generation, the explorer, the sweep engine, the report
battery) reads its model through :func:`check_model`, before any work:

- **Not a bridge**: a model name or folder (a string) is refused with the call that loads it
  (``lp.load_model(name)``); a Hugging Face model object with the call that bridges it (``lp.wrap_hf_model`` or
  ``TransformerBridge.boot_transformers(..., hf_model=...)``); anything else with what is accepted.
- **Processed weights** (``enable_compatibility_mode()`` or ``process_weights()``, which fold LayerNorm, centre the
  writing weights and fold the value biases into ``b_O``) are refused: folding ``b_V`` changes ``hook_v`` and every
  value-space split, centring changes the residual stream every residual space reads, and TransformerLens records
  that it processed, not which folds ran, so no space could say what it measured. Boot the model again without
  processing; ``enable_compatibility_mode(no_processing=True)`` (the legacy hook behaviour on the weights as
  loaded) is accepted and said in provenance.
- **Hooks the caller left on the bridge** (``hook.add_hook(f)`` or ``model.add_hook(name, f)``, or inside a
  ``with model.hooks(...)`` block, by the same rule) are refused, naming each hook point and saying how to pass
  them as an edit (the ``fwd_hooks`` list ``run_with_hooks`` takes, :class:`~lens_parallel.edits.FwdHooks`):
  lens_parallel changes activations only through its edits (:mod:`lens_parallel.edits`), which every analysis
  applies on each of its paths, records in provenance and keys its resumable stores on; a hook left on the bridge
  would change every number unrecorded, and would not reach Ray workers, which load the model by its spec. Remove
  them (``model.reset_hooks()``) and pass them as an edit, or write the change as an
  :class:`~lens_parallel.edits.Edit`. Hooks TransformerLens itself marks permanent are part of its model and left as
  they are.
- **A bridge the caller booted** (``TransformerBridge.boot_transformers(...)``) gets lens_parallel's attention and
  norms, as :func:`~lens_parallel.models.load_model` gives them (the same numbers and hook points, on the fused
  kernels, each norm computed once: :mod:`lens_parallel.norms`);
  provenance records each layer's attention path as it is then (:attr:`~lens_parallel.models.ModelInfo
  .attention_paths`), with the weights' processing, dtype and device read off the bridge.
"""

from __future__ import annotations

from typing import Any

import transformers
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import architectures, compat
from lens_parallel.errors import LensParallelError
from lens_parallel.kept import kept
from lens_parallel.models import ModelInfo, install_forwards, model_info, weights_state


def user_hooks(model: TransformerBridge) -> list[str]:
    """The hook points of ``model`` holding hooks that are not TransformerLens's permanent ones, each by the name
    TransformerLens documents (``blocks.0.attn.hook_z`` rather than the module path it aliases)."""
    named: dict[int, str] = {}
    for name, point in model.hook_dict.items():
        if point.has_hooks(including_permanent=False):
            named[id(point)] = min(named.get(id(point), name), name, key=_plainness)
    return sorted(named.values())


def _plainness(name: str) -> tuple[int, bool]:
    """How far a hook point's name is from the one TransformerLens documents: fewer dots, then not a module's own
    ``hook_in`` / ``hook_out`` (``blocks.1.hook_resid_pre`` over ``blocks.1.hook_in``)."""
    return name.count("."), name.endswith((".hook_in", ".hook_out"))


def _not_a_bridge(model: Any) -> str:
    """Why ``model`` is not what an entry point takes, and the call that makes it so."""
    if isinstance(model, str):
        return (
            f"got the string {model!r}; load it once and pass the bridge: model = lp.load_model({model!r}) (a toy, a "
            "real model, a folder or a hub name)"
        )
    if isinstance(model, transformers.PreTrainedModel):
        return (
            f"got a Hugging Face {type(model).__name__}; bridge it first: lp.wrap_hf_model(hf_model, tokenizer, "
            "name='...') (the tokenizer loaded from a folder), or TransformerBridge.boot_transformers(name, "
            "hf_model=hf_model, tokenizer=tokenizer)"
        )
    return (
        f"got {type(model).__name__}; accepted: a TransformerBridge (lp.load_model(spec), or "
        "TransformerBridge.boot_transformers(name_or_folder))"
    )


def check_model(model: Any) -> ModelInfo:
    """``model``'s :class:`~lens_parallel.models.ModelInfo`, once it is a bridge lens_parallel analyses as it is
    (module docstring); raises :class:`~lens_parallel.errors.LensParallelError` in one line otherwise. Installs
    lens_parallel's attention on a bridge the caller booted (idempotent).

    Examples:
        >>> import lens_parallel as lp
        >>> from lens_parallel.bridges import check_model
        >>> model = lp.load_model("toy-gpt2")
        >>> check_model(model).weights
        'unprocessed: no LayerNorm folding, no centering, value biases not folded into b_O'
        >>> model.blocks[0].attn.hook_z.add_hook(lambda z, hook: z)
        >>> try:
        ...     check_model(model)
        ... except lp.LensParallelError as error:
        ...     print(str(error).split(":")[0])
        toy-gpt2 carries hooks lens_parallel did not attach (blocks.0.attn.hook_z)
        >>> model.reset_hooks()  # or write the change as an lp.Edit
    """
    if not isinstance(model, TransformerBridge):
        raise LensParallelError(f"model: {_not_a_bridge(model)}")
    name = model.cfg.model_name
    if compat.bridge_attribute(model, "weights_processed"):
        raise LensParallelError(
            f"{name}: its weights were {weights_state(model)}, which changes hook_v and the residual stream every "
            "space reads; lens_parallel analyses unprocessed weights: boot it again without processing "
            "(lp.load_model(spec), or TransformerBridge.boot_transformers(name) with no enable_compatibility_mode(); "
            "enable_compatibility_mode(no_processing=True) is accepted)"
        )
    if hooks := user_hooks(model):
        raise LensParallelError(
            f"{name} carries hooks lens_parallel did not attach ({', '.join(hooks)}): they would change every number "
            "unrecorded; remove them (model.reset_hooks(), or leave the `with model.hooks(...)` block) and pass them "
            "as an edit, the fwd_hooks list run_with_hooks takes (lp.evaluate(model, docs, [(hook_name, fn), ...])), "
            "which every analysis applies and records"
        )
    if reason := kept(model, "refusal", lambda: architectures.bridge_refusal(set(model.hook_dict), model.cfg.n_layers)):
        raise LensParallelError(f"{name}: {reason}")
    install_forwards(model)
    return model_info(model)
