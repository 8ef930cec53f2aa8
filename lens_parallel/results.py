"""The Result protocol, provenance, and saving/loading results (JSON for fields, one ``.npz`` for arrays).

Every result class implements :class:`Result`: ``provenance``; ``to_dataframe()`` (tidy, full resolution: one row
per observation); ``summary()`` (one row per model); ``figures()`` (named Plotly figures; ``figure()`` is the main
one); ``save(path)`` / ``load(path)``. Saved files carry the format name and version and the fully qualified class
name of every dataclass in them; loading an unknown type or version is a clear error, and saving a value this
format cannot represent raises instead of turning it into a string.

The two files of a result are tied together: a random id is written into both, and the JSON holds the ``.npz``'s
sha256; both are written under temporary names and renamed into place (the ``.npz`` first), so a kill never leaves
a half-written file, and :func:`load_result` refuses a pair that does not belong together (an ``.npz`` copied from
another result, or a save interrupted between the two renames) in one line.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import importlib
import importlib.metadata
import json
import math
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast, runtime_checkable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from lens_parallel import __version__, display
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.errors import LensParallelError
from lens_parallel.models import ModelInfo, head_label
from lens_parallel.paths import add_suffix, check_writable, sha256_file, write_atomic

FORMAT = "lens_parallel.result"
FORMAT_VERSION = 2
"""2: the JSON and the ``.npz`` carry one random id and the JSON the ``.npz``'s sha256 (1: neither, not read)."""
_ID_KEY = "__result_id__"
T = TypeVar("T")
R = TypeVar("R", bound="ResultMixin")


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


SAVED_TYPES: tuple[str, ...] = (
    "lens_parallel.analyses.ablation.AblationRun",
    "lens_parallel.analyses.ablation.AblationSettings",
    "lens_parallel.analyses.attribution.AttributionResult",
    "lens_parallel.analyses.attribution.AttributionSettings",
    "lens_parallel.analyses.compression.CompressionResult",
    "lens_parallel.analyses.compression.CompressionSettings",
    "lens_parallel.analyses.confirm.ConfirmResult",
    "lens_parallel.analyses.confirm.ConfirmSettings",
    "lens_parallel.analyses.decompose.AlignmentTable",
    "lens_parallel.analyses.decompose.DecomposeSettings",
    "lens_parallel.analyses.decompose.DecompositionResult",
    "lens_parallel.analyses.diagonal.DiagonalSettings",
    "lens_parallel.analyses.diagonal.DiagonalView",
    "lens_parallel.analyses.dominance.DominanceResult",
    "lens_parallel.analyses.dominance.DominanceSettings",
    "lens_parallel.analyses.head_statistics.HeadStatistics",
    "lens_parallel.analyses.head_statistics.HeadStatisticsSettings",
    "lens_parallel.analyses.nulls.NullResult",
    "lens_parallel.analyses.nulls.NullSettings",
    "lens_parallel.analyses.reliability.SanityReport",
    "lens_parallel.analyses.reliability.SanitySettings",
    "lens_parallel.analyses.reliability.SplitHalfResult",
    "lens_parallel.analyses.scaling.ScaleSettings",
    "lens_parallel.analyses.scaling.ScalingResult",
    "lens_parallel.analyses.scaling.SweepPoint",
    "lens_parallel.analyses.sensitivity.SensitivityResult",
    "lens_parallel.analyses.sensitivity.SensitivitySettings",
    "lens_parallel.downstream.effects.TaskResult",
    "lens_parallel.downstream.settings.TaskSettings",
    "lens_parallel.generation.api.GenerateSettings",
    "lens_parallel.generation.api.GenerationResult",
    "lens_parallel.losses.DocLosses",
    "lens_parallel.losses.EditEffect",
    "lens_parallel.report.ModelReport",
    "lens_parallel.report.ReportSettings",
    "lens_parallel.results.Provenance",
    "lens_parallel.selection.TextSample",
    "lens_parallel.selection.TextSelection",
    "lens_parallel.sweep.AblationJob",
    "lens_parallel.training.factorial.FactorialResult",
    "lens_parallel.training.loop.TrainRun",
)
"""Every dataclass a saved result may hold, by module and name, written out: :func:`save_result` writes only these,
and :func:`load_result` imports the module of the one a file names. A new result type (or a dataclass inside one) is
a line here; ``tests/test_results.py`` checks each resolves, and that every exported result is here."""


def result_classes() -> list[type]:
    """Every class implementing the Result protocol (those built on :class:`ResultMixin`) that the package exports,
    whichever modules were imported before.

    Examples:
        >>> import lens_parallel as lp
        >>> "DecompositionResult" in [cls.__name__ for cls in lp.result_classes()]
        True
    """
    import lens_parallel

    exported = (getattr(lens_parallel, name) for name in lens_parallel.__all__)  # imports every result's module
    return sorted(
        {cls for cls in exported if isinstance(cls, type) and issubclass(cls, ResultMixin)}, key=qualified_name
    )


@functools.cache  # the version of the code this process runs: a package installed since has not been imported
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where a result came from: enough to rerun it.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> provenance = lp.decompose(model, docs, progress=False).provenance
        >>> provenance.model["name"]
        'toy-gpt2'
    """

    model: dict[str, Any]
    texts: dict[str, Any]
    weight_processing: str
    settings: dict[str, Any]
    versions: dict[str, str]
    created: str

    @staticmethod
    def installed_versions() -> dict[str, str]:
        """The versions of the packages that make the numbers: lens_parallel's of the code that runs (an editable
        install's metadata keeps the version it was installed at), the others' as installed."""
        return {"lens_parallel": __version__} | {p: _version(p) for p in ("transformer-lens", "transformers", "torch")}

    @classmethod
    def of(
        cls,
        info: ModelInfo,
        documents: DocumentsLike | None,
        analysis: str,
        settings: Any,
        options: Any,
        *,
        texts: Mapping[str, Any] | None = None,
        versions: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> Provenance:
        """The provenance of ``analysis`` run on ``info``'s model: ``documents`` (anything
        :meth:`~lens_parallel.documents.Documents.of` takes: their source, lengths and a hash of the tokens; or
        ``texts``, a description of what else it read, e.g. lm-eval's tasks), its settings object's fields (its
        ``record()`` where it has one; a mapping as it is), ``extra`` facts of the run (resolved layers, skipped
        ones, a reconstruction error, ...; they override a setting of the same name) and the run options under
        ``options``: a :class:`~lens_parallel.options.RunOptions`, or the :class:`~lens_parallel.sweep.SweepRun`
        that ran with them (its ``record()`` holds the batch size ``batch_size="auto"`` chose); None where the run
        takes none. ``versions``: packages beside :meth:`installed_versions` that made the numbers."""
        if hasattr(settings, "record"):
            plain = settings.record()
        elif isinstance(settings, Mapping):
            plain = dict(settings)
        else:
            plain = dataclasses.asdict(settings)
        recorded = {"analysis": analysis, **(plain | extra)}
        if options is not None:
            recorded["options"] = options.record()
        return cls(
            model=info.to_dict(),
            texts=dict(texts)
            if texts is not None
            else Documents.of(documents).describe()
            if documents is not None
            else {},
            weight_processing=info.weights or "unrecorded",
            settings=recorded,
            versions=cls.installed_versions() | dict(versions or {}),
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        )


def head_frame(
    info: ModelInfo,
    layers: Sequence[int],
    values: Mapping[str, Any],
    *,
    front: Mapping[str, Any] | None = None,
    outer: tuple[str, Sequence[Any]] | None = None,
) -> pd.DataFrame:
    """Tidy rows, one per (``outer`` value, layer, head), from arrays ``[outer?, layer, head]`` (or scalars):
    columns model, ``front``, the outer axis, layer (and layer_type on a hybrid model), head, kv_head, label
    (``L{l}H{h}``), then ``values``. The head axis is as wide as the widest of ``layers`` (its output heads:
    query heads, or a linear-attention layer's value heads); a layer's rows past its own heads are dropped."""
    width = max((info.output_heads(layer) for layer in layers), default=info.n_heads)
    shape = ((len(outer[1]),) if outer else ()) + (len(layers), width)
    index = np.indices(shape).reshape(len(shape), -1)
    layer, head = np.asarray(layers, dtype=np.int64)[index[-2]], index[-1]
    columns: dict[str, Any] = {"model": info.name, **(front or {})}
    if outer:
        columns[outer[0]] = np.asarray(outer[1])[index[0]]
    columns |= {"layer": layer, **_layer_types(info, layer)}
    groups = np.asarray([info.key_group(int(lay)) for lay in layers], dtype=np.int64)[index[-2]]
    columns |= {"head": head, "kv_head": head // groups}
    columns["label"] = [head_label(int(lay), int(h)) for lay, h in zip(layer, head, strict=True)]
    for name, v in values.items():
        columns[name] = np.broadcast_to(np.asarray(v), shape).ravel() if np.ndim(v) else v
    exists = head < np.asarray([info.output_heads(int(lay)) for lay in layers], dtype=np.int64)[index[-2]]
    return pd.DataFrame(columns)[exists].reset_index(drop=True)


def _layer_types(info: ModelInfo, layers: Sequence[int] | np.ndarray) -> dict[str, list[str]]:
    """The ``layer_type`` column (:data:`~lens_parallel.choices.LayerType`) of rows at ``layers``, on a hybrid model
    only."""
    return {"layer_type": [info.layer_types[int(layer)] for layer in layers]} if info.hybrid else {}


def layer_frame(
    info: ModelInfo, layers: Sequence[int], values: Mapping[str, Any], *, front: Mapping[str, Any] | None = None
) -> pd.DataFrame:
    """Tidy rows, one per layer, for what acts on all heads of a layer together: head and kv_head <NA>, label
    ``L{l}*``; columns as :func:`head_frame`'s."""
    columns: dict[str, Any] = {"model": info.name, **(front or {}), "layer": list(layers), **_layer_types(info, layers)}
    columns |= {
        "head": pd.array([pd.NA] * len(layers), dtype="Int64"),
        "kv_head": pd.array([pd.NA] * len(layers), dtype="Int64"),
    }
    columns["label"] = [head_label(int(layer)) for layer in layers]
    columns |= {name: np.asarray(v) if np.ndim(v) else v for name, v in values.items()}
    return pd.DataFrame(columns)


@runtime_checkable
class Result(Protocol):
    """What every result offers (see the module docstring).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> isinstance(lp.decompose(model, docs, progress=False), lp.Result)
        True
    """

    @property
    def provenance(self) -> Provenance | None: ...

    def to_dataframe(self) -> pd.DataFrame: ...

    def summary(self) -> pd.DataFrame: ...

    def figures(self) -> dict[str, go.Figure]: ...

    def figure(self) -> go.Figure: ...

    def save(self, path: str | Path) -> Path: ...


class ResultMixin:
    """What every result dataclass shares: ``info`` from its ``provenance``, ``figures``, ``save`` and ``load``.
    Results with several figures override :meth:`figures`; each names its columns in ``columns``."""

    columns: ClassVar[str] = ""
    """The columns of :meth:`to_dataframe` and :meth:`summary`, space-separated (:mod:`lens_parallel.glossary`
    defines each; ``<space>``, ``<setting>``: one column per space or setting)."""

    if TYPE_CHECKING:  # what every result class defines (a field or a property)

        @property
        def provenance(self) -> Provenance | None: ...

        def figure(self) -> go.Figure: ...

    @property
    def info(self) -> ModelInfo:
        if self.provenance is None:
            raise LensParallelError(f"this {type(self).__name__} records no provenance, so it names no model")
        return ModelInfo(**self.provenance.model)

    def figures(self) -> dict[str, go.Figure]:
        """Named figures; the first is :meth:`figure`."""
        return {"figure": self.figure()}

    def _repr_html_(self) -> str:
        """A notebook's view (:func:`lens_parallel.display.result_html`): type, model, summary, the table's head."""
        return display.result_html(cast(display.Shown, self))

    def __repr__(self) -> str:
        """The text view (:func:`lens_parallel.display.result_text`): one screen, no arrays (every result class is a
        dataclass with ``repr=False``, so that this is its repr at a prompt and in IPython)."""
        return display.result_text(cast(display.Shown, self))

    def save(self, path: str | Path) -> Path:
        """Write ``path.json`` (fields and provenance) and ``path.npz`` (arrays); returns the JSON path."""
        return save_result(self, path)

    @classmethod
    def load(cls: type[R], path: str | Path) -> R:
        """Read a result written by :meth:`save`; raises if the file holds another type."""
        result = load_result(path)
        if not isinstance(result, cls):
            raise LensParallelError(f"{path} holds a {type(result).__name__}, not a {cls.__name__}")
        return result


def _encode(obj: Any, arrays: dict[str, np.ndarray], key: str) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = qualified_name(type(obj))
        if name not in SAVED_TYPES:
            raise TypeError(f"cannot save {name} at {key}: add it to lens_parallel.results.SAVED_TYPES")
        out = {"__class__": name}
        for f in dataclasses.fields(obj):
            out[f.name] = _encode(getattr(obj, f.name), arrays, f"{key}.{f.name}")
        return out
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError(f"cannot save an object array at {key}")
        arrays[key] = obj
        return {"__array__": key}
    if isinstance(obj, (bool, str)) or obj is None:
        return obj
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x, arrays, f"{key}.{i}") for i, x in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(x, arrays, f"{key}.{i}") for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str) or k.startswith("__")]
        if bad:
            raise TypeError(f"cannot save a dict with key {bad[0]!r} at {key}: keys must be plain strings")
        return {k: _encode(v, arrays, f"{key}.{k}") for k, v in obj.items()}
    raise TypeError(f"cannot save a {type(obj).__name__} at {key}: convert it to plain data first")


def _decode(obj: Any, arrays: dict[str, np.ndarray], path: Path) -> Any:
    if isinstance(obj, dict):
        if "__array__" in obj:
            return arrays[obj["__array__"]]
        if "__tuple__" in obj:
            return tuple(_decode(x, arrays, path) for x in obj["__tuple__"])
        if "__float__" in obj:
            return float(obj["__float__"])
        if "__class__" in obj:
            cls = saved_class(obj["__class__"], path)
            fields = [f for f in dataclasses.fields(cls) if f.init]
            saved = set(obj) - {"__class__"}
            required = {f.name for f in fields if _no_default(f)}
            if not required <= saved or not saved <= {f.name for f in fields}:
                raise LensParallelError(
                    f"{path}: this {cls.__name__} was saved with another layout (missing: "
                    f"{sorted(required - saved)}, unknown: {sorted(saved - {f.name for f in fields})}), by another "
                    "version of lens_parallel; rerun the analysis with this version"
                )
            return cls(**{k: _decode(v, arrays, path) for k, v in obj.items() if k != "__class__"})
        return {k: _decode(v, arrays, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(x, arrays, path) for x in obj]
    return obj


def _no_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def saved_class(name: str, path: Path | str) -> type:
    """The dataclass a saved file names by its qualified name: one of :data:`SAVED_TYPES`, its module imported; a
    class that a later version moved to another module is found by its name among the package's exports. Refused in
    one line otherwise."""
    module, _, qualname = name.rpartition(".")
    if name in SAVED_TYPES:
        found: type = getattr(importlib.import_module(module), qualname)
        return found
    import lens_parallel  # moved since it was saved: the exported class of that name

    moved = getattr(lens_parallel, qualname, None) if qualname in lens_parallel.__all__ else None
    if isinstance(moved, type) and qualified_name(moved) in SAVED_TYPES:
        return moved
    raise LensParallelError(
        f"{path}: unknown result type {name!r} (saved by another version of lens_parallel?); this version saves "
        f"{', '.join(sorted(cls.__name__ for cls in result_classes()))}"
    )


def save_result(result: Any, path: str | Path) -> Path:
    """Write ``path.json`` (format, version, id, the npz's sha256, fields, provenance) and ``path.npz`` (arrays and
    the id); returns the JSON path. Both are written atomically, the ``.npz`` first (module docstring).

    ``path`` may end in ``.json`` or have no suffix; any other dot in the name is kept (``toy-qwen3.5_scaling``)."""
    stem = _stem(path)
    json_path, npz_path = add_suffix(stem, ".json"), add_suffix(stem, ".npz")
    for target in (json_path, npz_path):
        check_writable(target, "cannot save the result:")
    arrays: dict[str, np.ndarray] = {}
    data = _encode(result, arrays, "root")
    result_id = uuid.uuid4().hex
    arrays[_ID_KEY] = np.array(result_id)
    try:
        write_atomic(npz_path, lambda f: np.savez_compressed(f, allow_pickle=False, **arrays))
        payload = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "id": result_id,
            "npz_sha256": sha256_file(npz_path),
            "data": data,
        }
        text = json.dumps(payload, indent=1, allow_nan=False)
        write_atomic(json_path, lambda f: f.write(text.encode()))
    except OSError as exc:  # the disk filled, or the folder changed under us
        raise LensParallelError(f"cannot save the result to {json_path} ({exc.strerror})") from exc
    return json_path


def load_result(path: str | Path) -> Any:
    """Rebuild any result written by :func:`save_result` (``path`` with or without ``.json``). Raises
    :class:`LensParallelError` in one line for a missing, damaged or mismatched pair of files.

    Returns:
        Any: the result, an instance of the class its folder names (one of :func:`result_classes`).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> saved = lp.decompose(model, docs, progress=False).save(folder + "/decompose")
        >>> type(lp.load_result(folder + "/decompose")).__name__
        'DecompositionResult'
    """
    stem = _stem(path)
    json_path, npz_path = add_suffix(stem, ".json"), add_suffix(stem, ".npz")
    if not json_path.is_file():
        raise LensParallelError(f"no saved result at {json_path}")
    try:
        payload = json.loads(json_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LensParallelError(f"{json_path} is damaged (not valid JSON: {exc}); rerun the analysis") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise LensParallelError(f"{json_path} is not a lens_parallel result (no {FORMAT!r} format field)")
    if payload.get("version") != FORMAT_VERSION:
        raise LensParallelError(
            f"{json_path} has result format version {payload.get('version')!r}; this lens_parallel reads version "
            f"{FORMAT_VERSION} (its JSON and npz are tied by an id and a sha256): rerun the analysis"
        )
    if not npz_path.is_file():
        raise LensParallelError(f"{json_path} has no {npz_path.name} beside it; rerun the analysis")
    if sha256_file(npz_path) != payload.get("npz_sha256"):
        raise LensParallelError(
            f"{npz_path} does not belong to {json_path.name} (its sha256 differs from the one recorded there: copied "
            "from another result, or a save was interrupted); restore the pair or rerun the analysis"
        )
    try:
        with np.load(npz_path) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise LensParallelError(f"{npz_path} is damaged ({exc}); rerun the analysis") from exc
    if str(arrays.pop(_ID_KEY, "")) != payload.get("id"):
        raise LensParallelError(f"{npz_path} was written for another result than {json_path.name} (ids differ)")
    try:
        return _decode(payload["data"], arrays, json_path)
    except (KeyError, TypeError) as exc:
        raise LensParallelError(
            f"{json_path} is damaged (it refers to {exc} which it lacks); rerun the analysis"
        ) from exc


def _stem(path: str | Path) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".json", ".npz") else path
