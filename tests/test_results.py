"""Every registered result class implements the Result protocol: provenance, a tidy frame, a one-row summary,
named figures, and a save/load round trip that gives back an equal result."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

import lens_parallel as lp
from lens_parallel import paths
from lens_parallel.glossary import define
from lens_parallel.results import FORMAT_VERSION, SAVED_TYPES, load_result, qualified_name, result_classes, save_result
from lens_parallel.training.config import PRESETS

from .conftest import get_model


def _blocks(spec: str = "toy-gpt2", n_docs: int = 4, seq_len: int = 16):
    return lp.token_blocks(get_model(spec), "wikipedia-en", n_docs=n_docs, seq_len=seq_len)


@functools.cache
def _battery() -> lp.ModelReport:
    return lp.run_battery(get_model("toy-gpt2"), _blocks(n_docs=4, seq_len=12), progress=False)


@pytest.fixture(scope="module")
def factorial(tmp_path_factory):
    cfg = dataclasses.replace(PRESETS["tiny"], steps=4, eval_every=2)
    return lp.run_factorial(cfg, ["baseline", "xsa-gated"], [0, 1], out=tmp_path_factory.mktemp("f"), progress=False)


FACTORIES = {
    "EditEffect": lambda f: lp.evaluate(get_model("toy-gpt2"), _blocks(), lp.ComponentScale("value", s_par=0.0)),
    "AblationRun": lambda f: lp.run_ablations(
        get_model("toy-gpt2"), _blocks(), [lp.AblationJob(1, (0,)), lp.AblationJob(2, (1, 2))], progress=False
    ),
    "CompressionResult": lambda f: lp.compression_error(get_model("toy-qwen2"), _blocks("toy-qwen2"), method="int8"),
    "DecompositionResult": lambda f: lp.decompose(get_model("toy-gpt2"), _blocks(), space="all", progress=False),
    "DiagonalView": lambda f: lp.diagonal_view(get_model("toy-gpt2"), _blocks(), layer=1, head=2),
    "DominanceResult": lambda f: lp.head_dominance(get_model("toy-gpt2"), _blocks(n_docs=2), progress=False),
    "NullResult": lambda f: lp.gqa_alignment(get_model("toy-qwen3"), _blocks("toy-qwen3"), n_resamples=50),
    "SplitHalfResult": lambda f: lp.split_half_reliability(get_model("toy-gpt2"), _blocks(), progress=False),
    "SanityReport": lambda f: lp.sanity_report(get_model("toy-gpt2"), _blocks(), progress=False),
    "ScalingResult": lambda f: lp.scale_sweep(
        get_model("toy-gpt2"), _blocks(), space=["value", "residual-mlp"], s_par=(0.0,), s_perp=(0.5,), progress=False
    ),
    "SensitivityResult": lambda f: lp.head_sensitivity(
        get_model("toy-gpt2"), _blocks(), layers=[0, 1], n_resamples=50, n_permutations=50, progress=False
    ),
    "HeadStatistics": lambda f: lp.head_statistics(get_model("toy-qwen2"), _blocks("toy-qwen2")),
    "AttributionResult": lambda f: lp.head_attribution(
        get_model("toy-gpt2"), _blocks(), n_resamples=50, progress=False
    ),
    "ConfirmResult": lambda f: lp.confirm(
        get_model("toy-gpt2"),
        _blocks(),
        lp.head_attribution(get_model("toy-gpt2"), _blocks(), n_resamples=50, progress=False),
        top_k=3,
        n_random=2,
        progress=False,
    ),
    "ModelReport": lambda f: _battery(),
    "TaskResult": lambda f: lp.task_effects(
        get_model("toy-gpt2"), lp.ComponentScale("value", s_par=0.0), [("copa", 0)], limit=3, progress=False
    ),
    "GenerationResult": lambda f: lp.generate(
        get_model("toy-gpt2"), ["Once upon", "1, 2,"], lp.ZeroDiagonal(), max_new_tokens=3, progress=False
    ),
    "TrainRun": lambda f: f.runs[1],
    "FactorialResult": lambda f: f,
}


def test_every_result_class_has_a_protocol_check():
    assert {cls.__name__ for cls in result_classes()} == set(FACTORIES)
    assert {qualified_name(cls) for cls in result_classes()} <= set(SAVED_TYPES)


FRESH_TABLES = """
import dataclasses, json, sys
import lens_parallel as lp
from lens_parallel.analyses.registry import analyses
from lens_parallel.edits import EDITS
from lens_parallel.results import SAVED_TYPES, qualified_name, saved_class
found = [saved_class(name, "here") for name in SAVED_TYPES]
assert all(dataclasses.is_dataclass(c) and qualified_name(c) == n for c, n in zip(found, SAVED_TYPES))
loaded = [lp.load_result(path) for path in sys.argv[1:]]
print(json.dumps({"edits": sorted(EDITS), "analyses": sorted(analyses()), "saved": len(found),
                  "results": [r.summary().to_json() for r in loaded]}))
"""


def test_every_table_is_complete_after_import_lens_parallel_alone(tmp_path):
    """In a fresh interpreter that imported only lens_parallel: the edit kinds, the analyses and the saved types are
    all there (no module registers itself when imported), each saved type resolves to its class, and results saved
    here reopen, their modules imported by the names the files give."""
    model = get_model("toy-gpt2")
    docs = lp.token_blocks(model, "austen", n_docs=2, seq_len=16)
    results = [lp.decompose(model, docs, progress=False), lp.evaluate(model, docs, lp.ZeroDiagonal(), progress=False)]
    paths = [str(r.save(tmp_path / f"r{i}")) for i, r in enumerate(results)]
    ran = subprocess.run([sys.executable, "-c", FRESH_TABLES, *paths], capture_output=True, text=True, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout)
    from lens_parallel.analyses.registry import analyses
    from lens_parallel.edits import EDITS

    assert got["edits"] == sorted(EDITS) and len(EDITS) == 8
    assert got["analyses"] == sorted(analyses()) and len(got["analyses"]) == 7
    assert got["saved"] == len(SAVED_TYPES)
    assert got["results"] == [r.summary().to_json() for r in results]


def _assert_same(a, b, where: str = "result") -> None:
    """Field-by-field equality of two results (arrays exactly, NaN == NaN)."""
    assert type(a) is type(b), where
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
        assert a.dtype == b.dtype, where
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_result_protocol(name, factorial, tmp_path):
    result = FACTORIES[name](factorial)
    assert type(result).__name__ == name and isinstance(result, lp.Result)
    assert isinstance(result.provenance, lp.Provenance) and result.provenance.model["name"]
    tidy = result.to_dataframe()
    assert isinstance(tidy, pd.DataFrame) and len(tidy) >= 1
    summary = result.summary()
    assert isinstance(summary, pd.DataFrame) and len(summary) == 1 and "model" in summary.columns
    figures = result.figures()
    assert figures and all(isinstance(k, str) and isinstance(f, go.Figure) for k, f in figures.items())
    main = next(iter(figures.values()))
    assert main.to_json() == result.figure().to_json()
    assert all(f.layout.title.text for f in figures.values())
    path = result.save(tmp_path / "saved.v1")  # a dot in the name is kept, not taken for a suffix
    assert path.name == "saved.v1.json"
    meta = json.loads(path.read_text())
    assert meta["format"] == "lens_parallel.result" and meta["version"] == FORMAT_VERSION
    assert meta["data"]["__class__"] == qualified_name(type(result))
    loaded = type(result).load(tmp_path / "saved.v1")
    _assert_same(result, loaded)
    pd.testing.assert_frame_equal(loaded.to_dataframe(), tidy)
    pd.testing.assert_frame_equal(loaded.summary(), summary)
    _columns_are_defined(name, result)


def test_unknown_type_or_version_is_a_clear_error(tmp_path):
    effect = lp.evaluate(get_model("toy-gpt2"), _blocks(), lp.ComponentScale("value", s_par=0.5))
    path = effect.save(tmp_path / "effect")
    meta = json.loads(path.read_text())
    meta["version"] = FORMAT_VERSION + 1
    path.write_text(json.dumps(meta))
    with pytest.raises(lp.LensParallelError, match=f"format version {FORMAT_VERSION + 1}"):
        load_result(path)
    meta["version"] = FORMAT_VERSION
    old_layout = json.loads(json.dumps(meta))
    old_layout["data"]["old_field"] = old_layout["data"].pop("delta_loss")
    path.write_text(json.dumps(old_layout))
    with pytest.raises(lp.LensParallelError, match=r"saved with another layout \(missing: \['delta_loss'\], unknown"):
        load_result(path)
    meta["data"]["__class__"] = "lens_parallel.gone.OldResult"
    path.write_text(json.dumps(meta))
    with pytest.raises(lp.LensParallelError, match=r"unknown result type 'lens_parallel\.gone\.OldResult'"):
        load_result(path)
    with pytest.raises(lp.LensParallelError, match="no saved result"):
        load_result(tmp_path / "missing")
    effect.save(tmp_path / "ok")
    with pytest.raises(lp.LensParallelError, match="holds a EditEffect, not a ScalingResult"):
        lp.ScalingResult.load(tmp_path / "ok")


def test_nothing_is_silently_turned_into_a_string(tmp_path):
    effect = lp.evaluate(get_model("toy-gpt2"), _blocks(), lp.ComponentScale("value", s_par=0.5))
    settings = dict(effect.provenance.settings, where=tmp_path)  # a Path is not plain data
    bad = dataclasses.replace(effect, provenance=dataclasses.replace(effect.provenance, settings=settings))
    with pytest.raises(TypeError, match=r"cannot save a PosixPath at root\.provenance\.settings\.where"):
        save_result(bad, tmp_path / "bad")


@pytest.mark.parametrize("name", ["toy-qwen3.5", "Qwen/Qwen2.5-0.5B"])
def test_report_sections_of_a_dotted_model_name_do_not_collide(name, tmp_path):
    report = dataclasses.replace(_battery(), name=name)
    paths = report.save_sections(tmp_path)
    stem = name.replace("/", "_")
    assert sorted(p.name for p in paths) == sorted(f"{stem}_{s}.json" for s in report.results())
    for section, result in report.results().items():
        _assert_same(load_result(tmp_path / f"{stem}_{section}"), result)


def test_a_result_pair_that_does_not_belong_together_is_refused(tmp_path, monkeypatch):
    """The JSON and the npz share a random id and the JSON holds the npz's sha256: a run.npz of seed 1 copied over
    seed 0's (the paired delta flipped sign without a word before) is refused, as is a save killed between writes."""
    model, blocks = get_model("toy-gpt2"), _blocks()
    first = lp.evaluate(model, blocks, lp.ComponentScale("value", s_par=0.5)).save(tmp_path / "a" / "effect")
    second = lp.evaluate(model, blocks, lp.ComponentScale("value", s_par=0.0)).save(tmp_path / "b" / "effect")
    first.with_suffix(".npz").write_bytes(second.with_suffix(".npz").read_bytes())
    with pytest.raises(lp.LensParallelError, match=r"effect\.npz does not belong to effect\.json \(its sha256"):
        load_result(first)
    real_replace = paths.os.replace  # a kill between the two renames: the new npz, the old JSON

    def killed_before_json(src, dst):
        if str(dst).endswith(".json"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(paths.os, "replace", killed_before_json)
    with pytest.raises(KeyboardInterrupt):
        lp.evaluate(model, blocks, lp.ComponentScale("value", s_par=1.5)).save(tmp_path / "b" / "effect")
    monkeypatch.undo()
    assert not [p for p in (tmp_path / "b").iterdir() if ".tmp-" in p.name]  # nothing half-written left
    with pytest.raises(lp.LensParallelError, match=r"does not belong to effect\.json"):
        load_result(second)


def test_damaged_result_files_are_one_line_errors(tmp_path):
    path = lp.evaluate(get_model("toy-gpt2"), _blocks(), lp.ComponentScale("value", s_par=0.5)).save(tmp_path / "e")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # truncated
    with pytest.raises(lp.LensParallelError, match=r"e\.json is damaged \(not valid JSON"):
        load_result(path)
    path.write_text(text)
    path.with_suffix(".npz").unlink()
    with pytest.raises(lp.LensParallelError, match=r"has no e\.npz beside it"):
        load_result(path)
    meta = json.loads(text)
    meta["version"] = 1  # written before results were tied together
    path.write_text(json.dumps(meta))
    with pytest.raises(lp.LensParallelError, match="format version 1; this lens_parallel reads version 2"):
        load_result(path)


TABLES = (
    *("to_dataframe", "summary", "method_table", "layer_table", "effects_table", "projection_table", "joint_table"),
    *("group_table", "head_table", "correlation_table", "derivatives_table", "differences", "samples", "curves"),
    *("finals", "paired_table", "gates", "train_curve", "curve"),
)
"""Every public method of a result that returns a table (``TaskResult.table``'s columns are its tasks' names)."""


def _matches(template: str, column: str) -> bool:
    """Whether a ``columns`` template (``<...>`` stands for any text: a space, a setting) names ``column``."""
    pattern = "".join(".+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", template))
    return re.fullmatch(pattern, column) is not None


def _columns_are_defined(name: str, result: Any) -> None:
    """Each column a result's tables hold has a definition (:func:`lens_parallel.glossary.define`), and its main
    tables' columns are the ones its class names (``columns``, which ``help()`` lists)."""
    declared = type(result).columns.split()
    assert declared and all(define(template) for template in declared)
    for method in (m for m in TABLES if callable(getattr(result, m, None))):
        found = getattr(result, method)()
        for frame in found.values() if isinstance(found, dict) else [found]:
            for column in frame.columns:
                assert define(str(column)), (name, method, column)
                if method in ("to_dataframe", "summary"):
                    assert any(_matches(t, str(column)) for t in declared), f"{name}.columns lacks {column}"
    assert "Columns:" in (getattr(lp, name).__doc__ or "")
