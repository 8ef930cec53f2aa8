"""The explorer in a real browser: a JupyterLab server on localhost, notebooks/06_explorer.ipynb opened in Debian's
Chromium through Playwright and run, a slider moved and a heatmap cell clicked, the figures seen to change, a prompt
generated under the clicked head's edit beside the unedited model; no console error, no request leaving the machine.
And the exported page rendering offline."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from lens_parallel import explore, token_blocks

from .conftest import get_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_explorer.ipynb"
LOCAL = ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:", "file:", "about:")
TITLES = "Array.from(document.querySelectorAll('.js-plotly-plot .gtitle')).map(t => t.textContent)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with its own config, data and runtime folders, serving a copy of the notebook."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(NOTEBOOK, root)
    port, token = _free_port(), secrets.token_hex(16)
    env = os.environ | {
        "JUPYTER_CONFIG_DIR": str(root / ".config"),
        "JUPYTER_RUNTIME_DIR": str(root / ".runtime"),
        "LENS_PARALLEL_EXPLORE_MODEL": "toy-llama",
    }
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}"]
    command += [f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
    command += [
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
    ]
    command += ["--allow-root"]  # CI runs as root here; harmless otherwise
    log = open(root / "lab.log", "w")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (root / "lab.log").read_text()[-3000:]
                time.sleep(0.5)
        yield url, token
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        log.close()


def _browser(p, errors: list, external: list):
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))

    def refuse_network(route):
        if route.request.url.startswith(LOCAL):
            route.continue_()
        else:
            external.append(route.request.url)
            route.abort()

    page.route("**/*", refuse_network)
    return browser, page


def _wait_for_titles(page, *fragments: str) -> list[str]:
    """The figures' titles once every fragment is in one of them, read in the same evaluation that saw them (a
    figure being redrawn has no title for a moment: waiting for one fragment and reading later can miss another)."""
    condition = " && ".join(f"titles.some(t => t.includes({f!r}))" for f in fragments)
    script = f"(() => {{ const titles = {TITLES}; return ({condition}) && titles; }})()"
    found = page.wait_for_function(script, timeout=60_000)
    return found.json_value()


def test_the_notebook_widget_reacts_to_a_slider_a_heatmap_click_and_a_prompt(lab):
    assert CHROMIUM, "Chromium is needed for this test: apt-get install chromium (make test installs it)"
    url, token = lab
    errors, external = [], []
    with sync_playwright() as p:
        browser, page = _browser(p, errors, external)
        page.goto(f"{url}/lab/tree/{NOTEBOOK.name}?token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        page.wait_for_function("document.body.innerText.includes('(ipykernel) | Idle')", timeout=120_000)
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=180_000)
        before = _wait_for_titles(page, "loss change per token", "attention pattern")
        loss_before = next(t for t in before if t.startswith("loss change"))
        assert "s_par=0," in loss_before

        handle = page.locator(".widget-slider .noUi-handle").first  # s_par
        handle.focus()
        page.keyboard.press("ArrowRight")
        after_slider = _wait_for_titles(page, "s_par=0.1,", "attention pattern")
        assert next(t for t in after_slider if t.startswith("loss change")) != loss_before

        pattern_before = next(t for t in after_slider if "attention pattern" in t)
        heat = page.locator(".js-plotly-plot").first.locator(".nsewdrag").first
        box = heat.bounding_box()
        page.mouse.click(
            box["x"] + box["width"] * 0.1, box["y"] + box["height"] * 0.1
        )  # head 0 of layer 0 (at the top)
        found = page.wait_for_function(
            f"(() => {{ const titles = {TITLES}; return titles.some(t => t.includes('attention pattern') && "
            f"t !== {pattern_before!r}) && titles; }})()",
            timeout=60_000,
        )
        titles = found.json_value()

        page.locator(".widget-text input[type='text']").first.fill("The capital of France is")  # the prompt
        page.locator("button", has_text="generate").first.click()
        headers = "Array.from(document.querySelectorAll('.widget-html th')).map(t => t.textContent)"
        shown = page.wait_for_function(
            f"(() => {{ const h = {headers}; return h.includes('unedited') && h; }})()", timeout=120_000
        ).json_value()
        cells = page.evaluate("Array.from(document.querySelectorAll('.widget-html td')).map(t => t.textContent)")
        browser.close()
    assert shown[:2] == ["prompt", "unedited"] and "L0H0" in shown[2], shown  # the clicked head's edit
    assert cells[0] == "The capital of France is" and len(cells) == 3, cells
    assert any("L0H0 attention pattern" in t for t in titles), titles
    assert errors == [], errors
    assert external == [], external


def test_the_exported_page_renders_offline(tmp_path):
    assert CHROMIUM, "Chromium is needed for this test: apt-get install chromium (make test installs it)"
    model = get_model("toy-gpt2")
    path = explore(model, token_blocks(model, "wikipedia-en", n_docs=2, seq_len=12)).to_html(tmp_path / "x.html")
    errors, external = [], []
    with sync_playwright() as p:
        browser, page = _browser(p, errors, external)
        page.goto(path.as_uri())
        page.wait_for_function("document.querySelectorAll('.plotly-graph-div svg.main-svg').length >= 4")
        n_traces = page.evaluate(
            "Array.from(document.querySelectorAll('.plotly-graph-div')).map(d => (d.data || []).length)"
        )
        page.locator(".updatemenu-header-group").nth(1).click()  # the pattern figure's head / s_par menu
        page.locator(".updatemenu-dropdown-button").nth(3).click()
        title = page.evaluate(TITLES)
        browser.close()
    assert n_traces[0] == 3 and all(n > 0 for n in n_traces), n_traces  # one heatmap per space
    assert any("attention pattern" in t for t in title)
    assert errors == [] and external == []
