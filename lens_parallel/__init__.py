"""lens_parallel: parallel/perpendicular geometry of attention-head outputs, on TransformerLens.

Everything a user calls is importable from here: models and data, edits, the analyses (each returns a result
implementing :class:`Result`), the sweep engine, compression, training, the report battery and
:func:`load_result`.
"""

__version__ = "0.13.0"

from lens_parallel import logs, protocols  # noqa: F401  (logs first: its filters precede transformers)
from lens_parallel.analyses.ablation import AblationRun, AblationSettings, run_ablations
from lens_parallel.analyses.attribution import AttributionResult, AttributionSettings, head_attribution
from lens_parallel.analyses.compression import CompressionResult, CompressionSettings, compression_error
from lens_parallel.analyses.confirm import ConfirmResult, ConfirmSettings, confirm
from lens_parallel.analyses.decompose import SPACES, DecomposeSettings, DecompositionResult, decompose
from lens_parallel.analyses.diagonal import DiagonalSettings, DiagonalView, diagonal_view
from lens_parallel.analyses.dominance import DominanceResult, DominanceSettings, head_dominance, study_texts
from lens_parallel.analyses.evaluate import document_losses, evaluate
from lens_parallel.analyses.head_statistics import (
    HeadStatistics,
    HeadStatisticsSettings,
    compare_sensitivity,
    head_ratio_figure,
    head_statistics,
    sensitivity_correlations,
)
from lens_parallel.analyses.nulls import NullResult, NullSettings, causal_null, gqa_alignment
from lens_parallel.analyses.reliability import (
    SanityReport,
    SanitySettings,
    SplitHalfResult,
    sanity_report,
    split_half_reliability,
)
from lens_parallel.analyses.scaling import ScaleSettings, ScalingResult, scale_sweep
from lens_parallel.analyses.sensitivity import SensitivityResult, SensitivitySettings, head_sensitivity
from lens_parallel.compression import Compression, compress
from lens_parallel.data import TokenBlocks, load_texts, token_blocks
from lens_parallel.documents import Documents, whole_documents
from lens_parallel.downstream.effects import TaskResult, TaskSettings, task_effects
from lens_parallel.edits import (
    ABLATIONS,
    ComponentScale,
    DiagonalEdit,
    Edit,
    GatedRemoval,
    HeadEdit,
    LearnedGate,
    RandomDirectionRemoval,
    SkipFirstLayers,
    ZeroDiagonal,
    apply_edits,
)
from lens_parallel.errors import EnvironmentFailure, LensParallelError, LibraryError
from lens_parallel.explore import Explorer, View, explore
from lens_parallel.losses import DocLosses, EditEffect
from lens_parallel.models import ModelInfo, ModelSpecError, load_model, model_info
from lens_parallel.options import PROTOCOLS, DataOptions, RunOptions
from lens_parallel.report import ModelReport, ReportSettings, run_battery, write_report
from lens_parallel.results import Provenance, Result, load_result, result_classes
from lens_parallel.selection import TextSample, TextSelection, sample_texts
from lens_parallel.sweep import AblationJob, DocumentNLL, EditJob, Metric, SweepRun, TokenNLL, run_sweep
from lens_parallel.training import FactorialResult, TrainConfig, TrainRun, run_design, run_factorial, train

__all__ = [
    "ABLATIONS",
    "PROTOCOLS",
    "SPACES",
    "AblationJob",
    "AblationRun",
    "AblationSettings",
    "AttributionResult",
    "AttributionSettings",
    "ComponentScale",
    "Compression",
    "CompressionResult",
    "CompressionSettings",
    "ConfirmResult",
    "ConfirmSettings",
    "DataOptions",
    "DecomposeSettings",
    "DecompositionResult",
    "DiagonalEdit",
    "DiagonalSettings",
    "DiagonalView",
    "DocLosses",
    "DocumentNLL",
    "Documents",
    "DominanceResult",
    "DominanceSettings",
    "Edit",
    "EditEffect",
    "EditJob",
    "EnvironmentFailure",
    "Explorer",
    "FactorialResult",
    "GatedRemoval",
    "HeadEdit",
    "HeadStatistics",
    "HeadStatisticsSettings",
    "LearnedGate",
    "LensParallelError",
    "LibraryError",
    "Metric",
    "ModelInfo",
    "ModelReport",
    "ModelSpecError",
    "NullResult",
    "NullSettings",
    "Provenance",
    "RandomDirectionRemoval",
    "ReportSettings",
    "Result",
    "RunOptions",
    "SanityReport",
    "SanitySettings",
    "ScaleSettings",
    "ScalingResult",
    "SensitivityResult",
    "SensitivitySettings",
    "SkipFirstLayers",
    "SplitHalfResult",
    "SweepRun",
    "TaskResult",
    "TaskSettings",
    "TextSample",
    "TextSelection",
    "TokenBlocks",
    "TokenNLL",
    "TrainConfig",
    "TrainRun",
    "View",
    "ZeroDiagonal",
    "__version__",
    "apply_edits",
    "causal_null",
    "compare_sensitivity",
    "compress",
    "compression_error",
    "confirm",
    "decompose",
    "diagonal_view",
    "document_losses",
    "evaluate",
    "explore",
    "gqa_alignment",
    "head_attribution",
    "head_dominance",
    "head_ratio_figure",
    "head_sensitivity",
    "head_statistics",
    "load_model",
    "load_result",
    "load_texts",
    "model_info",
    "protocols",
    "result_classes",
    "run_ablations",
    "run_battery",
    "run_design",
    "run_factorial",
    "run_sweep",
    "sample_texts",
    "sanity_report",
    "scale_sweep",
    "sensitivity_correlations",
    "split_half_reliability",
    "study_texts",
    "task_effects",
    "token_blocks",
    "train",
    "whole_documents",
    "write_report",
]
