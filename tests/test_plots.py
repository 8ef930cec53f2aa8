"""Figure helpers: files written next to each other, and a missing PNG renderer explained in one line."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import plotly.graph_objects as go
import pytest

import lens_parallel.plots
import lens_parallel.plots.common
from lens_parallel.plots import save_figure
from lens_parallel.plots.common import png_failure

KALEIDO_NO_CHROME = (
    "\n\nKaleido requires Google Chrome to be installed.\n\nEither download and install Chrome yourself following "
    "Google's instructions for your operating system,\nor install it from your terminal by running:\n\n"
    "    $ plotly_get_chrome\n\n"
)


KALEIDO_1_NO_CHROME = (
    "Kaleido v1 and later requires Chrome to be installed. To install Chrome, use the CLI command "
    "`kaleido_get_chrome`, or from Python, use either `await kaleido.get_chrome()` or `kaleido.get_chrome_sync()`."
)


@pytest.mark.parametrize("message", [KALEIDO_NO_CHROME, KALEIDO_1_NO_CHROME])
def test_png_failure_names_the_cause_and_debians_fix_never_a_download(message):
    reason = png_failure(RuntimeError(message))
    assert reason == "no Chrome or Chromium found for kaleido (install Debian's chromium: apt-get install chromium)"
    assert png_failure(ValueError("")) == "ValueError"


def test_save_figure_without_a_png_renderer_says_why_once_per_process(tmp_path, monkeypatch, capsys):
    def no_chrome(fig, *, scale):
        raise RuntimeError(KALEIDO_NO_CHROME)

    monkeypatch.setattr(lens_parallel.plots.common, "png_bytes", no_chrome)
    monkeypatch.setattr(lens_parallel.plots.common, "_PNG_FAILURES_SAID", set())
    written = save_figure(go.Figure(layout={"title": "t"}), tmp_path / "toy-qwen3.5_decompose")
    assert [p.name for p in written] == ["toy-qwen3.5_decompose.html"]
    err = capsys.readouterr().err
    assert "(no PNG for toy-qwen3.5_decompose: no Chrome or Chromium found for kaleido (install Debian" in err
    assert err.count("\n") == 1
    again = save_figure(go.Figure(layout={"title": "u"}), tmp_path / "second")
    assert [p.name for p in again] == ["second.html"] and capsys.readouterr().err == ""  # said once


def test_save_figure_keeps_the_renderers_ignored_error_off_stderr(tmp_path, monkeypatch, caplog):
    """choreographer logs (with a traceback) a Chromium message it cannot decode and ignores; the PNG is still
    written, so lens_parallel.logs drops that record, and that record only. The logger stays logistro's, whose
    ``debug2`` choreographer calls on every message (a plain logger made before it would break every PNG)."""
    pipe = logging.getLogger("choreographer.channels.pipe")
    assert hasattr(pipe, "debug2")

    def garbled_message(fig, *, scale):
        try:
            raise ValueError("Expecting property name enclosed in double quotes")
        except ValueError:
            pipe.exception("JSONError decoding message. Ignoring")
        pipe.error("Error in trying to decode JSON off our read.")
        return b"png"

    monkeypatch.setattr(lens_parallel.plots.common, "png_bytes", garbled_message)
    with caplog.at_level(logging.DEBUG):
        written = save_figure(go.Figure(layout={"title": "t"}), tmp_path / "fig")
    assert [p.name for p in written] == ["fig.html", "fig.png"]
    assert [r.getMessage() for r in caplog.records] == ["Error in trying to decode JSON off our read."]


def test_plots_never_import_an_analysis_at_run_time():
    """Figures take results as arguments: apart from type hints, a plots module imports only plotting code."""
    allowed = ("lens_parallel.plots", "lens_parallel.errors", "lens_parallel.paths", "lens_parallel.models")  # labels
    allowed += ("lens_parallel.layers", "lens_parallel.spaces")  # the layer kinds' tick labels, the spaces' panels
    for path in Path(lens_parallel.plots.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: `if TYPE_CHECKING:` blocks are ast.If, not imports
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lens_parallel"):
                assert node.module.startswith(allowed), f"{path.name} imports {node.module}"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef,)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.ImportFrom):
                        assert not (inner.module or "").startswith("lens_parallel"), f"{path.name}: {inner.module}"
