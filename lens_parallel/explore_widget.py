"""The explorer's live widget: four Plotly ``FigureWidget`` s and ipywidgets controls bound to an
:class:`~lens_parallel.explore.Explorer` (needs ``ipywidgets`` and ``anywidget``, the ``notebook`` extra).

Plotly's ``FigureWidget`` syncs its front-end code (plotly.js and the widget, 5 MB) as part of every widget's
state, so a notebook saved with its widget state held one copy per figure (20 MB for the explorer's four). Here each
figure's front-end code is a small loader (:data:`LOADER`) that asks the kernel for plotly's bundle once per page
and runs it: the saved state holds the figures' data only. Without a kernel (a saved notebook reopened) the live
figures stay empty; :meth:`~lens_parallel.explore.Explorer.to_html` is the kernel-free page.
"""

from __future__ import annotations

import functools
import html
import importlib.metadata
import importlib.resources
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ipywidgets as w
import plotly.graph_objects as go

from lens_parallel.edits import explorer_edits
from lens_parallel.errors import LibraryError
from lens_parallel.plots.explore import setting_label
from lens_parallel.spaces import HEAD_SPACES


@runtime_checkable
class ExplorerRead(Protocol):
    """What the widget reads of a :class:`~lens_parallel.explore.Explorer` (which opens the widget: the widget
    never imports it)."""

    @property
    def documents(self) -> Any: ...

    def figures(self, *args: Any, **kwargs: Any) -> Any: ...

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...

    def save_view(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def state(self) -> Any: ...

    def update(self, *args: Any, **kwargs: Any) -> Any: ...

    @property
    def view(self) -> Any: ...


WIDTH = 560
"""Pixels per figure: two side by side fit a notebook's output area."""

BUNDLE_REQUEST = "lens-parallel:plotly-widget-bundle"
LOADER = f"""
const KEY = "{BUNDLE_REQUEST}";
function bundle(model) {{  // plotly's widget code, asked of the kernel once per page
  if (!globalThis[KEY]) {{
    globalThis[KEY] = new Promise((resolve, reject) => {{
      const received = (message, buffers) => {{
        if (!message || message.type !== KEY) return;
        model.off("msg:custom", received);
        const url = URL.createObjectURL(new Blob([buffers[0]], {{ type: "text/javascript" }}));
        import(url).then((module) => resolve(module.default), reject);
      }};
      model.on("msg:custom", received);
      model.send({{ type: KEY }});
    }});
  }}
  return globalThis[KEY];
}}
export default () => {{
  let ready;  // plotly's widget for this model, once its code is here and it is initialised
  return {{
    initialize(context) {{  // returns at once: the bundle arrives as a message, which must not wait for this
      ready = bundle(context.model).then((factory) => {{
        const widget = factory();
        widget.initialize(context);
        return widget;
      }});
    }},
    async render(context) {{
      return (await ready).render(context);
    }},
  }};
}};
"""
"""The front-end code of :class:`FigureWidget`: plotly's bundle (a factory of ``{initialize, render}``, as
anywidget runs it) fetched from the kernel by a custom message, cached on the page."""

PLOTLY_WIDGET_VERSIONS = ((6, 0), (8, 0))
"""plotly versions [from, to) whose ``FigureWidget`` is an anywidget running ``package_data/widgetbundle.js``, whose
default export is that factory (checked when a widget is made; tests/test_explore_browser.py renders it)."""


@functools.cache
def _plotly_bundle() -> bytes:
    """plotly's widget bundle (``plotly/package_data/widgetbundle.js``, what ``go.FigureWidget`` runs), after
    checking the installed plotly's version."""
    version = importlib.metadata.version("plotly")
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    low, high = PLOTLY_WIDGET_VERSIONS
    bundle = importlib.resources.files("plotly") / "package_data" / "widgetbundle.js"
    if not low <= major_minor < high or not bundle.is_file():
        raise LibraryError(
            f"the explorer's figures load plotly {low[0]}.x-{high[0] - 1}.x's widget bundle (package_data/"
            f"widgetbundle.js); plotly {version} is installed: pip install 'plotly>={low[0]},<{high[0]}'"
        )
    return bundle.read_bytes()


class FigureWidget(go.FigureWidget):  # type: ignore[misc]
    """plotly's ``FigureWidget`` whose front-end code is :data:`LOADER` (module docstring): the bundle is sent to
    the page on its request, never synced as state."""

    _esm = LOADER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _plotly_bundle()  # the installed plotly checked before any widget is shown
        super().__init__(*args, **kwargs)
        self.on_msg(self._send_bundle)

    def _send_bundle(self, widget: Any, content: Any, buffers: Any) -> None:
        if isinstance(content, dict) and content.get("type") == BUNDLE_REQUEST:
            self.send({"type": BUNDLE_REQUEST}, buffers=[_plotly_bundle()])


class ExplorerWidget:
    """Controls -> ``explorer.update(...)`` -> every figure's data and title replaced in place (``box`` shows it).

    Click a heatmap cell to select its head; the status line gives the last update's time in seconds. Below the
    figures, a prompt and ``generate``: its continuation unedited and under the view's edit, side by side, the
    edited text marked from where it departs."""

    def __init__(self, explorer: ExplorerRead, *, save_to: str | Path = "explorer_views") -> None:
        self.explorer, self.save_to = explorer, Path(save_to)
        st = explorer.state
        figs = explorer.figures()
        self.figures = {name: FigureWidget(fig.update_layout(width=WIDTH)) for name, fig in figs.items()}
        self.space = w.Dropdown(options=list(HEAD_SPACES), value=st["space"], description="space")
        self.doc = w.BoundedIntText(value=st["doc"], min=0, max=len(explorer.documents) - 1, description="document")
        self.s_par = w.FloatSlider(value=st["s_par"], min=-1.0, max=2.0, step=0.1, description="s_par")
        self.s_perp = w.FloatSlider(value=st["s_perp"], min=0.0, max=2.0, step=0.1, description="s_perp")
        self.all_heads = w.Checkbox(value=st["all_heads"], description="all heads of the layer")
        self.edit = w.Dropdown(options=list(explorer_edits()), value=st["edit"], description="edit")
        self.seed = w.BoundedIntText(value=st["seed"], min=0, max=2**31 - 1, description="seed")
        self.save = w.Button(description="save view", icon="save")
        self.status = w.HTML()
        self.prompt = w.Text(value="The capital of France is", description="prompt", layout=w.Layout(width="420px"))
        self.new_tokens = w.BoundedIntText(value=24, min=1, max=256, description="new tokens")
        self.run_generation = w.Button(description="generate", icon="play")
        self.generated = w.HTML()
        for control, key in (
            (self.space, "space"),
            (self.doc, "doc"),
            (self.s_par, "s_par"),
            (self.s_perp, "s_perp"),
            (self.all_heads, "all_heads"),
            (self.edit, "edit"),
            (self.seed, "seed"),
        ):
            control.observe(lambda change, key=key: self.apply(**{key: change["new"]}), names="value")
        self.figures["heatmap"].data[0].on_click(self._clicked)
        self.save.on_click(lambda _: self._save())
        self.run_generation.on_click(lambda _: self._generate())
        controls = w.VBox(
            [
                w.HBox([self.space, self.doc, self.all_heads]),
                w.HBox([self.edit, self.seed]),
                w.HBox([self.s_par, self.s_perp, self.save]),
            ]
        )
        grid = w.VBox(
            [
                w.HBox([self.figures["heatmap"], self.figures["pattern"]]),
                w.HBox([self.figures["diagonal"], self.figures["loss"]]),
            ]
        )
        generation = w.VBox([w.HBox([self.prompt, self.new_tokens, self.run_generation]), self.generated])
        self.box = w.VBox([controls, self.status, grid, generation])
        self._enable()
        self._show_status(0.0)

    def _clicked(self, trace: Any, points: Any, selector: Any) -> None:
        if points.point_inds:
            layer, head = points.point_inds[0]
            self.apply(layer=int(layer), head=int(head))

    def apply(self, **changes: Any) -> None:
        """Update the explorer and redraw every figure from its new view."""
        t0 = time.perf_counter()
        try:
            self.explorer.update(**changes)
        except ValueError as exc:
            self.status.value = f"<b>not applied</b>: {exc}"
            return
        for name, fig in self.explorer.figures().items():
            target = self.figures[name]
            with target.batch_update():
                for old, new in zip(target.data, fig.data, strict=True):
                    old.update(new.to_plotly_json(), overwrite=True)
                target.layout.title = fig.layout.title
                target.layout.shapes = fig.layout.shapes
        self._enable()
        self._show_status(time.perf_counter() - t0)

    def _enable(self) -> None:
        """Scales apply to ``scale`` only, the seed to the random directions only."""
        edit = self.explorer.state["edit"]
        self.s_par.disabled = self.s_perp.disabled = edit != "scale"
        self.seed.disabled = not edit.startswith("random")

    def _show_status(self, seconds: float) -> None:
        v = self.explorer.view
        self.status.value = (
            f"{v.label}, {v.space}, document {v.doc}, {setting_label(v)}: mean loss change "
            f"{v.loss_change.mean():+.4f} nats/token (updated in {seconds:.2f} s; click a heatmap cell: another head)"
        )

    def _generate(self) -> None:
        """The prompt continued unedited and under the view's edit, side by side (:meth:`Explorer.generate`)."""
        self.generated.value = "<i>generating ...</i>"
        try:
            result = self.explorer.generate(self.prompt.value, max_new_tokens=self.new_tokens.value)
        except ValueError as exc:  # LensParallelError: an empty prompt, too many tokens
            self.generated.value = f"<b>not generated</b>: {html.escape(str(exc))}"
            return
        self.generated.value = result._repr_html_()

    def _save(self) -> None:
        written = self.explorer.save_view(self.save_to)
        self.status.value += "<br>saved: " + ", ".join(str(p) for p in written)
