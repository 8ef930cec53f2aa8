"""Named task sets: the directional-decomposition paper's two, and one sized for a 2-core machine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lens_parallel.errors import LensParallelError


@dataclass(frozen=True, kw_only=True)
class TaskPreset:
    """``tasks``: (task name, shots) pairs; ``limit``: items per task (None: all); what it reproduces (``note``)."""

    tasks: tuple[tuple[str, int], ...]
    limit: int | None
    note: str


TASK_PRESETS: dict[str, TaskPreset] = {
    "directional-decomposition-pretrained": TaskPreset(
        tasks=(
            ("arc_easy_validation", 0),
            ("boolq", 0),
            ("lambada_openai", 0),
            ("openbookqa_validation", 0),
            ("piqa", 0),
            ("rte", 0),
            ("hellaswag", 10),
            ("winogrande", 5),
        ),
        limit=None,
        note=(
            "arXiv 2609.15975's pretrained-model table and task-wise figure: ARC-Easy, BoolQ, LAMBADA, OpenBookQA, "
            "PIQA, RTE at 0 shots, HellaSwag 10, WinoGrande 5; offline, so ARC-Easy and OpenBookQA on their "
            "validation splits (the paper: test) and few-shot examples from the scored split"
        ),
    ),
    "directional-decomposition-general": TaskPreset(
        tasks=(
            ("openbookqa", 0),
            ("piqa", 0),
            ("rte", 0),
            ("winogrande", 5),
            ("boolq", 0),
            ("arc_challenge", 25),
            ("hellaswag", 10),
            ("mmlu", 5),
        ),
        limit=None,
        note=(
            "the loglikelihood settings of arXiv 2609.15975's Qwen3-1.7B general-task averages (lm-eval's own task "
            "names: online); its six generation tasks (GSM8K, HumanEval, NQ-Open, DROP, MBPP, BBH CoT) are left "
            "out, since lens_parallel scores loglikelihoods only, so its average is over 8 of the 14 settings"
        ),
    ),
    "quick": TaskPreset(
        tasks=(("piqa", 0), ("arc_easy_validation", 0), ("copa", 0), ("lambada_openai", 0)),
        limit=60,
        note="four offline 0-shot tasks, 60 items each: minutes on 2 CPU cores for a 135M model",
    ),
}
"""Every task preset by name."""

TaskList = str | Sequence[str | tuple[str, int]]
"""A preset name, or task names, or (task name, shots) pairs."""


def resolve_tasks(tasks: object) -> tuple[list[tuple[str, int | None]], int | None]:
    """``tasks`` as (name, shots or None: the task's default) pairs and the preset's item limit (None otherwise)."""
    if isinstance(tasks, str):
        if tasks in TASK_PRESETS:
            preset = TASK_PRESETS[tasks]
            return [(n, k) for n, k in preset.tasks], preset.limit
        return [(tasks, None)], None
    if not isinstance(tasks, (list, tuple)):
        raise LensParallelError(f"tasks is a preset name or a list of task names, got {type(tasks).__name__}")
    plan: list[tuple[str, int | None]] = []
    for item in tasks:
        if isinstance(item, str):
            plan.append((item, None))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int):
            plan.append((item[0], item[1]))
        else:
            raise LensParallelError(f"a task is a name or a (name, shots) pair, got {item!r}")
    if not plan:
        raise LensParallelError(f"no tasks given; presets: {', '.join(TASK_PRESETS)}")
    return plan, None
