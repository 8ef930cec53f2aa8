"""The ``Args``, ``Returns`` and ``Columns`` sections of every public name's docstring, written from the code itself.

A public function or class of :mod:`lens_parallel` keeps, in its source, its prose (formula, shapes) and its
``Examples:``, plus an ``Args:`` entry only for what is its own. Its other parameters read their description from
one glossary (:data:`GLOSSARY`: ``model``, ``documents``, ``settings`` are described once), a settings dataclass's
fields from their ``metadata["help"]`` (the text the command line shows too), and every parameter's type and default
from the signature; ``**changes`` lists the fields of the function's settings class and of
:class:`~lens_parallel.options.RunOptions`; a result class, and a function returning one, lists its columns with their
definitions (:mod:`lens_parallel.glossary`). :func:`complete` writes the sections (Google style, rendered by
mkdocstrings and shown by ``help()``) when the name is first read from the package.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

SECTIONS = ("Args:", "Returns:", "Columns:", "Examples:")
GLOSSARY = {
    "model": "the model, a TransformerBridge (:func:`~lens_parallel.models.load_model`)",
    "documents": (
        "what to run on, by the input rule (:meth:`~lens_parallel.documents.Documents.of`): a string, a list of "
        "strings, a [batch, pos] token tensor or token-id lists, a tokenizer's batch with its attention_mask, "
        "TokenBlocks, TextWindows or Documents; padding is never scored"
    ),
    "settings": "the settings object (None: its defaults; its fields may be given as keywords instead)",
    "options": "run options (:class:`~lens_parallel.options.RunOptions`; None: the defaults; as keywords too)",
    "protocol": "a published protocol (:data:`~lens_parallel.protocols.PROTOCOLS`) whose settings to start from",
    "edits": "an edit, a list of edits applied together, or a dict naming several such settings",
    "changes": "keyword shortcuts for the fields of the settings and of RunOptions (below)",
    "progress": "show a progress bar",
    "path": "a folder or file path",
    "tokens": "token ids [batch, pos]",
    "seed": "the random seed",
    "n_docs": "how many documents",
    "seq_len": "tokens per block",
    "texts": "a bundled corpus name, a .txt / .jsonl file, or a list of your own texts",
    "batch_size": "documents per forward",
}
"""Descriptions of the parameters many public names share."""

_DONE: set[int] = set()
"""The ids of the objects whose docstrings are complete (not an attribute on them: a Protocol's attributes are what
``isinstance`` checks)."""


def _sections(doc: str) -> tuple[str, dict[str, str]]:
    """The prose of a docstring and its sections by title (their lines dedented one level)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    prose: list[str] = []
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        if line.strip() in SECTIONS and not line.startswith(" "):
            current = found.setdefault(line.strip(), [])
        elif current is None:
            prose.append(line)
        else:
            current.append(line[4:] if line.startswith("    ") else line)
    return "\n".join(prose).strip(), {k: "\n".join(v).strip("\n") for k, v in found.items()}


def _own_args(text: str) -> dict[str, str]:
    """The entries of a hand-written ``Args:`` section: ``name: description`` (continuation lines indented)."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if m := re.match(r"(\*{0,2}\w+)(?: \([^)]*\))?: (.*)", line):
            name = m.group(1).lstrip("*")
            out[name] = m.group(2)
        elif name is not None and line.strip():
            out[name] += " " + line.strip()
    return out


def _kind(annotation: Any) -> str:
    """An annotation as written (postponed annotations are strings already)."""
    if annotation is inspect.Parameter.empty:
        return "Any"
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def _entry(name: str, kind: str, default: Any, text: str) -> str:
    shown = "" if default is inspect.Parameter.empty else f" Default: {default!r}."
    return f"    {name} ({kind}): {text}{shown}".rstrip()


def _field_entries(cls: type, indent: str) -> list[str]:
    """A settings dataclass's fields as entries (its signature's types and defaults, each field's help)."""
    helps = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}
    return [indent + _entry(p.name, _kind(p.annotation), p.default, helps.get(p.name, "")) for p in _params(cls)]


def _params(obj: Any) -> list[inspect.Parameter]:
    """The parameters a caller gives ``obj`` (a function, or a class's constructor): no self, no ``*args``."""
    if inspect.isclass(obj) and not getattr(obj.__init__, "__module__", "").startswith("lens_parallel"):
        return []  # a protocol's or an exception's inherited constructor: no parameters of its own
    try:
        signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    except (TypeError, ValueError):
        return []
    return [
        p for p in signature.parameters.values() if p.name not in ("self", "cls") and p.kind is not p.VAR_POSITIONAL
    ]


def _resolve(obj: Any, annotation: str) -> type | None:
    """The first class named in an annotation string, looked up in ``obj``'s module."""
    module = inspect.getmodule(obj)
    for word in re.findall(r"[A-Za-z_]\w*", annotation):
        found = getattr(module, word, None)
        if inspect.isclass(found) and word not in ("None", "Any"):
            return found
    return None


def _changes(fn: Any) -> list[str]:
    """``**changes``: the fields of the function's settings class and the names of RunOptions' fields."""
    from lens_parallel.options import RunOptions

    lines = [_entry("**changes", "Any", inspect.Parameter.empty, GLOSSARY["changes"])]
    parameters = inspect.signature(fn).parameters
    cls = _resolve(fn, _kind(parameters["settings"].annotation)) if "settings" in parameters else None
    if cls is not None and dataclasses.is_dataclass(cls):
        lines += _field_entries(cls, indent="    ")
    if "options" in parameters:
        names = ", ".join(f.name for f in dataclasses.fields(RunOptions) if f.init)
        lines.append(f"        (and RunOptions' fields: {names})")
    return lines


def _returns(fn: Any, text: str) -> str:
    """A function's ``Returns:`` entry: its return annotation and ``text`` (default: the returned class's summary)."""
    kind = _kind(inspect.signature(fn).return_annotation)
    if kind in ("None", "Any") and not text:
        return ""
    returned = _resolve(fn, kind)
    if not text and returned is not None:
        text = (inspect.getdoc(returned) or "").split("\n\n")[0]
    return f"    {kind}: {' '.join(text.split())}".rstrip()


def _columns(obj: Any) -> str:
    """The ``Columns:`` entries of a result class, or of a function returning one: each column its class names
    (``columns``) with its definition from :mod:`lens_parallel.glossary`."""
    cls = obj if inspect.isclass(obj) else _resolve(obj, _kind(inspect.signature(obj).return_annotation))
    names = getattr(cls, "columns", "") if cls is not None else ""
    if not isinstance(names, str) or not names:
        return ""
    from lens_parallel.glossary import section

    return section(names.split())


def complete(obj: Any) -> Any:
    """``obj`` with its docstring's ``Args:`` and ``Returns:`` sections written (see the module docstring); once."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)) or id(obj) in _DONE:
        return obj
    prose, sections = _sections(obj.__doc__ or "")
    own = _own_args(sections.get("Args:", ""))
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        own = {f.name: f.metadata["help"] for f in dataclasses.fields(obj) if "help" in f.metadata} | own
    args: list[str] = []
    for p in _params(obj):
        if p.kind is p.VAR_KEYWORD and p.name == "changes":
            args += _changes(obj)
        else:
            name = f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name
            args.append(_entry(name, _kind(p.annotation), p.default, own.get(p.name) or GLOSSARY.get(p.name, "")))
    returns = _returns(obj, sections.get("Returns:", "")) if inspect.isfunction(obj) else ""
    parts = [prose]
    if args:
        parts.append("Args:\n" + "\n".join(args))
    if returns:
        parts.append("Returns:\n" + returns)
    if columns := _columns(obj):
        parts.append("Columns:\n" + columns)
    if examples := sections.get("Examples:"):
        parts.append("Examples:\n" + "\n".join(f"    {line}" if line else "" for line in examples.splitlines()))
    obj.__doc__ = "\n\n".join(parts)
    _DONE.add(id(obj))
    return obj
