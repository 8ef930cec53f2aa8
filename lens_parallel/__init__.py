"""lens_parallel: parallel/perpendicular geometry of attention-head outputs, on TransformerLens."""

from lens_parallel.analyses.decompose import SPACES, DecompositionResult, decompose
from lens_parallel.data import TokenBlocks, load_texts, token_blocks
from lens_parallel.models import ModelInfo, ModelSpecError, load_model, model_info

__all__ = [
    "SPACES",
    "DecompositionResult",
    "ModelInfo",
    "ModelSpecError",
    "TokenBlocks",
    "decompose",
    "load_model",
    "load_texts",
    "model_info",
    "token_blocks",
]
