"""lens_parallel's own attention: softmax attention without the square pattern nobody reads, one site per attention
layer (:mod:`~lens_parallel.attention.site`), each with its score spec and features
(:mod:`~lens_parallel.attention.spec`, :mod:`~lens_parallel.attention.features`), computed on the cheapest exact path
its hooks allow (:mod:`~lens_parallel.attention.paths`) from fused kernels (:mod:`~lens_parallel.attention.kernels`,
:mod:`~lens_parallel.attention.fused`), reached through TransformerLens's and Hugging Face's forwards
(:mod:`~lens_parallel.attention.routes`)."""

from lens_parallel.attention.features import FEATURES, GATES, Feature
from lens_parallel.attention.paths import attention_path, chosen_path, recorded_paths
from lens_parallel.attention.routes import install, sites
from lens_parallel.attention.rows import QUERY_BLOCK, STEP_VALUES, Diagonal, QueryBlock, RowsHook, block_rows, rows_hook
from lens_parallel.attention.site import AttentionSite, site_of
from lens_parallel.attention.spec import ScoreSpec

__all__ = [
    "FEATURES",
    "GATES",
    "QUERY_BLOCK",
    "STEP_VALUES",
    "AttentionSite",
    "Diagonal",
    "Feature",
    "QueryBlock",
    "RowsHook",
    "ScoreSpec",
    "attention_path",
    "block_rows",
    "chosen_path",
    "install",
    "recorded_paths",
    "rows_hook",
    "site_of",
    "sites",
]
