"""The support matrix: one row per architecture lens_parallel knows, as the models guide shows it
(``docs/guides/architectures.md``) and ``tests/test_architectures.py`` checks it.

A row says what a toy of the architecture (:mod:`lens_parallel.toys`) is once loaded: its layers' kinds, its
features (:mod:`lens_parallel.features`), what is analysed (every space, or the residual spaces only where the bridge
opens no heads) or why it is refused, and which attention path serves its softmax layers. The rows are read off the
loaded model, never written by hand; the test then checks each row's claim of exactness numerically (against
TransformerLens's own eager hooks and Hugging Face), and that the guide's table is the one these rows make
(``python scripts/architecture_matrix.py`` writes it).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import astuple, dataclass, fields

from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import architectures
from lens_parallel.features import all_features
from lens_parallel.layers import LAYER_KINDS
from lens_parallel.models import ModelInfo, ModelSpecError, load_model, model_info
from lens_parallel.toys import FAMILY_MODEL_TYPES, architecture_toys

MATRIX_START, MATRIX_END = "<!-- support matrix: start -->", "<!-- support matrix: end -->"
"""The markers around the generated support matrix in the architectures guide."""
FEATURES_START, FEATURES_END = "<!-- features: start -->", "<!-- features: end -->"
"""The markers around the generated table of features (:func:`lens_parallel.features.all_features`)."""


@dataclass(frozen=True)
class SupportRow:
    """One architecture: its Hugging Face model type and class, the toy that stands for it, what is analysed
    (``status``: ``exact``, ``exact; residual spaces on mixer layers``, ``residual spaces only``, or ``refused:
    why``), its layers by kind, its features, and the attention path of its softmax layers."""

    model_type: str
    hf_class: str
    toy: str
    status: str
    layers: str
    features: str
    attention: str

    @property
    def refused(self) -> bool:
        return self.status.startswith("refused")

    def cells(self) -> tuple[str, ...]:
        return tuple(str(cell) for cell in astuple(self))


COLUMNS = tuple(f.name.replace("_", " ") for f in fields(SupportRow))
"""The table's column names."""


def _status(info: ModelInfo) -> str:
    mixers = [layer for layer in range(info.n_layers) if not info.kind(layer).heads]
    if len(mixers) == info.n_layers:
        return "residual spaces only: the bridge opens no heads"
    notes = [f"layers {', '.join(map(str, mixers))}: residual spaces (no heads)"] if mixers else []
    if info.patterns_after:
        notes.append("edits of the pattern refused (hook_pattern fires after the attention: read-only)")
    return "; ".join(["exact", *notes])


def _layers(info: ModelInfo) -> str:
    counts: Counter[str] = Counter(info.layer_types)
    return ", ".join(f"{counts[name]} {name}" for name in LAYER_KINDS if counts[name])


def _attention(info: ModelInfo) -> str:
    paths = sorted({path for path in info.attention_paths if path})
    return "; ".join(paths) if paths else "none (no softmax layer opened)"


def support_row(model_type: str, model: TransformerBridge | None = None) -> SupportRow:
    """The row of ``model_type``: read off ``model`` (its toy, loaded here when not given) or, when loading refuses
    it, the one line that says why."""
    spec, cls = toy_of(model_type), architectures.bridged_causal_lms()[model_type]
    if model is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = load_model(spec)
        except ModelSpecError as refusal:  # "{spec}: {why}" (a bridge without residual hooks) or REFUSED's line
            reason = architectures.REFUSED.get(model_type) or str(refusal).split(": ", 1)[1]
            return SupportRow(model_type, cls, spec, f"refused: {reason}", "", "", "")
    info = model_info(model)
    return SupportRow(model_type, cls, spec, _status(info), _layers(info), ", ".join(info.features), _attention(info))


def matrix_model_types() -> tuple[str, ...]:
    """Every model type the matrix has a row for: the analysed ones (:func:`lens_parallel.architectures.
    analysed_model_types`), refused ones included."""
    return architectures.analysed_model_types()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def matrix_markdown(rows: Iterable[SupportRow]) -> str:
    """The rows as a Markdown table (between the guide's markers)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(c) for c in row.cells()) + " |" for row in rows]
    return "\n".join([MATRIX_START, *lines, MATRIX_END])


def features_markdown() -> str:
    """The features (:func:`lens_parallel.features.all_features`) as a Markdown table: name, what it is, and what
    lens_parallel does with it."""
    lines = ["| feature | what it is | how lens_parallel handles it |", "| --- | --- | --- |"]
    lines += [f"| `{f.name}` | {_cell(f.title)} | {_cell(f.handling)} |" for f in all_features().values()]
    return "\n".join([FEATURES_START, *lines, FEATURES_END])


def replace_between(text: str, start: str, end: str, table: str) -> str:
    """``text`` with what lies between the markers ``start`` and ``end`` (markers included) replaced by ``table``
    (which holds them)."""
    before, rest = text.split(start, 1)
    return before + table + rest.split(end, 1)[1]


def read_matrix(text: str) -> Mapping[str, SupportRow]:
    """The rows of the table between the markers in ``text`` (the models guide), by model type."""
    inside = text.split(MATRIX_START, 1)[1].split(MATRIX_END, 1)[0]
    rows = {}
    for line in inside.strip().splitlines()[2:]:
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        row = SupportRow(*cells)
        rows[row.model_type] = row
    return rows


def toy_of(model_type: str) -> str:
    """The spec of the toy standing for ``model_type``: a family's (``toy-llama``), else its architecture toy."""
    if model_type in FAMILY_MODEL_TYPES:
        return FAMILY_MODEL_TYPES[model_type]
    return next(spec for spec, toy in architecture_toys().items() if toy.model_type == model_type)
