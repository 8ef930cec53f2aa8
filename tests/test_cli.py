from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser

import pandas as pd
import pytest
import torch

from lens_parallel import LensParallelError, cli
from lens_parallel.cli import main
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


def _run(*args):
    return subprocess.run([sys.executable, "-m", "lens_parallel.cli", *args], capture_output=True, text=True)


def test_user_errors_exit_2_with_one_line_and_no_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = str(tmp_path / "o")
    cases = {
        ("--model", "toy-nope", "--out", out): "unknown model spec 'toy-nope'",
        ("--model", "toy-gpt2", "--seq-len", "5000", "--out", out): "exceeds the model's context length",
        ("--model", "toy-gpt2", "--out", str(blocker / "sub")): "cannot create the folder",
    }
    for args, message in cases.items():
        proc = _run("decompose", *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    proc = _run("decompose", "--space", "nope")
    assert proc.returncode == 2 and "invalid choice: 'nope'" in proc.stderr and "Traceback" not in proc.stderr


TOY = ("--model", "toy-gpt2", "--n-docs", "4", "--seq-len", "24")
SUBCOMMANDS = {
    "scale": (("--s-par", "0", "1.5", "--s-perp", "0.5"), ["scale.csv", "scale.json", "scale.html"]),
    "diagonal": ((), ["diagonal.csv", "diagonal.json", "diagonal.html"]),
    "sensitivity": (("--layers", "0", "2"), ["sensitivity.csv", "sensitivity.json", "sensitivity.html"]),
    "sensitivity --method attribution": (
        ("--method", "attribution", "--confirm", "2"),
        ["attribution.csv", "attribution.json", "attribution.html", "attribution_confirm.csv"],
    ),
    "dominance": (
        ("--query-start", "4", "--query-stop", "20", "--scale", "js_distance"),
        ["dominance.csv", "dominance.json", "dominance.html"],
    ),
    "checks": ((), ["checks.csv", "checks.json", "checks.html"]),
    "compress": (
        ("--method", "int8", "wanda-2:4"),
        [
            "compress.csv",
            "compress_methods.csv",
            "compress_summary.csv",
            "compress.json",
            "compress.html",
            "compress_mlp.html",
        ],
    ),
}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_each_subcommand_writes_its_files(tmp_path, command):
    extra, files = SUBCOMMANDS[command]
    command = command.split()[0]
    proc = _run(command, *TOY, *extra, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for name in [*files, f"{files[0].removesuffix('.csv')}_summary.csv"]:
        assert (tmp_path / name).stat().st_size > 100, name
    stem = files[0].removesuffix(".csv")
    meta = json.loads((tmp_path / f"{stem}.json").read_text())
    assert meta["format"] == "lens_parallel.result" and meta["version"] == 1
    data = meta["data"]
    provenance = data["null"]["provenance"] if command == "checks" else data["provenance"]  # two results in one
    assert provenance["model"]["name"] == "toy-gpt2"
    assert len(pd.read_csv(tmp_path / files[0])) > 0
    assert "wrote:" in proc.stdout and "Traceback" not in proc.stderr
    if command == "dominance":  # the study's texts by default, the window and scale as given
        assert "js_distance scale" in proc.stdout and "L0→L1" in proc.stdout
        assert provenance["settings"]["query_positions"] == list(range(4, 20))
        assert "lunyu" in provenance["texts"]["corpus"]


def test_train_and_models_subcommands(tmp_path):
    proc = _run(
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
    assert proc.returncode == 0, proc.stderr
    table = pd.read_csv(tmp_path / "paired.csv")
    assert list(table["arm"]) == ["xsa-gated"] and table["n_seeds"].item() == 2
    assert table["role"].item() == "primary" and {"mde_paper", "mde_80", "mde_90"} <= set(table.columns)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["arms"] == ["baseline", "xsa-gated"] and plan["seeds"] == [0, 1] and "mde_paper" in proc.stdout
    assert len(pd.read_csv(tmp_path / "train.csv")) == 2 * 2  # one row per (arm, seed)
    assert (tmp_path / "train.html").is_file() and (tmp_path / "train_gates.html").is_file()
    assert (tmp_path / "baseline" / "seed1" / "model" / "config.json").is_file()
    proc = _run("models", "--out", str(tmp_path))
    assert proc.returncode == 0 and "toy-qwen3" in proc.stdout
    models = pd.read_csv(tmp_path / "models.csv")
    assert models.set_index("spec").loc["toy-gpt2", "offline_now"] == "yes"
    assert models.set_index("spec").loc["openai-community/gpt2", "offline_now"].startswith(("no", "yes"))


def test_more_bad_inputs_exit_2_with_one_line(tmp_path):
    cases = [
        (("compress", "--method", "gptq", "--out", str(tmp_path)), "unknown compression 'gptq'"),
        (("scale", "--model", "toy-gpt2", "--s-par", "nan", "--out", str(tmp_path)), "finite"),
        (("diagonal", *TOY, "--layer", "7", "--head", "0", "--out", str(tmp_path)), "out of range"),
        (("diagonal", *TOY, "--layer", "1", "--out", str(tmp_path)), "give both --layer and --head"),
        (
            ("report", "--model", "toy-gpt2", "toy-nope", "--n-docs", "4", "--seq-len", "16", "--out", str(tmp_path)),
            "unknown model spec 'toy-nope'",
        ),
        (("train", "--preset", "tiny", "--arms", "xsa-gated", "--out", str(tmp_path)), "baseline"),
        (("decompose", *TOY, "--device", "gpu", "--out", str(tmp_path)), "unknown device 'gpu'"),
        (("report", *TOY, "--device", "gpu", "--out", str(tmp_path)), "unknown device 'gpu'"),
        (("train", "--preset", "tiny", "--device", "gpu", "--out", str(tmp_path)), "device 'gpu'"),
        (("sensitivity", *TOY, "--confirm", "3", "--out", str(tmp_path)), "use it with --method attribution"),
        (
            ("sensitivity", *TOY, "--method", "attribution", "--confirm", "13", "--out", str(tmp_path)),
            "exceeds the 12 heads screened",
        ),
    ]
    if not torch.cuda.is_available():
        cases += [
            (("decompose", *TOY, "--device", "cuda", "--out", str(tmp_path)), "this machine has no CUDA device"),
            (("train", "--preset", "tiny", "--device", "cuda", "--out", str(tmp_path)), "no CUDA device"),
        ]
    for args, message in cases:
        proc = _run(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, (args, proc.stderr)
    for args in (("sensitivity", "--edit", "erase"), ("train", "--preset", "huge"), ("compress", "--positions", "x")):
        proc = _run(*args)
        assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_a_bug_inside_the_package_keeps_its_traceback(monkeypatch):
    """Only LensParallelError is bad input; any other exception is a bug and must not pose as one."""

    def broken(args):
        raise KeyError("an internal bug")

    monkeypatch.setitem(cli.COMMANDS, "models", broken)
    with pytest.raises(KeyError, match="an internal bug"):
        main(["models"])

    def bad_input(args):
        raise LensParallelError("layers [9] out of range")

    monkeypatch.setitem(cli.COMMANDS, "models", bad_input)
    assert main(["models"]) == 2


def _script_tags(page: str) -> list[dict]:
    """The attributes of every <script> tag (an HTML parser: strings inside scripts are not tags)."""
    found = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "script":
                found.append(dict(attrs))

    Parser().feed(page)
    return found


def test_report_is_self_contained_with_every_section(tmp_path):
    proc = _run(
        "report", "--model", "toy-gpt2", "toy-qwen3", "--n-docs", "4", "--seq-len", "24", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
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
