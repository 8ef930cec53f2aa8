"""Models in TransformerLens's ``TransformerBridge`` with unprocessed weights, by job:

- :mod:`~lens_parallel.models.info`: what lens_parallel knows of a loaded model (:class:`ModelInfo`), its labels,
  and the architectures it refuses;
- :mod:`~lens_parallel.models.digests`: how the weights were processed, and their digest;
- :mod:`~lens_parallel.models.export`: a wrapped model handed back to Hugging Face;
- :mod:`~lens_parallel.models.loading`: loading toys, local folders, the hub and the shipped real models, placing
  them, and wrapping a user's Hugging Face model (the specs :func:`load_model` accepts).
"""

from lens_parallel.models.digests import UNPROCESSED, weights_digest, weights_state
from lens_parallel.models.export import export_hf_model
from lens_parallel.models.info import (
    POSITIONAL,
    ModelInfo,
    ModelSpecError,
    config_hash,
    head_label,
    layer_label,
    model_info,
)
from lens_parallel.models.loading import (
    BRIDGE_FAILURES,
    HUB_EXAMPLES,
    WEIGHT_FILES,
    available_models,
    check_device,
    check_spec,
    install_forwards,
    load_model,
    toy_folder,
    wrap_hf_model,
)
from lens_parallel.toys import TOY_MODELS, find_toy

__all__ = [
    "BRIDGE_FAILURES",
    "HUB_EXAMPLES",
    "POSITIONAL",
    "TOY_MODELS",
    "UNPROCESSED",
    "WEIGHT_FILES",
    "ModelInfo",
    "ModelSpecError",
    "available_models",
    "check_device",
    "check_spec",
    "config_hash",
    "export_hf_model",
    "find_toy",
    "head_label",
    "install_forwards",
    "layer_label",
    "load_model",
    "model_info",
    "toy_folder",
    "weights_digest",
    "weights_state",
    "wrap_hf_model",
]
