"""lens_parallel: parallel/perpendicular geometry of attention-head outputs, on TransformerLens."""

from lens_parallel.analyses.decompose import SPACES, DecompositionResult, decompose
from lens_parallel.analyses.diagonal import DiagonalView, diagonal_view
from lens_parallel.analyses.scaling import ScalingResult, scale_sweep
from lens_parallel.data import TokenBlocks, load_texts, token_blocks
from lens_parallel.edits import ComponentScale, DiagonalEdit, apply_edits
from lens_parallel.evaluate import EditEffect, evaluate
from lens_parallel.models import ModelInfo, ModelSpecError, load_model, model_info

__all__ = [
    "SPACES",
    "ComponentScale",
    "DecompositionResult",
    "DiagonalEdit",
    "DiagonalView",
    "EditEffect",
    "ModelInfo",
    "ModelSpecError",
    "ScalingResult",
    "TokenBlocks",
    "apply_edits",
    "decompose",
    "diagonal_view",
    "evaluate",
    "load_model",
    "load_texts",
    "model_info",
    "scale_sweep",
    "token_blocks",
]
