"""The documentation site builds strictly (a broken link, a page outside the navigation or a reference
mkdocstrings cannot resolve fails the build), its API reference holds every public name, its command-line
reference every subcommand and option of the saved parser, and every page with Python examples is run by
tests/test_readme.py."""

from __future__ import annotations

import html as html_module
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lens_parallel
from lens_parallel.cli import SPEC_PATH
from tests.test_readme import PAGES, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs-site")]  # one worker: the site is built once


@pytest.fixture(scope="session")  # built once per worker, however the tests are ordered
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1", "LENS_PARALLEL_DOCS_EXECUTE": "false"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_api_reference_holds_every_public_name(site: Path) -> None:
    html = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    anchors = set(re.findall(r'id="(lens_parallel\.[\w.]+)"', html))
    assert [n for n in lens_parallel.__all__ if f"lens_parallel.{n}" not in anchors] == []
    assert "lens_parallel.geometry.project" in anchors  # a public module's functions, each with its docstring
    text = html_module.unescape(re.sub(r"<[^>]+>", "", html))
    assert "head_index d_head" in text  # jaxtyping shapes in the signatures
    assert "self_cos[<space>,<level>]" in text and "<space>" not in html  # a column's name is text, not a tag


def test_the_cli_reference_holds_every_subcommand_and_option(site: Path) -> None:
    text = re.sub(r"<[^>]+>", "", (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8"))
    spec = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
    for name, command in spec["commands"].items():
        assert f"lens-parallel {name}" in text
        assert all(argument["flag"] in text for argument in command["arguments"])


def test_every_notebook_and_guide_is_a_page(site: Path) -> None:
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks and all((site / "notebooks" / n / "index.html").is_file() for n in notebooks)
    for page in PAGES:
        assert (site / page.relative_to(ROOT / "docs").with_suffix("") / "index.html").is_file()


def test_every_page_with_python_examples_is_run_by_the_readme_test() -> None:
    ran = {page.relative_to(ROOT / "docs") for page in PAGES}
    examples = {p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md") if "```python" in p.read_text()}
    assert examples == ran


OUTSIDE = re.compile(
    r"<(?:script|img|iframe|source|audio|video)\b[^>]*\bsrc=[\"']?(?:https?:)?//"
    r"|<link\b[^>]*\bhref=[\"']?(?:https?:)?//"
    r"|url\(\s*[\"']?(?:https?:)?//"
    r"|@import\s+[\"']?(?:https?:)?//"
    r"|import\(\s*[\"'](?:https?:)?//"
    r"|\.src\s*=\s*[\"'](?:https?:)?//"
    r"|Src\s*=\s*[\"'](?:https?:)?//",
    re.I,
)
"""A resource a page would load from outside the site: a script, image, frame or medium, a stylesheet, font or
preconnect, a CSS url() or @import, a dynamic import, a script's src set in code. Links to other sites (``<a href>``)
are not loads."""


def test_the_site_loads_nothing_from_outside_it(site: Path) -> None:
    """Offline, every page renders whole: no font, script or stylesheet comes from a CDN. Scanned: every page and
    stylesheet, inline scripts included. Not scanned: the theme's and plotly's minified bundles, whose only outside
    addresses are loaders of features these pages do not use (Mermaid diagrams, a polyfill for browsers without
    ResizeObserver, plotly's geographic maps)."""
    files = [*site.rglob("*.html"), *site.rglob("*.css")]
    found = {str(f.relative_to(site)): OUTSIDE.findall(f.read_text(encoding="utf-8")) for f in files}
    assert len(files) > 30 and {k: v for k, v in found.items() if v} == {}


def test_the_docs_figures_fill_the_column_and_load_nothing(tmp_path: Path) -> None:
    """The renderer the executed notebooks' pages use (``scripts/docs_hooks.py``, FIGURES): a figure laid out 1,150
    px wide comes out at the column's width, responsive, with no plotly.js or MathJax from a CDN."""
    import importlib.util

    import plotly.graph_objects as go
    import plotly.io as pio

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    default = pio.renderers.default
    try:
        exec(hooks.FIGURES, {})  # what each kernel runs at start
        title = "Layer sensitivity to parallel-value ablation: toy-qwen3 (base loss 11.953 nats/token)"
        fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 2]), layout={"width": 1150, "height": 480, "title": title})
        html = pio.renderers["lens_parallel_docs"].to_mimebundle(fig.to_dict())["text/html"]
        short = go.Figure(layout={"title": "Loss by layer"}).to_dict()
        assert "Loss by layer" in pio.renderers["lens_parallel_docs"].to_mimebundle(short)["text/html"]
    finally:
        pio.renderers.default = default
    assert 'style="height:480px; width:100%;"' in html and '"responsive": true' in html
    assert '"width": 1150' not in html and "<script src" not in html and not OUTSIDE.findall(html)
    assert "toy-qwen3\\u003cbr\\u003e\\u003csup\\u003e(base loss 11.953 nats" in html  # two lines (JSON-escaped)


def test_the_cli_reference_shows_each_value_and_default_once(site: Path) -> None:
    html = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    rows = [re.sub(r"<[^>]+>", " ", row) for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)]
    assert "<code></code>" not in html and "``" not in html  # an option without a type shows one, not empty quotes
    assert [row for row in rows if row.count("(default:") > 1] == []
