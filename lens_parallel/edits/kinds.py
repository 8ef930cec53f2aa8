"""The built-in edit kinds, written out: one row per kind with its class (which names its ``kind``), a one-line
summary, whether a command-line spec can build it (scalar settings only) and the explorer's menu entries it
provides. The command line's specs, the explorer's menu and the error messages read this table; nothing registers
itself when imported.

Adding an edit: its module under ``lens_parallel/edits/`` (a frozen dataclass deriving
:class:`~lens_parallel.edits.base.EditBase`, its ``kind``, ``hooks`` and ``footprint``) and its row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lens_parallel.edits.base import EditBase
from lens_parallel.edits.diagonal import DiagonalEdit, ZeroDiagonal
from lens_parallel.edits.directions import RandomDirectionRemoval
from lens_parallel.edits.gates import GatedRemoval, LearnedGate
from lens_parallel.edits.heads import HeadEdit
from lens_parallel.edits.scaling import ComponentScale
from lens_parallel.edits.wrappers import SkipFirstLayers
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import did_you_mean


@dataclass(frozen=True)
class EditKind:
    """A built-in edit kind: its class (whose ``kind`` is its name), a one-line summary, whether a command-line spec
    can build it (scalar settings only) and the explorer's menu entries it provides (each a name and the settings it
    fixes).

    Examples:
        >>> from lens_parallel.edits import EDITS
        >>> EDITS["zero-diagonal"].name
        'zero-diagonal'
    """

    cls: type[EditBase]
    summary: str
    spec: bool = False
    explorer: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The kind's name: its class's ``kind``."""
        return self.cls.kind


EDITS: dict[str, EditKind] = {
    kind.name: kind
    for kind in (
        EditKind(
            ComponentScale,
            "scale the parallel and perpendicular parts of a message in one space",
            spec=True,
            explorer={"scale": {}},
        ),
        EditKind(DiagonalEdit, "parallel-only scaling written as a change of the attention diagonal A_tt"),
        EditKind(
            ZeroDiagonal,
            "every head's attention to its own token set to 0, rows renormalised",
            spec=True,
            explorer={"zero-diagonal": {}},
        ),
        EditKind(HeadEdit, "remove heads' contribution at one layer: zero, mean, parallel-value or -residual"),
        EditKind(
            RandomDirectionRemoval,
            "rank-one removal from each head's output along a fixed random unit direction",
            spec=True,
            explorer={
                "random-direction": {"norm_matched": False},
                "random-direction-norm-matched": {"norm_matched": True},
            },
        ),
        EditKind(GatedRemoval, "a gated rank-one removal from every head's value aggregate (XSA and its controls)"),
        EditKind(LearnedGate, "value-space parallel scaling with a learned per-token scale"),
        EditKind(SkipFirstLayers, "any edit with its first layers left alone"),
    )
}
"""Every built-in edit kind, by name."""


def explorer_edits() -> dict[str, tuple[EditKind, Mapping[str, Any]]]:
    """The explorer's edit menu from :data:`EDITS`: each entry's name, its edit kind and the settings it fixes
    (``scale`` first: the explorer's default)."""
    menu = {entry: (kind, fixed) for kind in EDITS.values() for entry, fixed in kind.explorer.items()}
    return dict(sorted(menu.items(), key=lambda item: item[0] != "scale"))


def edit_kind(name: str) -> EditKind:
    """The edit kind ``name``, or a :class:`~lens_parallel.errors.LensParallelError` listing the kinds."""
    if name not in EDITS:
        raise LensParallelError(f"unknown edit kind {name!r}{did_you_mean(name, EDITS)}; the kinds: {', '.join(EDITS)}")
    return EDITS[name]
