"""Named task sets: the directional-decomposition paper's two, RULER's offline long-context tasks, and one sized for a
2-core machine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lens_parallel.errors import LensParallelError


@dataclass(frozen=True, kw_only=True)
class TaskPreset:
    """``tasks``: (task name, shots: None for the task's own) pairs; ``limit``: items per task (None: all); what it
    reproduces (``note``). Tasks scored by running model-written code are left out of a run without
    ``allow_code_execution``, and said so (:func:`~lens_parallel.downstream.effects.task_effects`).
    ``max_seq_lengths``: the prompt lengths of RULER's synthetic tasks (None: RULER's 4096)."""

    tasks: tuple[tuple[str, int | None], ...]
    limit: int | None
    note: str
    max_seq_lengths: tuple[int, ...] | None = None
    reference: dict[str, float] | None = None
    """The paper's average score over the preset's tasks (percent) per setting, printed beside a run as context."""


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
            ("gsm8k", 5),
            ("humaneval", 0),
            ("nq_open", 5),
            ("drop", 0),
            ("mbpp", 3),
            ("bbh_cot_zeroshot", 0),
        ),
        limit=None,
        note=(
            "the 14 settings of arXiv 2609.15975's Qwen3-1.7B general-task averages, as its authors' script runs "
            "them, with lm-eval's own task names (online: the hub's data): OBQA 0, PIQA 0, RTE 0, WinoGrande 5, "
            "BoolQ 0, ARC-Challenge 25, HellaSwag 10, MMLU 5, GSM8K 5, HumanEval 0, NQ-Open 5, DROP 0, MBPP 3, BBH "
            "CoT 0-shot; the generation tasks decoded under the edits. HumanEval and MBPP run the code the model "
            "writes: only with allow_code_execution, else left out and said so. Offline, each task whose data cannot "
            "be reached is replaced by its stand-in (openbookqa_validation, arc_challenge_validation, gsm8k_cot's 8 "
            "fixed shots for GSM8K, nq_open_validation_shots, drop_validation1000; HumanEval, MBPP and MMLU read "
            "the shipped items under lm-eval's names) and BBH, which has no offline source, is left out: each said "
            "in one line, the average over the tasks that ran"
        ),
        reference={
            "unedited": 53.0,
            "value-parallel removal": 53.2,
            "attention-output parallel removal": 42.4,
            "hard diagonal removal": 26.9,
        },
    ),
    "long-context": TaskPreset(
        tasks=(
            ("niah_single_1", 0),
            ("niah_multikey_2", 0),
            ("niah_multikey_3", 0),
            ("ruler_vt", 0),
            ("ruler_cwe", 0),
            ("ruler_fwe", 0),
        ),
        limit=None,
        max_seq_lengths=(4096,),
        note=(
            "lm-eval's RULER tasks that need no download (needle in a haystack: one needle, multi-key with needle "
            "haystacks; variable tracking; common and frequent word extraction), built from the model's own "
            "tokenizer at max_seq_lengths tokens (default 4096) and generated under the edits (128 tokens, greedy); "
            "the essay and QA tasks read the hub and are online only"
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


def resolve_tasks(tasks: object) -> tuple[list[tuple[str, int | None]], TaskPreset | None]:
    """``tasks`` as (name, shots or None: the task's default) pairs and the preset they come from (None: named)."""
    if isinstance(tasks, str):
        if tasks in TASK_PRESETS:
            preset = TASK_PRESETS[tasks]
            return list(preset.tasks), preset
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
