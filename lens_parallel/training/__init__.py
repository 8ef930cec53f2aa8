"""Training-time interventions: small causal LMs trained with each arm's edit, paired by seed.

- :mod:`~lens_parallel.training.config`: :class:`TrainConfig` and the presets (``tiny``, ``cpu-small``, ``gpu-50m``);
- :mod:`~lens_parallel.training.arms`: the arms and their parameters (built from :mod:`lens_parallel.edits`);
- :mod:`~lens_parallel.training.loop`: :func:`train` one arm and seed, with exact resume;
- :mod:`~lens_parallel.training.factorial`: :func:`run_factorial` over arms x seeds and the paired analysis.
"""

from lens_parallel.training.arms import ARMS, ArmParameters
from lens_parallel.training.config import PRESETS, TrainConfig
from lens_parallel.training.factorial import FactorialResult, paired_table, run_factorial
from lens_parallel.training.loop import TrainRun, load_trained, train

__all__ = [
    "ARMS",
    "PRESETS",
    "ArmParameters",
    "FactorialResult",
    "TrainConfig",
    "TrainRun",
    "load_trained",
    "paired_table",
    "run_factorial",
    "train",
]
