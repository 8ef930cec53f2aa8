"""ruff lint and format and mypy --strict are part of the suite, so CI fails on a style or typing regression."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import TIERS

ROOT = Path(__file__).resolve().parents[1]
FMT_DIRECTIVE = re.compile(r"#\s*fmt:\s*(skip|off)")
PATHS = ["lens_parallel", "tests", "benchmarks", "scripts", "notebooks"]


def test_ruff_check_and_format():
    for args in (["check", *PATHS], ["format", "--check", *PATHS]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_owns_the_layout():
    """No hand-packed lines: nothing opts out of the formatter."""
    skips = [
        f"{path.relative_to(ROOT)}:{i}"
        for folder in PATHS
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".ipynb")
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if FMT_DIRECTIVE.search(line)
    ]
    assert skips == []


def test_mypy_strict_passes_on_the_package():
    """Every function of ``lens_parallel`` is annotated and type-checks under ``mypy --strict`` (config in
    pyproject.toml: which third-party packages ship no stubs, whose untyped factories are called). Its incremental
    cache lives in the package's cache folder, not the checkout: a new clone's run rechecks what changed, by content,
    in about 1 s instead of 24 s (torch's and numpy's stubs analysed again)."""
    from lens_parallel.paths import cache_dir

    env = os.environ | {"MYPY_CACHE_DIR": str(cache_dir() / "mypy")}
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout


def test_the_runtime_type_checker_checks_the_package_and_each_closure_by_its_own_hints():
    """The suite runs the package under jaxtyping's import hook with beartype (tests/typecheck.py): a wrong shape is
    refused at the call (jaxtyping's wrapper: a function with array hints); a wrong value of another hint too
    (beartype alone: every other function of the package). A function defined inside another (a hook built per
    call) is checked afresh each time it is built; its checked signature is reused only for an equal signature."""
    import torch
    from beartype.roar import BeartypeCallHintParamViolation
    from jaxtyping import TypeCheckError, jaxtyped

    from lens_parallel import geometry
    from lens_parallel.sandbox import fence
    from tests.typecheck import checker

    assert geometry.merge_heads(torch.zeros(2, 3, 4, 5)).shape == (2, 3, 20)
    with pytest.raises(TypeCheckError, match="merge_heads"):
        geometry.merge_heads(torch.zeros(2, 3, 4))
    assert "jaxtyping" in geometry.merge_heads.__code__.co_filename
    assert fence._size.__code__.co_filename.startswith("<@beartype(lens_parallel.sandbox.fence._size)")
    assert fence._size(2048) == "2 KB" and str(inspect.signature(fence._size)) == "(n: 'int') -> 'str'"
    with pytest.raises(BeartypeCallHintParamViolation, match="_size"):
        fence._size("2048")

    def make(kind: type) -> Any:
        def inner(x: Any) -> Any:
            return x

        inner.__annotations__ = {"x": kind, "return": kind}  # this module's hints are strings: the closure's own
        return jaxtyped(inner, typechecker=checker)

    first, again, other = make(int), make(int), make(str)
    assert (first(3), again(4), other("a")) == (3, 4, "a")
    for checked, wrong in ((again, "4"), (other, 5)):
        with pytest.raises(TypeCheckError):
            checked(wrong)


def test_every_ignore_names_its_error_code():
    """A ``# type: ignore`` without a code would hide any error on its line."""
    bare = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted((ROOT / "lens_parallel").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"#\s*type:\s*ignore(?!\[)", line)
    ]
    assert bare == []


def test_every_test_has_exactly_one_tier(request):
    """Every test this session collected carries exactly one tier (unit, integration, browser, slow, real:
    tests/conftest.py), so that ``make test-fast`` and ``make test`` together cover the suite."""
    items = request.session.items
    assert request.node in items
    tiers_of = {item.nodeid: [t for t in TIERS if item.get_closest_marker(t)] for item in items}
    assert not {name: tiers for name, tiers in tiers_of.items() if len(tiers) != 1}


def test_no_function_of_the_package_is_over_100_lines():
    """A function reads in one screen or two: one over 100 lines is split by what its parts do."""
    long = []
    for path in sorted((ROOT / "lens_parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            functions = (ast.FunctionDef, ast.AsyncFunctionDef)
            if isinstance(node, functions) and node.end_lineno is not None and node.end_lineno - node.lineno >= 100:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []


def test_no_large_file_is_tracked_outside_the_package_assets():
    """The repository holds source, not binaries: a tracked file over 1 MB may only be one of the package's own
    assets (the toy models' tokenizers, the shipped corpora)."""
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    large = [
        name
        for name in proc.stdout.split("\0")
        if name and (ROOT / name).is_file() and (ROOT / name).stat().st_size > 1 << 20
    ]
    assert [name for name in large if not name.startswith("lens_parallel/assets/")] == []


def test_the_changelog_names_this_version_first():
    """Each capability that lands raises the version and says what changed (Keep a Changelog's form)."""
    import lens_parallel

    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == lens_parallel.__version__


def _compared_strings(node: ast.Compare) -> set[str]:
    """The string constants a comparison compares with (``x == "a"``, ``x in ("a", "b")``)."""
    found: set[str] = set()
    for side in (node.left, *node.comparators):
        items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
        found |= {item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)}
    return found


def test_no_space_layer_kind_ablation_path_or_edit_option_is_told_apart_by_its_name():
    """Spaces, layer kinds, head ablations, attention paths and an edit's options are objects whose methods differ
    (:mod:`lens_parallel.spaces`, :mod:`lens_parallel.layers`, :data:`lens_parallel.edits.ABLATION_KINDS`,
    :data:`lens_parallel.attention.paths.CHOICES`, :data:`lens_parallel.edits.EDIT_POSITIONS`,
    :data:`lens_parallel.edits.scaling.GATE_SITES` and ``GUARD_CLAMPS``, :data:`lens_parallel.edits.PATTERN_PATHS`),
    compression methods (:data:`lens_parallel.compression.METHODS`) and attention gates
    (:data:`lens_parallel.attention.GATES`): no comparison in the package names one. ("all", "auto" and "none" are words
    of other choices too: heads, a device, a compression.)"""
    from lens_parallel.choices import (
        Ablation,
        AttentionPath,
        EditPositions,
        LayerType,
        ReferenceGuard,
        Space,
        ValueSite,
    )
    from lens_parallel.edits import PatternUse
    from lens_parallel.validate import literal_values

    choices = (Space, LayerType, Ablation, AttentionPath, EditPositions, ReferenceGuard, ValueSite, PatternUse)
    from lens_parallel.attention import GATES
    from lens_parallel.compression import METHODS

    names = {name for choice in choices for name in literal_values(choice)} | set(METHODS) | set(GATES)
    names -= {"all", "auto", "none"}
    data = {
        ("report.py", "value"): "the value-space rows of a decomposition's table",
        ("sandbox/channel.py", "value"): "a key of the sandbox's JSON reply",
        ("downstream/loading.py", "mean"): "an lm-eval metric's aggregation",
    }
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
        for path in sorted((ROOT / "lens_parallel").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        for name in sorted(_compared_strings(node) & names)
        if (str(path.relative_to(ROOT / "lens_parallel")), name) not in data
    ]
    assert found == []


def test_each_attention_feature_is_spelled_in_its_own_module_alone():
    """An attention feature's name (the support matrix's word) and the keyword Hugging Face's attention interface
    hands it under appear, as string constants of the package, in the module of the feature's object alone
    (:mod:`lens_parallel.attention.features`): the matrix, the kernels and the interface's check read the object."""
    from lens_parallel.attention.features import FEATURES

    data = {("lens_parallel/toys.py", "sliding_window"): "the toys' config field of that name (the window they have)"}
    spelled: dict[str, set[str]] = {}
    for path in sorted((ROOT / "lens_parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = str(path.relative_to(ROOT))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (where, node.value) not in data:
                spelled.setdefault(node.value, set()).add(where)
    for kind in FEATURES:
        home = str(Path(inspect.getfile(kind)).relative_to(ROOT))
        for word in (kind.name, kind.keyword):
            if word is not None:
                assert spelled.get(word) == {home}, f"{kind.__name__}: {word!r} spelled in {spelled.get(word)}"
