"""Notebooks are part of the product: each one runs end to end here (committed without outputs); its figures
survive nbconvert's HTML export offline (``notebook_figures``: plotly.js inline once); and what a user saves after
running it stays small (outputs and widget state under 2 MB besides that one plotly.js: no copy per figure)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbconvert
import nbformat
import plotly.offline
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
    text = nbformat.writes(nb)  # as saved: outputs, and the widgets' state (nbclient stores it)
    plotly_js = plotly.offline.get_plotlyjs()
    banner = re.search(r"plotly\.js v[\d.]+", plotly_js).group()  # in each copy of the library
    copies = text.count(banner) // plotly_js.count(banner)
    figures = sum("application/vnd.plotly.v1+json" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert copies == (1 if figures else 0), f"{path.name}: {figures} figures, {copies} copies of plotly.js"
    saved = len(text.encode()) - copies * len(json.dumps(plotly_js).encode())
    assert saved < 2_000_000, f"{path.name} would be saved at {saved / 1e6:.1f} MB besides plotly.js"
    page, _ = nbconvert.HTMLExporter().from_notebook_node(nb)  # what `jupyter nbconvert --to html` writes
    assert page.count("Plotly.newPlot(") >= figures  # every figure drawn by the page itself
    html = [str(o.get("data", {}).get("text/html", "")) for c in nb.cells for o in c.get("outputs", [])]
    assert not [h for h in html if re.search(r'<script[^>]*\ssrc="(?:https?:)?//', h)]  # no output loads from outside


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
