"""What the edited model answered, readable per item, and no number from a run that did not happen: ``samples()``
against lm-eval's own logged samples, contexts cut to fit the model counted by hand, RULER lengths beyond the
model's context and unreachable hub data refused in one line before any work, task settings typed."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pandas as pd
import pytest
from sqlitedict import SqliteDict

import lens_parallel as lp
from lens_parallel.cli import main
from lens_parallel.downstream import data as task_data
from lens_parallel.downstream import effects, loading, offline, settings
from lens_parallel.downstream.effects import TaskResult, task_effects
from lens_parallel.downstream.lm import EditedLM
from lens_parallel.tokenizers import hf_tokenizer
from tests.conftest import get_model

pytestmark = pytest.mark.xdist_group("task_answers")  # one worker: the module's shared run is built once

TASKS = [("copa", 0), ("lambada_openai", 0), "gsm8k_cot"]


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    """toy-gpt2 on a multiple-choice, a single-continuation and a generation task, under one edit, with a store;
    and lm-eval's own logged samples of the unedited model on the same items (a separate ``simple_evaluate``)."""
    from lm_eval.evaluator import simple_evaluate

    model = get_model("toy-gpt2")
    store = tmp_path_factory.mktemp("answers") / "requests.sqlite"
    run = dict(limit=3, max_gen_toks=6, n_resamples=20, progress=False, store=store)
    result = task_effects(model, {"zero diagonal": lp.ZeroDiagonal()}, TASKS, **run)
    loaded = loading.load_tasks([t if isinstance(t, tuple) else (t, None) for t in TASKS], None)
    manager, tasks = loaded.manager, loaded.tasks
    lm = EditedLM(model, (), max_gen_toks=6, progress=False)
    logged = simple_evaluate(
        model=lm, tasks=list(tasks.values()), limit=3, log_samples=True, task_manager=manager, bootstrap_iters=0
    )
    return model, result, logged["samples"], tasks, store


def test_samples_are_lm_evals_own_logged_answers(answered):
    _, result, logged, tasks, _ = answered
    frame = result.samples()
    assert list(frame.columns[:6]) == ["task", "doc_id", "setting", "context", "target", "response"]
    assert len(frame) == 3 * 3 * 2 and set(frame["setting"]) == {"unedited", "zero diagonal"}
    ours = frame[frame["setting"] == "unedited"].set_index(["task", "doc_id"])
    for row in logged["copa"]:  # multiple choice: the option lm-eval's acc takes, its text and its score
        got = ours.loc[("copa", row["doc_id"])]
        chosen = int(np.argmax([r[0][0] for r in row["resps"]]))  # resps: per option [(loglikelihood, greedy)]
        assert got["chosen"] == chosen and got["response"] == tasks["copa"].doc_to_choice(row["doc"])[chosen]
        assert got["acc"] == row["acc"] and got["target"] == row["target"]
        assert result.context("copa", row["doc_id"]) == row["arguments"][0][0]
    for row in logged["lambada_openai"]:  # one continuation: its log-likelihood and whether it is greedy
        got = ours.loc[("lambada_openai", row["doc_id"])]
        assert (
            got["loglikelihood"] == pytest.approx(row["resps"][0][0][0]) and got["is_greedy"] == row["resps"][0][0][1]
        )
    for row in logged["gsm8k_cot"]:  # generation: the text, and each filter's extracted answer and exact match
        got = ours.loc[("gsm8k_cot", row["doc_id"])]
        assert got["response"] == row["resps"][0][0] and got["target"] == row["target"]
        flt = row["filter"]
        assert got[f"answer[{flt}]"] == row["filtered_resps"][0] and got[f"exact_match,{flt}"] == row["exact_match"]
        assert got["context"].startswith("…") and row["arguments"][0][0].endswith(got["context"][1:])


def test_samples_are_saved_and_loaded_and_drawn_side_by_side(answered, tmp_path):
    _, result, _, _, _ = answered
    loaded = TaskResult.load(result.save(tmp_path / "tasks"))
    pd.testing.assert_frame_equal(loaded.samples(context="full"), result.samples(context="full"))
    page = result.samples_html()
    assert page.startswith("<!DOCTYPE html>") and page.count("<table") == 3
    assert "width:100%;table-layout:fixed" in page and "overflow-wrap:anywhere" in page  # the table fits the page
    assert all(f"<th>{s}</th>" in page for s in result.settings) and "gsm8k_cot: 3 of 3 items" in page
    with pytest.raises(lp.LensParallelError, match="unknown context 'middle'; accepted: short, full"):
        result.samples(context="middle")


def test_the_store_is_one_file_a_table_per_setting_and_a_rerun_reads_it(answered, monkeypatch):
    model, result, _, _, store = answered
    tables = SqliteDict.get_tablenames(str(store))
    assert len([t for t in tables if t.startswith("requests_")]) == 2  # the unedited run and the edited one
    monkeypatch.setattr("lens_parallel.downstream.lm.forward", _no_forward)
    monkeypatch.setattr("lens_parallel.downstream.lm.decode_batch", _no_forward)
    run = dict(limit=3, max_gen_toks=6, n_resamples=20, progress=False, store=store)
    again = task_effects(model, {"zero diagonal": lp.ZeroDiagonal()}, TASKS, **run)  # nothing recomputed
    pd.testing.assert_frame_equal(again.samples(), result.samples())
    assert again.truncated == result.truncated  # stored answers' contexts are counted too


def _no_forward(*args, **kwargs):
    raise AssertionError("a forward ran")


def test_cut_contexts_are_counted_as_a_hand_count(answered):
    model, result, logged, _, _ = answered
    tokenizer, n_ctx = hf_tokenizer(model), int(model.cfg.n_ctx)
    by_hand = sum(len(tokenizer.encode(row["arguments"][0][0])) > n_ctx - 6 for row in logged["gsm8k_cot"]) // 2
    assert by_hand == 3  # 8-shot contexts do not fit toy-gpt2's 512 tokens: every one is cut (one row per filter)
    assert result.truncated["gsm8k_cot"] == {"unedited": 3, "zero diagonal": 3}
    assert result.truncated["copa"] == {"unedited": 0, "zero diagonal": 0}
    assert result.provenance.settings["truncated"] == result.truncated


def test_a_mix_of_cut_and_whole_contexts_is_counted_exactly():
    model = get_model("toy-gpt2")
    tokenizer, n_ctx = hf_tokenizer(model), int(model.cfg.n_ctx)
    tasks = loading.load_tasks([("nq_open_validation_shots", None)], None).tasks
    task = tasks["nq_open_validation_shots"]
    task.build_all_requests(limit=6, rank=0, world_size=1)
    lengths = sorted(len(tokenizer.encode(inst.args[0])) for inst in task.instances)
    max_gen = n_ctx - lengths[2]  # the three longest contexts no longer fit
    by_hand = sum(length > n_ctx - max_gen for length in lengths)
    assert 0 < by_hand < 6
    with pytest.warns(UserWarning, match=rf"{by_hand} of 6 nq_open_validation_shots contexts were cut to {lengths[2]}"):
        result = task_effects(model, (), ["nq_open_validation_shots"], limit=6, max_gen_toks=max_gen, progress=False)
    assert result.truncated["nq_open_validation_shots"]["unedited"] == by_hand


def _refuse_loading(monkeypatch):
    monkeypatch.setattr(effects, "load_tasks", _no_forward)
    monkeypatch.setattr(effects, "check_task_names", _no_forward)


def test_ruler_beyond_the_models_context_is_refused_in_one_line_before_any_task_loads(monkeypatch):
    _refuse_loading(monkeypatch)
    with pytest.raises(lp.LensParallelError) as refused:
        task_effects(get_model("toy-gpt2"), lp.ZeroDiagonal(), "long-context", limit=1)
    assert str(refused.value) == (
        "RULER at 4,096 tokens cannot run on toy-gpt2, whose context is 512 tokens: RULER's shortest length is "
        "4,096, so it can serve none"
    )
    with pytest.raises(
        lp.LensParallelError, match="max_seq_lengths 512: lm-eval's RULER tasks score only 4,096, 8,192"
    ):
        task_effects(get_model("toy-gpt2"), lp.ZeroDiagonal(), "long-context", max_seq_lengths=(512,))


def test_the_scored_ruler_lengths_are_the_ones_every_ruler_task_declares():
    from lens_parallel import compat
    from lens_parallel.downstream import data

    index = data.task_manager(None).task_index
    for name in data.RULER_SYNTHETIC | data.RULER_ONLINE:
        declared = [m["metric"] for m in compat.task_yaml(str(index[name].yaml_path))["metric_list"]]
        assert tuple(int(m) for m in declared) == data.RULER_SCORED_LENGTHS, name


def test_task_settings_are_typed_and_checked_before_any_task_loads(monkeypatch):
    _refuse_loading(monkeypatch)
    with pytest.raises(lp.LensParallelError, match="max_gen_toks=100000 leaves no room for a context in toy-gpt2's"):
        task_effects(get_model("toy-gpt2"), lp.ZeroDiagonal(), ["gsm8k_cot"], max_gen_toks=100000)
    for field, value, message in [
        ("add_bos_token", "yes", "add_bos_token must be True, False or None, got 'yes'"),
        ("apply_chat_template", "no", "apply_chat_template must be True or False, got 'no'"),
        ("allow_code_execution", 1, "allow_code_execution must be True or False, got 1"),
    ]:
        with pytest.raises(lp.LensParallelError, match=message):
            unchecked(settings.TaskSettings, **{field: value})
    with pytest.raises(lp.LensParallelError, match="progress must be True or False, got 'no'"):
        unchecked(lp.RunOptions, progress="no")


def unchecked(cls, **fields):
    """``cls(**fields)`` past the suite's runtime type checker (which refuses a mistyped field before the package's
    own check can: without it, as users run, the package's one-line error is what they get)."""
    obj = object.__new__(cls)
    inspect.unwrap(cls.__init__)(obj, **fields)
    return obj


def test_hub_tasks_named_offline_are_one_line_naming_the_alternatives_and_exit_3(monkeypatch, tmp_path, capsys):
    """Tasks named one by one (not a preset, which substitutes) are refused offline in one line that names each
    offline alternative, before any forward."""
    monkeypatch.setattr(offline, "hub_offline", lambda: True)
    monkeypatch.setattr(loading, "hub_offline", lambda: True)
    names = ["openbookqa", "gsm8k", "nq_open", "drop", "bbh_cot_fewshot"]
    line = ["tasks", "--model", "toy-gpt2", "--tasks", *names, "--limit", "1"]
    assert main([*line, "--no-progress", "--out", str(tmp_path)]) == 3
    (failed,) = capsys.readouterr().err.strip().splitlines()  # one line
    assert failed.startswith("lens-parallel tasks: could not run: the Hugging Face hub cannot be reached")
    pairs = ("openbookqa -> openbookqa_validation", "gsm8k -> gsm8k_cot", "nq_open -> nq_open_validation_shots")
    assert all(pair in failed for pair in (*pairs, "drop -> drop_validation1000"))
    assert failed.endswith("none for bbh_cot_fewshot")
    assert not list(tmp_path.glob("tasks*.json"))


def test_offline_alternatives_are_the_local_tasks_of_the_same_name():
    assert task_data.alternative("arc_easy") == "arc_easy_validation" and task_data.alternative("piqa") is None
    assert task_data.alternative("gsm8k") == "gsm8k_cot" and task_data.alternative("bbh_cot_fewshot") is None
    assert task_data.alternative("drop") == "drop_validation1000" and task_data.alternative("humaneval") is None
    assert json.loads(json.dumps(offline.STAND_INS)) == offline.STAND_INS


def test_a_run_outside_a_checkout_prints_no_git_error(monkeypatch, tmp_path, capfd):
    monkeypatch.chdir(tmp_path)  # not a git repository: lm-eval's ``git describe`` would say "fatal: ..."
    result = task_effects(get_model("toy-gpt2"), (), [("copa", 0)], limit=2, n_resamples=20, progress=False)
    assert result.scores["copa"]["acc"]["unedited"] in (0.0, 0.5, 1.0)
    assert "fatal" not in capfd.readouterr().err


def test_ruler_is_imported_without_an_nltk_download_or_its_false_report(monkeypatch, capsys):
    import sys

    import nltk

    from lens_parallel.downstream import harness

    real_find = nltk.data.find

    def missing(resource, *args, **kwargs):
        if resource == "tokenizers/punkt_tab":
            raise LookupError(resource)
        return real_find(resource, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "lm_eval.tasks.ruler.prepare_niah", raising=False)
    monkeypatch.setattr(nltk.data, "find", missing)
    monkeypatch.setattr(nltk, "download", _no_forward)  # any download attempt fails the test
    harness.import_ruler_without_download()
    assert "lm_eval.tasks.ruler.prepare_niah" in sys.modules and nltk.data.find is missing
    assert "punkt_tab" not in capsys.readouterr().out


def test_printed_lines_are_dropped_by_pattern_and_every_other_line_passes(capsys):
    import re

    from lens_parallel.logs import RULER_PRINTED_LINE, drop_printed_lines

    with drop_printed_lines(RULER_PRINTED_LINE):
        print("Max length 4096 | Current length 1234 | Noises: 5")
        print("kept line")
        print("Num noises: 140")
        print("reduces chain length for not enough noises")
        print("Max length 512 | Current length 600 | Noises: 1\nalso kept", end="")
    assert capsys.readouterr().out == "kept line\nalso kept"
    with drop_printed_lines(re.compile("x")):
        print("Max length 4096 | Current length 1234")
    assert capsys.readouterr().out == "Max length 4096 | Current length 1234\n"


def test_the_summary_holds_one_number_per_cell_named_by_what_it_averages(answered, tmp_path):
    """Two averages (acc over copa and LAMBADA, score over all three): one column set each, every cell a number,
    the CSV the command line writes read back as numbers."""
    _, result, _, _, _ = answered
    summary = result.summary()
    table = result.differences()
    for metric in ("acc", "score"):
        average = table[(table["task"] == "average") & (table["metric"] == metric)].iloc[0]
        for key, column in (("difference", "difference"), ("difference_lo", "ci_low"), ("difference_hi", "ci_high")):
            cell = summary.iloc[0][f"average_{metric}_{key}[zero diagonal]"]
            assert isinstance(cell, float) and cell == pytest.approx(average[column], nan_ok=True)
    summary.to_csv(tmp_path / "tasks_summary.csv", index=False)
    read = pd.read_csv(tmp_path / "tasks_summary.csv")
    assert len(read) == 1 and all(read[c].dtype == float for c in read.columns if c.startswith("average_"))


def test_every_difference_says_its_unit_and_the_table_says_percent(answered):
    _, result, _, _, _ = answered
    units = result.differences().set_index(["task", "metric"])["unit"]
    assert units[("copa", "acc")] == units[("average", "score")] == units[("gsm8k_cot", "exact_match,strict-match")]
    assert units[("copa", "acc")] == "fraction" and units[("lambada_openai", "perplexity")] == "perplexity"
    table = result.table()
    assert table.columns.name.startswith("percent") and "percentage points" in table.columns.name
    copa = result.differences().set_index(["task", "metric"]).loc[("copa", "acc")]
    assert table.loc["zero diagonal", "copa"] == pytest.approx(100 * copa["edited"])  # the same number, in percent
