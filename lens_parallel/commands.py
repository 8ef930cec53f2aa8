"""The subcommands of ``lens-parallel`` (:mod:`lens_parallel.cli` parses; this module runs), and the options
objects its parser is generated from.

    lens-parallel decompose|scale|diagonal|sensitivity|dominance|checks|compress [--model M] [options] [--out DIR]
    lens-parallel report [--model M [M ...]]        # the standard battery, one self-contained report.html
    lens-parallel train --preset cpu-small          # training-time interventions, paired by seed
    lens-parallel models                            # what loads offline now, what needs the hub
    lens-parallel protocols                         # the named protocols (a study's saved settings)

Every option of a subcommand is a field of one of the objects it runs with: the analysis's settings (e.g.
:class:`~lens_parallel.analyses.scaling.ScaleSettings`), :class:`~lens_parallel.options.RunOptions` and
:class:`~lens_parallel.options.DataOptions` (the model and the documents). An option's default is the field's
default, shown in ``--help``; only what is typed is passed on, so a ``--protocol`` supplies every setting not typed.
The parser is data: :func:`parser_spec` generates it from those objects, ``lens_parallel/assets/cli_spec.json``
holds it (``python scripts/build_cli_spec.py`` writes it; a test checks it is current), and :mod:`lens_parallel.cli`
builds argparse from it without importing torch or any analysis, so ``--help`` and a mistyped option answer at
once; this module and the analyses load only to run a parsed command (:func:`run`).

Every analysis writes a CSV table, the result as JSON (+ .npz, with provenance), its figures as interactive HTML
(and PNG when kaleido can find a Chrome/Chromium), and prints a short table. Bad input exits with status 2 and one
line on stderr (:class:`~lens_parallel.errors.LensParallelError`); a failed environment (no registry, no Ray) with
status 3 and what failed and what to do (:class:`~lens_parallel.errors.EnvironmentFailure`); anything else (a
:class:`~lens_parallel.errors.LibraryError`, a bug) keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import functools
import json
import operator
import os
import re
import shutil
import sys
import textwrap
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union

import pandas as pd

from lens_parallel.choices import SensitivityMethod
from lens_parallel.errors import EnvironmentFailure, LensParallelError, interrupt_message, one_line_interrupt
from lens_parallel.options import RENAMED, DataOptions, RunOptions, resolve
from lens_parallel.paths import SPEC_PATH, add_suffix, check_writable, write_atomic, write_table
from lens_parallel.protocols import PROTOCOLS
from lens_parallel.validate import check_non_negative_int, literal_values

OUTPUT_SUFFIXES = (".csv", ".json", ".jsonl", ".npz", ".html", ".png", ".sqlite")


# -- options of the command line only ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SensitivityCommand:
    """How ``sensitivity`` measures: ``method`` ``exact`` (one ablation per head on the engine) or ``attribution``
    (every head from one forward and one backward), the top ``confirm`` heads of a screen then run exactly."""

    method: SensitivityMethod = field(default="exact", metadata={"help": "exact ablations, or an attribution screen"})
    confirm: int = field(default=0, metadata={"help": "attribution: rerun the top K heads (and K random) exactly"})

    def __post_init__(self) -> None:
        check_non_negative_int("confirm", self.confirm)


@dataclass(frozen=True, kw_only=True)
class TasksCommand:
    """What ``tasks`` scores: the ``settings`` (edit specs such as ``value:s_par=0`` or a YAML / JSON file naming
    them) and the ``tasks`` (a preset or task names), each against the unedited model."""

    settings: tuple[str, ...] = field(
        default=("value:s_par=0",), metadata={"help": "edit specs (value:s_par=0, zero-diagonal, ...) or a file"}
    )
    tasks: tuple[str, ...] = field(default=("quick",), metadata={"help": "a task preset, or task names"})


@dataclass(frozen=True, kw_only=True)
class GlossaryCommand:
    """Which columns ``glossary`` defines (:mod:`lens_parallel.glossary`)."""

    columns: tuple[str, ...] = field(
        default=(), metadata={"help": "column names, as the tables have them", "none": "every column"}
    )


@dataclass(frozen=True, kw_only=True)
class GenerateCommand:
    """What ``generate`` continues: the ``prompt`` texts and/or a ``prompts_file`` (one prompt a line, UTF-8), under
    each of the ``settings`` (edit specs, as ``tasks``) beside the unedited model."""

    prompt: tuple[str, ...] = field(default=(), metadata={"help": "prompt text(s)"})
    prompts_file: str | None = field(default=None, metadata={"help": "a file of prompts, one a line", "none": "none"})
    settings: tuple[str, ...] = field(
        default=(), metadata={"help": "edit specs (value:s_par=0, zero-diagonal, ...) or a file", "none": "none"}
    )

    def prompts(self) -> list[str]:
        """The prompts given, the file's non-empty lines after them; refused in one line when there are none or the
        file cannot be read."""
        found = list(self.prompt)
        if self.prompts_file is not None:
            path = Path(self.prompts_file)
            try:
                found += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            except (OSError, UnicodeDecodeError) as exc:
                raise LensParallelError(f"cannot read the prompts file {path}: {exc}") from None
        if not found:
            raise LensParallelError("give at least one prompt: --prompt TEXT or --prompts-file PATH")
        return found


@dataclass(frozen=True)
class Command:
    """A subcommand: its help, the settings classes whose fields are its options (the first is the analysis's),
    its defaults for :class:`DataOptions` (None: no model or documents), the :class:`RunOptions` fields it takes,
    the stem of its output files and, where it keeps one, the default name of its store."""

    help: str
    run: Callable[[Invocation], None]
    settings: tuple[type, ...] = ()
    data: dict[str, Any] | None = None
    run_fields: tuple[str, ...] = ("batch_size", "progress")
    stem: str = ""
    store: str | None = None
    many_models: bool = False
    data_fields: tuple[str, ...] | None = None


SWEEP = ("batch_size", "memory_budget", "tokens_per_forward", "store", "progress", "workers", "ray_address")


# -- the generator -----------------------------------------------------------------------------------------------


def _members(hint: Any) -> list[Any]:
    if typing.get_origin(hint) in (Union, UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


def _scalar(hint: Any) -> tuple[str, tuple[str, ...] | None]:
    """How one value of a field is read from the command line: (the name of its type in
    :data:`~lens_parallel.cli.ARGUMENT_TYPES`, choices)."""
    members = _members(hint)
    literals = [m for m in members if typing.get_origin(m) is Literal]
    if literals and all(typing.get_origin(m) is Literal for m in members):
        return "str", tuple(v for m in literals for v in literal_values(m))
    if int in members and any(typing.get_origin(m) is Literal for m in members):  # heads: indices or "all"
        return "int_or_word", None
    if members == [int]:
        return "int", None
    if members == [float]:
        return "float", None
    return "str", None


def _argument(hint: Any, metadata: dict[str, Any]) -> dict[str, Any]:
    """argparse keywords for a field of type ``hint``, as data (types and actions by name: :mod:`lens_parallel.cli`)."""
    members = _members(hint)
    if members == [bool]:
        return {"action": "boolean_optional"}
    sequence = next((m for m in members if typing.get_origin(m) is tuple), None)
    kw: dict[str, Any] = {}
    if sequence is not None:
        element = typing.get_args(sequence)[0]
        extra = [m for m in members if m is not sequence]
        scalar, choices = _scalar(functools.reduce(operator.or_, extra, element))
        kw = {"nargs": "+", "type": scalar}
    else:
        scalar, choices = _scalar(hint)
        kw = {"type": scalar}
    named = metadata.get("choices")
    if isinstance(named, str):
        choices = tuple(_NAMED_CHOICES[named]())
    elif named is not None:
        choices = tuple(named)
    if choices:
        kw["choices"] = list(choices) + list(metadata.get("also", ()))
    return kw


def _named_presets() -> list[str]:
    from lens_parallel.training import PRESETS

    return sorted(PRESETS)


def _named_designs() -> list[str]:
    from lens_parallel.protocols import designs

    return sorted(designs())


_NAMED_CHOICES: dict[str, Callable[[], list[str]]] = {"presets": _named_presets, "designs": _named_designs}


def _show(value: Any, metadata: Any) -> str:
    """A field's default as ``--help`` says it (an empty tuple or None: the field's ``none`` text)."""
    if isinstance(value, tuple) and value:
        return " ".join(map(str, value))
    return str(metadata.get("none", "none")) if value in (None, ()) else str(value)


def _flag(name: str) -> str:
    """A field's command-line flag: ``memory_budget`` -> ``--memory-budget``."""
    return f"--{name.replace('_', '-')}"


def field_arguments(
    cls: type,
    defaults: dict[str, Any] | None = None,
    *,
    only: tuple[str, ...] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One option per field of the dataclass ``cls`` (``--field-name``; help and default from the field, or from
    ``defaults`` where the subcommand has its own), stored as ``<class>.<field>`` and only when typed
    (argparse.SUPPRESS); ``overrides``: argparse keywords replacing a field's (several models for one option). Each
    option is ``{"flag", "kwargs"}``, plain data (:func:`parser_spec`)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.metadata.get("cli") is False:
            continue
        default = (defaults or {}).get(f.name, f.default)
        kw = {"dest": f"{cls.__name__}.{f.name}", "default": argparse.SUPPRESS, "help": f.metadata.get("help", "")}
        kw |= _argument(hints[f.name], dict(f.metadata)) | (overrides or {}).get(f.name, {})
        help_text = f"{kw['help']} (default: {_show(default, f.metadata)})"
        kw["help"] = help_text.replace("%", "%%")  # argparse %-formats help ("wanda-50%" would break --help)
        if "choices" not in kw and "action" not in kw:
            kw["metavar"] = f.name.upper()
        out.append({"flag": _flag(f.name), "kwargs": kw})
    return out


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` typed on the command line (lists as tuples)."""
    prefix = f"{cls.__name__}."
    return {
        k.removeprefix(prefix): tuple(v) if isinstance(v, list) else v
        for k, v in vars(args).items()
        if k.startswith(prefix)
    }


@dataclass(frozen=True)
class Invocation:
    """A parsed command line: the command, its arguments, and the objects built from what was typed."""

    name: str
    command: Command
    args: argparse.Namespace

    @property
    def protocol(self) -> str | None:
        return getattr(self.args, "protocol", None)

    def settings(self, cls: type) -> Any:
        """The settings object ``cls``: the protocol's (when given and it covers ``cls``) or the defaults, with
        the typed fields applied."""
        protocol = self.protocol
        if protocol is not None and not any(type(s) is cls for s in PROTOCOLS[protocol].settings):
            protocol = None  # a protocol covers some of a command's settings; the others keep their defaults
        return resolve(cls, None, None, protocol, given(self.args, cls))[0]

    def data(self) -> DataOptions:
        documents = PROTOCOLS[self.protocol].documents if self.protocol else {}
        return DataOptions(**((self.command.data or {}) | documents | given(self.args, DataOptions)))

    def run_options(self, out: Path) -> RunOptions:
        """The run options typed, the store (default: ``out/<the command's store>``) checked writable."""
        typed = given(self.args, RunOptions)
        if self.command.store is not None and "store" not in typed:
            typed["store"] = str(out / self.command.store)
        if typed.get("store"):
            check_writable(typed["store"], "store")
        return RunOptions(**typed)

    def out(self, *stems: str) -> Path:
        return output_dir(self.args.out, self.name, *(stems or (self.command.stem or self.name,)))


def parser_spec() -> dict[str, Any]:
    """The whole command line as data: per subcommand its help and options (:func:`field_arguments` of its
    :class:`DataOptions`, settings and :class:`RunOptions` fields, ``--protocol`` where a named protocol covers it,
    ``--out``). :mod:`lens_parallel.cli` builds argparse from the saved copy
    (:data:`~lens_parallel.paths.SPEC_PATH`)."""
    commands: dict[str, Any] = {}
    for name, command in COMMANDS.items():
        arguments = []
        if command.data is not None:
            several = {"model": {"nargs": "+", "help": "model spec(s); several: side by side"}}
            overrides = several if command.many_models else None
            arguments += field_arguments(DataOptions, command.data, only=command.data_fields, overrides=overrides)
        for cls in command.settings:
            arguments += field_arguments(cls)
        store = {"store": f"OUT/{command.store}"} if command.store else {}
        arguments += field_arguments(RunOptions, store, only=command.run_fields)
        covering = sorted(n for n, prot in PROTOCOLS.items() if any(type(s) in command.settings for s in prot.settings))
        if covering:
            protocol = {"default": None, "choices": covering, "help": "a named protocol's settings, documents"}
            arguments.append({"flag": "--protocol", "kwargs": protocol})
        out = {"default": None, "help": f"output folder, created if missing (default: results/{name})"}
        arguments.append({"flag": "--out", "kwargs": out})
        commands[name] = {"help": command.help, "arguments": arguments}
    renamed = {_flag(old): _flag(new) for old, new in RENAMED.items()}
    description = "Parallel/perpendicular geometry of heads."
    return {"prog": "lens-parallel", "description": description, "commands": commands, "renamed": renamed}


def write_spec(path: Path = SPEC_PATH) -> Path:
    """Write :func:`parser_spec` to ``path`` (the command line's saved parser): after a change to any options
    object, a subcommand, a named protocol or preset (``python scripts/build_cli_spec.py``)."""
    path.write_text(json.dumps(parser_spec(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# -- output ------------------------------------------------------------------------------------------------------


_MADE: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar("made", default=None)
"""The folders the running command created (the topmost of each path it made), for :func:`_tidy_up`."""


def _writable_dir(path: str) -> Path:
    if not path.strip():
        raise LensParallelError("--out is empty: give the folder to write to (or leave --out out for the default)")
    out = Path(path)
    missing = [folder for folder in (out, *out.parents) if not folder.exists()]
    if missing and (made := _MADE.get()) is not None:
        made.append(missing[-1])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LensParallelError(f"--out {path}: cannot create the folder ({exc.strerror})") from exc
    if not os.access(out, os.W_OK):
        raise LensParallelError(f"--out {path}: the folder is not writable")
    return out


def output_dir(out: str | None, command: str, *names: str) -> Path:
    """The output folder (``--out``, else ``results/<subcommand>``), created and checked before any work: every file
    this subcommand writes (``<name>*.csv|json|npz|html|png``) that is there already must be a writable file."""
    folder = _writable_dir(out if out is not None else f"results/{command}")
    for name in names:
        for path in folder.glob(f"{name}*"):
            if path.suffix in OUTPUT_SUFFIXES:
                check_writable(path, f"--out {folder}: output file")
    return folder


def _emit(
    out: Path,
    name: str,
    result: Any,
    shown: pd.DataFrame,
    *,
    store: str | Path | None = None,
    also: tuple[Path, ...] = (),
) -> None:
    """Write ``name.csv`` (the tidy table), ``name_summary.csv``, the result (JSON + npz) and every figure
    (``name`` for the main one, ``name_<figure>`` for the others); print ``shown`` and every file the command wrote:
    these, the sweep ``store`` (when there is one) and the files ``also`` written before."""
    from lens_parallel.plots import save_figure

    write_table(result.to_dataframe(), out / f"{name}.csv")
    write_table(result.summary(), out / f"{name}_summary.csv")
    saved = result.save(out / name)
    written = [out / f"{name}.csv", out / f"{name}_summary.csv", saved, add_suffix(out / name, ".npz"), *also]
    for i, (fig_name, fig) in enumerate(result.figures().items()):
        written += save_figure(fig, out / (name if i == 0 else f"{name}_{fig_name}"))
    written += [Path(store)] if store and Path(store).is_file() else []
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(shown.to_string())
    print("wrote:", *map(str, written), sep="\n  ")


def _load(inv: Invocation, out: Path, opts: RunOptions, *, whole_texts: bool = False) -> tuple[Any, Any]:
    """The model and the documents, after the output folder, the run options and the texts are checked.
    ``whole_texts``: the first ``n_docs`` texts whole, in lm-eval's rolling windows of ``seq_len`` tokens (for word
    perplexity; ``--texts wikitext``: lm-eval's WikiText-2 task, online)."""
    import torch

    from lens_parallel.analyses.dominance import study_texts
    from lens_parallel.data import check_corpus, token_blocks
    from lens_parallel.distributed import check_workers
    from lens_parallel.models import load_model

    data = inv.data()
    check_workers(opts.workers, opts.ray_address)  # before loading anything
    if data.texts != "study" and not (whole_texts and data.texts == "wikitext"):
        check_corpus(data.texts)
    model = load_model(data.model, device=data.device, dtype=getattr(torch, data.dtype))
    if whole_texts:
        from lens_parallel.downstream.perplexity import text_windows

        return model, text_windows(model, data.texts, window=data.seq_len, n_docs=data.n_docs)
    if data.texts == "study":
        return model, study_texts(model, seq_len=data.seq_len, seed=data.doc_seed)
    return model, token_blocks(model, data.texts, n_docs=data.n_docs, seq_len=data.seq_len, seed=data.doc_seed)


# -- the subcommands ---------------------------------------------------------------------------------------------


def _analysis(inv: Invocation) -> None:
    """Run a registered analysis (:mod:`lens_parallel.analyses.registry`): its settings and display options from
    the command line, the output folder and run options checked, the model and documents loaded, the analysis run,
    its files written and its table printed."""
    analysis = _registry()[inv.name]
    s = inv.settings(analysis.settings)
    display = inv.settings(analysis.display) if analysis.display else None
    out = inv.out()
    opts = inv.run_options(out)
    if analysis.check_data is not None:
        analysis.check_data(inv.data())
    whole_texts = analysis.whole_texts is not None and analysis.whole_texts(s)
    model, docs = _load(inv, out, opts, whole_texts=whole_texts)
    result = analysis.function(model, docs, settings=s, options=opts)
    title, shown = analysis.printer(result, s, display)
    print(title)
    also = analysis.files(result, out) if analysis.files else ()
    _emit(out, analysis.name, result, shown, store=opts.store if analysis.sweep else None, also=also)


def _sensitivity(inv: Invocation) -> None:
    from lens_parallel.analyses.sensitivity import SensitivitySettings

    how = inv.settings(SensitivityCommand)
    if how.confirm and how.method != "attribution":
        raise LensParallelError("--confirm K checks an attribution screen: use it with --method attribution")
    s = inv.settings(SensitivitySettings)
    if how.method == "attribution":
        _attribution(inv, s, how.confirm)
        return
    _analysis(inv)


def _attribution(inv: Invocation, s: Any, top: int) -> None:
    from lens_parallel.analyses.attribution import AttributionSettings, head_attribution
    from lens_parallel.analyses.confirm import confirm
    from lens_parallel.hooks import softmax_layers
    from lens_parallel.models import model_info

    run = given(inv.args, RunOptions)
    if run.get("workers", 1) > 1 or run.get("ray_address"):
        raise LensParallelError(
            "--method attribution is one forward + backward per batch: it runs here, without --workers"
        )
    out = inv.out("attribution")
    opts = inv.run_options(out)
    model, docs = _load(inv, out, opts)
    info = model_info(model)
    n_heads = info.n_heads * len(softmax_layers(info, s.layers, what="attribution")[0])
    if top > n_heads:
        raise LensParallelError(f"--confirm {top} exceeds the {n_heads} heads screened")
    screen_settings = AttributionSettings(
        ablation=s.ablation, positions=s.positions, layers=s.layers, n_resamples=s.n_resamples, seed=s.seed
    )
    result = head_attribution(model, docs, settings=screen_settings, options=dataclasses.replace(opts, store=None))
    heads = result.to_dataframe().dropna(subset=["head"])
    shown = heads.loc[heads["estimate"].abs().nlargest(10).index]
    print(f"{result.info.name}: first-order estimate of {s.ablation} per head (nats/token), largest 10")
    _emit(out, "attribution", result, shown.head(10)[["label", "estimate", "ci_lo", "ci_hi"]].round(5))
    if top:
        checked = confirm(model, docs, result, top_k=top, n_random=min(top, n_heads - top), seed=s.seed, options=opts)
        print(f"exact check of the top {top} heads and as many random ones:")
        _emit(out, "attribution_confirm", checked, checked.summary().drop(columns="note").round(4), store=opts.store)
        print(checked.summary()["note"].iloc[0])


def _report(inv: Invocation) -> None:
    import time

    import torch

    from lens_parallel.analyses.reliability import check_documents
    from lens_parallel.data import check_corpus, token_blocks
    from lens_parallel.models import check_device, check_spec, load_model
    from lens_parallel.report import ReportSettings, run_battery, write_report

    typed = given(inv.args, DataOptions)
    specs = typed.pop("model", None) or (DataOptions().model,)
    data = DataOptions(**((inv.command.data or {}) | typed))
    check_device(data.device)
    for spec in specs:  # every spec, and every step's settings, before the first (long) battery
        check_spec(spec)
    check_documents(data.n_docs)
    check_corpus(data.texts)
    s = inv.settings(ReportSettings)
    out = inv.out("report")
    for folder in ("tables", "results"):
        if (out / folder).exists() and not (out / folder).is_dir():
            raise LensParallelError(f"--out {out}: {folder} is a file, where the report writes a folder; remove it")
    opts = inv.run_options(out)
    t0 = time.perf_counter()
    reports = []
    for spec in specs:
        print(f"[{spec}] running the battery")
        model = load_model(spec, device=data.device, dtype=getattr(torch, data.dtype))
        docs = token_blocks(model, data.texts, n_docs=data.n_docs, seq_len=data.seq_len, seed=data.doc_seed)
        reports.append(run_battery(model, docs, settings=s, options=opts))
    settings = {"texts": data.texts, "n_docs": data.n_docs, "seq_len": data.seq_len, "seed": s.seed}
    path = write_report(reports, out, settings=settings)
    summary = pd.concat([r.summary() for r in reports]).set_index("model")
    with pd.option_context("display.width", 160, "display.max_columns", 30):
        print(summary.T.to_string())
    print(f"report: {path} ({time.perf_counter() - t0:.0f} s); tables in {out / 'tables'}")


def _train(inv: Invocation) -> None:
    from lens_parallel.distributed import check_workers
    from lens_parallel.training import run_design, run_factorial
    from lens_parallel.training.factorial import TrainSettings

    s = inv.settings(TrainSettings)
    run = given(inv.args, RunOptions)
    workers, address = run.get("workers", 1), run.get("ray_address")
    check_workers(workers, address)
    out = inv.out("train", "paired", "curves")
    if s.design:
        changes: dict[str, Any] = {"device": s.device} | ({"steps": s.steps} if s.steps else {})
        changes |= {"texts": tuple(s.texts)} if s.texts else {}
        result = run_design(
            s.design, out=out, plan=s.plan, tokens=s.tokens, workers=workers, ray_address=address, **changes
        )
        name = f"design {s.design}"
    else:
        result = run_factorial(
            s.config(),
            s.arms,
            s.seeds,
            out=out,
            primary=s.primary,
            plan=s.plan,
            progress=run.get("progress", True),
            workers=workers,
            ray_address=address,
        )
        name = f"preset {s.preset}"
    table = result.paired_table()
    write_table(table, out / "paired.csv")
    write_table(result.curves(), out / "curves.csv")
    print(
        f"{name}: delta = arm - reference final validation loss (nats/token), paired by seed; mde_paper = the paper's "
        "2.9 sigma/sqrt(n) approximation, mde_80 / mde_90 = exact noncentral-t MDE at 80% / 90% power"
    )
    cols = ["role", "n_seeds", "mean_delta", "ci_lo", "ci_hi", "p", "p_holm", "cohens_dz", "mde_paper", "mde_80"]
    _emit(
        out, "train", result, table.set_index("contrast")[cols].round(5), also=(out / "paired.csv", out / "curves.csv")
    )


def _tasks(inv: Invocation) -> None:
    import torch

    from lens_parallel.downstream.data import check_task_names
    from lens_parallel.downstream.effects import task_effects
    from lens_parallel.downstream.presets import resolve_tasks
    from lens_parallel.downstream.settings import TaskSettings
    from lens_parallel.downstream.specs import parse_settings
    from lens_parallel.models import load_model

    out = inv.out()
    opts = inv.run_options(out)
    s, what = inv.settings(TaskSettings), inv.settings(TasksCommand)
    named = parse_settings(what.settings)  # every spec and task name checked before the model loads
    tasks = what.tasks[0] if len(what.tasks) == 1 else list(what.tasks)
    check_task_names([name for name, _ in resolve_tasks(tasks)[0]])
    data = inv.data()
    model = load_model(data.model, device=data.device, dtype=getattr(torch, data.dtype))
    result = task_effects(model, named, tasks, settings=s, options=opts)
    table = result.differences()
    write_table(table, out / "tasks_differences.csv")
    samples = out / "tasks_samples.jsonl"
    result.samples(context="full").to_json(samples, orient="records", lines=True, force_ascii=False)
    page = out / "tasks_samples.html"
    write_atomic(page, lambda f: f.write(result.samples_html().encode()))
    print(f"{result.info.name}: edited - unedited per task (lm-eval's metrics; CI: paired bootstrap over items)")
    cols = [
        "task",
        "metric",
        "unit",
        "setting",
        "n_items",
        "unedited",
        "edited",
        "difference",
        "ci_low",
        "ci_high",
        "p_holm",
    ]
    shown = table[cols].round(4).set_index("task")
    _emit(out, "tasks", result, shown, store=opts.store, also=(out / "tasks_differences.csv", samples, page))


def _generate(inv: Invocation) -> None:
    import torch

    from lens_parallel.downstream.specs import parse_settings
    from lens_parallel.generation import GenerateSettings, generate
    from lens_parallel.models import load_model

    out = inv.out()
    opts = inv.run_options(out)
    s, what = inv.settings(GenerateSettings), inv.settings(GenerateCommand)
    prompts = what.prompts()  # checked before the model loads, as every spec
    named = parse_settings(what.settings) if what.settings else None
    data = inv.data()
    model = load_model(data.model, device=data.device, dtype=getattr(torch, data.dtype))
    result = generate(model, prompts, named, settings=s, options=opts)
    frame = result.to_dataframe()
    page = out / "generate_texts.html"
    write_atomic(page, lambda f: f.write(result.html().encode()))
    print(f"{result.info.name}: continuations per setting (departs_at: first token unlike the unedited one)")
    shown = frame.set_index(["prompt_index", "setting"])[["n_tokens", "departs_at", "text"]]
    used = max(len(line) for line in shown.assign(text="").to_string().splitlines())  # all but the texts
    room = max(shutil.get_terminal_size((120, 24)).columns - used - 1, 20)
    shown = shown.assign(text=[_cut(t, room) for t in shown["text"]])
    _emit(out, "generate", result, shown, store=opts.store, also=(page,))


def _cut(text: str, width: int) -> str:
    """One line of at most ``width`` characters, padded to it (left-aligned in a table): line breaks shown as ⏎,
    a longer text cut with …; the whole texts are in the files."""
    line = text.replace("\r\n", "⏎").replace("\n", "⏎")
    return (line if len(line) <= width else line[: width - 1] + "…").ljust(width)


TERMINAL_WIDTH = 100
"""The widest line the command line prints in its own tables (``models``)."""


def _models(inv: Invocation) -> None:
    """Every model spec: its name and whether it loads offline now on one line, what it is, its size and licence
    below, wrapped to :data:`TERMINAL_WIDTH` (the whole table in ``models.csv`` with ``--out``)."""
    from lens_parallel.models import available_models

    table = available_models()
    width = int(table["spec"].str.len().max()) + 2
    for row in table.itertuples(index=False):
        print(f"{row.spec:<{width}}{row.offline_now}")
        about = "; ".join(str(x) for x in (row.what, row.size, row.licence) if isinstance(x, str) and x.strip())
        print(textwrap.fill(about, TERMINAL_WIDTH, initial_indent="    ", subsequent_indent="    "))
    if inv.args.out is not None:
        path = inv.out("models") / "models.csv"
        write_table(table, path)
        print("wrote:", path)


def _protocols(inv: Invocation) -> None:
    rows = [
        {
            "protocol": p.name,
            "covers": ", ".join(type(s).__name__ for s in p.settings),
            "documents": ", ".join(f"{k}={v}" for k, v in p.documents.items()) or "the caller's",
            "source": p.source,
        }
        for p in PROTOCOLS.values()
    ]
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print(pd.DataFrame(rows).to_string(index=False))
    for p in PROTOCOLS.values():
        print(f"\n{p.name}: {p.description}")


def _glossary(inv: Invocation) -> None:
    from lens_parallel.glossary import glossary_table

    table = glossary_table(inv.settings(GlossaryCommand).columns or None)
    width = max(map(len, table.column)) + 2
    for row in table.itertuples(index=False):
        wrapped = textwrap.wrap(row.definition, TERMINAL_WIDTH - width)
        print(f"{row.column:<{width}}{wrapped[0]}", *(" " * width + line for line in wrapped[1:]), sep="\n")


def _registry() -> dict[str, Any]:
    from lens_parallel.analyses.registry import analyses

    return analyses()


_CUSTOM_RUNS: dict[str, tuple[Callable[[Invocation], None], tuple[type, ...]]] = {
    "sensitivity": (_sensitivity, (SensitivityCommand,)),
}
"""Analyses whose subcommand does more than :func:`_analysis` (sensitivity's attribution screen), with the extra
options classes of that subcommand."""


def _commands() -> dict[str, Command]:
    from lens_parallel.downstream.settings import TaskSettings
    from lens_parallel.generation import GenerateSettings
    from lens_parallel.report import ReportSettings
    from lens_parallel.training.factorial import TrainSettings

    analyses = {}
    for name, a in _registry().items():
        run, extra = _CUSTOM_RUNS.get(name, (_analysis, ()))
        settings = (a.settings, *((a.display,) if a.display else ()), *extra)
        run_fields = SWEEP if a.sweep else ("batch_size", "progress")
        analyses[name] = Command(a.help, run, settings, dict(a.data), run_fields, store=a.store)
    return analyses | {
        "report": Command(
            "the standard battery on one or several models: report.html + tables",
            _report,
            (ReportSettings,),
            {"n_docs": 8},
            ("batch_size", "tokens_per_forward", "progress"),
            many_models=True,
        ),
        "train": Command(
            "train small LMs with each arm, paired by seed",
            _train,
            (TrainSettings,),
            None,
            ("progress", "workers", "ray_address"),
        ),
        "tasks": Command(
            "downstream task scores under edits (lm-evaluation-harness), paired per item",
            _tasks,
            (TaskSettings, TasksCommand),
            {},
            ("batch_size", "tokens_per_forward", "store", "progress"),
            store="tasks_requests.sqlite",
            data_fields=("model", "device", "dtype"),
        ),
        "generate": Command(
            "continue prompts with the unedited model and under edits (KV-cached, the edits at every step)",
            _generate,
            (GenerateSettings, GenerateCommand),
            {},
            ("batch_size", "store", "progress"),
            data_fields=("model", "device", "dtype"),
        ),
        "models": Command("list the models that load offline now and those that need the hub", _models, run_fields=()),
        "protocols": Command("list the named protocols (a study's saved settings)", _protocols, run_fields=()),
        "glossary": Command(
            "define the columns of every table (all, or --columns NAME ...)",
            _glossary,
            (GlossaryCommand,),
            run_fields=(),
        ),
    }


COMMANDS: dict[str, Command] = _commands()


def run(args: argparse.Namespace) -> int:
    """Run a parsed command line (:func:`lens_parallel.cli.main` parsed it): 0 when it ran, 2 and one line on
    stderr for bad input, 3 and what failed for a failed environment; anything else keeps its traceback. A warning
    is one line on stderr too (``lens-parallel <command>: warning: ...``), without Python's file and source line."""

    def one_line_warning(message: Warning | str, category: type[Warning], *rest: Any, **kwargs: Any) -> None:
        print(f"lens-parallel {args.command}: warning: {_one_line(message)}", file=sys.stderr)

    made = _MADE.set([])
    try:
        with warnings.catch_warnings(), one_line_interrupt("the command"):
            warnings.showwarning = one_line_warning
            COMMANDS[args.command].run(Invocation(args.command, COMMANDS[args.command], args))
    except LensParallelError as exc:  # bad input: one line
        print(f"lens-parallel {args.command}: error: {as_flags(args.command, _one_line(exc))}", file=sys.stderr)
        return _tidy_up(2)
    except EnvironmentFailure as exc:  # the environment failed: what failed and what to do, no traceback
        print(f"lens-parallel {args.command}: could not run: {as_flags(args.command, _one_line(exc))}", file=sys.stderr)
        return _tidy_up(3)
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, what was kept and how to resume (one_line_interrupt)
        said = interrupt_message(exc) or "the command stopped"
        print(f"lens-parallel {args.command}: interrupted: {as_flags(args.command, said)}", file=sys.stderr)
        return _tidy_up(130)
    except BrokenPipeError:  # the reader went away (lens-parallel glossary | head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's advice: no error at exit
        return 0
    except BaseException:  # anything else (LibraryError, a bug inside the package) shows its traceback
        _tidy_up(1)
        raise
    finally:
        _MADE.reset(made)
    return 0


def _tidy_up(status: int) -> int:
    """After a failed or interrupted command: remove every folder it created that holds no file (finished work, a
    store with its jobs, stays where it is; every file is written whole or not at all); returns ``status``."""
    for top in _MADE.get() or []:
        for folder in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty folder goes
    return status


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())


def as_flags(command: str, message: str) -> str:
    """A library message as the command line says it: ``name=value`` of an option ``command`` takes as its flag
    (``max_gen_toks=2048`` -> ``--max-gen-toks 2048``, ``name=True`` -> ``--name``, ``name=False`` ->
    ``--no-name``); the asides written for both (``(command line: --flag)``, ``(name= in Python, --flag on the
    command line)``) as the flag alone."""
    spec = COMMANDS[command]
    classes = [*([DataOptions] if spec.data is not None else []), *spec.settings, RunOptions]
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    message = re.sub(r"\s*\(command line: [^)]*\)", "", message)
    message = re.sub(r"\(\w+= in Python, (--[\w-]+) on the command line\)", r"(\1)", message)

    def flag(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name not in names:
            return match.group(0)
        return (
            _flag(name)
            if value == "True"
            else f"--no-{name.replace('_', '-')}"
            if value == "False"
            else (f"{_flag(name)} {value}")
        )

    return re.sub(r"\b([a-z][a-z0-9_]*)=([^\s,;)]+)", flag, message)
