"""Notebooks are part of the product: each one runs end to end here (committed without outputs), and what a user
saves after running it stays small (outputs and widget state under 2 MB: no copy of plotly.js per figure)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(cell.get("outputs", []) == [] for cell in nb.cells if cell.cell_type == "code"), "commit without outputs"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    last = nb.cells[-1].outputs[0]["data"]["text/plain"]
    assert last == "True"  # the saved-and-reloaded result equals the original
    saved = len(nbformat.writes(nb).encode())  # as saved: outputs, and the widgets' state (nbclient stores it)
    assert saved < 2_000_000, f"{path.name} would be saved at {saved / 1e6:.1f} MB"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_valid_with_cell_ids(path):
    """nbformat 4.5: every cell has an id (else nbformat warns on every read, and mkdocs-jupyter prints it)."""
    import json
    import warnings

    raw = json.loads(path.read_text(encoding="utf-8"))
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5) and all("id" in cell for cell in raw["cells"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nbformat.validate(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))
