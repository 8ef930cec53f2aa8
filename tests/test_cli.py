from __future__ import annotations

import argparse
import dataclasses
import html
import json
import os
import re
import shlex
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch

import lens_parallel as lp
from lens_parallel import LensParallelError, cli, commands
from lens_parallel.cli import main
from lens_parallel.commands import COMMANDS, as_flags
from lens_parallel.report import SECTIONS


def test_decompose_writes_table_result_and_figure(tmp_path, capsys):
    out = tmp_path / "dec"
    argv = [
        "decompose",
        "--model",
        "toy-gpt2",
        "--space",
        "value",
        "residual-mlp",
        "--n-docs",
        "3",
        "--seq-len",
        "16",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    df = pd.read_csv(out / "decompose.csv")
    assert set(df.space) == {"value", "residual-mlp"} and len(df) == 3 * 4 + 3
    meta = json.loads((out / "decompose.json").read_text())
    assert meta["data"]["provenance"]["model"]["name"] == "toy-gpt2"
    assert (out / "decompose.html").stat().st_size > 1000
    assert "toy-gpt2: means over layers and heads" in capsys.readouterr().out


def _listed(stdout: str, folder: Path) -> set[str]:
    """The names of the files under ``folder`` that the "wrote:" lists of ``stdout`` name."""
    return {Path(line.strip()).name for line in stdout.splitlines() if line.startswith(f"  {folder}")}


def _on_disk(folder: Path) -> set[str]:
    """The files in ``folder`` (a store's lock is kept in the cache folder: none is here)."""
    return {p.name for p in folder.iterdir()}


def test_texts_from_a_users_file_and_every_written_file_listed(tmp_path, capsys):
    texts = tmp_path / "mine.txt"
    texts.write_text("\n\n".join(f"Document {i} says: " + "lorem ipsum dolor sit amet " * 8 for i in range(3)))
    out = tmp_path / "dec"
    argv = ["decompose", "--model", "toy-gpt2", "--texts", str(texts), "--n-docs", "3", "--seq-len", "16"]
    assert main([*argv, "--out", str(out)]) == 0
    meta = json.loads((out / "decompose.json").read_text())
    assert meta["data"]["provenance"]["texts"]["corpus"] == str(texts)
    listed = _listed(capsys.readouterr().out, out)
    assert {"decompose.json", "decompose.npz", "decompose.csv"} <= listed and listed == _on_disk(out)


def test_a_read_only_output_file_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """An output file that exists and cannot be written (immutable: read-only even to root, who runs CI) is one line
    and exit 2 before the model loads (loading fails the test)."""
    from lens_parallel import models

    out = tmp_path / "out"
    out.mkdir()
    (out / "decompose.csv").write_text("an earlier run's table")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    subprocess.run(["chattr", "+i", str(out / "decompose.csv")], check=True)
    try:
        assert main(["decompose", "--model", "toy-gpt2", "--out", str(out)]) == 2
    finally:
        subprocess.run(["chattr", "-i", str(out / "decompose.csv")], check=True)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"output file {out / 'decompose.csv'} exists and is not writable" in line


def test_the_console_command_exits_with_mains_code_one_line_and_no_traceback(tmp_path):
    """The installed ``python -m lens_parallel.cli`` process: a run that fails on bad input exits 2 with one line on
    stderr and no traceback (every subcommand's bad input is checked in-process: ``BAD_COMMAND_LINES``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lens_parallel.cli", "decompose", "--model", "toy-nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "unknown model spec 'toy-nope'" in lines[0], proc.stderr


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in this process: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_subcommand_continues_prompts_from_the_line_and_a_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nThe capital of France is\n", encoding="utf-8")
    out = tmp_path / "out"
    code, stdout, stderr = _main(
        capsys,
        "generate",
        "--model",
        "toy-gpt2",
        "--prompt",
        "1, 2, 3,",
        "--prompts-file",
        str(prompts),
        "--settings",
        "value:s_par=0",
        "--max-new-tokens",
        "4",
        "--store",
        str(out / "generate_store.jsonl"),
        "--out",
        str(out),
    )
    assert code == 0, stderr
    frame = pd.read_csv(out / "generate.csv")
    page = (out / "generate_texts.html").read_text()  # the texts side by side, each prompt a row
    unedited = frame[frame["setting"] == "unedited"]
    assert page.count("<tr>") == 1 + 3 and all(f"<td>{html.escape(p)}</td>" in page for p in unedited["prompt"])
    assert all(f"<td>{html.escape(t)}</td>" in page for t in unedited["text"].fillna(""))
    assert len((out / "generate_store.jsonl").read_text().splitlines()) == 1 + 3 * 2  # header, prompts x settings
    assert list(frame["prompt"].unique()) == ["1, 2, 3,", "Once upon a time", "The capital of France is"]
    assert list(frame["setting"].unique()) == ["unedited", "value:s_par=0"] and (frame["n_tokens"] <= 4).all()
    meta = json.loads((out / "generate.json").read_text())
    assert meta["data"]["provenance"]["settings"]["max_new_tokens"] == 4
    assert _on_disk(out) == _listed(stdout, out)


def test_train_and_models_subcommands(tmp_path, capsys):
    code, stdout, stderr = _main(
        capsys,
        "train",
        "--preset",
        "tiny",
        "--arms",
        "baseline",
        "xsa-gated",
        "--seeds",
        "0",
        "1",
        "--steps",
        "4",
        "--device",
        "cpu",
        "--plan",
        str(tmp_path / "plan.json"),
        "--out",
        str(tmp_path),
    )
    assert code == 0, stderr
    table = pd.read_csv(tmp_path / "paired.csv")
    assert list(table["arm"]) == ["xsa-gated"] and table["n_seeds"].item() == 2
    assert table["role"].item() == "primary" and {"mde_paper", "mde_80", "mde_90"} <= set(table.columns)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["arms"] == ["baseline", "xsa-gated"] and plan["seeds"] == [0, 1] and "mde_paper" in stdout
    assert len(pd.read_csv(tmp_path / "train.csv")) == 2 * 2  # one row per (arm, seed)
    assert (tmp_path / "train.html").is_file() and (tmp_path / "train_gates.html").is_file()
    assert (tmp_path / "baseline" / "seed1" / "model" / "config.json").is_file()
    code, stdout, _ = _main(capsys, "models", "--out", str(tmp_path))
    assert code == 0 and "toy-qwen3" in stdout
    models = pd.read_csv(tmp_path / "models.csv")
    assert models.set_index("spec").loc["toy-gpt2", "offline_now"] == "yes"
    assert models.set_index("spec").loc["openai-community/gpt2", "offline_now"].startswith(("no", "yes"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Files and folders the bad command lines point at (placeholders of BAD_COMMAND_LINES)."""
    import transformers

    root = tmp_path_factory.mktemp("bad")
    (root / "blocker").write_text("a file, not a folder")
    (root / "table.csv").write_text("arm,loss\nbaseline,1.0\n")
    (root / "latin1.txt").write_bytes("caf\u00e9 au lait, a document in Latin-1".encode("latin-1"))
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (root / "empty_config").mkdir()
    (root / "empty_config" / "config.json").write_text("{}")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(root / "no_weights")
    for folder, inside in (("collide", "decompose.csv"), ("report_collide", "report.html"), ("plan_dir", "")):
        (root / folder / inside).mkdir(parents=True)
    cache = root / "cache" / "smollm2-135m"
    cache.mkdir(parents=True)
    (cache / "lens_parallel_manifest.json").write_text('{"sha256": {"mod')
    trained = ["train", "--preset", "tiny", "--arms", "baseline", "xsa-gated", "--seeds", "0", "1", "--steps", "3"]
    assert main([*trained, "--device", "cpu", "--plan", str(root / "plan.json"), "--out", str(root / "trained")]) == 0
    (root / "malformed.json").write_text((root / "plan.json").read_text()[:50])
    scaled = [
        "scale",
        *T.split(),
        "--s-par",
        "0",
        "--store",
        str(root / "damaged.jsonl"),
        "--out",
        str(root / "scaled"),
    ]
    assert main(scaled) == 0
    store = (root / "damaged.jsonl").read_bytes()  # one byte of the header's fingerprint flipped
    (root / "damaged.jsonl").write_bytes(store.replace(b"toy-gpt2", b"toy-gpt3", 1))
    run_json = root / "trained" / "baseline" / "seed0" / "run.json"
    run_json.write_text(run_json.read_text()[:300])
    return {name: str(root / name) for name in os.listdir(root)} | {"out": str(root / "out"), "root": str(root)}


T = "--model toy-gpt2 --n-docs 4 --seq-len 16"
TRAIN = "train --preset tiny --device cpu --steps 3"
BAD_COMMAND_LINES = [  # (command line, what its one line says); {name}: a path of the workspace fixture
    ("decompose --model toy-nope --out {out}", "unknown model spec 'toy-nope'"),
    (f"decompose {T} --seq-len 5000 --out {{out}}", "exceeds the model's context length"),
    (f"decompose {T} --out {{blocker}}/sub", "cannot create the folder"),
    ("decompose --space nope", "invalid choice: 'nope'"),
    ("decompse --space value", "(did you mean 'decompose'?)"),
    (  # no prefix of an option is taken for it: argparse's default would start a run with --n-docs 4
        f"decompose {T} --n-doc 4 --out {{out}}",
        "lens-parallel decompose: error: unrecognized arguments: --n-doc 4 (did you mean '--n-docs'?) (see "
        "lens-parallel decompose --help)",
    ),
    (
        "scale --ndocs 4",
        "unrecognized arguments: --ndocs 4 (did you mean '--n-docs'?) (see lens-parallel scale --help)",
    ),
    ("sensitivity --batch 2", "(did you mean '--batch-size'?) (see lens-parallel sensitivity --help)"),
    ("scale --space valeu", "'valeu' (choose from 'value', 'value-exclude-self'"),
    ("glossary --columns par_fracc", "no column 'par_fracc' in the glossary (did you mean 'par_frac'?)"),
    ("decompose --doc-seed -1", "doc_seed must be an integer >= 0, got -1"),
    ("decompose --out ''", "--out is empty"),
    (f"decompose {T} --device gpu --out {{out}}", "unknown device 'gpu'"),
    ("decompose --n-docs 0", "must be a positive integer, got 0"),
    ("decompose --batch-size 0", "must be a positive integer or 'auto', got 0"),
    (f"decompose {T} --layers 9 --out {{out}}", "layers [9] out of range"),
    ("decompose --model {empty_config} --out {out}", "names no model_type or architectures"),
    ("decompose --model {no_weights} --out {out}", "holds a config.json but no weights"),
    (f"decompose {T} --texts nope --out {{out}}", "unknown corpus 'nope'"),
    (f"decompose {T} --out {{collide}}", "decompose.csv is a folder, where a file goes"),
    ("decompose --model smollm2-135m --out {out}", "lens_parallel_manifest.json is damaged"),
    ("decompose --bogus", "unrecognized arguments: --bogus"),
    (f"scale {T} --s-par nan --out {{out}}", "finite"),
    ("scale --space value-nope", "invalid choice: 'value-nope'"),
    ("scale --positions first", "invalid choice: 'first'"),
    ("scale --workers 0", "must be a positive integer, got 0"),
    (f"scale {T} --layers -5 --out {{out}}", "layers [-5] out of range: this model has layers 0..2 (or -3..-1"),
    (f"scale {T} --store {{table.csv}} --out {{out}}", "first line is not a sweep header"),
    (f"scale {T} --store {{plan_dir}} --out {{out}}", "is a folder, where a file goes"),
    (f"scale {T} --store {{blocker}}/s.jsonl --out {{out}}", "s.jsonl: cannot create its folder"),
    (f"decompose {T} --texts {{latin1.txt}} --out {{out}}", "latin1.txt is not UTF-8: byte offset 3 holds b'\\xe9'"),
    (f"decompose {T} --texts {{root}}/missing.txt --out {{out}}", "missing.txt does not exist"),
    (f"decompose {T} --texts {{broken.jsonl}} --out {{out}}", "broken.jsonl line 2 is not JSON"),
    (f"diagonal {T} --layer 7 --head 0 --out {{out}}", "out of range"),
    (f"diagonal {T} --layer 1 --out {{out}}", "give both layer and head, or neither"),
    (f"diagonal {T} --layer 1 --head 9 --out {{out}}", "heads [9] out of range"),
    (f"sensitivity {T} --confirm 3 --out {{out}}", "use it with --method attribution"),
    (f"sensitivity {T} --method attribution --confirm 13 --out {{out}}", "exceeds the 12 heads screened"),
    ("sensitivity --ablation erase", "invalid choice: 'erase'"),
    ("sensitivity --edit zero", "--edit is now --ablation"),
    ("generate --model toy-gpt2 --out {out}", "give at least one prompt: --prompt TEXT or --prompts-file PATH"),
    ("generate --model toy-gpt2 --prompt x --max-new-tokens 0 --out {out}", "must be a positive integer, got 0"),
    ("checks --edit=zero", "--edit is now --ablation"),
    (f"sensitivity {T} --method attribution --workers 2 --out {{out}}", "runs here, without --workers"),
    (f"dominance {T} --query-start -5 --out {{out}}", "must satisfy 0 <= start < stop <= 16"),
    (f"dominance {T} --query-stop 1000 --out {{out}}", "must satisfy 0 <= start < stop <= 16"),
    (f"dominance {T} --query-start 12 --query-stop 6 --out {{out}}", "query positions 12:6 must satisfy"),
    ("dominance --scale nope", "invalid choice: 'nope'"),
    ("checks --model toy-gpt2 --n-docs 2 --seq-len 16 --out {out}", "needs at least 4 documents"),
    ("checks --null nope", "invalid choice: 'nope'"),
    ("compress --method gptq --out {out}", "unknown compression 'gptq'"),
    ("compress --scored x", "invalid choice: 'x'"),
    ("report --model toy-gpt2 toy-nope --n-docs 4 --seq-len 16 --out {out}", "unknown model spec 'toy-nope'"),
    (f"report {T} --device gpu --out {{out}}", "unknown device 'gpu'"),
    ("report --model toy-gpt2 --n-docs 2 --seq-len 16 --out {out}", "needs at least 4 documents"),
    (f"report {T} --texts nope --out {{out}}", "unknown corpus 'nope'"),
    (f"report {T} --out {{report_collide}}", "report.html is a folder"),
    (f"{TRAIN} --arms xsa-gated --out {{out}}", "baseline"),
    ("train --preset tiny --device gpu --out {out}", "device 'gpu'"),
    (f"{TRAIN} --seeds -1 0 --out {{out}}", "must be an integer >= 0, got -1"),
    (f"{TRAIN} --plan {{table.csv}} --out {{out}}", "is not a plan this package wrote"),
    (f"{TRAIN} --plan {{blocker}}/plan.json --out {{out}}", "cannot write the plan"),
    (f"{TRAIN} --plan {{plan_dir}} --out {{out}}", "is a folder; give a path for the plan"),
    (f"{TRAIN} --plan {{malformed.json}} --out {{out}}", "is not a plan this package wrote (not JSON"),
    (f"{TRAIN} --plan {{plan.json}} --out {{out}}", "governs the runs in"),
    (f"{TRAIN} --arms baseline xsa-gated --seeds 0 1 --out {{trained}}", "cannot be read"),
    ("train --steps 0", "must be a positive integer, got 0"),
    ("train --preset huge", "invalid choice: 'huge'"),
    ("models --out {blocker}/sub", "cannot create the folder"),
    ("protocols --bogus", "unrecognized arguments: --bogus"),
    (
        "tasks --model toy-gpt2 --settings nope:s_par=0 --out {out}",
        "unknown kind 'nope'; accepted: value, value-exclude-self",
    ),
    ("tasks --model toy-gpt2 --settings value:s_par --out {out}", "'s_par' is not key=value"),
    ("tasks --model toy-gpt2 --settings value:colour=2 --out {out}", "unexpected keyword argument 'colour'"),
    ("tasks --model toy-gpt2 --settings missing.yaml --out {out}", "settings file missing.yaml does not exist"),
    ("tasks --model toy-gpt2 --tasks not_a_task --out {out}", "unknown task 'not_a_task' (no task is named like it)"),
    ("tasks --model toy-gpt2 --tasks gsm8k_co piqa --out {out}", "unknown task 'gsm8k_co' (did you mean gsm8k_cot"),
    ("tasks --model toy-gpt2 --tasks humaneval --out {out}", "pass --allow-code-execution to run it"),
    (
        "tasks --model toy-gpt2 --tasks humaneval --allow-code-execution --out {out}",
        "humaneval (1,024) may generate as many tokens as toy-gpt2's whole context of 512, which leaves no room",
    ),
    ("tasks --model toy-gpt2 --tasks copa --max-gen-toks 600 --out {out}", "--max-gen-toks 600 leaves no room"),
    ("tasks --model toy-gpt2 --tasks copa --store /proc/lp.sqlite --out {out}", "store /proc/lp.sqlite cannot be"),
    (f"scale {T} --s-par 0 --store {{damaged.jsonl}} --out {{out}}", "is damaged: its header does not match"),
    ("tasks --model toy-gpt2 --limit 0 --out {out}", "limit must be a positive integer, got 0"),
    ("tasks --model toy-gpt2 --texts wikipedia-en --out {out}", "unrecognized arguments: --texts"),
    ("checks --protocol nope", "invalid choice: 'nope'"),
    ("nope", "invalid choice: 'nope'"),
    ("", "the following arguments are required: command"),
]
if not torch.cuda.is_available():
    BAD_COMMAND_LINES += [
        (f"decompose {T} --device cuda --out {{out}}", "this machine has no CUDA device"),
        ("train --preset tiny --device cuda --out {out}", "no CUDA device"),
    ]


@pytest.mark.parametrize(("line", "message"), BAD_COMMAND_LINES, ids=[line for line, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_exit_2_with_one_line(workspace, line, message, capsys, monkeypatch):
    """Every subcommand: a bad command line exits 2 with one line on stderr and no traceback (in-process, so any
    other exception would fail the test), before any expensive work."""
    if "smollm2" in line:  # a cache whose real-model manifest is damaged
        monkeypatch.setenv("LENS_PARALLEL_CACHE", str(Path(workspace["root"]) / "cache"))
    argv = shlex.split(_fill(line, workspace))
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (Path(workspace["out"]) / "baseline" / "seed-1").exists()
    if argv and argv[0] in COMMANDS:  # the command line's words only: every option named by its flag
        said = lines[0].split(": error: ", 1)[-1]
        assert as_flags(argv[0], said) == said, said


def _fill(line: str, workspace: dict[str, str]) -> str:
    for name, path in workspace.items():
        line = line.replace("{" + name + "}", path)
    return line


def test_the_battery_covers_every_subcommand():
    covered = {line.split()[0] for line, _ in BAD_COMMAND_LINES if line}
    assert covered >= set(commands.COMMANDS) and len(BAD_COMMAND_LINES) >= 40


def test_a_bug_inside_the_package_keeps_its_traceback(monkeypatch):
    """Only LensParallelError is bad input; any other exception is a bug and must not pose as one."""

    def broken(args):
        raise KeyError("an internal bug")

    monkeypatch.setitem(commands.COMMANDS, "models", dataclasses.replace(commands.COMMANDS["models"], run=broken))
    with pytest.raises(KeyError, match="an internal bug"):
        main(["models"])

    def bad_input(args):
        raise LensParallelError("layers [9] out of range")

    monkeypatch.setitem(commands.COMMANDS, "models", dataclasses.replace(commands.COMMANDS["models"], run=bad_input))
    assert main(["models"]) == 2

    def offline(args):
        raise lp.EnvironmentFailure("could not download x==1 from the package registry; rerun to fetch the rest")

    monkeypatch.setitem(commands.COMMANDS, "models", dataclasses.replace(commands.COMMANDS["models"], run=offline))
    assert main(["models"]) == 3  # the environment failed: what and what to do, no traceback

    def incompatible(args):
        raise lp.LibraryError("hook blocks.0.attn.hook_z: expected shape [batch, pos, n_heads=4, d_head=16]")

    monkeypatch.setitem(commands.COMMANDS, "models", dataclasses.replace(commands.COMMANDS["models"], run=incompatible))
    with pytest.raises(lp.LibraryError):  # a library incompatibility is not bad input: it keeps its traceback
        main(["models"])


def _script_tags(page: str) -> list[dict]:
    """The attributes of every <script> tag (an HTML parser: strings inside scripts are not tags)."""
    found = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "script":
                found.append(dict(attrs))

    Parser().feed(page)
    return found


def test_report_is_self_contained_with_every_section(tmp_path, capsys):
    argv = ("report", "--model", "toy-gpt2", "toy-qwen3", "--n-docs", "4", "--seq-len", "24", "--out", str(tmp_path))
    code, _, stderr = _main(capsys, *argv)
    assert code == 0, stderr
    assert "resumed" not in stderr  # the report's own shared store is silent
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".lock")]
    page = (tmp_path / "report.html").read_text()
    for section in ("summary", *SECTIONS):
        assert f'<section id="{section}">' in page, section
    scripts = _script_tags(page)
    assert scripts and not any("src" in attrs for attrs in scripts)  # every script inline: no network needed
    assert page.count("plotly.js v") <= 2  # the library is inlined once (its banner), not per figure
    assert page.count('class="plotly-graph-div"') >= 2 * (1 + 1 + 2 + 1 + 2 + 1)  # every figure of both models
    summary = pd.read_csv(tmp_path / "tables" / "summary.csv")
    assert list(summary["model"]) == ["toy-gpt2", "toy-qwen3"]
    assert (tmp_path / "tables" / "toy-qwen3_sensitivity.csv").is_file()
    meta = json.loads((tmp_path / "results" / "toy-qwen3_decomposition.json").read_text())
    assert meta["data"]["provenance"]["model"]["name"] == "toy-qwen3"
    assert (tmp_path / "results" / "toy-gpt2_diagonal_1.json").is_file()
    confirmed = pd.read_csv(tmp_path / "tables" / "toy-gpt2_attribution.csv")  # 12 heads: top 6, 6 random
    assert list(confirmed["chosen"]) == ["top"] * 6 + ["random"] * 6
    assert summary["attribution_spearman"].between(-1, 1).all()
    assert (tmp_path / "results" / "toy-qwen3_attribution_confirm.json").is_file()


def test_weights_changed_on_disk_refuse_the_old_store(tmp_path, capsys):
    """`sensitivity --model DIR --out O`, DIR/model.safetensors rewritten in place, rerun: before, exit 0 with the old
    edited losses against a fresh base (L0H0 -0.0121 where a fresh run gives +0.0014); now the store is refused, and
    a new store gives exactly a fresh run's table."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lens_parallel.models import toy_folder

    folder = tmp_path / "model"
    shutil.copytree(toy_folder("toy-gpt2"), folder)
    args = ["sensitivity", "--model", str(folder), "--n-docs", "3", "--seq-len", "12", "--layers", "0", "--out"]
    assert main([*args, str(tmp_path / "o")]) == 0
    state = load_file(folder / "model.safetensors")
    name = next(k for k in state if "h.0.attn.c_attn.weight" in k)
    state[name][0, :8] *= 1.5  # retrained / fine-tuned in place
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main([*args, str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "sensitivity_store.jsonl was written by a run whose numbers differ (weights: store has" in err
    assert "--store" in err
    assert main([*args, str(tmp_path / "o"), "--store", str(tmp_path / "new.jsonl")]) == 0
    assert main([*args, str(tmp_path / "fresh")]) == 0
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "o" / "sensitivity.csv"), pd.read_csv(tmp_path / "fresh" / "sensitivity.csv")
    )


def test_tasks_scores_edit_specs_and_a_settings_file(tmp_path, capsys):
    settings = tmp_path / "settings.yaml"
    settings.write_text("own direction: value:s_par=0\nboth: [zero-diagonal, random-direction:seed=2]\n")
    line = ["tasks", "--model", "toy-gpt2", "--tasks", "copa", "--limit", "4", "--no-progress"]
    assert main([*line, "--settings", str(settings), "value:s_par=0.5,layers=1+2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "copa" in printed
    for name in (
        "tasks.csv",
        "tasks_summary.csv",
        "tasks_differences.csv",
        "tasks.json",
        "tasks.html",
        "tasks_scores.html",
        "tasks_samples.jsonl",
        "tasks_samples.html",
        "tasks_requests.sqlite",
    ):
        assert (tmp_path / name).stat().st_size > 100, name
        assert f"  {tmp_path / name}\n" in printed, name  # the "wrote:" list names every file, the store too
    frame = pd.read_csv(tmp_path / "tasks.csv")
    assert set(frame["setting"]) == {"unedited", "own direction", "both", "value:s_par=0.5,layers=1+2"}
    assert len(frame) == 4 * 4
    edits = json.loads((tmp_path / "tasks.json").read_text())["data"]["provenance"]["settings"]["edits"]
    assert [e["type"].rsplit(".", 1)[1] for e in edits["both"]] == ["ZeroDiagonal", "RandomDirectionRemoval"]
    assert edits["value:s_par=0.5,layers=1+2"][0]["layers"] == {"__tuple__": [1, 2]}
    samples = pd.read_json(tmp_path / "tasks_samples.jsonl", lines=True)
    assert len(samples) == 4 * 4 and samples["response"].str.len().min() > 0  # every answer readable
    joined = samples.merge(frame, on=["doc_id", "setting"], suffixes=("", "_scored"))
    assert (joined["acc"] == joined["acc_scored"]).all() and len(joined) == 16
    assert (joined["acc"] == (joined["response"] == joined["target"])).all()  # the chosen option is scored


def test_every_subcommand_prints_its_help(capsys):
    """--help of every subcommand (argparse %-formats help texts: a literal "50%" in one broke compress --help)."""
    parser = cli.build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in choices:
        with pytest.raises(SystemExit) as done:
            cli.build_parser().parse_args([name, "--help"])
        assert done.value.code == 0, name
        text = capsys.readouterr().out
        assert f"usage: lens-parallel {name}" in text
        if name == "compress":
            assert "wanda-50%" in text and "--mode {local,global}" in text


def test_an_unknown_task_is_refused_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr("lens_parallel.models.load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, _, stderr = _main(capsys, "tasks", "--model", "smollm2-135m", "--tasks", "gsm8k_co")
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and len(stderr.strip()) < 300
    assert "did you mean gsm8k_cot" in stderr


@pytest.mark.parametrize(
    ("message", "said"),
    [
        (
            "pass allow_code_execution=True (command line: --allow-code-execution) to run it",
            "pass --allow-code-execution to run it",
        ),
        ("max_gen_toks=600 leaves no room", "--max-gen-toks 600 leaves no room"),
        ("give another store (store= in Python, --store on the command line)", "give another store (--store)"),
        ("without apply_chat_template=False", "without --no-apply-chat-template"),
        ("s_par=0 is not an option of tasks", "s_par=0 is not an option of tasks"),
    ],
)
def test_a_library_message_names_the_command_lines_flags(message, said):
    assert as_flags("tasks", message) == said


def test_the_generate_table_fits_the_terminal_with_texts_left_aligned(tmp_path, capsys, monkeypatch):
    """75 rows of texts far longer than the terminal: each printed line fits its 80 columns, each text starts in
    the same column (cut with …); the whole texts are in the files."""
    monkeypatch.setenv("COLUMNS", "80")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Prompt number {i} says" for i in range(25)), encoding="utf-8")
    argv = ["generate", "--model", "toy-gpt2", "--prompts-file", str(prompts), "--max-new-tokens", "40"]
    code, stdout, stderr = _main(capsys, *argv, "--settings", "value:s_par=0", "zero-diagonal", "--out", str(tmp_path))
    assert code == 0, stderr
    table = stdout.split("wrote:")[0].splitlines()[1:]
    rows = [line for line in table if "unedited" in line or "s_par" in line or "zero-diagonal" in line]
    assert len(rows) == 75 and all(len(line) <= 80 for line in table), max(map(len, table))
    frame = pd.read_csv(tmp_path / "generate.csv")
    assert len({len(line) for line in rows}) == 1  # every text padded to one width after the same columns: left-aligned
    assert all(line.endswith("…") for line in rows)  # each longer than the room left, cut
    assert frame["text"].str.len().min() > 80  # the files keep them whole


def test_version_models_width_and_help_that_names_only_flags_it_has(capsys):
    from lens_parallel import __version__
    from lens_parallel.cli import SPEC_PATH
    from lens_parallel.commands import TERMINAL_WIDTH

    code, stdout, _ = _main(capsys, "models")
    assert code == 0 and max(len(line) for line in stdout.splitlines()) <= TERMINAL_WIDTH
    code, stdout, _ = _main(capsys, "--version")
    assert code == 0 and stdout.strip() == f"lens-parallel {__version__}"
    spec = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
    fields = {f.name for cls in (lp.RunOptions, lp.DataOptions) for f in dataclasses.fields(cls)}
    for name, command in spec["commands"].items():
        flags = {a["flag"].lstrip("-").replace("-", "_") for a in command["arguments"]}
        for argument in command["arguments"]:
            named = set(re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", str(argument["kwargs"].get("help", "")))) & fields
            assert named <= flags, f"{name} {argument['flag']}: its help names {named - flags}, which has no flag"
