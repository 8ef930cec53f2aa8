"""The HTML report in a real headless browser (Debian's Chromium driven by Playwright; .ci/run installs Chromium).

Every figure must render (a plotly div holding data and a drawn SVG), with no console error and no request
leaving the file (network requests are refused)."""

from __future__ import annotations

import shutil

import pytest
from playwright.sync_api import sync_playwright

from lens_parallel import token_blocks
from lens_parallel.report import SECTIONS, run_battery, write_report
from tests.conftest import get_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    reports = []
    for spec in ("toy-gpt2", "toy-llama"):
        model = get_model(spec)
        blocks = token_blocks(model, "wikipedia-en", n_docs=4, seq_len=24)
        reports.append(run_battery(model, blocks, progress=False))
    return write_report(reports, tmp_path_factory.mktemp("report"))


def test_every_figure_renders_offline_without_console_errors(report_path):
    assert CHROMIUM, "Chromium is needed for this test: apt-get install chromium (make test installs it)"
    errors, external = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))

        def refuse_network(route):
            if route.request.url.startswith("file:"):
                route.continue_()
            else:
                external.append(route.request.url)
                route.abort()

        page.route("**/*", refuse_network)
        page.goto(report_path.as_uri())
        page.wait_for_function("document.querySelectorAll('.plotly-graph-div').length > 0")
        figures = page.evaluate("""Array.from(document.querySelectorAll('.plotly-graph-div')).map(d => ({
            traces: (d.data || []).length, svg: d.querySelectorAll('svg.main-svg').length,
            section: d.closest('section').id}))""")
        sections = page.evaluate("Array.from(document.querySelectorAll('section')).map(s => s.id)")
        browser.close()
    assert sections == ["summary", *SECTIONS]
    # per model: decomposition, scaling, 2 diagonal views, sensitivity, attribution screen and its confirmation, sanity
    assert len(figures) == 2 * 8
    assert all(f["traces"] > 0 and f["svg"] > 0 for f in figures), figures
    assert {f["section"] for f in figures} == set(SECTIONS) - {"edits", "tasks"}  # no edits, no tasks asked for
    assert errors == [] and external == []
