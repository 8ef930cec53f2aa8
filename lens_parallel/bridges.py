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
- **Hooks the caller left on the bridge** (``hook.add_hook(f)``, ``model.add_hook(name, f)``, or a
  ``with model.hooks(...)`` block around the call): a hook that only reads (returns None, writes nothing) runs in
  the analysis and is recorded in provenance (:attr:`~lens_parallel.models.ModelInfo.observer_hooks`); one that
  changes its activation is refused the first time it does, in one line saying how to pass it as an edit (the
  ``fwd_hooks`` list ``run_with_hooks`` takes, :class:`~lens_parallel.edits.FwdHooks`), which every analysis applies
  on each of its paths, records and keys its resumable stores on (:mod:`lens_parallel.observers`). Hooks left on
  the bridge do not reach Ray workers, which load the model by its spec.
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

from lens_parallel import architectures, compat, observers
from lens_parallel.errors import LensParallelError
from lens_parallel.kept import kept
from lens_parallel.models import ModelInfo, install_forwards, model_info, weights_state


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
        >>> model.blocks[0].attn.hook_z.add_hook(lambda z, hook: None)  # an observer: runs, and is recorded
        >>> check_model(model).observer_hooks
        ('blocks.0.attn.hook_z',)
        >>> model.reset_hooks()
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
    observers.watch(model)
    if reason := kept(model, "refusal", lambda: architectures.bridge_refusal(set(model.hook_dict), model.cfg.n_layers)):
        raise LensParallelError(f"{name}: {reason}")
    install_forwards(model)
    return model_info(model)
