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


def _private_uses(path: pathlib.Path) -> list[str]:
    """Imports of a private name from another package, and attribute reads of TransformerLens's wrapped module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in OTHERS:
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            found += [node.module or ""] if ".generalized_components" in (node.module or "") else []
        if isinstance(node, ast.Attribute) and node.attr in ("original_component", "__dict__"):
            found.append(node.attr)
        if isinstance(node, ast.Constant) and node.value == "._original_component":
            found.append(node.value)
    return found


def test_no_other_module_uses_a_private_name_of_another_package():
    offenders = {
        str(p.relative_to(PACKAGE)): uses
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "compat.py" and (uses := _private_uses(p))
    }
    assert offenders == {}
    assert _private_uses(PACKAGE / "compat.py")  # the check sees them where they are
