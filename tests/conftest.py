"""Shared fixtures, and the test tiers.

Every test carries exactly one tier marker, given here by module (``pytest -m unit`` and so on):

- ``unit``: no model is loaded (pure math, statistics, messages, options, style and types); seconds;
- ``integration``: the toy models of every family (built in memory in about a second each);
- ``browser``: a real Chromium page (playwright) renders the report or the explorer;
- ``users``: as users run the package, each in a fresh interpreter or their own objects: the README's and the
  guides' examples and every command-line example of the documentation, saved results reopened in another process,
  a bridge they booted, packed blocks, compatibility mode, hooks left on the bridge, Ctrl-C to a running command;
- ``slow``: the real smollm2-135m (fetched once from PyPI), the notebooks executed end to end, the CLI's
  subcommands end to end (one as a console process), the documentation's build and examples, and the Ray cluster
  tests (each starts processes that import torch afresh);
- ``real``: the larger real models (deselected by default: ``pytest -m real``).

``make test-fast`` runs ``unit or integration`` (the inner loop, a few minutes); ``make test`` runs everything but
``real``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fresh import compile_package
from tests.typecheck import install, preload_dependencies

preload_dependencies()  # before the package: see tests/typecheck.py
install()
compile_package()

from lens_parallel.edits import Footprint  # noqa: E402
from lens_parallel.models import TOY_MODELS, load_model  # noqa: E402

FAMILIES = tuple(TOY_MODELS)
LINEAR_VALUE_NOISE = 1e-2
"""toy-qwen3.5's linear-attention layers forget within a token (transformers' initial decay: A up to 16, dt_bias 1):
there o_t is a_tt v_t but for about 0.2%, so the part of o_t off v_t (c_t = o_t - a_tt v_t, o_t's perpendicular part) is
near float32's rounding of o_t, and batches of other shapes or other attention paths move the value spaces' statistics
built on it (exclude-self's, the perpendicular fraction and the par/perp ratio): seen up to 2.8e-3 on an exclude-self
mean cosine of 0.25 between attention paths. Comparisons of them use this tolerance; tests/test_linear_attention.py
checks these layers exactly, on a copy with a slow decay."""


def noisy_linear_value(info: Any, space: str, layer: int) -> bool:
    """Whether statistics of ``space`` at ``layer`` are :data:`LINEAR_VALUE_NOISE`'s case."""
    return space.startswith("value") and info.layer_types[layer] == "linear"


TIERS = ("unit", "integration", "browser", "users", "slow", "real")
UNIT_MODULES = frozenset({"test_cache", "test_devices", "test_geometry", "test_messages", "test_stats", "test_style"})
BROWSER_MODULES = frozenset({"test_explore_browser", "test_png_browser", "test_report_browser"})
USERS_MODULES = frozenset({"test_readme", "test_user_session"})
SLOW_MODULES = frozenset({"test_cli", "test_distributed", "test_notebooks", "test_smollm2"})
_MODELS: dict[str, Any] = {}
_CURRENT_TIER: list[str] = []


def tier_of(item: pytest.Item) -> str:
    """A test's tier: its own marker (or its module's ``pytestmark``), the most expensive first, else its module's
    listing here."""
    for tier in ("real", "slow", "users", "browser", "integration", "unit"):
        if item.get_closest_marker(tier):
            return tier
    module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
    if module in UNIT_MODULES:
        return "unit"
    if module in BROWSER_MODULES:
        return "browser"
    if module in USERS_MODULES:
        return "users"
    return "slow" if module in SLOW_MODULES else "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(getattr(pytest.mark, tier))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Records the test's tier; and under ``--dist loadgroup`` fails a grouped test that lost its group. Each
    ``xdist_group`` must reach one worker whole (one Ray head, one docs site, one shared run): pytest-xdist marks a
    grouped test by a ``@group`` suffix on its node id, which pytest 9.2's structured node ids silently drop
    (pytest-dev/pytest-xdist#1386; every group then splits over the workers, each starting its own cluster)."""
    _CURRENT_TIER[:] = [tier_of(item)]
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
    if grouped and "@" not in item.nodeid:
        pytest.fail(
            "--dist loadgroup lost this test's xdist_group: this pytest and pytest-xdist do not group "
            "(pytest-dev/pytest-xdist#1386); install the versions pyproject.toml pins",
            pytrace=False,
        )


def get_model(spec: str):
    """Load each model once per test session (toys build in about a second; smollm2 in a few). Unit tests load
    none (their tier says so)."""
    if _CURRENT_TIER == ["unit"]:
        raise RuntimeError(f"a unit test loads no model (asked for {spec}): move it to an integration module")
    if spec not in _MODELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[spec] = load_model(spec)
    return _MODELS[spec]


@pytest.fixture(params=FAMILIES)
def toy(request):
    return get_model(request.param)


class Killed(Exception):
    """Stands in for the process dying mid-run."""


class KillSwitch:
    """Wraps ``owner.name`` (a function or method) so that its ``at``-th call raises :class:`Killed`, recording the
    first argument selected by ``record`` of every call; ``disarm()`` lets every later call through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, *, at: int, record: Any) -> None:
        self.calls: list[Any] = []
        self.at: int | None = at
        real = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(record(*args, **kwargs))
            if len(self.calls) == self.at:
                raise Killed
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    def disarm(self) -> None:
        self.calls.clear()
        self.at = None


@dataclass(frozen=True)
class NotDecodeSafe:
    """A user-defined edit whose footprint says it cannot run against cached keys and values."""

    def hooks(self, model: Any, info: Any) -> list[Any]:
        return []

    def footprint(self, info: Any) -> Footprint:
        return Footprint(("v",), ("z",), "rows", decode_safe=False)
