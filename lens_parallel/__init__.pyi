"""The names :mod:`lens_parallel` exports, for type checkers and for ``lazy_loader`` (each is imported on first
use, so that ``import lens_parallel`` and the command line's ``--help`` stay fast)."""

__version__: str

from . import geometry, protocols
from .analyses.ablation import AblationRun, AblationSettings, run_ablations
from .analyses.attribution import AttributionResult, AttributionSettings, head_attribution
from .analyses.compression import CompressionResult, CompressionSettings, compression_error
from .analyses.confirm import ConfirmResult, ConfirmSettings, confirm
from .analyses.decompose import AlignmentTable, DecomposeSettings, DecompositionResult, decompose
from .analyses.diagonal import DiagonalSettings, DiagonalView, diagonal_view
from .analyses.dominance import DominanceResult, DominanceSettings, head_dominance, study_texts
from .analyses.evaluate import EvaluateSettings, document_losses, evaluate
from .analyses.head_statistics import (
    HeadStatistics,
    HeadStatisticsSettings,
    compare_sensitivity,
    head_ratio_figure,
    head_statistics,
    sensitivity_correlations,
)
from .analyses.nulls import NullResult, NullSettings, causal_null, gqa_alignment
from .analyses.reliability import (
    SanityReport,
    SanitySettings,
    SplitHalfResult,
    sanity_report,
    split_half_reliability,
)
from .analyses.scaling import ScaleSettings, ScalingResult, scale_sweep
from .analyses.sensitivity import SensitivityResult, SensitivitySettings, head_sensitivity
from .compression import Compression, compress
from .data import TokenBlocks, load_texts, token_blocks
from .documents import Documents, whole_documents
from .downstream.effects import TaskResult, task_effects
from .downstream.settings import TaskSettings
from .edits import (
    ABLATIONS,
    EDITS,
    ComponentScale,
    DiagonalEdit,
    Edit,
    EditBase,
    Footprint,
    FwdHooks,
    GatedRemoval,
    HeadEdit,
    LearnedGate,
    RandomDirectionRemoval,
    SkipFirstLayers,
    ZeroDiagonal,
    apply_edits,
)
from .errors import EnvironmentFailure, LensParallelError, LibraryError, NonFiniteError
from .explore import Explorer, View, explore
from .generation import GenerateSettings, GenerationResult, generate
from .losses import DocLosses, EditEffect
from .models import ModelInfo, ModelSpecError, load_model, model_info, wrap_hf_model
from .options import DataOptions, RunOptions
from .plots.common import notebook_figures
from .protocols import PROTOCOLS
from .report import ModelReport, ReportSettings, run_battery, write_report
from .results import Provenance, Result, load_result, result_classes
from .sandbox import Execution, SandboxLimits, run_program
from .selection import TextSample, TextSelection, sample_texts
from .spaces import SPACES, SpaceSpec
from .sweep import AblationJob, DocumentNLL, EditJob, Metric, SweepRun, TokenNLL, run_sweep
from .training import FactorialResult, TrainConfig, TrainRun, run_design, run_factorial, train

__all__ = [
    "ABLATIONS",
    "EDITS",
    "PROTOCOLS",
    "SPACES",
    "AblationJob",
    "AblationRun",
    "AblationSettings",
    "AlignmentTable",
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
    "EditBase",
    "EditEffect",
    "EditJob",
    "EnvironmentFailure",
    "EvaluateSettings",
    "Execution",
    "Explorer",
    "FactorialResult",
    "Footprint",
    "FwdHooks",
    "GatedRemoval",
    "GenerateSettings",
    "GenerationResult",
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
    "NonFiniteError",
    "NullResult",
    "NullSettings",
    "Provenance",
    "RandomDirectionRemoval",
    "ReportSettings",
    "Result",
    "RunOptions",
    "SandboxLimits",
    "SanityReport",
    "SanitySettings",
    "ScaleSettings",
    "ScalingResult",
    "SensitivityResult",
    "SensitivitySettings",
    "SkipFirstLayers",
    "SpaceSpec",
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
    "generate",
    "geometry",
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
    "notebook_figures",
    "protocols",
    "result_classes",
    "run_ablations",
    "run_battery",
    "run_design",
    "run_factorial",
    "run_program",
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
    "wrap_hf_model",
    "write_report",
]
