"""PNG export through one headless Chromium kept open for the process.

plotly's ``write_image`` starts a Chromium (kaleido's) for every figure and closes it after: about 2 s a figure on
two cores, most of a command that writes a few figures. :func:`png_bytes` keeps one :class:`kaleido.Kaleido` open
on an event loop of its own (a daemon thread), opened at the first PNG and closed at exit, so that a figure takes
about 0.2 s. The rendering is ``write_image``'s: the installed plotly's plotly.js, the width and height of the
figure's layout (or its template's, or 700 x 500) times ``scale``. A browser whose render fails or outlasts
:data:`RENDER_TIMEOUT` is closed, and the next figure opens a new one; a process forked from this one opens its
own.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any

import plotly.graph_objects as go

RENDER_TIMEOUT = 90.0
"""Seconds a browser may take to open, or to render one figure."""
CLOSE_TIMEOUT = 10.0
"""Seconds a browser may take to close."""


class _Browser:
    """One kaleido browser driven from an event loop on a daemon thread of the process that opened it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lens_parallel-png", daemon=True)
        self.thread.start()
        try:
            self.kaleido = self.run(_open())
        except BaseException:
            self._stop()
            raise

    def run(self, coroutine: Coroutine[Any, Any, Any], timeout: float = RENDER_TIMEOUT) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        """Close the browser (a broken one as far as it closes within :data:`CLOSE_TIMEOUT`), end the loop and its
        thread."""
        try:
            with contextlib.suppress(Exception):
                self.run(self.kaleido.close(), CLOSE_TIMEOUT)
        finally:
            self._stop()

    def _stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_TIMEOUT)
        if not self.thread.is_alive():
            self.loop.close()


async def _open() -> Any:
    import kaleido  # the `dev` extra's; without it save_figure writes the HTML and says why there is no PNG

    browser = kaleido.Kaleido(n=1, timeout=RENDER_TIMEOUT)
    await browser.open()
    return browser


_LOCK = threading.Lock()
_OPEN: list[_Browser] = []  # the browser this process renders with, once one is open


def png_bytes(fig: go.Figure, *, scale: float) -> bytes:
    """``fig`` as a PNG, ``scale`` times its layout's size, from this process's browser (opened on first use).
    Raises what kaleido raises (no Chrome/Chromium, a render that failed) or :class:`TimeoutError`."""
    with _LOCK:
        if _OPEN and _OPEN[0].pid != os.getpid():
            _OPEN.clear()  # the parent's browser: its thread did not survive the fork
        if not _OPEN:
            _OPEN.append(_Browser())
        browser = _OPEN[0]
        try:
            return bytes(browser.run(browser.kaleido.calc_fig(fig, opts={"format": "png", "scale": scale})))
        except BaseException:
            _OPEN.clear()
            browser.close()
            raise


@atexit.register
def _close_at_exit() -> None:
    with _LOCK:
        if _OPEN and _OPEN[0].pid == os.getpid():
            _OPEN[0].close()
        _OPEN.clear()
