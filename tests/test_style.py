"""ruff lint and format are part of the suite, so CI fails on a style regression."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["lens_parallel", "tests", "benchmarks", "scripts", "notebooks"]


def test_ruff_check_and_format():
    for args in (["check", *PATHS], ["format", "--check", *PATHS]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
