"""The functions the offline task definitions name (``!function lens_parallel_functions.<name>`` in the task folder
:func:`lens_parallel.downstream.data.task_definitions` writes, whose module re-exports these) where lm-eval's own
cannot serve offline: HumanEval's and MBPP's metric loads Hugging Face ``evaluate``'s ``code_eval`` from the hub, and
DROP's documents ship in the form lm-eval's ``process_docs`` returns, not the hub's.
"""

from __future__ import annotations

import ast
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lens_parallel import sandbox
from lens_parallel.downstream.data import task_data_folder
from lens_parallel.errors import LensParallelError

__all__ = ["drop_docs", "humaneval_predictions", "mbpp_predictions", "pass_at_1"]


def code_case(references: str | list[str], predictions: str | list[Any]) -> tuple[str, str]:
    """The (program, tests) of one code item from what lm-eval hands its metric: ``references`` the test code, and
    the filtered answer in ``predictions`` (a list of candidates, or a list of one list): the first candidate."""
    test = references[0] if isinstance(references, list) else references
    candidate: Any = predictions[0] if isinstance(predictions, list) else predictions
    while isinstance(candidate, list):
        candidate = candidate[0]
    return str(candidate), str(test)


def pass_at_1(references: str | list[str], predictions: str | list[Any], **kwargs: Any) -> float:
    """1.0 when the first candidate program passes the item's tests, else 0.0: Hugging Face ``code_eval``'s
    pass@1 of ``candidate + "\\n" + test``, with the program in the sandbox and the tests in the judge
    (:func:`lens_parallel.sandbox.run_program`; its verdict shared through :mod:`lens_parallel.sandbox.pool`).
    The item is found by its tests (:func:`trusted_item`: its prompt and entry point, which the judge trusts), also
    where no filter started it; tests that are no item's are refused in one line."""
    program, tests = code_case(references, predictions)
    return float(sandbox.verdict(sandbox.Case(program, tests, **trusted_item(tests))).passed)


@functools.cache
def _items() -> dict[str, dict[str, Any]]:
    folder = task_data_folder()
    found: dict[str, dict[str, Any]] = {}
    for doc in _read_jsonl(folder / "humaneval.jsonl"):
        found[humaneval_tests(doc)] = {"prompt": doc["prompt"], "entry_point": doc["entry_point"]}
    for doc in _read_jsonl(folder / "mbpp.jsonl"):
        found[mbpp_tests(doc)] = {"prompt": "", "entry_point": mbpp_entry_point(doc)}
    return found


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def trusted_item(tests: str) -> dict[str, Any]:
    """What the judge trusts of the HumanEval or MBPP item whose tests (as lm-eval renders its target) are
    ``tests``: its ``prompt`` (HumanEval's; MBPP has none) and ``entry_point``. Tests that are no item's are refused
    in one line: a program is never judged without its item's prompt."""
    try:
        return _items()[tests]
    except KeyError:
        raise LensParallelError(
            f"pass_at_1 scores a program against a HumanEval or MBPP item, found by its tests, and these tests are no "
            f"item's ({' '.join(tests.split())[:80]!r}...): score the task with lens_parallel's offline definition "
            "(task_effects(..., tasks=['humaneval'])), whose filter passes each item"
        ) from None


def humaneval_tests(doc: Mapping[str, Any]) -> str:
    """HumanEval's target as lm-eval renders it (``{{test}}\\ncheck({{entry_point}})``)."""
    return f"{doc['test']}\ncheck({doc['entry_point']})"


def mbpp_tests(doc: Mapping[str, Any]) -> str:
    """MBPP's target as lm-eval renders it for a scored item: its first three asserts, one per line."""
    return "\n".join(doc["test_list"][:3])


def mbpp_entry_point(doc: Mapping[str, Any]) -> str | None:
    """The function an MBPP item tests (MBPP names none): the first one its asserts call that the dataset's
    reference solution defines, so that the judge calls the program's even where it has a builtin's name (task 126
    tests a ``sum``)."""
    defined = {n.name for n in ast.parse(doc["code"]).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    calls = [n for n in ast.walk(ast.parse(mbpp_tests(doc))) if isinstance(n, ast.Call)]
    return next((c.func.id for c in calls if isinstance(c.func, ast.Name) and c.func.id in defined), None)


def humaneval_predictions(resps: list[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """HumanEval's filter (lm-eval's ``build_predictions``): each generated body after its prompt; every item's
    first program started at once (:func:`lens_parallel.sandbox.start`), judged with the item's prompt
    and entry point (the prompt's helpers run in the judge, as the dataset wrote them)."""
    out = [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs, strict=True)]
    for candidates, doc in zip(out, docs, strict=True):
        sandbox.start(sandbox.Case(candidates[0], humaneval_tests(doc), doc["prompt"], doc["entry_point"]))
    return out


def mbpp_predictions(resps: list[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """MBPP's answers unchanged (lm-eval's ``take_first`` follows), every item's first program started at once."""
    for resp, doc in zip(resps, docs, strict=True):
        sandbox.start(sandbox.Case(resp[0], mbpp_tests(doc), entry_point=mbpp_entry_point(doc)))
    return resps


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
