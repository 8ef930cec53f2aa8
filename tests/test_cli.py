from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd

from lens_parallel.cli import main


def test_decompose_writes_table_result_and_figure(tmp_path, capsys):
    out = tmp_path / "dec"
    argv = ["decompose", "--model", "toy-gpt2", "--space", "value", "residual-mlp", "--n-docs", "3",
            "--seq-len", "16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    df = pd.read_csv(out / "decompose.csv")
    assert set(df.space) == {"value", "residual-mlp"} and len(df) == 3 * 4 + 3
    meta = json.loads((out / "decompose.json").read_text())
    assert meta["provenance"]["model"]["name"] == "toy-gpt2"
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
