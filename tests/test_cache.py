"""Shared cache folders under concurrent builders: every process succeeds, no finished folder or live partial
folder of another process is deleted, a half-written folder is never visible."""

from __future__ import annotations

import multiprocessing
import os
import threading

from lens_parallel import paths
from lens_parallel.tokenizers import bundled_tokenizer_folder, load_bundled_tokenizer

FORK = multiprocessing.get_context("fork")


def _first_use(cache: str, barrier, family: str, results) -> None:
    """A process that builds the cache if it finds none (slowly: a random delay after unpacking widens the window
    between a build's end and its install), then loads the tokenizer again and again, as analyses do."""
    import random
    import time

    from lens_parallel import tokenizers

    os.environ["LENS_PARALLEL_CACHE"] = cache
    unpack = tokenizers._unpack

    def slow_unpack(name, into):
        unpack(name, into)
        time.sleep(random.uniform(0.0, 0.4))

    tokenizers._unpack = slow_unpack
    barrier.wait()
    ids = [load_bundled_tokenizer(family)("Hello world", add_special_tokens=False)["input_ids"] for _ in range(5)]
    results.put(ids[0] if ids.count(ids[0]) == len(ids) else ids)


def test_concurrent_first_builds_of_a_tokenizer_all_succeed(tmp_path):
    """Before: each builder deleted the finished folder, then renamed its own into place, so a process loading it in
    between failed (2 of 24 concurrent first builds crashed)."""
    for trial in range(1):
        cache, n = str(tmp_path / f"cache{trial}"), 6
        barrier, results = FORK.Barrier(n), FORK.Queue()
        procs = [FORK.Process(target=_first_use, args=(cache, barrier, "gpt2", results)) for _ in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0] * n
        assert [results.get(timeout=5) for _ in range(n)] == [[15496, 995]] * n
        left = [p.name for p in (tmp_path / f"cache{trial}" / "tokenizers").iterdir() if ".partial-" in p.name]
        assert left == []  # no scratch folder left behind


def test_a_slow_builder_never_replaces_a_finished_folder(tmp_path, monkeypatch):
    """Deterministic interleaving: builder A is held mid-build while builder B runs. Before, B installed its folder
    and A, released, deleted it and renamed its own in (the folder a reader had just opened, gone); now B waits for
    A's lock, then uses A's folder: exactly one folder is ever installed."""
    from lens_parallel import tokenizers

    monkeypatch.setenv("LENS_PARALLEL_CACHE", str(tmp_path))
    release, holding = threading.Event(), threading.Event()
    unpack = tokenizers._unpack

    def held_unpack(family, into):
        if threading.current_thread().name == "A":
            holding.set()
            release.wait(30)
        unpack(family, into)

    monkeypatch.setattr(tokenizers, "_unpack", held_unpack)
    folders = {}
    a = threading.Thread(target=lambda: folders.update(A=bundled_tokenizer_folder("gpt2")), name="A")
    a.start()
    assert holding.wait(30)
    b = threading.Thread(target=lambda: folders.update(B=bundled_tokenizer_folder("gpt2")), name="B")
    b.start()
    b.join(3)  # before: B builds and installs meanwhile; now it waits for A's lock
    first = (tmp_path / "tokenizers" / "gpt2").stat().st_ino if (tmp_path / "tokenizers" / "gpt2").exists() else None
    release.set()
    a.join(30)
    b.join(30)
    installed = (tmp_path / "tokenizers" / "gpt2").stat().st_ino
    assert first in (None, installed), "a finished folder was replaced by a later builder"
    assert folders["A"] == folders["B"] and load_bundled_tokenizer("gpt2")("Hello world")["input_ids"] == [15496, 995]


def test_a_finished_folder_that_verifies_is_never_replaced(tmp_path):
    target = tmp_path / "built"
    target.mkdir()
    (target / "data").write_text("first")
    scratch = paths.scratch_folder(target)
    (scratch / "data").write_text("second")
    with open(target / "data") as reader:  # another process reading the finished folder
        assert paths.install_folder(scratch, target, lambda folder: (folder / "data").is_file()) == target
        assert reader.read() == "first"
    assert (target / "data").read_text() == "first" and not scratch.exists()
    stale = paths.scratch_folder(target)  # a folder that does not verify is replaced in one rename
    (stale / "data").write_text("third")
    paths.install_folder(stale, target, lambda folder: (folder / "data").read_text() == "third")
    assert (target / "data").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built"]


def test_only_abandoned_scratch_folders_are_removed(tmp_path):
    """A scratch folder whose process is alive is never deleted (before: every `.partial-*` was, including a
    half-precision copy another process was writing)."""
    target = tmp_path / "model"
    live = paths.scratch_folder(target)  # this process: alive
    dead_process = FORK.Process(target=lambda: None)
    dead_process.start()
    dead_process.join()
    dead = tmp_path / f".model.partial-{paths._host()}-{dead_process.pid}-0000abcd"
    dead.mkdir()
    foreign = tmp_path / ".model.partial-not-ours"  # not a name this package writes: left alone
    foreign.mkdir()
    paths.remove_abandoned(target)
    assert live.is_dir() and foreign.is_dir() and not dead.exists()
    assert paths.is_abandoned(dead) and not paths.is_abandoned(live)


def test_cached_folder_builds_once_and_reuses(tmp_path):
    builds = []

    def build(into):
        builds.append(into)
        (into / "marker").write_text("ok")

    target = tmp_path / "thing"
    for _ in range(2):
        assert paths.cached_folder(target, build, lambda f: (f / "marker").is_file()) == target
    assert len(builds) == 1 and (target / "marker").read_text() == "ok"
    assert bundled_tokenizer_folder("gpt-neox").name == "gpt-neox"
