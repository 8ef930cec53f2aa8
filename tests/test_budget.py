"""batch_size="auto": sizes parsed, peaks measured, the largest batch that fits chosen, recorded and reused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lens_parallel import LensParallelError, RunOptions, decompose, head_sensitivity, token_blocks
from lens_parallel import budget as budget_module
from lens_parallel.budget import choose_batch_size, parse_bytes, peak_added
from lens_parallel.store import SweepStore

from .conftest import get_model

CPU = torch.device("cpu")
MB = 10**6


def test_sizes_are_parsed_and_bad_ones_refused_naming_the_units():
    assert parse_bytes("4GB") == 4 * 10**9 and parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes(1000) == 1000 and parse_bytes("1.5kb") == 1500
    for bad in ("4 parsecs", "GB", -1, 0, True, "-3GB"):
        with pytest.raises(LensParallelError, match=r"memory_budget .*(accepted|positive|size)"):
            parse_bytes(bad)
    with pytest.raises(LensParallelError, match="memory_budget is read only with batch_size='auto'"):
        RunOptions(batch_size=4, memory_budget="1GB")
    with pytest.raises(LensParallelError, match="batch_size must be a positive integer or 'auto', got 0"):
        RunOptions(batch_size=0)


def _allocate(k: int, per_doc: int = 60 * MB, fixed: int = 20 * MB) -> None:
    block = np.ones(fixed + k * per_doc, dtype=np.uint8)  # touched: resident
    assert block.sum() == fixed + k * per_doc


def test_the_peak_of_a_run_is_measured_on_cpu():
    added = peak_added(CPU, lambda: _allocate(2))
    assert 130 * MB < added < 190 * MB  # 140 MB allocated; the interpreter adds a little


def test_the_largest_batch_that_fits_is_chosen(monkeypatch):
    """The choice from the probes' peaks (the measurement itself is tested above; here each probe's peak is its
    exact size, so that the choice does not depend on what earlier tests left in the process's heap)."""
    sizes: list[int] = []

    def exact_peak(device, run):
        run()
        return 20 * MB + 60 * MB * sizes[-1]

    monkeypatch.setattr(budget_module, "peak_added", exact_peak)
    chosen = choose_batch_size(sizes.append, n_docs=100, tokens=10, budget=500 * MB, device=CPU)
    assert sizes == [1, 2] and chosen.peak_one == 80 * MB and chosen.peak_two == 140 * MB
    # one more document costs max(140 - 80, 140 / 2) = 70 MB (never under half the 2-document peak, a safety margin
    # on fixed costs measured too low): 1 + (500 - 80) // 70 = 7 documents
    assert chosen.per_document == 70 * MB and chosen.bytes_per_token == chosen.per_document / 10
    assert chosen.batch_size == 7, chosen
    monkeypatch.undo()
    assert choose_batch_size(_allocate, n_docs=3, tokens=10, budget=500 * MB, device=CPU).batch_size == 3
    with pytest.raises(LensParallelError, match=r"one document of 10 tokens needs \d+ MiB, over memory_budget"):
        choose_batch_size(_allocate, n_docs=3, tokens=10, budget=30 * MB, device=CPU)


def test_auto_batch_size_runs_the_sweep_as_the_chosen_size_does_and_records_it(tmp_path, monkeypatch):
    model = get_model("toy-qwen2")
    blocks = token_blocks(model, "wikipedia-en", n_docs=6, seq_len=16)
    calls = []
    real = budget_module.choose_batch_size

    def spy(probe, **kw):
        calls.append(kw)
        return real(probe, **kw)

    monkeypatch.setattr("lens_parallel.sweep.choose_batch_size", spy)
    store = tmp_path / "sens.jsonl"
    auto = head_sensitivity(
        model, blocks, ablation="zero", batch_size="auto", memory_budget="8GB", store=store, progress=False
    )
    chosen = auto.provenance.settings["options"]["batch_size_auto"]
    assert calls and calls[0]["budget"] == 8 * 10**9 and calls[0]["tokens"] == 16
    assert chosen["memory_budget"] == "8GB" and 1 <= chosen["batch_size"] <= 6 and chosen["bytes_per_token"] > 0
    assert auto.provenance.settings["options"]["batch_size"] == chosen["batch_size"]
    header = SweepStore.stored_fingerprint(store)
    assert header["batch_size"] == chosen["batch_size"] and header["batch_size_auto"] == "8GB"
    fixed = head_sensitivity(model, blocks, ablation="zero", batch_size=chosen["batch_size"], progress=False)
    np.testing.assert_array_equal(auto.head_delta, fixed.head_delta)
    # a resumed run takes the size from its store: no probe
    monkeypatch.setattr("lens_parallel.sweep.choose_batch_size", lambda *a, **k: pytest.fail("probed again"))
    again = head_sensitivity(
        model, blocks, ablation="zero", batch_size="auto", memory_budget="8GB", store=store, progress=False
    )
    np.testing.assert_array_equal(again.head_delta, auto.head_delta)
    assert again.provenance.settings["options"]["batch_size_auto"]["from"] == "store"


def test_auto_batch_size_on_a_capture_metric():
    model = get_model("toy-gpt2")
    blocks = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=12)
    auto = decompose(model, blocks, space="value", batch_size="auto", progress=False)
    size = auto.provenance.settings["options"]["batch_size_auto"]["batch_size"]
    fixed = decompose(model, blocks, space="value", batch_size=size, progress=False)
    np.testing.assert_array_equal(auto.table("value").self_cos, fixed.table("value").self_cos)
