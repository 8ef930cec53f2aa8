"""Hook names, shape checks, forwards and streaming (reduce-in-the-forward) capture, by job:

- :mod:`~lens_parallel.hooks.names`: the role each hook point plays, what a hook hands over, the layers and heads
  an analysis may ask for;
- :mod:`~lens_parallel.hooks.running`: forwards to the unembedding's input and no further, one per model at a time,
  and where a NaN first appeared;
- :mod:`~lens_parallel.hooks.streams`: a :class:`LayerStream` captures only the hooks an analysis asks for and hands
  each layer to a reducer as soon as it is complete;
- :mod:`~lens_parallel.hooks.checkpoint`: gradient passes that recompute whole blocks.

Nothing here changes an activation: interventions live in :mod:`lens_parallel.edits`.
"""

from lens_parallel.hooks.checkpoint import GradReducer, checkpointed_blocks, gradient_pass
from lens_parallel.hooks.names import (
    BLOCK_NAME,
    RENAMED_ROLES,
    ROLE_HOOKS,
    Hook,
    HookShapeError,
    block_of,
    check_head_writes,
    check_heads,
    check_indices,
    check_not_gated,
    check_shape,
    effective_qk_roles,
    expand_kv,
    expected_shape,
    head_layers,
    head_write_inputs,
    head_writes_note,
    hook_name,
    layers_where,
    linear_head_inputs,
    output_weights,
    residual_reference_role,
    softmax_layers,
)
from lens_parallel.hooks.running import (
    FINAL_HOOK,
    StopForward,
    forward,
    is_finite,
    model_lock,
    raise_non_finite,
    skip_blocks_before,
)
from lens_parallel.hooks.streams import LayerStream, Reducer

__all__ = [
    "BLOCK_NAME",
    "FINAL_HOOK",
    "RENAMED_ROLES",
    "ROLE_HOOKS",
    "GradReducer",
    "Hook",
    "HookShapeError",
    "LayerStream",
    "Reducer",
    "StopForward",
    "block_of",
    "check_head_writes",
    "check_heads",
    "check_indices",
    "check_not_gated",
    "check_shape",
    "checkpointed_blocks",
    "effective_qk_roles",
    "expand_kv",
    "expected_shape",
    "forward",
    "gradient_pass",
    "head_layers",
    "head_write_inputs",
    "head_writes_note",
    "hook_name",
    "is_finite",
    "layers_where",
    "linear_head_inputs",
    "model_lock",
    "output_weights",
    "raise_non_finite",
    "residual_reference_role",
    "skip_blocks_before",
    "softmax_layers",
]
