"""Bad input from Python: one line of the package's error, raised before any forward (a forward here fails the
test), for unwritable outputs and stores, text that is not UTF-8, and a field given twice with two values. (The
command line's battery is ``BAD_COMMAND_LINES`` in test_cli.py.)"""

from __future__ import annotations

import json

import pytest

import lens_parallel as lp
from lens_parallel import LensParallelError
from lens_parallel.data import check_texts, read_text_file
from lens_parallel.hooks import running
from lens_parallel.options import resolve
from lens_parallel.plots import save_figure
from lens_parallel.sweep import AblationJob, run_sweep

from .conftest import get_model


@pytest.fixture
def no_forward(monkeypatch):
    """Any forward of any model fails the test: each refusal below must come before the first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a forward ran before the bad input was refused")

    monkeypatch.setattr(running, "_run", forbidden)


@pytest.fixture
def model_and_docs():
    model = get_model("toy-gpt2")
    return model, lp.token_blocks(model, n_docs=4, seq_len=16)


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_a_store_in_an_unwritable_place_is_refused_before_any_forward(tmp_path, model_and_docs, no_forward):
    model, docs = model_and_docs
    (tmp_path / "blocker").write_text("a file, where the store's folder would be")
    with pytest.raises(LensParallelError) as refused:
        run_sweep(model, docs, [AblationJob(0, (1,))], ablation="zero", store=tmp_path / "blocker" / "s.jsonl")
    assert "store" in _one_line(refused) and "cannot create its folder" in str(refused.value)


def test_save_to_an_unwritable_path_raises_the_packages_error(tmp_path, model_and_docs):
    model, docs = model_and_docs
    result = lp.decompose(model, docs, progress=False)
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(LensParallelError, match=r"cannot save the result: .*cannot create its folder") as refused:
        result.save(tmp_path / "blocker" / "decompose")
    _one_line(refused)
    (tmp_path / "decompose.json").mkdir()
    with pytest.raises(LensParallelError, match=r"decompose\.json is a folder"):
        result.save(tmp_path / "decompose")
    with pytest.raises(LensParallelError, match=r"figure .* cannot create its folder"):
        save_figure(result.figure(), tmp_path / "blocker" / "figure")


def test_texts_that_are_not_text_are_refused_before_tokenizing(model_and_docs, no_forward):
    model, _ = model_and_docs
    escaped = ["a fine document", "caf\udce9 au lait"]  # read with errors="surrogateescape": byte 0xe9 kept
    message = "document 1 is not valid text: character 3 is an undecoded byte"
    for make in (lp.token_blocks, lp.whole_documents):
        with pytest.raises(LensParallelError, match=message) as refused:
            make(model, escaped, n_docs=1)
        _one_line(refused)
    # bytes (e.g. Latin-1 file contents) are refused by the same check (called directly: the test suite's runtime
    # type checker would refuse a list holding bytes first, at random, as it samples one element)
    with pytest.raises(LensParallelError, match="document 1 is bytes, not str: decode it"):
        check_texts(["a fine document", b"caf\xe9"])


def test_a_users_text_files_are_read_as_utf8(tmp_path, model_and_docs):
    txt = tmp_path / "mine.txt"
    txt.write_bytes("\ufeffFirst document,\nstill the first.\n\n  \nSecond: caf\u00e9.\n\n\n".encode())
    assert read_text_file(txt) == ["First document,\nstill the first.", "Second: caf\u00e9."]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["one", "two"])) + "\n\n")
    assert read_text_file(jsonl) == ["one", "two"]
    model, _ = model_and_docs
    blocks = lp.token_blocks(model, str(txt), n_docs=2, seq_len=3)
    assert blocks.corpus == str(txt) and blocks.tokens.shape == (2, 3)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("latin1.txt", "caf\u00e9 au lait".encode("latin-1"), r"not UTF-8: byte offset 3 holds b'\\xe9'"),
        ("broken.jsonl", b'{"text": "fine"}\n{"text": \n', "line 2 is not JSON"),
        ("no_text.jsonl", b'{"body": "no text field"}\n', "line 1 has no string field 'text'"),
    ],
)
def test_a_bad_text_file_is_one_line_naming_where(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(LensParallelError, match=message) as refused:
        lp.load_texts(str(tmp_path / name))
    _one_line(refused)
    with pytest.raises(LensParallelError, match="does not exist"):
        lp.load_texts(str(tmp_path / "missing.txt"))


def test_a_field_given_twice_with_two_values_is_refused(model_and_docs, no_forward):
    model, docs = model_and_docs
    with pytest.raises(LensParallelError, match=r"query_start is given twice: 4 in settings= and 5 as a keyword"):
        lp.head_dominance(model, docs, settings=lp.DominanceSettings(query_start=4), query_start=5)
    with pytest.raises(LensParallelError, match=r"batch_size is given twice: 2 in options= and 4 as a keyword"):
        lp.evaluate(model, docs, lp.ComponentScale("value"), options=lp.RunOptions(batch_size=2), batch_size=4)


def test_a_field_given_twice_with_one_value_and_a_protocol_overridden_are_accepted(model_and_docs):
    model, docs = model_and_docs
    same = lp.decompose(model, docs, settings=lp.DecomposeSettings(layers=(1,)), layers=(1,), progress=False)
    assert set(same.to_dataframe()["layer"]) == {1}
    protocol = resolve(lp.DominanceSettings, None, None, "dominance-study", {"query_start": 5})[0]
    assert protocol.query_start == 5  # a named protocol is a starting point: a keyword overrides it
