"""Every private API of another package is used in lens_parallel/compat.py alone, and each use fails loudly in one
line when the installed version leaves the range it was checked on."""

from __future__ import annotations

import ast
import pathlib

import pytest

from lens_parallel import compat
from lens_parallel.errors import LibraryError

pytestmark = pytest.mark.unit

PACKAGE = pathlib.Path(compat.__file__).parent
OTHERS = ("transformer_lens", "lm_eval", "transformers", "torch", "torchao", "accelerate", "datasets", "ray")


@pytest.mark.parametrize("package", list(compat.CHECKED))
def test_the_installed_versions_are_in_their_checked_ranges(package):
    compat.check.cache_clear()
    compat.check(package)


@pytest.mark.parametrize("package", list(compat.CHECKED))
def test_a_version_outside_the_range_fails_in_one_line_naming_it(package, monkeypatch):
    monkeypatch.setattr(compat.importlib.metadata, "version", lambda name: "99.1.0")
    compat.check.cache_clear()
    try:
        with pytest.raises(LibraryError) as error:
            compat.check(package)
    finally:
        compat.check.cache_clear()
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{package} 99.1.0 is installed")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _compat_names() -> set[str]:
    """The private names of other packages compat spells: the attributes it reads or writes and the strings it
    names them by (TransformerLens's steps, lm-eval's index, torch's ops, transformers' config fields)."""
    tree = ast.parse((PACKAGE / "compat.py").read_text(encoding="utf-8"))
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _private(node.attr)}
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return names | {text for text in strings if _private(text) and text.isidentifier()}


def _private_uses(path: pathlib.Path, names: set[str]) -> list[str]:
    """Imports of another package's private module or name (or its generalized components), attribute reads of
    TransformerLens's wrapped module or an object's ``__dict__``, and any use of a private name compat spells
    (:func:`_compat_names`) as an attribute or a string."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OTHERS:
            module = node.module or ""
            found += [f"{module}.{a.name}" for a in node.names if _private(a.name)]
            parts = [*module.split("."), *(a.name for a in node.names)]
            found += [module] if "generalized_components" in parts or any(map(_private, module.split("."))) else []
        if isinstance(node, ast.Attribute) and (node.attr in ("original_component", "__dict__") or node.attr in names):
            found.append(node.attr)
        if isinstance(node, ast.Constant) and (node.value == "._original_component" or node.value in names):
            found.append(node.value)
    return found


def test_no_other_module_uses_a_private_name_of_another_package():
    names = _compat_names()
    assert {"_update_kv_cache", "_layer_idx", "_index", "_scaled_dot_product_efficient_attention"} <= names
    offenders = {
        str(p.relative_to(PACKAGE)): uses
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "compat.py" and (uses := _private_uses(p, names))
    }
    assert offenders == {}
    assert _private_uses(PACKAGE / "compat.py", names)  # the check sees them where they are
