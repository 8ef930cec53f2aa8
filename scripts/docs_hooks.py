"""mkdocs hooks: the pages generated from the package itself, so that they cannot fall out of date.

- ``reference/api.md``: one mkdocstrings entry per name of ``lens_parallel.__all__``, grouped by the module that
  defines it (its docstring, signature with jaxtyping shapes, a dataclass's fields);
- ``reference/cli.md``: every subcommand and option of ``lens-parallel`` from the saved parser
  (``lens_parallel/assets/cli_spec.json``, the one the command line itself is built from);
- ``reference/glossary.md``: every column of every table, from :mod:`lens_parallel.glossary` (what ``help()`` and
  ``lens-parallel glossary`` read);

and ``js/plotly.min.js``, the installed plotly's own, which the notebooks' pages load for their figures. Nothing
is loaded from outside the site (the theme's fonts are the system's; nbconvert's Mermaid loader is dropped;
formulas, written ``$...$`` in the pages, become MathML at build time, which the browser draws without a script).
"""

from __future__ import annotations

import html
import inspect
import json
import os
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import latex2mathml.converter
import plotly.offline

import lens_parallel
from lens_parallel.cli import SPEC_PATH

ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|obj|exc):(?=<code>)")
"""A Sphinx role before an inline literal in a rendered docstring (``:func:`name```), dropped."""
SHORTENED = re.compile(r"<code>~(?:[\w]+\.)*([\w]+)</code>")
"""A literal shortened Sphinx's way (``~package.module.name``), shown as its last part."""
API_MARK = "<!-- api -->"
CLI_MARK = "<!-- cli -->"
GLOSSARY_MARK = "<!-- glossary -->"


def _defined_in(name: str) -> str:
    """The module that defines ``lens_parallel.<name>`` (the package itself for a registry or a plain value)."""
    obj = getattr(lens_parallel, name)
    if inspect.ismodule(obj):
        return obj.__name__
    return obj.__module__ if inspect.isclass(obj) or inspect.isfunction(obj) else "lens_parallel"


def api_page() -> str:
    """Markdown: a section per defining module, an mkdocstrings entry per public name (``lens_parallel.<name>``;
    a public module with its functions)."""
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in lens_parallel.__all__:
        by_module[_defined_in(name)].append(name)
    lines = []
    for module in sorted(by_module):
        lines += [f"## `{module}`", ""]
        for name in by_module[module]:
            if inspect.ismodule(getattr(lens_parallel, name)):
                lines += [f"::: {module}", ""]  # a module of functions (geometry): each with its formula
            else:
                lines += [f"::: lens_parallel.{name}", ""]
    return "\n".join(lines)


def _option(argument: dict[str, Any]) -> str:
    """One option of a subcommand as a table row: flag, type or choices, default, help."""
    kwargs = argument["kwargs"]
    kind = " / ".join(f"`{c}`" for c in kwargs["choices"]) if "choices" in kwargs else f"`{kwargs.get('type', 'str')}`"
    if kwargs.get("action") == "boolean_optional":
        kind = "flag"
    if kwargs.get("nargs") in ("+", "*"):
        kind += " ..."
    text = str(kwargs.get("help", "")).replace("|", "\\|").replace("\n", " ")
    return f"| `{argument['flag']}` | {kind} | {text} |"


def cli_page() -> str:
    """Markdown: per subcommand of the saved parser, its help and a table of its options."""
    spec = json.loads(SPEC_PATH.read_text(encoding="utf-8"))
    lines = [f"`{spec['prog']}`: {spec['description']}", ""]
    for name, command in spec["commands"].items():
        lines += [f"## `{spec['prog']} {name}`", "", command["help"], ""]
        lines += ["| option | value | help |", "| --- | --- | --- |"]
        lines += [_option(argument) for argument in command["arguments"]]
        lines.append("")
    return "\n".join(lines)


def glossary_page() -> str:
    """Markdown: one table row per column name of :mod:`lens_parallel.glossary` and its definition."""
    from lens_parallel.glossary import glossary_table

    lines = ["| column | definition |", "| --- | --- |"]
    for row in glossary_table().itertuples(index=False):
        text = html.escape(row.definition).replace("|", "\\|")
        lines.append(f"| `{row.column}` | {text} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Fill the generated pages' marks."""
    if GLOSSARY_MARK in markdown:
        markdown = markdown.replace(GLOSSARY_MARK, glossary_page())
    if API_MARK in markdown:
        markdown = markdown.replace(API_MARK, api_page())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_page())
    return markdown


_KERNEL_PROFILE: list[tempfile.TemporaryDirectory[str]] = []


def on_config(config: Any, **_: Any) -> Any:
    """The kernels that execute the notebooks (``make docs EXECUTE=1``) get an IPython profile of their own, in a
    folder removed after the build: ipykernel's log at ERROR (else each kernel warns that it runs over TCP), no
    IPython history written, and the figures drawn by :data:`FIGURES`."""
    home = tempfile.TemporaryDirectory(prefix="lens-parallel-docs-ipython-")
    _KERNEL_PROFILE.append(home)
    profile = Path(home.name) / "profile_default"
    profile.mkdir()
    settings = {"IPKernelApp": {"log_level": "ERROR"}, "HistoryManager": {"enabled": False}}
    (profile / "ipython_kernel_config.json").write_text(json.dumps(settings), encoding="utf-8")
    (profile / "startup").mkdir()
    (profile / "startup" / "00-figures.py").write_text(FIGURES, encoding="utf-8")
    os.environ["IPYTHONDIR"] = home.name
    return config


def _remove_kernel_profile() -> None:
    while _KERNEL_PROFILE:
        _KERNEL_PROFILE.pop().cleanup()


def on_build_error(**_: Any) -> None:
    _remove_kernel_profile()


def on_post_build(config: Any, **_: Any) -> None:
    """Ship plotly.js (the installed plotly's, so that it matches the figures' JSON) for the notebooks' figures;
    remove the kernels' profile folder."""
    target = Path(config["site_dir"]) / "js" / "plotly.min.js"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(plotly.offline.get_plotlyjs(), encoding="utf-8")
    _remove_kernel_profile()


OUTSIDE_LOADERS = [
    re.compile(
        r'<script type="module">\s*document\.addEventListener\("DOMContentLoaded".*?jp-Mermaid.*?</script>', re.S
    ),
    re.compile(r"<script>\s*\(function\(\) \{\s*function addWidgetsRenderer\(\).*?</script>", re.S),
]
"""nbconvert's loaders of Mermaid (from cdnjs) and of the Jupyter widgets' manager (from unpkg), on every notebook
page: dropped, so that no page loads anything from outside the site (no page draws a diagram; a widget needs a live
kernel, and the explorer's page shows its static HTML export instead)."""

FIGURES = '''"""The documentation's figure renderer (scripts/docs_hooks.py sets it for the kernels that execute the
notebooks): each figure as HTML drawn by the plotly.js the site ships (no CDN, no MathJax), filling the text column:
its layout's fixed width dropped, redrawn when the column's width changes, never narrower than 720 px (its own
width if less): in a narrower column the output scrolls, so that titles and legends never run into each other."""
import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer


def wrapped(title):
    """A title longer than a narrow column holds, on two lines: what comes after its first " (" (else ": ") as a
    smaller second line."""
    text = title.get("text") if isinstance(title, dict) else title
    if not isinstance(text, str) or "<br>" in text or len(text) <= 60:
        return title
    for sep, skip in ((" (", 1), (": ", 2)):
        if (i := text.find(sep)) > 0:
            text = f"{text[:i]}<br><sup>{text[i + skip:]}</sup>"
            break
    return {**title, "text": text} if isinstance(title, dict) else text


class ColumnWide(MimetypeRenderer):
    def to_mimebundle(self, fig_dict):
        least = min(fig_dict.get("layout", {}).get("width") or 720, 720)  # narrower: the output scrolls
        layout = {k: v for k, v in fig_dict.get("layout", {}).items() if k != "width"} | {"autosize": True}
        if "title" in layout:
            layout["title"] = wrapped(layout["title"])
        html = pio.to_html(
            {**fig_dict, "layout": layout},
            include_plotlyjs=False,
            include_mathjax=False,
            full_html=False,
            default_width="100%",
            config={"responsive": True},
            validate=False,
        )
        return {"text/html": f'<div style="min-width: {least}px">{html}</div>'}


pio.renderers["lens_parallel_docs"] = ColumnWide()
pio.renderers.default = "lens_parallel_docs"
'''


def on_post_page(output: str, page: Any, **_: Any) -> str:
    """The notebooks' pages without nbconvert's loaders of outside scripts."""
    if page.file.src_uri.endswith(".ipynb"):
        for loader in OUTSIDE_LOADERS:
            output = loader.sub("", output)
    return output


MATH = re.compile(r'<(span|div) class="arithmatex">\\[(\[](.*?)\\[)\]]</\1>', re.S)
"""A formula as ``pymdownx.arithmatex`` leaves it (``$...$`` inline in a span, ``$$...$$`` display in a div)."""


def _mathml(match: re.Match[str]) -> str:
    """A formula as MathML (the browser renders it: no script, nothing loaded from outside the site)."""
    tag, latex = match.group(1), html.unescape(match.group(2))
    return str(latex2mathml.converter.convert(latex.strip(), display="block" if tag == "div" else "inline"))


def on_page_content(html_text: str, **_: Any) -> str:
    """The docstrings' Sphinx roles rendered as plain literals; formulas written ``$...$`` as MathML."""
    return MATH.sub(_mathml, SHORTENED.sub(r"<code>\1</code>", ROLE.sub("", html_text)))
