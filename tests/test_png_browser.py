"""PNGs from one Chromium kept for the process (lens_parallel.plots.png): the bytes plotly's own export writes, one
browser for every figure, and a browser whose render failed replaced by a new one."""

from __future__ import annotations

import struct

import plotly.graph_objects as go

import lens_parallel.plots.common
from lens_parallel.plots import png, save_figure


def _size(image: bytes) -> tuple[int, int]:
    """A PNG's width and height (its IHDR chunk)."""
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", image[16:24])


def test_one_kept_browser_writes_plotlys_own_bytes(tmp_path):
    sized = go.Figure(go.Scatter(y=[1, 3, 2]), layout={"title": "sized", "width": 400, "height": 300})
    assert [p.name for p in save_figure(sized, tmp_path / "sized")] == ["sized.html", "sized.png"]
    browser = png._OPEN[0]
    default = go.Figure(go.Bar(y=[2, 1]), layout={"title": "default size"})
    save_figure(default, tmp_path / "default")
    assert [browser] == png._OPEN  # the second figure did not start a browser
    for name, fig, size in (("sized", sized, (800, 600)), ("default", default, (1400, 1000))):
        image = (tmp_path / f"{name}.png").read_bytes()
        assert _size(image) == size  # the layout's size (or plotly's 700 x 500) at scale 2
        assert image == fig.to_image(format="png", scale=2)  # plotly's write_image, one browser per figure


def test_a_failed_render_closes_the_browser_and_the_next_figure_opens_another(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lens_parallel.plots.common, "_PNG_FAILURES_SAID", set())
    fig = go.Figure(go.Scatter(y=[1, 2]), layout={"title": "t"})
    save_figure(fig, tmp_path / "first")
    broken = png._OPEN[0]

    async def fails(*args, **kwargs):
        raise RuntimeError("the render failed")

    monkeypatch.setattr(broken.kaleido, "calc_fig", fails)
    assert [p.name for p in save_figure(fig, tmp_path / "second")] == ["second.html"]
    assert "(no PNG for second: the render failed; the HTML has the figure)" in capsys.readouterr().err
    assert png._OPEN == [] and broken.loop.is_closed() and not broken.thread.is_alive()
    assert [p.name for p in save_figure(fig, tmp_path / "third")] == ["third.html", "third.png"]
    assert png._OPEN[0] is not broken
    assert (tmp_path / "third.png").read_bytes() == (tmp_path / "first.png").read_bytes()
