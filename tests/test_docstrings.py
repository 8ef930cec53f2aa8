"""``help()`` of every public function and class shows its parameters (types and defaults), what it returns and a
runnable example, and the examples run: each public name's ``Examples:`` section is a doctest here."""

from __future__ import annotations

import doctest
import inspect
import re

import pytest

import lens_parallel as lp
from tests.conftest import get_model

PUBLIC = sorted(n for n in lp.__all__ if inspect.isfunction(getattr(lp, n)) or inspect.isclass(getattr(lp, n)))
"""Every public function and class (the registries, modules and ``__version__`` are values: help() of a value shows
its type's help, so they are documented where they are defined)."""


def _section(doc: str, title: str) -> str:
    match = re.search(rf"^{title}:\n((?:    .*\n?|\n)*)", doc, re.M)
    return match.group(1) if match else ""


@pytest.mark.parametrize("name", PUBLIC)
def test_help_lists_every_parameter_its_return_and_an_example(name):
    obj = getattr(lp, name)
    doc = inspect.getdoc(obj) or ""
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = [
        p
        for p in inspect.signature(target).parameters.values()
        if p.name not in ("self", "cls") and p.kind is not p.VAR_POSITIONAL
    ]
    if inspect.isclass(obj) and not (getattr(obj.__init__, "__module__", None) or "").startswith("lens_parallel"):
        params = []  # a protocol's or an exception's inherited constructor
    args = _section(doc, "Args")
    for p in params:
        star = "**" if p.kind is p.VAR_KEYWORD else ""
        default = "" if p.default is p.empty else f" Default: {p.default!r}."
        assert re.search(rf"^    {re.escape(star + p.name)} \([^\n]+\):.*{re.escape(default)}$", args, re.M), (
            f"{name}: parameter {p.name} (type and default{default}) missing from Args"
        )
    if inspect.isfunction(obj) and inspect.signature(obj).return_annotation not in ("None", None, inspect._empty):
        assert _section(doc, "Returns").strip(), f"{name}: no Returns section"
    assert ">>> " in _section(doc, "Examples"), f"{name}: no example"


@pytest.mark.parametrize("name", PUBLIC)
def test_the_examples_run(name, tmp_path, monkeypatch):
    """Each example as a reader runs it. The toy models it loads are the test session's (``get_model``: built once
    per worker, as a reader's notebook holds one), so that sixty examples do not build sixty copies."""
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    doc = inspect.getdoc(getattr(lp, name)) or ""
    load = lp.load_model
    monkeypatch.setattr(lp, "load_model", lambda spec, **kw: get_model(spec) if not kw else load(spec, **kw))
    test = doctest.DocTestParser().get_doctest(_section(doc, "Examples"), {}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda text: pytest.fail(text))
    assert runner.failures == 0 and runner.tries > 0


def test_completing_leaves_a_protocols_members_as_they_were():
    """A runtime-checkable protocol's ``isinstance`` reads the names in its class: completing adds none."""
    assert not [name for name in vars(lp.Edit) if "lens_parallel" in name or "completed" in name]
