"""A wrapped model handed back to Hugging Face: a plain copy ``save_pretrained`` can write."""

from __future__ import annotations

import transformers

from lens_parallel import compat
from lens_parallel.errors import LibraryError


def export_hf_model(hf_model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """A plain Hugging Face copy of a model a bridge has wrapped (whose state-dict keys now carry the bridge's
    ``._original_component`` segments and aliases, so ``save_pretrained`` fails on it): a fresh model of the same
    config holding the same weights, ready for ``save_pretrained``. The copy is built without initialising its
    weights (transformers' ``no_init_weights``, as its own ``from_pretrained`` does: every one is then loaded, and a
    missing one raises), which was most of a copy's time (a random init of every parameter)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        fresh: transformers.PreTrainedModel = transformers.AutoModelForCausalLM.from_config(
            hf_model.config, dtype=next(hf_model.parameters()).dtype
        )
    wanted = set(fresh.state_dict())
    state = {}
    for key, tensor in hf_model.state_dict().items():
        plain = compat.plain_name(key)
        if plain in wanted:
            state[plain] = tensor.detach()  # load_state_dict copies into fresh's own tensors: no clone held beside
    missing = wanted - set(state)
    if missing:
        raise LibraryError(f"cannot export the wrapped model: no weights found for {sorted(missing)[:5]}")
    fresh.load_state_dict(state)
    fresh.eval()
    return fresh
