"""Training-time interventions: small causal LMs trained with each arm's edit, paired by seed.

- :mod:`~lens_parallel.training.config`: :class:`TrainConfig` and the presets (``tiny``, ``cpu-small``, ``qwen3-59m``,
  ``xsa-controls-51m``);
- :mod:`~lens_parallel.training.arms`: the arms and their parameters (built from :mod:`lens_parallel.edits`);
- :mod:`~lens_parallel.training.loop`: :func:`train` one arm and seed, with exact resume;
- :mod:`~lens_parallel.training.factorial`: :func:`run_factorial` over arms x seeds, declared endpoints, a frozen
  analysis plan, and the paired analysis; :func:`run_design` (a protocol's factorial, such as the sanity-checks
  paper's ``xsa-controls``).
"""

from lens_parallel.training.arms import ARMS, ArmParameters
from lens_parallel.training.config import PRESETS, TrainConfig
from lens_parallel.training.factorial import Design, FactorialResult, paired_table, run_design, run_factorial
from lens_parallel.training.loop import TrainRun, load_trained, train

__all__ = [
    "ARMS",
    "PRESETS",
    "ArmParameters",
    "Design",
    "FactorialResult",
    "TrainConfig",
    "TrainRun",
    "load_trained",
    "paired_table",
    "run_design",
    "run_factorial",
    "train",
]
