"""Generation under edits: :func:`generate` continues prompts with the unedited model and under each setting, the
edits active at every KV-cached decoding step (:mod:`lens_parallel.generation.decode`)."""

from lens_parallel.generation.api import GenerateSettings, GenerationResult, generate
from lens_parallel.generation.decode import Decoded, Sampling, decode_batch

__all__ = ["Decoded", "GenerateSettings", "GenerationResult", "Sampling", "decode_batch", "generate"]
