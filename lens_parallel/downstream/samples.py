"""What the model answered on each item: lm-eval's logged samples turned into readable rows.

lm-eval logs, per task and item, the requests it made (``arguments``), the model's raw answers (``resps``), each
filter's extracted answer (``filtered_resps``, one logged row per filter) and every metric. :func:`task_answers`
turns one task's rows of every setting into columns, one entry per item x setting (items in doc-id order, settings
in order), with the item's context kept once per item:

- ``response``: a generation task's generated text (lm-eval's raw answer, before any filter); a multiple-choice
  task's chosen option, the argmax of the options' log-likelihoods as lm-eval's ``acc`` takes it (``chosen``: its
  index; ``chosen_norm``: lm-eval's ``acc_norm`` choice, the log-likelihoods divided by each option's characters,
  where the task reports ``acc_norm``); empty for a task that scores one continuation (``loglikelihood``: the
  continuation's summed log-likelihood and whether it is the greedy one) or a whole text (perplexity);
- ``answer[<filter>]``: each filter's extracted answer (generation tasks: GSM8K's ``strict-match`` and
  ``flexible-extract``, ...);
- ``target``: lm-eval's target (a multiple-choice index as its option's text);
- ``execution``: a code task's verdict on the program, with its reason (``passed``, ``failed: AssertionError in
  check, line 7``, ``timed out after 3 s``, ...: :class:`~lens_parallel.sandbox.fence.Execution`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lens_parallel import sandbox
from lens_parallel.downstream.task_functions import code_case, trusted_item

CONTEXT_SHORT = 160
"""Characters of a context kept in :meth:`~lens_parallel.downstream.effects.TaskResult.samples`'s short form (its
end, where the item's own question lies after any few-shot examples)."""


def short_context(context: str) -> str:
    """The last :data:`CONTEXT_SHORT` characters of ``context``, "…" marking a cut."""
    return context if len(context) <= CONTEXT_SHORT else "…" + context[-CONTEXT_SHORT:]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _context(row: dict[str, Any]) -> str:
    args = row["arguments"]
    return _text(args[0][0]) if args else ""


def _target(task: Any, row: dict[str, Any], options: Sequence[str]) -> str:
    target = row["target"]
    if task.OUTPUT_TYPE == "multiple_choice" and isinstance(target, (int, np.integer)) and 0 <= target < len(options):
        return options[int(target)]
    return _text(target)


def _answer_of(task: Any, row: dict[str, Any], metrics: Sequence[str]) -> dict[str, Any]:
    """The model's answer to one item (its first logged row; the same for every filter but the extracted one)."""
    kind = task.OUTPUT_TYPE
    if kind == "multiple_choice":
        options = [_text(o) for o in task.doc_to_choice(row["doc"])]
        lls = np.asarray([float(r[0]) for r in row["filtered_resps"]][: len(options)])
        chosen = int(np.argmax(lls))
        out: dict[str, Any] = {"response": options[chosen], "chosen": chosen}
        if "acc_norm" in metrics:
            out["chosen_norm"] = int(np.argmax(lls / np.asarray([float(len(o)) for o in options])))
        return out | {"target": _target(task, row, options)}
    if kind == "generate_until":
        out = {"response": _text(row["resps"][0][0]), "target": _target(task, row, ())}
        if task.config.unsafe_code:  # the sandbox's verdict on the program the metric scored
            program, tests = code_case(row["target"], row["filtered_resps"])
            got = sandbox.known(sandbox.Case(program, tests, **trusted_item(tests)))
            out["execution"] = got.result if got is not None else "not run"
        return out
    if kind == "loglikelihood":
        ll, greedy = row["filtered_resps"][0]
        return {"response": "", "loglikelihood": float(ll), "is_greedy": bool(greedy), "target": _target(task, row, ())}
    return {"response": "", "target": _target(task, row, ())}  # loglikelihood_rolling: the text is the context


def task_answers(
    task: Any, runs: dict[str, list[dict[str, Any]]], settings: Sequence[str]
) -> tuple[list[str], dict[str, list[Any]]]:
    """One task's items: their contexts (doc-id order) and the answer columns (module docstring), one entry per
    item x setting, from ``runs`` (each setting's logged rows of this task, one per item and filter)."""
    by_setting: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for setting in settings:
        grouped: dict[int, list[dict[str, Any]]] = {}
        for row in runs[setting]:
            grouped.setdefault(int(row["doc_id"]), []).append(row)
        by_setting[setting] = grouped
    doc_ids = sorted(by_setting[settings[0]])
    contexts = [_context(by_setting[settings[0]][d][0]) for d in doc_ids]
    columns: dict[str, list[Any]] = {"setting": [], "item": []}
    filters = [r.get("filter", "none") for r in by_setting[settings[0]][doc_ids[0]]] if doc_ids else []
    for setting in settings:
        for item, doc in enumerate(doc_ids):
            rows = by_setting[setting][doc]
            entry = _answer_of(task, rows[0], rows[0].get("metrics", ()))
            if task.OUTPUT_TYPE == "generate_until":
                by_filter = {r.get("filter", "none"): r["filtered_resps"] for r in rows}
                entry |= {f"answer[{f}]": _text(_first(by_filter.get(f))) for f in filters}
            entry |= {"setting": setting, "item": item}
            n_rows = len(columns["setting"])
            for key in entry:
                columns.setdefault(key, [None] * n_rows)
            for key, column in columns.items():
                column.append(entry.get(key))
    return contexts, columns


def _first(value: Any) -> Any:
    """A filter's answer: lm-eval keeps one per repeat (a list), a code task's filter a list of candidate programs
    per repeat: the first, as text (never a list's repr)."""
    while isinstance(value, list) and value:
        value = value[0]
    return value
