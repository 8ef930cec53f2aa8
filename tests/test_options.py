"""One set of defaults: the command line is generated from the options objects, so every subcommand's defaults are
the library's, and the library's analysis functions take no option of their own beside their settings objects."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

import lens_parallel as lp
from lens_parallel import cli, commands
from lens_parallel.analyses.registry import analyses
from lens_parallel.options import DataOptions, RunOptions
from lens_parallel.protocols import PROTOCOLS

LIBRARY_ONLY = [  # inputs beyond a model and documents (a screen, edits, tasks, jobs, prompts): no analysis subcommand
    lp.head_attribution,
    lp.confirm,
    lp.causal_null,
    lp.gqa_alignment,
    lp.split_half_reliability,
    lp.head_statistics,
    lp.run_ablations,
    lp.run_battery,
    lp.evaluate,
    lp.task_effects,
    lp.generate,
]
ANALYSES = [a.function for a in analyses().values()] + LIBRARY_ONLY


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.mark.parametrize("name", list(commands.COMMANDS))
def test_the_command_lines_defaults_are_the_librarys(name):
    """Nothing typed: every settings object equals its class's defaults, the documents the subcommand's stated
    defaults, the run options RunOptions' (the store placed in --out); and every option's help shows the field's
    default."""
    parser = cli.build_parser()
    command = commands.COMMANDS[name]
    inv = commands.Invocation(name, command, parser.parse_args([name]))
    for cls in command.settings:
        assert inv.settings(cls) == cls()
    if command.data is not None:
        assert inv.data() == DataOptions(**command.data)
    expected_run = RunOptions(store=f"OUT/{command.store}" if command.store else None)
    assert dataclasses.replace(inv.run_options(commands.Path("OUT")), store=expected_run.store) == expected_run
    sub = _subparser(parser, name)
    # argparse's help is a %-format string: a literal % is written %%
    shown = {a.dest: a.help.replace("%%", "%") for a in sub._actions if "." in (a.dest or "")}
    for cls in (*command.settings, *([DataOptions] if command.data is not None else [])):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            if cls is DataOptions and command.data_fields is not None and f.name not in command.data_fields:
                assert f"DataOptions.{f.name}" not in shown, f.name  # a command that loads no documents
                continue
            default = (command.data or {}).get(f.name, f.default) if cls is DataOptions else f.default
            assert shown[f"{cls.__name__}.{f.name}"].endswith(f"(default: {commands._show(default, f.metadata)})"), (
                f.name
            )
    for f in dataclasses.fields(RunOptions):
        if f.name in command.run_fields and f.name != "store":
            assert shown[f"RunOptions.{f.name}"].endswith(f"(default: {commands._show(f.default, f.metadata)})")


def test_the_saved_parser_is_current():
    """The command line parses with the parser saved in assets (no analysis imported); it must be what the options
    objects generate today."""
    saved = json.loads(cli.SPEC_PATH.read_text(encoding="utf-8"))
    assert saved == json.loads(json.dumps(commands.parser_spec())), "run: python scripts/build_cli_spec.py"


@pytest.mark.parametrize(
    "argv", [["--help"], ["decompose", "--help"], ["decompsoe"], ["decompose", "--space", "nope"], ["scale"]]
)
def test_help_and_bad_command_lines_import_no_heavy_module(argv):
    """--help and argument errors are answered before torch, TransformerLens, pandas or any analysis is imported
    (a command that parses, the last case, is run after the check)."""
    heavy = ("torch", "transformer_lens", "pandas", "lens_parallel.commands", "lens_parallel.analyses")
    code = (
        "import sys, lens_parallel.cli as cli\n"
        f"try:\n    cli.build_parser().parse_args({argv!r})\nexcept SystemExit:\n    pass\n"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


@pytest.mark.parametrize("function", ANALYSES, ids=lambda f: f.__name__)
def test_analyses_take_their_settings_and_run_options_only(function):
    """No analysis repeats a settings or run-option field as a parameter with a default of its own (there is
    one set of defaults, in the objects); they come as ``settings=`` / ``options=`` or as keyword shortcuts."""
    params = inspect.signature(function).parameters
    own = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"settings", "options"} <= own, sorted(own)
    assert own <= {"settings", "options", "protocol", "calibration", "compressed"}, sorted(own)  # data, not settings
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_keyword_shortcuts_settings_and_protocols_agree():
    model = lp.load_model("toy-gpt2")
    blocks = lp.token_blocks(model, "austen", n_docs=4, seq_len=12)
    by_keyword = lp.causal_null(model, blocks, null="exact", seed=3, n_resamples=50, progress=False)
    settings = lp.NullSettings(null="exact", seed=3, n_resamples=50)
    by_object = lp.causal_null(model, blocks, settings=settings, options=RunOptions(progress=False))
    assert (by_keyword.cos_null == by_object.cos_null).all()
    assert by_keyword.provenance.settings["options"]["progress"] is False
    protocol = lp.causal_null(model, blocks, protocol="sanity-checks", n_resamples=50, progress=False)
    assert protocol.null == "sampled" and protocol.provenance.settings["null"] == "sampled"
    with pytest.raises(
        lp.LensParallelError, match=r"unknown option 'nul' \(did you mean 'null'\?\); accepted: null, groups"
    ):
        lp.causal_null(model, blocks, nul="exact")
    renamed = r"^SensitivitySettings: edit= is now ablation= \(give ablation='zero'\)$"
    with pytest.raises(lp.LensParallelError, match=renamed):
        lp.head_sensitivity(model, blocks, edit="zero")
    with pytest.raises(lp.LensParallelError, match="protocol 'xsa-controls' has no NullSettings; it covers: Design"):
        lp.causal_null(model, blocks, protocol="xsa-controls")
    with pytest.raises(lp.LensParallelError, match="unknown protocol 'nope'; known: sanity-checks"):
        lp.causal_null(model, blocks, protocol="nope")
    assert set(PROTOCOLS) >= {"sanity-checks", "dominance-study", "xsa-controls"}
