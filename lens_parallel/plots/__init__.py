"""Plotly figures, one module per analysis. Results call these from ``.figure()`` / ``.figures()``; nothing here
computes statistics, and nothing here imports an analysis module. Panels draw into a given figure cell
(``row``, ``col``), so combined figures compose panels."""

from lens_parallel.plots.common import save_figure

__all__ = ["save_figure"]
